"""The model a plan is for, as the numbers the cost models need: `--model llama-2-13b` names a shape the
planner knows; a checkpoint (`default` or a path) gives its own (read by the CLI, which has the loader).

Shapes are the models' published configs (Hugging Face config.json of each: meta-llama/Llama-2-7b-hf,
-13b-hf, -70b-hf, meta-llama/Meta-Llama-3-8B, -70B, meta-llama/Llama-3.2-1B, Qwen/Qwen2.5-7B,
HuggingFaceTB/SmolLM2-135M).
"""

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @functools.cached_property  # a simulation asks on every step of every executor
    def linears(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each linear operator of a decoder layer, fused as the engine stores them."""
        h, i = self.hidden_size, self.intermediate_size
        return {"qkv_proj": (self.q_size + 2 * self.kv_size, h), "o_proj": (h, self.q_size),
                "gate_up_proj": (2 * i, h), "down_proj": (h, i)}

    @functools.cached_property
    def layer_params(self) -> int:
        """Weights of the linear operators of one decoder layer (what quantization shrinks)."""
        return sum(o * i for o, i in self.linears.values())

    @property
    def embedding_params(self) -> int:
        """Token embeddings plus the LM head unless it is tied to them (kept at full precision)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)


SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("llama-2-7b", 32, 4096, 11008, 32, 32, 128, 32000, False, 4096),
    ModelShape("llama-2-13b", 40, 5120, 13824, 40, 40, 128, 32000, False, 4096),
    ModelShape("llama-2-70b", 80, 8192, 28672, 64, 8, 128, 32000, False, 4096),
    ModelShape("llama-3-8b", 32, 4096, 14336, 32, 8, 128, 128256, False, 8192),
    ModelShape("llama-3-70b", 80, 8192, 28672, 64, 8, 128, 128256, False, 8192),
    ModelShape("llama-3.2-1b", 16, 2048, 8192, 32, 8, 64, 128256, True, 131072),
    ModelShape("qwen2.5-7b", 28, 3584, 18944, 28, 4, 128, 152064, False, 32768),
    ModelShape("smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152, True, 8192),
)}

