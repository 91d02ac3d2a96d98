"""`morphling profile`: rank decoder layers by how safely they can be quantized (MorphServe's LIS).

Under memory pressure the controller quantizes layers one after another; this profile decides the
order. We could not obtain the exact definitions of MorphServe's Algorithm 1, so these are our reading
of it, each a cosine similarity averaged over the tokens of the calibration windows (higher = safer):

- LTS, layer transformation similarity: between a layer's input and output hidden states. A layer that
  barely changes the residual stream matters little.
- LRS, layer replacement similarity: between the last layer's output of the full model and of the model
  with only layer i quantized (INT4, simulated).
- MDS, model degradation similarity: between the output logits of those two models.
- LIS = 0.25·LTS + 0.25·LRS + 0.5·MDS; the swap order is the layers by LIS, highest first.

The ranking is computed once against the full-precision model; the greedy variant (re-scoring the
remaining layers with the chosen ones already quantized) costs O(layers²) forward passes and is not run.

Hidden states are read by running the decoder layer by layer here rather than by hooking
`DecoderModel.forward`, whose hot path stays untouched. A full-prefill window attends only to itself, so
this needs no KV pages; with layer i quantized, layers before i are unchanged and the pass resumes from
layer i's recorded input.
"""

import argparse
import hashlib
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.prefill_attention import prefill_attention
from services.executor.engine.engine import LLMEngine
from services.executor.tools.evaluate import (
    DEFAULT_CORPUS, DEFAULT_PROFILE, SimulatedQuantization, load_tokens, require_full_precision,
)
from services.executor.engine.model.decoder import DecoderModel, rms_norm, rotate
from shared.config import EngineConfig, parse_size

WEIGHTS = {"lts": 0.25, "lrs": 0.25, "mds": 0.5}
PROFILE_BITS = 4  # the harshest variant the controller uses, so the ranking reflects the worst case
# The LM head costs about a fifth of a forward pass at every row; every fourth row estimates MDS as well.
MDS_STRIDE = 4


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
    gate, up = F.linear(h, w["gate_up_proj"]).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w["down_proj"])


def logits(model: DecoderModel, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(rms_norm(hidden[::MDS_STRIDE], model.norm, model.cfg.rms_norm_eps), model.lm_head).float()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.float(), b.float(), dim=-1).mean())


@torch.inference_mode()
def profile(engine: LLMEngine, windows: list[list[int]]) -> dict:
    """LTS, LRS, MDS and LIS of every decoder layer, averaged over `windows`, and the swap order."""
    model = engine.model
    require_full_precision(model)
    num_layers = model.cfg.num_layers
    quant = SimulatedQuantization(engine)
    sums = {name: [0.0] * num_layers for name in WEIGHTS}
    for ids in windows:
        input_ids = torch.tensor(ids, dtype=torch.int64, device=engine.config.device)
        cos = model.cos[:len(ids)].unsqueeze(1)
        sin = model.sin[:len(ids)].unsqueeze(1)
        inputs = [F.embedding(input_ids, model.embed_tokens)]
        for i in range(num_layers):
            inputs.append(decoder_layer(model, i, inputs[i], cos, sin))
        final = inputs[-1]
        reference = logits(model, final)
        for i in range(num_layers):
            sums["lts"][i] += cosine(inputs[i], inputs[i + 1])
            quant.apply([i], PROFILE_BITS)
            try:
                x = inputs[i]
                for j in range(i, num_layers):
                    x = decoder_layer(model, j, x, cos, sin)
            finally:
                quant.restore()
            sums["lrs"][i] += cosine(final, x)
            sums["mds"][i] += cosine(reference, logits(model, x))
    metrics = {name: [s / len(windows) for s in values] for name, values in sums.items()}
    lis = [sum(WEIGHTS[name] * metrics[name][i] for name in WEIGHTS) for i in range(num_layers)]
    order = sorted(range(num_layers), key=lambda i: (-lis[i], i))
    return dict(order=order, scores=dict(enumerate(lis)), **metrics)


def fingerprint(engine: LLMEngine) -> str:
    """Hash of the model's configuration and a sample of its weights: a profile belongs to one model."""
    digest = hashlib.sha256(repr(engine.model_config).encode())
    for w in engine.model.layers:
        digest.update(w["down_proj"].flatten()[:4096].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="morphling profile", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--max-tokens", type=int, default=1024, help="calibration tokens (cut into windows)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--memory-budget", default="600MiB")
    ap.add_argument("--out", type=Path, default=DEFAULT_PROFILE, help="the profile JSON to write")
    args = ap.parse_args(argv)

    engine = LLMEngine(EngineConfig(model=args.model, memory_budget=parse_size(args.memory_budget),
                                    max_model_len=args.window), progress=False)
    tokens = load_tokens(engine, args.corpus, args.max_tokens)
    windows = [tokens[s:s + args.window] for s in range(0, len(tokens), args.window)]
    windows = [w for w in windows if len(w) > 1]
    started = time.perf_counter()
    result = profile(engine, windows)
    result = dict(order=result["order"], scores={str(k): v for k, v in result["scores"].items()},
                  lts=result["lts"], lrs=result["lrs"], mds=result["mds"], weights=WEIGHTS,
                  bits=PROFILE_BITS, model=args.model, model_fingerprint=fingerprint(engine),
                  corpus=str(args.corpus), tokens=len(tokens), window=args.window,
                  seconds=round(time.perf_counter() - started, 1),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    print(f"{'layer':>5} {'LTS':>7} {'LRS':>7} {'MDS':>7} {'LIS':>7}")
    for i in result["order"]:
        print(f"{i:>5} {result['lts'][i]:7.4f} {result['lrs'][i]:7.4f} {result['mds'][i]:7.4f} "
              f"{result['scores'][str(i)]:7.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"swap order: {result['order']}\nwrote {args.out}")
    return result
