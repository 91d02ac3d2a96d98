"""`morphling eval ppl`: what quantizing K decoder layers costs in perplexity, by swap order and bit width.

The controller quantizes layers one after another in a swap order; the question this answers is how
much quality each step gives up, and whether the LIS order (from `morphling profile`) gives up less
than naive orders. Quality is measured by *simulated* quantization: the chosen layers' weight views are
overwritten in place with `quantize_*(w).dequantize()`, which is exactly what the W8A16/W4A16
reference kernels compute (dequantize, then matmul), so the engine's ordinary full-precision forward
pass sees the same numbers a quantized layer would produce. The originals are kept and copied back,
bit for bit, after each measurement, so one loaded model serves a whole table.

Perplexity runs the engine's own `DecoderModel.forward` over non-overlapping windows of `--window`
tokens, each one prefill chunk in KV pages taken from the arena's ledger, with logits for every row.

`--table` measures every K of `--ks` and every layer, for each width of `--table-bits`, in each order:
`lis` (the shipped profile, or `--profile`), every profile given with `--compare`, front to back, back
to front, and random, the mean over `--random-runs` seeded permutations.
"""

import argparse
import json
import math
import platform
import random
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from services.executor.engine.engine import LLMEngine
from services.executor.engine.model.decoder import ForwardBatch, PrefillChunk
from services.executor.engine.morphing.importance import DEFAULT_PROFILE, load_tokens
from services.executor.engine.morphing.simulated import SimulatedQuantization
from services.executor.engine.morphing.variants import DEFAULT_CORPUS
from shared.config import RESULTS_DIR, EngineConfig, parse_size, read_swap_order

ORDERS = ("lis", "front", "back", "random")
# The table's K besides every layer, which it always measures: services/tools/bench/quality.py reads the largest
# K as "every layer", where all orders agree, and interpolates in between.
TABLE_KS = (0, 4, 8, 16)
TABLE_BITS = (8, 4)
RANDOM_RUNS = 3


@torch.inference_mode()
def window_nll(engine: LLMEngine, ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[1:] given their prefixes, run as one prefill, and its count."""
    bs, device = engine.config.block_size, engine.config.device
    ledger = engine.arena.ledger
    pages = ledger.allocate_many(-(-len(ids) // bs))
    try:
        table = torch.tensor(pages, dtype=torch.int32, device=device)
        slots = [pages[p // bs] * bs + p % bs for p in range(len(ids))]
        n = len(ids)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.arange(n, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            decodes=[],
            prefills=[PrefillChunk(0, n, table, 0)],
            logits_rows=torch.arange(n, dtype=torch.int64, device=device),
        )
        logits = engine.model.forward(batch)
        target = batch.input_ids[1:]
        nll = F.cross_entropy(logits[:-1], target, reduction="sum")
        return float(nll), n - 1
    finally:
        for page in pages:
            ledger.decref(page)


def perplexity(engine: LLMEngine, tokens: list[int], window: int) -> float:
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        chunk = tokens[start:start + window]
        if len(chunk) < 2:
            break
        nll, n = window_nll(engine, chunk)
        total, count = total + nll, count + n
    return math.exp(total / count)


def swap_order(order: str, num_layers: int, profile: Path | None = None, seed: int = 0) -> list[int]:
    """Every layer, in the order the controller would quantize them."""
    if order == "front":
        return list(range(num_layers))
    if order == "back":
        return list(range(num_layers - 1, -1, -1))
    if order == "random":
        layers = list(range(num_layers))
        random.Random(seed).shuffle(layers)
        return layers
    if order == "lis":
        path = profile or DEFAULT_PROFILE
        if not path.exists():
            raise SystemExit(f"no LIS profile at {path}: run `morphling profile` first or pass --profile")
        layers = list(read_swap_order(str(path)))
        if sorted(layers) != list(range(num_layers)):
            raise SystemExit(f"{path} orders {len(layers)} layers, not this model's {num_layers}")
        return layers
    raise ValueError(f"unknown order {order!r}")


def evaluate(engine: LLMEngine, quant: SimulatedQuantization, tokens: list[int], window: int,
             layers: list[int], bits: int) -> float:
    quant.apply(layers, bits)
    try:
        return perplexity(engine, tokens, window)
    finally:
        quant.restore()


def table_orders(num_layers: int, profile: Path | None, compare: dict[str, Path], seed: int,
                 random_runs: int) -> dict[str, list[list[int]]]:
    """The table's rows: each order's label and its permutations, one each but `random_runs` seeded
    ones for random, whose single draw could land on a lucky or an unlucky permutation."""
    orders = {"lis": [swap_order("lis", num_layers, profile)]}
    orders |= {label: [swap_order("lis", num_layers, path)] for label, path in compare.items()}
    orders |= {order: [swap_order(order, num_layers)] for order in ("front", "back")}
    orders["random"] = [swap_order("random", num_layers, seed=seed + run) for run in range(random_runs)]
    return orders


def table(engine: LLMEngine, quant: SimulatedQuantization, tokens: list[int], window: int,
          orders: dict[str, list[list[int]]], ks: list[int], widths: list[int]) -> list[dict]:
    """Perplexity for every (bits, order, K); an order with several permutations reports their mean.

    A set of quantized layers is evaluated once per width whichever orders reach it, so K=0 runs once in
    all and K=every layer once per width.
    """
    measured: dict[tuple[int, frozenset[int]], float] = {}

    def ppl(layers: list[int], bits: int) -> float:
        key = (bits if layers else 0, frozenset(layers))  # with nothing quantized the width is moot
        if key not in measured:
            measured[key] = evaluate(engine, quant, tokens, window, layers, bits)
        return measured[key]

    rows = []
    for bits in widths:
        for label, permutations in orders.items():
            for k in ks:
                started = time.perf_counter()
                runs = [dict(layers=p[:k], ppl=ppl(p[:k], bits)) for p in permutations]
                mean = sum(r["ppl"] for r in runs) / len(runs)
                rows.append(dict(bits=bits, order=label, k=k, ppl=mean, runs=runs))
                print(f"int{bits} {label:>12} K={k:>2}: ppl {mean:.3f} ({time.perf_counter() - started:.1f} s)",
                      flush=True)
        quant.clear_cache()
    return rows


def markdown_table(rows: list[dict]) -> str:
    """Perplexity by K (columns) for each bit width and order (rows); a mean over several permutations
    carries their range."""
    ks = sorted({r["k"] for r in rows})
    lines = ["| bits | order | " + " | ".join(f"K={k}" for k in ks) + " |",
             "|---|---|" + "---:|" * len(ks)]
    for bits in dict.fromkeys(r["bits"] for r in rows):
        for order in dict.fromkeys(r["order"] for r in rows):
            cells = {r["k"]: cell(r) for r in rows if r["bits"] == bits and r["order"] == order}
            lines.append(f"| int{bits} | {order} | " + " | ".join(cells[k] for k in ks) + " |")
    return "\n".join(lines)


def cell(row: dict) -> str:
    values = sorted({r["ppl"] for r in row["runs"]})
    spread = f" ({values[0]:.2f}–{values[-1]:.2f})" if len(values) > 1 else ""
    return f"{row['ppl']:.2f}{spread}"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # only the table needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = list(dict.fromkeys(r["bits"] for r in rows))
    fig, axes = plt.subplots(1, len(widths), figsize=(5 * len(widths), 4), squeeze=False)
    for ax, bits in zip(axes[0], widths):
        for order in dict.fromkeys(r["order"] for r in rows):
            curve = sorted((r for r in rows if r["bits"] == bits and r["order"] == order), key=lambda r: r["k"])
            ks = [r["k"] for r in curve]
            runs = len(curve[0]["runs"])
            line, = ax.plot(ks, [r["ppl"] for r in curve], marker="o",
                            label=order if runs == 1 else f"{order} (mean of {runs}, band: range)")
            if runs > 1:
                ax.fill_between(ks, [min(x["ppl"] for x in r["runs"]) for r in curve],
                                [max(x["ppl"] for x in r["runs"]) for r in curve], color=line.get_color(), alpha=0.15)
        ax.set_title(f"INT{bits} (simulated), layers quantized in swap order")
        ax.set_xlabel("K, decoder layers quantized")
        ax.set_ylabel("perplexity")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def labelled_path(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH, got {text!r}")
    if label in ORDERS:
        raise argparse.ArgumentTypeError(f"{label!r} already labels a row of the table")
    return label, Path(path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="morphling eval", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["ppl"], help="what to evaluate (perplexity)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--quantized", "-k", type=int, default=0, help="number of layers quantized (K)")
    ap.add_argument("--order", choices=ORDERS, default="lis")
    ap.add_argument("--bits", type=int, choices=[4, 8], default=8)
    ap.add_argument("--profile", type=Path, default=None, help=f"LIS profile JSON (default {DEFAULT_PROFILE})")
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random order (the first, with --table)")
    ap.add_argument("--memory-budget", default="600MiB")
    ap.add_argument("--table", action="store_true",
                    help="run every K of --ks and every layer x every order x every width of --table-bits, "
                         "write perplexity.json and a plot")
    ap.add_argument("--ks", type=int, nargs="+", default=list(TABLE_KS),
                    help="with --table: the K to measure besides every layer")
    ap.add_argument("--table-bits", type=int, nargs="+", choices=[4, 8], default=list(TABLE_BITS),
                    help="with --table: the widths to measure")
    ap.add_argument("--compare", type=labelled_path, action="append", default=[], metavar="LABEL=PATH",
                    help="with --table: one more row, the swap order of another profile JSON (repeatable)")
    ap.add_argument("--random-runs", type=int, default=RANDOM_RUNS,
                    help="with --table: random orders averaged (seeds --seed, --seed+1, ...)")
    ap.add_argument("--out", type=Path, default=None, help="folder of the JSON (default: . , or docs/results "
                                                             "with --table)")
    args = ap.parse_args(argv)
    out = args.out or (RESULTS_DIR if args.table else Path("."))
    out.mkdir(parents=True, exist_ok=True)

    engine = LLMEngine(EngineConfig(model=args.model, memory_budget=parse_size(args.memory_budget),
                                    max_model_len=args.window), progress=False)
    quant = SimulatedQuantization(engine)
    tokens = load_tokens(engine, args.corpus, args.max_tokens)
    num_layers = engine.model_config.num_layers
    started = time.perf_counter()
    result = dict(model=args.model, corpus=str(args.corpus), tokens=len(tokens), window=args.window,
                  machine=dict(platform=platform.platform(), processor=platform.processor(),
                               torch_threads=torch.get_num_threads()),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    if args.table:
        orders = table_orders(num_layers, args.profile, dict(args.compare), args.seed, args.random_runs)
        ks = sorted({min(k, num_layers) for k in args.ks} | {num_layers})
        result["profiles"] = {"lis": str(args.profile or DEFAULT_PROFILE)} | {k: str(v) for k, v in args.compare}
        result["rows"] = table(engine, quant, tokens, args.window, orders, ks, args.table_bits)
        path = out / "perplexity.json"
    else:
        layers = swap_order(args.order, num_layers, args.profile, args.seed)[:args.quantized]
        ppl = evaluate(engine, quant, tokens, args.window, layers, args.bits)
        result |= dict(bits=args.bits, order=args.order, k=args.quantized, layers=layers, ppl=ppl)
        print(f"ppl {ppl:.3f}  (int{args.bits}, K={args.quantized}, order {args.order}, {len(tokens)} tokens)")
        path = out / f"ppl_int{args.bits}_{args.order}_k{args.quantized}.json"
    result["seconds"] = round(time.perf_counter() - started, 1)
    path.write_text(json.dumps(result, indent=2))
    if args.table:
        print(markdown_table(result["rows"]))
        plot(result["rows"], out / "perplexity.png")
    print(f"wrote {path}")
    return result
