"""`morphling profile --indicator`: SplitQuant's variance indicator ω of every decoder layer at each bit width.

The planner spends quantization where it hurts least, so it needs a cheap estimate of how much quantizing one
layer to b bits perturbs the model. SplitQuant (§IV-B) bounds the extra output variance that rounding the
weights of a linear operator adds (Theorem 1) and sums it over a layer's operators (Proposition 1, Eq. 3):

  ω_{i,b} = Σ_o D_{W_o} · S_{W_o}(b)² · G(X_o),   G(X) = ¼·Var[X] (deterministic rounding)
                                                  G(X) = ⅙·(E[X]² + Var[X]) (stochastic rounding)

over o in qkv_proj, o_proj, gate_up_proj and down_proj. X_o is what the operator reads when calibration
windows run through the full-precision model; its mean and variance are taken over all of its elements
(every token, every input channel) of every window. Full precision rounds nothing: its ω is 0.

Where the paper has one scale per tensor, our quantizers (engine/morphing/quant.py, as the layer variants
call them: variants.quantize_layer) have one per output channel (INT8, symmetric) or per output channel and
group of input channels (INT4, asymmetric; down_proj's groups divide the FFN piece width). D_W·S_W² then
becomes Σ_g n_g·s_g², n_g the weights sharing scale s_g, which is the paper's term when there is one scale.
The scales are the quantizers' own, computed in float32 from the full-precision weights. The FFN is stored
in zero-padded pieces (decoder.fused_ffn): padding rows and columns are no weights of the model, so they
count in no n_g, and down_proj's padding inputs (always 0) in no statistic of X; the zeros do take part in
the min and max of a group they share with real weights, as they do when the variant is made.

The inputs are read by running the decoder layer by layer here, as profile.decoder_layer does, rather than by
hooking DecoderModel.forward, whose hot path stays untouched. A full-prefill window attends only to itself,
so this needs no KV pages.

`--validate` checks what the ranking is for: perplexity on WikiText-2 test tokens after the calibration ones
with one layer at a time quantized (simulated, engine/morphing/simulated.py) against ω, by Spearman rank
correlation over all (layer, bits) pairs and per bit width across layers. Written as JSON with a PNG of ω
against ΔPPL beside it:

  {"kind": "variance-indicator", "model", "model_fingerprint", "num_layers", "bits": [8, 4], "rounding",
   "omega": {"8": [per layer], "4": [per layer]}, "calibration": {"corpus", "tokens", "window", "windows"},
   "validation": {"corpus", "skip_tokens", "tokens", "window", "ppl_full", "ppl": {"8": [...], ...},
                  "delta_ppl": {"8": [...], ...}, "spearman": {"overall": {"rho", "p"}, "8": {...}, ...},
                  "machine", "seconds"} or null,
   "seconds", "date"}
"""

import argparse
import json
import math
import platform
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from morphling_kernels.prefill_attention import prefill_attention
from services.executor.engine.engine import LLMEngine
from services.executor.engine.model.decoder import LINEARS, DecoderModel, fused_ffn, int4_group_of, rms_norm, rotate
from services.executor.engine.morphing.importance import WINDOW, fingerprint, load_tokens, write_json
from services.executor.engine.morphing.quant import quantize_int4, quantize_int8
from services.executor.engine.morphing.simulated import SimulatedQuantization, require_full_precision
from services.executor.engine.morphing.variants import DEFAULT_CORPUS
from services.tools.evaluate import evaluate, perplexity
from shared.config import RESULTS_DIR, EngineConfig, parse_size, served_model_name

KIND = "variance-indicator"
BITS = (8, 4)
ROUNDINGS = ("deterministic", "stochastic")
DEFAULT_OUT = RESULTS_DIR / "omega.json"
CALIB_TOKENS = 1024
EVAL_TOKENS = 4096


class IndicatorError(ValueError):
    """An ω file that cannot be used; the message names the file and the field."""


class InputMoments:
    """Count, sum and sum of squares of an operator's input elements, over every window (float64: a sum over
    millions of float32 elements would lose the variance to cancellation)."""

    def __init__(self):
        self.count, self.total, self.squares = 0, 0.0, 0.0

    def add(self, x: torch.Tensor) -> None:
        x = x.double()
        self.count += x.numel()
        self.total += float(x.sum())
        self.squares += float(x.square().sum())

    def g(self, rounding: str) -> float:
        """G(X) of Theorem 1; Var is the population variance over every element."""
        mean = self.total / self.count
        second = self.squares / self.count
        var = max(second - mean * mean, 0.0)
        if rounding == "deterministic":
            return var / 4
        if rounding == "stochastic":
            return second / 6  # (E[X]² + Var[X]) / 6
        raise ValueError(f"rounding is one of {ROUNDINGS}, not {rounding!r}")


def real_channels(model: DecoderModel) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per linear, boolean masks of the output rows and input columns of its logical weight that belong to the
    model rather than to the FFN's padding, laid out by the decoder's own fused_ffn."""
    cfg, device = model.cfg, model.embed_tokens.device
    ones = torch.ones(cfg.intermediate_size, 1)
    ffn = fused_ffn(ones, ones, ones.t(), cfg.ffn_pieces, model.ffn_width)
    masks = {}
    for name in LINEARS:
        out, inp = model.layers[0][name].shape
        rows, cols = torch.ones(out, dtype=torch.bool), torch.ones(inp, dtype=torch.bool)
        if name == "gate_up_proj":
            rows = ffn[name][:, 0].bool()
        elif name == "down_proj":
            cols = ffn[name][0].bool()
        masks[name] = (rows.to(device), cols.to(device))
    return masks


def group_size(model: DecoderModel, name: str, bits: int) -> int:
    """Input channels sharing one scale, as variants.quantize_layer quantizes `name`."""
    in_features = model.layers[0][name].shape[1]
    if bits == 8:
        return in_features
    if bits == 4:
        return int4_group_of(name, in_features, model.cfg)
    raise ValueError(f"layers quantize to 8 or 4 bits, not {bits}")


def scale_energy(w: torch.Tensor, bits: int, group: int, rows: torch.Tensor, cols: torch.Tensor) -> float:
    """Σ_g n_g·s_g² over the scales s_g the `bits`-bit quantizer gives `w`, n_g the real weights (`rows` ×
    `cols`) sharing s_g: D_W·S_W² of Theorem 1 when there is one scale."""
    w32 = w.float()
    if bits == 8:
        scales = quantize_int8(w32).scale[:, None]
    elif bits == 4:
        scales = quantize_int4(w32, group).scale
    else:
        raise ValueError(f"layers quantize to 8 or 4 bits, not {bits}")
    shared = rows.double()[:, None] * cols.view(-1, group).sum(1).double()[None, :]  # n_g of every scale
    return float((shared * scales.double().square()).sum())


def layer_with_inputs(model: DecoderModel, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      visit: Callable[[str, torch.Tensor], None]) -> torch.Tensor:
    """profile.decoder_layer, handing visit(linear, input) each linear's input on the way."""
    cfg, w, n = model.cfg, model.layers[index], x.shape[0]
    h = rms_norm(x, w["input_norm"], cfg.rms_norm_eps)
    visit("qkv_proj", h)
    q, k, v = F.linear(h, w["qkv_proj"], w.get("qkv_bias")).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    q = rotate(q.view(n, cfg.num_heads, cfg.head_dim), cos, sin)
    k = rotate(k.view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
    v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
    no_pages = torch.empty(0, dtype=torch.int32, device=x.device)  # context_start 0 never reads the cache
    attn = prefill_attention(q, k, v, model.arena.kv_cache, index, no_pages, 0, model.scale).reshape(n, cfg.q_size)
    visit("o_proj", attn)
    x = x + F.linear(attn, w["o_proj"])
    h = rms_norm(x, w["post_attn_norm"], cfg.rms_norm_eps)
    visit("gate_up_proj", h)
    gate_up = F.linear(h, w["gate_up_proj"]).unflatten(-1, (-1, 2, model.ffn_width))
    act = (F.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]).flatten(-2)
    visit("down_proj", act)
    return x + F.linear(act, w["down_proj"])


@torch.inference_mode()
def input_moments(model: DecoderModel, windows: list[list[int]]) -> list[dict[str, InputMoments]]:
    """Per layer and linear, the moments of the linear's real input channels over `windows` (full precision)."""
    masks = real_channels(model)
    moments = [{name: InputMoments() for name in LINEARS} for _ in model.layers]
    for ids in windows:
        cos, sin = model.cos[:len(ids)].unsqueeze(1), model.sin[:len(ids)].unsqueeze(1)
        x = F.embedding(torch.tensor(ids, dtype=torch.int64, device=model.embed_tokens.device), model.embed_tokens)
        for i in range(model.cfg.num_layers):
            x = layer_with_inputs(model, i, x, cos, sin, lambda name, xo: moments[i][name].add(xo[:, masks[name][1]]))
    return moments


@torch.inference_mode()
def operator_terms(engine: LLMEngine, windows: list[list[int]], bits: Sequence[int] = BITS,
                   rounding: str = "deterministic") -> list[dict[str, dict[int, float]]]:
    """terms[i][linear][b] = Σ_g n_g·s_g(b)²·G(X): one operator's share of ω_{i,b}."""
    model = engine.model
    require_full_precision(model)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding is one of {ROUNDINGS}, not {rounding!r}")
    if not windows or any(len(w) < 1 for w in windows):
        raise ValueError("the indicator needs at least one non-empty calibration window")
    masks = real_channels(model)
    moments = input_moments(model, windows)
    terms = []
    for i, weights in enumerate(model.layers):
        terms.append({name: {b: scale_energy(weights[name], b, group_size(model, name, b), *masks[name])
                             * moments[i][name].g(rounding) for b in bits} for name in LINEARS})
    return terms


def omega(engine: LLMEngine, windows: list[list[int]], bits: Sequence[int] = BITS,
          rounding: str = "deterministic") -> dict[int, list[float]]:
    """ω_{i,b} of Eq. 3 for every decoder layer i, by bit width b, calibrated on token `windows`."""
    terms = operator_terms(engine, windows, bits, rounding)
    return {b: [sum(layer[name][b] for name in LINEARS) for layer in terms] for b in bits}


def spearman(x: Sequence[float], y: Sequence[float]) -> dict:
    """Spearman's ρ and its two-sided p-value; None where undefined (a constant side, fewer than 3 points)."""
    from scipy.stats import spearmanr  # only validation needs it

    if len(x) < 3:
        return dict(rho=None, p=None, n=len(x))
    result = spearmanr(x, y)
    rho, p = float(result.statistic), float(result.pvalue)
    return dict(rho=rho if math.isfinite(rho) else None, p=p if math.isfinite(p) else None, n=len(x))


def validate(engine: LLMEngine, omegas: dict[int, list[float]], tokens: list[int], window: int,
             progress: bool = True) -> dict:
    """Perplexity of `tokens` with each layer alone quantized at each width of `omegas`, its rise over full
    precision (ΔPPL), and how ω ranks against it."""
    quant = SimulatedQuantization(engine)
    started = time.perf_counter()
    num_layers = engine.model_config.num_layers
    bar = tqdm(total=1 + num_layers * len(omegas), desc="perplexity, one layer quantized", unit="eval",
               disable=not progress)
    full = perplexity(engine, tokens, window)
    bar.update()
    ppl: dict[int, list[float]] = {}
    for b in omegas:
        ppl[b] = []
        for i in range(num_layers):
            ppl[b].append(evaluate(engine, quant, tokens, window, [i], b))
            quant.clear_cache()  # every layer is quantized once per width: a cache would only hold memory
            bar.update()
    bar.close()
    delta = {b: [p - full for p in values] for b, values in ppl.items()}
    correlations = {"overall": spearman([w for b in omegas for w in omegas[b]], [d for b in omegas for d in delta[b]])}
    correlations |= {str(b): spearman(omegas[b], delta[b]) for b in omegas}
    return dict(ppl_full=full, ppl={str(b): v for b, v in ppl.items()}, delta_ppl={str(b): v for b, v in delta.items()},
                spearman=correlations, tokens=len(tokens), window=window,
                machine=dict(platform=platform.platform(), processor=platform.processor(),
                             torch_threads=torch.get_num_threads()),
                seconds=round(time.perf_counter() - started, 1))


def load_omega(path: Path | str, num_layers: int | None = None) -> dict[int, list[float]]:
    """ω by bit width (one value per decoder layer) from a JSON `morphling profile --indicator` wrote; with
    `num_layers`, that many layers. Full precision, which rounds nothing, has ω 0 and no entry.

    Raises IndicatorError naming the file and the field when it cannot be read or used."""
    path = Path(path)

    def fail(field: str, problem: str) -> IndicatorError:
        return IndicatorError(f"{path}: {field}: {problem}")

    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise fail("(file)", "not found: write it with `morphling profile --indicator`") from None
    except (OSError, ValueError) as exc:
        raise fail("(file)", f"unreadable: {exc}") from exc
    if not isinstance(record, dict):
        raise fail("(top level)", f"expected a JSON object, got {type(record).__name__}")
    if record.get("kind") != KIND:
        raise fail("kind", f"expected {KIND!r} (written by `morphling profile --indicator`), "
                           f"got {record.get('kind')!r}")
    layers = record.get("num_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise fail("num_layers", f"expected a whole number of at least 1, got {layers!r}")
    if num_layers is not None and layers != num_layers:
        raise fail("num_layers", f"made for a model of {layers} layers, not {num_layers}")
    bits = record.get("bits")
    if not isinstance(bits, list) or not bits or any(b not in BITS for b in bits) or len(set(bits)) != len(bits):
        raise fail("bits", f"expected distinct widths among {list(BITS)}, got {bits!r}")
    table = record.get("omega")
    if not isinstance(table, dict) or sorted(table) != sorted(str(b) for b in bits):
        raise fail("omega", f"expected one list per width of bits {bits}, got keys "
                            f"{sorted(table) if isinstance(table, dict) else table!r}")
    omegas = {}
    for b in bits:
        values = table[str(b)]
        if not isinstance(values, list) or len(values) != layers:
            raise fail(f"omega.{b}", f"expected {layers} values, one per layer, got {values!r}")
        for i, value in enumerate(values):
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or value < 0):
                raise fail(f"omega.{b}[{i}]", f"expected a finite number >= 0, got {value!r}")
        omegas[b] = [float(v) for v in values]
    return omegas


def plot(record: dict, path: Path) -> None:
    import matplotlib  # only validation needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    validation = record["validation"]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    deltas = [d for b in record["bits"] for d in validation["delta_ppl"][str(b)]]
    for b in record["bits"]:
        xs, ys = record["omega"][str(b)], validation["delta_ppl"][str(b)]
        rho = validation["spearman"][str(b)]["rho"]
        ax.scatter(xs, ys, s=18, label=f"INT{b}: Spearman ρ = {rho:.2f}" if rho is not None else f"INT{b}")
        for i, (x, y) in enumerate(zip(xs, ys)):
            ax.annotate(str(i), (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
    ax.set_xscale("log")
    positive = [abs(d) for d in deltas if d != 0]
    if min(deltas) > 0:
        ax.set_yscale("log")
    elif positive:
        # a layer can leave perplexity where it was, or lower it: a log axis could not show it
        ax.set_yscale("symlog", linthresh=10 ** math.floor(math.log10(min(positive))))
    overall = validation["spearman"]["overall"]["rho"]
    ax.set_title(f"{served_model_name(record['model'])}: ω vs ΔPPL, one layer quantized"
                 + (f" (overall ρ = {overall:.2f})" if overall is not None else ""), fontsize=9)
    ax.set_xlabel(f"ω (Eq. 3, {record['rounding']} rounding)")
    ax.set_ylabel(f"ΔPPL over full precision ({validation['tokens']} tokens)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bits_arg(text: str) -> tuple[int, ...]:
    try:
        bits = tuple(dict.fromkeys(int(b) for b in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated bit widths, got {text!r}") from None
    if any(b not in BITS for b in bits):
        raise argparse.ArgumentTypeError(f"layers quantize to {' or '.join(map(str, BITS))} bits, not {text!r}")
    return bits


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def print_table(record: dict) -> None:
    bits, validation = record["bits"], record["validation"]
    header = f"{'layer':>5} " + " ".join(f"{'ω' + str(b):>10}" for b in bits)
    if validation:
        header += " " + " ".join(f"{'ΔPPL' + str(b):>9}" for b in bits)
    print(header)
    for i in range(record["num_layers"]):
        row = f"{i:>5} " + " ".join(f"{record['omega'][str(b)][i]:10.3e}" for b in bits)
        if validation:
            row += " " + " ".join(f"{validation['delta_ppl'][str(b)][i]:9.4f}" for b in bits)
        print(row)
    if validation:
        print(f"full-precision ppl {validation['ppl_full']:.3f} on {validation['tokens']} tokens")
        for key, value in validation["spearman"].items():
            label = "all (layer, bits)" if key == "overall" else f"INT{key}, across layers"
            rho = "undefined" if value["rho"] is None else f"{value['rho']:+.3f} (p = {value['p']:.2g})"
            print(f"Spearman ρ(ω, ΔPPL), {label}: {rho}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="morphling profile --indicator", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--bits", type=bits_arg, default=BITS, help="widths to rate, comma-separated (default 8,4)")
    ap.add_argument("--rounding", choices=ROUNDINGS, default="deterministic",
                    help="G(X) of Theorem 1; our quantizers round to nearest (deterministic)")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--calib-tokens", type=positive, default=CALIB_TOKENS,
                    help="the corpus's first tokens, cut into windows, calibrate X")
    ap.add_argument("--window", type=positive, default=WINDOW)
    ap.add_argument("--memory-budget", default="600MiB")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON to write (the PNG goes beside it)")
    ap.add_argument("--validate", action="store_true",
                    help="also measure perplexity with each layer alone quantized at each width, and rank-correlate")
    ap.add_argument("--eval-tokens", type=positive, default=EVAL_TOKENS,
                    help="with --validate: tokens that follow the calibration ones")
    args = ap.parse_args(argv)
    if not args.corpus.exists():
        raise SystemExit(f"no corpus at {args.corpus}")

    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, memory_budget=parse_size(args.memory_budget),
                                    max_model_len=args.window), progress=False)
    window = min(args.window, engine.max_model_len)  # the model's RoPE tables end there
    tokens = load_tokens(engine, args.corpus, args.calib_tokens + (args.eval_tokens if args.validate else 0))
    calibration = tokens[:args.calib_tokens]
    windows = [calibration[s:s + window] for s in range(0, len(calibration), window)]
    key = fingerprint(engine)  # before any layer is quantized
    omegas = omega(engine, windows, args.bits, args.rounding)
    record = dict(kind=KIND, model=args.model, model_fingerprint=key, num_layers=engine.model_config.num_layers,
                  bits=list(args.bits), rounding=args.rounding, omega={str(b): v for b, v in omegas.items()},
                  calibration=dict(corpus=str(args.corpus), tokens=len(calibration), window=window,
                                   windows=len(windows)),
                  validation=None)
    print(f"ω of {record['num_layers']} layers from {len(calibration)} tokens in {time.perf_counter() - started:.0f} s",
          flush=True)
    if args.validate:
        held_out = tokens[args.calib_tokens:]
        if len(held_out) < 2:
            raise SystemExit(f"{args.corpus} has no tokens after the first {args.calib_tokens} to validate on")
        record["validation"] = dict(corpus=str(args.corpus), skip_tokens=args.calib_tokens)
        record["validation"] |= validate(engine, omegas, held_out, window)
    record |= dict(seconds=round(time.perf_counter() - started, 1),
                   date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    print_table(record)
    write_json(args.out, record)
    wrote = str(args.out)
    if record["validation"]:
        plot(record, args.out.with_suffix(".png"))
        wrote += f" and {args.out.with_suffix('.png')}"
    print(f"wrote {wrote} ({record['seconds']:.0f} s)")
    return record
