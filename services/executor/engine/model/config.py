"""The architecture facts the engine needs about a Llama-family decoder, whatever file it came from."""

from dataclasses import dataclass, field

from shared.core.planner.shapes import ModelShape
from shared.core.plans import FFN_PIECES

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig(ModelShape):
    """The model's shape (the planner's ModelShape: its sizes) and what the engine needs besides to run it."""
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    rms_norm_eps: float
    rope_theta: float
    # {"rope_type": "linear"|"llama3", "factor": ..., and for llama3 "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None means plain RoPE.
    rope_scaling: dict | None = None
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # The FFN's intermediate width is stored in this many zero-padded pieces (decoder.layer_layout), the
    # finest tensor-parallel cut there is; a member of a TP-k instance holds pieces / k of them.
    ffn_pieces: int = FFN_PIECES

    @property
    def max_context(self) -> int:
        """Longest sequence we can serve exactly; a sliding window caps it because we attend to all."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings
