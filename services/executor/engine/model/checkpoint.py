"""The format-independent half of loading: canonical tensor names and shapes, and the Checkpoint base.

It exists so that the GGUF and Hugging Face loaders (gguf_loader.py, hf_loader.py) can share the
base class and checks without importing loader.py, which imports them both.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod

import torch

from services.executor.engine.model.config import ModelConfig
from shared.core.errors import ModelLoadError


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


class Checkpoint(ABC):
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

    @abstractmethod
    def _read(self, name: str) -> torch.Tensor:
        """The tensor `name` in the checkpoint's own dtype (each format reads its files its own way)."""

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


def _check_supported(path: str, c: ModelConfig) -> None:
    if c.num_heads % c.num_kv_heads:
        raise ModelLoadError(path, f"{c.num_heads} attention heads are not a multiple of {c.num_kv_heads} kv heads")
    if c.head_dim % 2:
        raise ModelLoadError(path, f"head_dim {c.head_dim} is odd; RoPE needs an even head size")
