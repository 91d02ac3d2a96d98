"""Configuration of every Morphling process, in one place. No torch import here."""

from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str | int) -> int:
    """'1.5GiB', '800M', '1048576' -> bytes (binary units, as memory budgets are)."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().replace(" ", "")
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(digits):]
    if not digits or unit not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: expected a number with an optional unit like 1.5GiB")
    return int(float(digits) * _UNITS[unit])


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"  # "default" (SmolLM2-135M-Instruct GGUF), a HF directory or a .gguf file
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    memory_budget: int = parse_size("1GiB")  # bytes of the page arena (weights of the decoder layers + KV)
    block_size: int = 16  # tokens per KV block (= per page)
    max_model_len: int | None = None  # None: the model's own context length
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 512  # per-step token budget (decode tokens + prefill chunks)
    max_waiting: int = 256  # bounded waiting queue; a full queue rejects at admission
    seed: int = 0  # seeds unseeded sampling, so that a whole run is reproducible

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"
