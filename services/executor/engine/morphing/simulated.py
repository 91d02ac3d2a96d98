"""Simulated quantization: layers' projection views overwritten in place with their quantized-then-dequantized
values, which is what the W8A16/W4A16 reference kernels compute, so the full-precision forward pass sees the
numbers a quantized layer would produce. The originals are copied back bit for bit. The LIS profile
(importance.py) and `morphling eval ppl` measure quality this way.
"""

import torch

from services.executor.engine.morphing.quant import int4_group, quantize_int4, quantize_int8

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # norms and biases stay in full precision


def simulated(w: torch.Tensor, bits: int) -> torch.Tensor:
    """The weight a `bits`-bit variant of `w` computes with."""
    if bits == 8:
        return quantize_int8(w).dequantize()
    if bits == 4:
        return quantize_int4(w, int4_group(w.shape[1])).dequantize()
    raise ValueError(f"layers quantize to 8 or 4 bits, not {bits}")


def require_full_precision(model) -> None:
    # Simulated quantization edits the full-precision views; a slot holding a real variant has none.
    full = getattr(model, "full_bits", None)
    if any(bits != full for bits in getattr(model, "layer_bits", [])):
        raise RuntimeError("simulated quantization needs every layer in full precision; restore them first")


class SimulatedQuantization:
    """Overwrites layers' projection views with their quantized-then-dequantized values; restores them."""

    def __init__(self, engine):
        self.model = engine.model
        self._saved: dict[int, dict[str, torch.Tensor]] = {}
        self._cache: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def apply(self, layers: list[int], bits: int) -> None:
        require_full_precision(self.model)
        for i in layers:
            if i in self._saved:
                raise ValueError(f"layer {i} is already quantized")
            views = self.model.layers[i]
            self._saved[i] = {name: views[name].clone() for name in PROJECTIONS}
            if (i, bits) not in self._cache:
                self._cache[(i, bits)] = {name: simulated(views[name], bits) for name in PROJECTIONS}
            for name, value in self._cache[(i, bits)].items():
                views[name].copy_(value)

    def restore(self, layers: list[int] | None = None) -> None:
        """Copy the originals of `layers` (default: every quantized layer) back."""
        for i in list(self._saved) if layers is None else layers:
            if i not in self._saved:
                raise ValueError(f"layer {i} is not quantized")
            for name, value in self._saved.pop(i).items():
                self.model.layers[i][name].copy_(value)

    def clear_cache(self) -> None:
        self._cache.clear()
