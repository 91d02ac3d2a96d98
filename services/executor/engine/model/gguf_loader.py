"""Reads a llama.cpp GGUF file into a Checkpoint under the canonical tensor names.

Kept apart from hf_loader.py because GGUF needs its own name map, dequantisation, the undoing of
llama.cpp's RoPE row permutation, and the recovery of Llama 3 RoPE scaling from `rope_freqs`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from services.executor.engine.model.checkpoint import Checkpoint, _check_supported, _source_name
from services.executor.engine.model.config import SUPPORTED_ROPE_TYPES, ModelConfig
from shared.core.errors import ModelLoadError, UnsupportedModelError

# Mistral GGUFs are written with general.architecture "llama"; the weights and RoPE layout match.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

_GGUF_LAYER_NAMES = {
    "input_norm": "attn_norm.weight",
    "post_attn_norm": "ffn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
}
_GGUF_GLOBAL_NAMES = {"embed_tokens": "token_embd.weight", "norm": "output_norm.weight",
                      "lm_head": "output.weight"}


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each head (its RoPE rotates adjacent
    # pairs); HF Llama rotates halves. This is the inverse of convert_hf_to_gguf's permute, the same
    # as transformers' LlamaTensorProcessor._reverse_permute_weights.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class GGUFCheckpoint(Checkpoint):
    def __init__(self, config: ModelConfig, path: str, tensors: dict, unpermute: bool):
        super().__init__(config, path, [path])
        self._tensors = tensors
        self._unpermute = unpermute

    def _read(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        src = _source_name(name, _GGUF_GLOBAL_NAMES, _GGUF_LAYER_NAMES, "blk.{i}.")
        t = self._tensors[src]
        try:
            w = dequantize(t.data, t.tensor_type)
        except (ValueError, NotImplementedError) as e:
            raise UnsupportedModelError(self.path, f"tensor {src} has unsupported type {t.tensor_type.name}: {e}")
        # GGUF lists dims innermost first (ne0 = in-features); numpy order is the reverse: [out, in].
        w = np.asarray(w, dtype=np.float32).reshape(self._shapes[name])
        if self._unpermute and name.endswith(("q_proj", "k_proj", "q_bias", "k_bias")):
            heads = self.config.num_heads if name.startswith("q", name.rfind(".") + 1) else self.config.num_kv_heads
            w = _unpermute_rope_rows(w, heads)
        return torch.from_numpy(np.array(w, dtype=np.float32, copy=True))


def _f32(value) -> float:
    # GGUF stores these as float32; the shortest decimal that round-trips gives back the original 1e-5, not 9.99e-6.
    return float(str(np.float32(value)))


def _fit_llama3_rope(path: str, freq_factors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """Recover Llama 3 rope_scaling parameters from the per-dimension factors llama.cpp stores.

    llama.cpp bakes the Llama 3 rule into a `rope_freqs` tensor: 1 for high frequencies, `factor` for
    low ones, and between them 1 / ((1 - s) / factor + s) with s = (old * u - low) / (high - low),
    u = freq / 2pi. Only old / (high - low) and low / (high - low) are identifiable, so we fix
    low_freq_factor = 1 (every Llama 3.x release) and solve for the other two; with few head
    dimensions (tiny models) fewer than two blended points exist and the cut-offs come from the
    neighbouring unblended dimensions instead. The result is checked by recomputing the factors.
    """
    u = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / (2 * math.pi)
    r = freq_factors.astype(np.float64)
    problem = "its rope_freqs tensor does not follow the Llama 3 scaling rule"
    if r.shape != u.shape:
        raise ModelLoadError(path, f"rope_freqs has {r.size} entries, expected {u.size}")
    factor = float(r.max())
    if factor <= 1 + 1e-6:
        return None
    ones = r <= 1 + 1e-5
    lows = r >= factor * (1 - 1e-5)
    blended = ~ones & ~lows
    smooth = (1 / r[blended] - 1 / factor) / (1 - 1 / factor)
    if blended.sum() >= 2:
        a, minus_one = np.polyfit(u[blended], smooth, 1)  # s = (a u - 1) / b = (a / b) u - 1 / b
        b = -1 / minus_one
        a = a * b
    elif lows.any():
        # The low cut-off sits on the highest frequency scaled by the full factor: s = 0 there.
        a = 1 / u[lows].max()
        if blended.any():
            b = (a * u[blended][0] - 1) / smooth[0]
        elif ones.any():
            b = a * u[ones].min() - 1  # the high cut-off on the lowest unscaled frequency: s = 1 there
        else:
            raise UnsupportedModelError(path, problem)
    else:
        raise UnsupportedModelError(path, problem)
    original = float(round(a)) if abs(a - round(a)) < 1e-6 * a else float(a)
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": float(1 + b),
              "original_max_position_embeddings": int(original) if original.is_integer() else original}
    if b <= 0 or not np.allclose(_llama3_factors(u, params), r, rtol=1e-4):
        raise UnsupportedModelError(path, problem)
    return params


def _llama3_factors(u: np.ndarray, p: dict) -> np.ndarray:
    # Same rule as transformers' _compute_llama3_parameters, as per-dimension divisors of the frequency.
    wavelen = 1 / u
    old = p["original_max_position_embeddings"]
    low_wl, high_wl = old / p["low_freq_factor"], old / p["high_freq_factor"]
    smooth = (old / wavelen - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
    blended = 1 / ((1 - smooth) / p["factor"] + smooth)
    return np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, p["factor"], blended))


def _load_gguf(path: str) -> GGUFCheckpoint:
    from services.executor.engine.model.gguf_file import read_gguf  # imports gguf: only GGUF needs it

    try:
        parsed = read_gguf(path)
    except Exception as e:  # corruption surfaces as struct/numpy/value errors of any kind
        raise ModelLoadError(path, f"not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}")
    meta, tensors = parsed.metadata, parsed.tensors
    arch_raw = meta.get("general.architecture")
    if arch_raw is None:
        raise ModelLoadError(path, "GGUF metadata has no general.architecture")
    if arch_raw not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            path, f"unsupported architecture {arch_raw!r}; supported GGUF architectures: "
                  f"{', '.join(GGUF_ARCHITECTURES)} (Mistral GGUFs declare 'llama')")
    arch = GGUF_ARCHITECTURES[arch_raw]

    def need(key: str):
        value = meta.get(f"{arch_raw}.{key}")
        if value is None:
            raise ModelLoadError(path, f"GGUF metadata lacks {arch_raw}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch_raw}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch_raw}.attention.key_length", hidden // heads))
    rope_dim = meta.get(f"{arch_raw}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise UnsupportedModelError(path, f"partial rotary embeddings (rope.dimension_count {rope_dim} "
                                          f"!= head_dim {head_dim}) are not supported")
    theta = _f32(meta.get(f"{arch_raw}.rope.freq_base", 10000.0))
    max_pos = int(need("context_length"))

    rope_scaling = None
    scaling_type = meta.get(f"{arch_raw}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise UnsupportedModelError(
                path, f"unsupported rope scaling type {scaling_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        rope_scaling = {"rope_type": "linear", "factor": _f32(need("rope.scaling.factor"))}
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        rope_scaling = _fit_llama3_rope(path, np.asarray(t.data, dtype=np.float32).reshape(-1), theta, head_dim)

    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab = len(tokens)
    else:
        vocab = int(need("vocab_size"))
    eos = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = meta.get(key)
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    sliding = meta.get(f"{arch_raw}.attention.sliding_window")

    config = ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        max_position_embeddings=max_pos,
        rope_scaling=rope_scaling,
        attention_bias="blk.0.attn_q.bias" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(eos),
        name=str(meta.get("general.name") or Path(path).stem),
    )
    _check_supported(path, config)
    ckpt = GGUFCheckpoint(config, path, tensors, unpermute=arch == "llama")
    for name, shape in ckpt._shapes.items():
        src = _source_name(name, _GGUF_GLOBAL_NAMES, _GGUF_LAYER_NAMES, "blk.{i}.")
        if src not in tensors:
            raise ModelLoadError(path, f"missing tensor {src} (needed for {name})")
        found = tuple(int(d) for d in reversed(tensors[src].shape))
        if found != shape:
            raise ModelLoadError(path, f"tensor {src} has shape {list(found)}, expected {list(shape)} for {name}")
    return ckpt
