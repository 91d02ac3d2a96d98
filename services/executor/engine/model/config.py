"""The architecture facts the engine needs about a Llama-family decoder, whatever file it came from."""

from dataclasses import dataclass, field

from shared.core.plans import FFN_PIECES

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    # {"rope_type": "linear"|"llama3", "factor": ..., and for llama3 "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None means plain RoPE.
    rope_scaling: dict | None = None
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""
    # The FFN's intermediate width is stored in this many zero-padded pieces (decoder.layer_layout), the
    # finest tensor-parallel cut there is; a member of a TP-k instance holds pieces / k of them.
    ffn_pieces: int = FFN_PIECES

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_context(self) -> int:
        """Longest sequence we can serve exactly; a sliding window caps it because we attend to all."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings
