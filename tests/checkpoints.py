"""Tiny, randomly initialised Hugging Face checkpoints for tests.

Real checkpoints are unavailable offline and too big for unit tests, so these writers build small
Llama-3, Qwen2 and Mistral models with transformers itself: what they save is, by construction, what
transformers expects to read, which makes them a ground truth for the loader and for numerical
comparisons against transformers' forward pass. Sizes are chosen to exercise the awkward cases:
grouped-query attention, head_dim != hidden/heads, Llama 3 RoPE scaling, q/k/v biases, tied and untied
heads, several safetensors shards with an index, and bf16/fp16 storage.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shared.config import data_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, IM_START_ID, EOS_ID = 0, 1, 2
VOCAB_TARGET = 512
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus_lines(limit: int = 3000) -> list[str]:
    path = data_dir() / "corpora" / "wikitext-2-test.txt"
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return lines[:limit]


_TOKENIZER_CACHE: str | None = None


def build_tokenizer_json() -> str:
    """A byte-level BPE tokenizer (vocab ~512) serialised as tokenizer.json text; trained once per process."""
    global _TOKENIZER_CACHE
    if _TOKENIZER_CACHE is None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB_TARGET,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_corpus_lines(), trainer=trainer)
        _TOKENIZER_CACHE = tok.to_str()
    return _TOKENIZER_CACHE


def _write_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer

    text = build_tokenizer_json()
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[BOS_ID],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
    }, indent=2), encoding="utf-8")
    return Tokenizer.from_str(text).get_vocab_size()


def _rerandomise(model: torch.nn.Module, seed: int) -> None:
    # transformers' init leaves biases at zero and weights small (std 0.02), which would let a loader
    # that drops biases or mixes up rows still pass; make every parameter distinct and O(0.1).
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.1
            p.copy_(noise + 1.0 if "norm" in name else noise)


def _save(model, out: Path, dtype: torch.dtype, generation: dict) -> Path:
    model = model.to(dtype)
    model.save_pretrained(out, max_shard_size="200KB")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    return out


def write_tiny_llama3(out) -> Path:
    """Llama 3 style: GQA 8/2 heads, head_dim 16 (> hidden/heads), llama3 RoPE scaling, tied embeddings, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(out)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    _rerandomise(model, seed=1)
    # A list of eos ids, as Llama 3 instruct models ship, to exercise that form.
    return _save(model, out, torch.float32, {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, BOS_ID]})


def tiny_llama3_engine(out, **config):
    """An engine over a tiny Llama-3 checkpoint written to `out`, in an arena sized for it; `config` sets
    other EngineConfig fields."""
    from services.executor.engine.engine import LLMEngine
    from shared.config import EngineConfig

    path = write_tiny_llama3(out)
    return LLMEngine(EngineConfig(model=str(path), memory_budget=4 << 20, block_size=8, max_model_len=256, **config),
                     progress=False)


def write_tiny_qwen2(out) -> Path:
    """Qwen2 style: MHA 4/4 heads, non-zero q/k/v biases, untied lm_head, rope_theta 1e6, stored as bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(out)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, use_sliding_window=False,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    _rerandomise(model, seed=2)
    return _save(model, out, torch.bfloat16, {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})


def write_tiny_mistral(out) -> Path:
    """Mistral style: GQA 4/2 heads, sliding_window 32, untied head, stored as fp16."""
    from transformers import MistralConfig, MistralForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(out)
    config = MistralConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=32, tie_word_embeddings=False,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    _rerandomise(model, seed=3)
    return _save(model, out, torch.float16, {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})


HF_TO_CANONICAL_LAYER = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
}


def canonical_state_dict(model, tied: bool) -> dict[str, torch.Tensor]:
    """A transformers model's weights under the loader's canonical names, as float32."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "model.embed_tokens.weight":
            out["embed_tokens"] = t
        elif name == "model.norm.weight":
            out["norm"] = t
        elif name == "lm_head.weight":
            if not tied:
                out["lm_head"] = t
        elif name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            out[f"layers.{i}.{HF_TO_CANONICAL_LAYER[rest]}"] = t
    return {k: v.float() for k, v in out.items()}


_CANONICAL_TO_GGUF_LAYER = {
    "input_norm": "attn_norm.weight", "post_attn_norm": "ffn_norm.weight",
    "q_proj": "attn_q.weight", "k_proj": "attn_k.weight", "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight", "gate_proj": "ffn_gate.weight", "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight", "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
}


def _llama_cpp_permute(w, n_head: int):
    # Verbatim from llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute): what the loader must undo.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(theta: float, head_dim: int, rs: dict):
    # Verbatim rule from llama.cpp's converter, which stores per-dimension factors instead of rope_scaling.
    import math

    import numpy as np

    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    old, lo, hi, factor = (rs["original_max_position_embeddings"], rs["low_freq_factor"],
                           rs["high_freq_factor"], rs["factor"])
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_tiny_gguf(hf_dir, out_file, arch: str | None = None, rope_scaling_type: str | None = None) -> Path:
    """Convert one of the tiny HF checkpoints above to an F32 GGUF the way llama.cpp would.

    `arch` overrides general.architecture (to fabricate unsupported files); `rope_scaling_type`
    writes a {arch}.rope.scaling.type key (e.g. "yarn").
    """
    import gguf
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir, out_file = Path(hf_dir), Path(out_file)
    cfg = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tied = bool(cfg.tie_word_embeddings)
    sd = canonical_state_dict(model, tied)
    real_arch = "qwen2" if cfg.model_type == "qwen2" else "llama"
    arch = arch or real_arch
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = dict(cfg.rope_parameters or {})

    w = gguf.GGUFWriter(str(out_file), arch)
    w.add_name(hf_dir.name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if rope_scaling_type:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling_type))
        w.add_rope_scaling_factor(4.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)

    tensors = {"token_embd.weight": sd["embed_tokens"], "output_norm.weight": sd["norm"]}
    if not tied:
        tensors["output.weight"] = sd["lm_head"]
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = torch.from_numpy(_llama3_rope_freqs(rope["rope_theta"], head_dim, rope))
    for name, t in sd.items():
        if not name.startswith("layers."):
            continue
        _, i, kind = name.split(".")
        arr = t
        if real_arch == "llama" and kind in ("q_proj", "q_bias"):
            arr = _llama_cpp_permute(t, cfg.num_attention_heads)
        elif real_arch == "llama" and kind in ("k_proj", "k_bias"):
            arr = _llama_cpp_permute(t, cfg.num_key_value_heads)
        tensors[f"blk.{i}.{_CANONICAL_TO_GGUF_LAYER[kind]}"] = arr
    for name, t in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t.numpy().astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_file


def write_tiny_llama_8kv(out) -> Path:
    """Llama with 8 KV heads (16 query heads), for TP2 and TP4 without replication; an intermediate width of
    200, which no TP degree's alignment divides, so the FFN shards are padded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(out)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=200, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=8, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    _rerandomise(model, seed=3)
    return _save(model, out, torch.float32, {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
