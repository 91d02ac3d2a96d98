"""Reads a Hugging Face model directory (config.json plus safetensors) into a Checkpoint.

Kept apart from gguf_loader.py because a directory is described by JSON files (config, generation
and tokenizer configs, a shard index) and its weights are read lazily from memory-mapped shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.executor.engine.model.checkpoint import Checkpoint, _check_supported, _source_name
from services.executor.engine.model.config import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ModelConfig
from shared.core.errors import ModelLoadError, UnsupportedModelError

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

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
