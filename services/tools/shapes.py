"""Named model shapes, and random-weight Hugging Face checkpoints of them written once and cached.

GPU machines we benchmark on may reach no model hub, yet what a decode step costs depends on the shape of
the model (its bytes, its matrix sizes), not on what its weights say. So `ensure_checkpoint` writes a
directory that our loader and transformers both read as they would the real one: config.json,
generation_config.json, safetensors shards with their index, and a tokenizer. The tokenizer is a byte-level
BPE over a synthetic vocabulary of the model's size (no data files needed), with Llama 3's special tokens
at the top of the id range and its chat template, so that any text encodes and every id decodes.

Weights are normal with std 0.02 (norms ones), drawn per tensor from a generator seeded by the tensor's
name on the device that writes them (CUDA draws gigabytes in a blink; the CPU takes minutes for an 8B), so
the same shape, dtype and device always give the same checkpoint. A marker file, written last, says a
directory is complete: one without it (an interrupted write) is written again.
"""

from __future__ import annotations

import json
import math
import shutil
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from shared.core.planner.shapes import SHAPES as PLANNER_SHAPES
from shared.core.planner.shapes import ModelShape

DEFAULT_CACHE_DIR = Path("~/.cache/morphling/shapes")
MARKER = "morphling-shape.json"  # written last: its presence means the directory is complete
FORMAT_VERSION = 1  # bump when what a written directory holds changes meaning
MAX_SHARD_BYTES = 4 * 10**9
INIT_STD = 0.02
SEED = 0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Llama 3's named special tokens and their offsets from the first special id; the other of the 256 are reserved.
NUM_SPECIAL = 256
NAMED_SPECIAL = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>", 7: "<|end_header_id|>",
                 8: "<|eom_id|>", 9: "<|eot_id|>"}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


class ShapeError(ValueError):
    """A shape is neither a named one nor a usable checkpoint directory, or a cached one is unusable."""


@dataclass(frozen=True)
class Shape(ModelShape):
    """A model's shape as the planner knows it (shared/core/planner/shapes.py), and what a checkpoint of it says
    besides: its RoPE and its norms' epsilon."""
    rope_theta: float = 500000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    rms_norm_eps: float = 1e-5

    @property
    def special_ids(self) -> dict[str, int]:
        first = self.vocab_size - NUM_SPECIAL
        return {text: first + offset for offset, text in NAMED_SPECIAL.items()}

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the checkpoint under its Hugging Face name, [out, in], in file order."""
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            shapes |= {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)}
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.tensor_shapes().values())

    def hf_config(self, dtype: str) -> dict:
        ids = self.special_ids
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": dtype,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "mlp_bias": False, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "initializer_range": INIT_STD, "pretraining_tp": 1,
            "use_cache": True, "bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": ids["<|end_of_text|>"],
        }


_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# The planner's shapes of the real models (meta-llama/Llama-3.2-1B, meta-llama/Meta-Llama-3-8B), with their
# config.json's RoPE: Llama 3.0's 8B has plain RoPE over 8192 positions; the llama3 scaling came with 3.1.
# `tiny` is a scaled-down 3.2-1B for tests.
SHAPES = {
    "llama-3.2-1b": Shape(**asdict(PLANNER_SHAPES["llama-3.2-1b"]), rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}),
    "llama-3-8b": Shape(**asdict(PLANNER_SHAPES["llama-3-8b"])),
    "tiny": Shape("tiny", num_layers=4, hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2,
                  head_dim=32, vocab_size=2048, tie_word_embeddings=False, max_position_embeddings=131072,
                  rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}),
}


# --- the tokenizer ----------------------------------------------------------------------------

def _byte_alphabet() -> list[str]:
    """The 256 byte-level symbols, the ones common in text first, so that the first merges are letter pairs."""
    from tokenizers import pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    common = "Ġ" + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "0123456789"
    return [*common, *(s for s in symbols if s not in common)]


def build_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer` of exactly `vocab_size` ids: 256 bytes, then synthetic merges (every pair of
    bytes, then a pair plus a byte, ...) up to the special tokens, which take the last NUM_SPECIAL ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    regular = vocab_size - NUM_SPECIAL
    alphabet = _byte_alphabet()
    if regular < len(alphabet):
        raise ShapeError(f"a vocabulary of {vocab_size} leaves no room for 256 bytes and {NUM_SPECIAL} special tokens")
    vocab = {s: i for i, s in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    level = alphabet
    while len(vocab) < regular:
        longer = []
        for left in level:
            for right in alphabet:
                if len(vocab) == regular:
                    break
                vocab[left + right] = len(vocab)
                merges.append((left, right))
                longer.append(left + right)
        level = longer
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    names = {offset: text for offset, text in NAMED_SPECIAL.items()}
    tok.add_special_tokens([AddedToken(names.get(k, f"<|reserved_special_token_{k}|>"), special=True,
                                       normalized=False) for k in range(NUM_SPECIAL)])
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ShapeError(f"built a tokenizer of {tok.get_vocab_size(True)} ids for a vocabulary of {vocab_size}")
    return tok


def _write_tokenizer(shape: Shape, out: Path) -> None:
    build_tokenizer(shape.vocab_size).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": shape.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }, indent=2))


# --- the weights --------------------------------------------------------------------------------

def _shards(shapes: dict[str, tuple[int, ...]], itemsize: int, max_bytes: int) -> list[list[str]]:
    """Tensor names grouped in file order into shards of at most `max_bytes` (a bigger tensor goes alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(SEED ^ zlib.crc32(name.encode()))
    w = torch.randn(shape, generator=gen, dtype=torch.float32, device=device).mul_(INIT_STD)
    return w.to(dtype).cpu()


def _write_weights(shape: Shape, dtype: str, out: Path, device: str, max_shard_bytes: int, progress: bool) -> None:
    from safetensors.torch import save_file

    torch_dtype = DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    shapes = shape.tensor_shapes()
    groups = _shards(shapes, itemsize, max_shard_bytes)
    files = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))])
    total = sum(math.prod(s) for s in shapes.values()) * itemsize
    weight_map = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {shape.name} ({dtype}) weights",
              disable=not progress) as bar:
        for file, names in zip(files, groups):
            tensors = {}
            for name in names:
                tensors[name] = _random_tensor(name, shapes[name], torch_dtype, device)
                weight_map[name] = file
                bar.update(tensors[name].numel() * itemsize)
            save_file(tensors, str(out / file), metadata={"format": "pt"})
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


# --- the cache ----------------------------------------------------------------------------------

def _marker(shape: Shape, dtype: str, device: str) -> dict:
    # The device is part of what was written: CUDA's and the CPU's generators draw different numbers.
    return {"format": FORMAT_VERSION, "shape": asdict(shape), "dtype": dtype, "generator_device": device,
            "seed": SEED, "init_std": INIT_STD}


def _complete(directory: Path, expected: dict) -> bool:
    try:
        return json.loads((directory / MARKER).read_text()) == expected
    except (OSError, ValueError):
        return False


def _location(shape: str, dtype: str, cache_dir: str | Path | None, device: str) -> tuple[Path, dict]:
    if dtype not in DTYPES:
        raise ShapeError(f"checkpoints are written in {', '.join(DTYPES)}, not {dtype!r}")
    generator_device = "cuda" if str(device).startswith("cuda") else "cpu"
    out = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / f"{shape}-{dtype}"
    return out, _marker(SHAPES[shape], dtype, generator_device)


def cached_checkpoint(shape: str, dtype: str, cache_dir: str | Path | None = None, device: str = "cpu"
                      ) -> Path | None:
    """The complete cached directory `ensure_checkpoint` would return for a named shape, or None (not
    written yet, or `shape` is not a named one)."""
    if shape not in SHAPES:
        return None
    out, expected = _location(shape, dtype, cache_dir, device)
    return out if _complete(out, expected) else None


def ensure_checkpoint(shape: str, dtype: str, cache_dir: str | Path | None = None, device: str = "cpu",
                      progress: bool = True, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """The checkpoint directory of `shape`: a named shape's, written under `cache_dir` (default
    ~/.cache/morphling/shapes) as <name>-<dtype> unless a complete one is there, or `shape` itself when it is
    a Hugging Face checkpoint directory (`dtype` then only says how it is served)."""
    if shape not in SHAPES:
        path = Path(shape).expanduser()
        if path.is_dir() and (path / "config.json").is_file():
            return path.resolve()
        raise ShapeError(f"{shape!r} is neither a named shape ({', '.join(SHAPES)}) nor a checkpoint directory "
                         f"(a folder with config.json)")
    out, expected = _location(shape, dtype, cache_dir, device)
    if _complete(out, expected):
        return out
    spec, generator_device = SHAPES[shape], expected["generator_device"]
    if out.exists():
        shutil.rmtree(out)  # an interrupted write, or one of another definition: nothing in it can be trusted
    out.mkdir(parents=True)
    _write_tokenizer(spec, out)
    (out / "config.json").write_text(json.dumps(spec.hf_config(dtype), indent=2))
    ids = spec.special_ids
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|begin_of_text|>"],
        "eos_token_id": [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]}, indent=2))
    _write_weights(spec, dtype, out, device if generator_device == "cuda" else "cpu", max_shard_bytes, progress)
    (out / MARKER).write_text(json.dumps(expected, indent=2))
    return out
