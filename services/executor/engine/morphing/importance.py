"""The order in which to quantize decoder layers, by MorphServe's Layer Importance Score (`morphling profile`).

Under memory pressure the controller quantizes layers one after another; this profile decides the order.
It follows the paper's definitions (§4.2, Eqs. 2–5) and greedy selection (Appendix A.2, Algorithm 1).
Each metric is a cosine similarity averaged over the tokens of the calibration windows; higher means
safer to quantize:

- LTS_p = cos(h_p(x), x_p), layer transformation: layer p's output against its input, in the
  full-precision model. A layer that barely changes the residual stream matters little.
- LRS_p = cos(h_p(x), h_p^Q(x)), layer replacement: layer p's output with its full-precision weights
  against its quantized weights, on the same full-precision input. Nothing but layer p changes.
- MDS_p^(Q) = cos(f^(Q)(x), f^(Q∪{p})(x)), model degradation: the output logits with the layers chosen
  so far (Q) quantized, against Q and p quantized.
- LIS_p = 0.25·LTS_p + 0.25·LRS_p + 0.5·MDS_p^(Q).

Greedy: from an empty Q, every layer not in Q is scored with Q quantized, the one with the highest LIS
joins Q and stays quantized, until every layer has joined; the order they joined in is the swap order.
LTS and LRS do not depend on Q and are computed once. A layer's "output" is the residual stream after
it, what the layer hands the next one. Quantization is INT4, simulated (simulated.SimulatedQuantization).

Cost: L(L+1)/2 candidate passes for L layers. The hidden state entering each layer under f^(Q) is kept,
so a candidate j reruns only layers j..L-1; the logits are taken at every MDS_STRIDE-th position only.

Hidden states are read by running the decoder layer by layer here rather than by hooking
`DecoderModel.forward`, whose hot path stays untouched. A full-prefill window attends only to itself, so
this needs no KV pages.

`swap_order_for` is what serving start-up calls: the shipped profile when it was made for the loaded
model, else one an earlier call cached, else a fresh one.
"""

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from morphling_kernels.prefill_attention import prefill_attention
from services.executor.engine.engine import LLMEngine
from services.executor.engine.model.decoder import DecoderModel, mlp, rms_norm, rotate
from services.executor.engine.morphing.simulated import SimulatedQuantization, require_full_precision
from services.executor.engine.morphing.variants import DEFAULT_CORPUS
from shared.config import RESULTS_DIR

log = logging.getLogger(__name__)

DEFAULT_PROFILE = RESULTS_DIR / "lis_profile.json"  # shipped for the default model

WEIGHTS = {"lts": 0.25, "lrs": 0.25, "mds": 0.5}  # α1, α2 and β of Eq. 5, as the paper sets them
PROFILE_BITS = 4  # the harshest variant the controller uses, so the ranking reflects the worst case
# The LM head costs about a fifth of a forward pass at every row; every fourth row estimates MDS as well.
MDS_STRIDE = 4
DEFAULT_CACHE_DIR = Path("~/.cache/morphling/profiles")
# What a start-up profiles when neither the shipped profile nor the cache has its model: one window, as
# the greedy search costs L(L+1)/2 candidate passes per window. On two shared CPU cores SmolLM2-135M took
# 28 min for 1,024 tokens, so about 14 for these; the shipped profile spares the default model that.
STARTUP_TOKENS = 512
WINDOW = 512


class MissingCorpusError(FileNotFoundError):
    """A profile has to be computed but its calibration corpus is not there."""

    def __init__(self, corpus: Path):
        super().__init__(f"no calibration corpus at {corpus}: cannot profile the swap order")
        self.corpus = corpus


def load_tokens(engine: LLMEngine, corpus: Path, max_tokens: int) -> list[int]:
    """The first `max_tokens` tokens of `corpus` (no BOS: SmolLM2's tokenizer adds none)."""
    text = corpus.read_text(encoding="utf-8")
    # Tokenizing all of a large corpus to keep its start is slow; a prefix of ~6 characters a token is
    # enough, doubled when it is not.
    chars = max_tokens * 6
    while True:
        ids = engine.tokenizer.encode(text[:chars])
        if len(ids) > max_tokens or chars >= len(text):
            return ids[:max_tokens]
        chars *= 2


def decoder_layer(model: DecoderModel, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> torch.Tensor:
    """One decoder layer over one whole-window prefill, as DecoderModel.forward computes it."""
    cfg, w, n = model.cfg, model.layers[index], x.shape[0]
    h = rms_norm(x, w["input_norm"], cfg.rms_norm_eps)
    q, k, v = F.linear(h, w["qkv_proj"], w.get("qkv_bias")).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    q = rotate(q.view(n, cfg.num_heads, cfg.head_dim), cos, sin)
    k = rotate(k.view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
    v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
    no_pages = torch.empty(0, dtype=torch.int32, device=x.device)  # context_start 0 never reads the cache
    attn = prefill_attention(q, k, v, model.arena.kv_cache, index, no_pages, 0, model.scale)
    x = x + F.linear(attn.reshape(n, cfg.q_size), w["o_proj"])
    h = rms_norm(x, w["post_attn_norm"], cfg.rms_norm_eps)
    return x + mlp(h, w, model.full_bits, model.ffn_width)


def logits(model: DecoderModel, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(rms_norm(hidden[::MDS_STRIDE], model.norm, model.cfg.rms_norm_eps), model.lm_head).float()


def mean_cosine(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Cosine similarity of paired rows, averaged over every row of every pair (so over tokens, not windows)."""
    total, rows = 0.0, 0
    for a, b in pairs:
        total += float(F.cosine_similarity(a.float(), b.float(), dim=-1).sum())
        rows += a.shape[0]
    return total / rows


class Trace:
    """One calibration window: the hidden state entering each layer with the layers now quantized in the
    model (inputs[L] is the last layer's output), and the logits they end in."""

    def __init__(self, model: DecoderModel, ids: list[int]):
        self.model = model
        self.cos = model.cos[:len(ids)].unsqueeze(1)
        self.sin = model.sin[:len(ids)].unsqueeze(1)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=model.embed_tokens.device)
        self.inputs = [F.embedding(input_ids, model.embed_tokens)]
        self.record_from(0)

    def layer(self, index: int) -> torch.Tensor:
        """Layer `index`'s output, as the layer is now, on its recorded input."""
        return decoder_layer(self.model, index, self.inputs[index], self.cos, self.sin)

    def output_from(self, start: int) -> torch.Tensor:
        """The last layer's output with layers `start`.. as they are now, from layer `start`'s recorded input."""
        x = self.inputs[start]
        for i in range(start, self.model.cfg.num_layers):
            x = decoder_layer(self.model, i, x, self.cos, self.sin)
        return x

    def record_from(self, start: int) -> None:
        """Record again what follows layer `start`, which has just changed."""
        del self.inputs[start + 1:]
        for i in range(start, self.model.cfg.num_layers):
            self.inputs.append(self.layer(i))
        self.logits = logits(self.model, self.inputs[-1])


def layer_similarities(quant: SimulatedQuantization, traces: list[Trace]) -> tuple[list[float], list[float]]:
    """LTS and LRS of every layer, from full-precision traces."""
    lts, lrs = [], []
    for i in range(traces[0].model.cfg.num_layers):
        lts.append(mean_cosine((t.inputs[i + 1], t.inputs[i]) for t in traces))
        quant.apply([i], PROFILE_BITS)
        try:
            lrs.append(mean_cosine((t.inputs[i + 1], t.layer(i)) for t in traces))
        finally:
            quant.restore([i])
    return lts, lrs


def degradation(quant: SimulatedQuantization, traces: list[Trace], candidate: int) -> float:
    """MDS of `candidate` given the layers quantized now: the traces' logits against those with it quantized too."""
    quant.apply([candidate], PROFILE_BITS)
    try:
        return mean_cosine((t.logits, logits(t.model, t.output_from(candidate))) for t in traces)
    finally:
        quant.restore([candidate])


@torch.inference_mode()
def profile(engine: LLMEngine, windows: list[list[int]], progress: bool = False) -> dict:
    """The greedy swap order over `windows`, every layer's LTS and LRS, and each step's LIS and MDS of
    every candidate. The model is back in full precision when it returns."""
    model = engine.model
    require_full_precision(model)
    num_layers = model.cfg.num_layers
    quant = SimulatedQuantization(engine)
    traces = [Trace(model, ids) for ids in windows]
    lts, lrs = layer_similarities(quant, traces)
    order, steps = [], []
    bar = tqdm(total=num_layers * (num_layers + 1) // 2, desc="profiling the swap order", unit="candidate",
               disable=not progress)
    try:
        while len(order) < num_layers:
            mds = {}
            for j in (j for j in range(num_layers) if j not in order):
                mds[j] = degradation(quant, traces, j)
                bar.update()
            lis = {j: WEIGHTS["lts"] * lts[j] + WEIGHTS["lrs"] * lrs[j] + WEIGHTS["mds"] * m for j, m in mds.items()}
            chosen = max(lis, key=lis.get)  # the lowest index among equals
            quant.apply([chosen], PROFILE_BITS)
            for t in traces:
                t.record_from(chosen)
            order.append(chosen)
            steps.append(dict(layer=chosen, lis=lis[chosen], mds=mds))
    finally:
        quant.restore()
        bar.close()
    return dict(order=order, lts=lts, lrs=lrs, steps=steps)


def fingerprint(engine: LLMEngine) -> str:
    """Hash of the model's configuration (its fields by name, so that their order in the class is not part of it)
    and a sample of its weights: a profile belongs to one model."""
    fields = json.dumps(dataclasses.asdict(engine.model_config), sort_keys=True, default=str)
    digest = hashlib.sha256(fields.encode())
    for w in engine.model.layers:
        digest.update(w["down_proj"].flatten()[:4096].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def run_profile(engine: LLMEngine, corpus: Path, max_tokens: int, window: int, progress: bool) -> dict:
    """Profile the first `max_tokens` tokens of `corpus` in windows of `window`: the record a profile JSON holds."""
    if not corpus.exists():
        raise MissingCorpusError(corpus)
    window = min(window, engine.max_model_len)  # the model's RoPE tables end there
    tokens = load_tokens(engine, corpus, max_tokens)
    windows = [tokens[s:s + window] for s in range(0, len(tokens), window)]
    started = time.perf_counter()
    result = profile(engine, [w for w in windows if len(w) > 1], progress)
    return dict(order=result["order"], model_fingerprint=fingerprint(engine), lts=result["lts"],
                lrs=result["lrs"], steps=result["steps"], algorithm="greedy LIS (MorphServe Algorithm 1)",
                weights=WEIGHTS, bits=PROFILE_BITS, mds_stride=MDS_STRIDE, model=engine.config.model,
                corpus=str(corpus), tokens=len(tokens), window=window,
                seconds=round(time.perf_counter() - started, 1),
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def write_json(path: Path, record: dict) -> None:
    """Write `path` whole or not at all: a start-up killed mid-write must not leave a truncated profile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shipped or shared profile from other users
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def stored_order(path: Path, model_fingerprint: str, num_layers: int) -> list[int] | None:
    """The swap order of the profile JSON at `path` if it was made for the model with this fingerprint."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable profile %s: %s", path, exc)
        return None
    if not isinstance(record, dict) or record.get("model_fingerprint") != model_fingerprint:
        return None
    order = record.get("order")
    if not (isinstance(order, list) and all(isinstance(i, int) for i in order)
            and sorted(order) == list(range(num_layers))):
        log.warning("ignoring profile %s: its order is not a permutation of %d layers", path, num_layers)
        return None
    return order


def swap_order_for(engine: LLMEngine, corpus: Path = DEFAULT_CORPUS, cache_dir: Path | None = None,
                   progress: bool = True, max_tokens: int = STARTUP_TOKENS, window: int = WINDOW,
                   shipped: Path = DEFAULT_PROFILE) -> list[int]:
    """The swap order for the engine's model, safest layer first: from the `shipped` profile when it was
    made for this model, else from `<cache_dir>/<fingerprint>.json` written by an earlier call, else
    profiled now on the first `max_tokens` tokens of `corpus` (a progress bar on stderr) and cached.

    Raises MissingCorpusError when it must profile and `corpus` does not exist.
    """
    key = fingerprint(engine)
    cached = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / f"{key}.json"
    for path in (shipped, cached):
        order = stored_order(path, key, engine.model_config.num_layers)
        if order is not None:
            return order
    log.info("no swap-order profile for this model (fingerprint %s): profiling %d tokens of %s", key,
             max_tokens, corpus)
    record = run_profile(engine, corpus, max_tokens, window, progress)
    write_json(cached, record)
    log.info("profiled the swap order in %.0f s; cached in %s", record["seconds"], cached)
    return record["order"]
