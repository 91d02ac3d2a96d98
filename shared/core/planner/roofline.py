"""Modelled latency of one decoder layer on a device of the devices table, for devices this machine cannot
profile: the phase-aware roofline the paper's cost model rests on (§IV-A: prefill is compute-bound, decode
memory-bound), with the same inputs as a measured profile (latency.FittedLatency).

A layer's time is max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) plus a fixed per-layer cost for
its kernel launches. FLOPs: 2 per weight per token, plus attention (QKᵀ and PV over the context). Bytes:
the weights at their bits, the KV the step reads, and the hidden states in and out. Weight-only
quantized kernels (W8A16, W4A16) compute in FP16, so bits change the bytes; in prefill they also
dequantize every weight to FP16 and read it back, which is why the paper finds FP16 ahead in prefill and
low bits ahead in decode (Fig. 5).

Achieved fractions of the datasheet peaks are assumptions, not measurements (typical of tuned GEMM and
GEMV kernels on these parts); a measured profile of a device (`morphling profile --latency` there)
replaces this model for it.
"""

from collections.abc import Callable
from dataclasses import dataclass

from shared.core.planner.devices import Device
from shared.core.planner.memory import FULL_BITS, weight_bytes
from shared.core.planner.shapes import ModelShape

COMPUTE_EFFICIENCY = 0.6
MEMORY_EFFICIENCY = 0.8
LAYER_OVERHEAD_S = 40e-6  # about eight kernel launches of ~5 µs


@dataclass(frozen=True)
class RooflineLatency:
    device: Device
    shape: ModelShape
    full_bytes: int = 2
    source: str = "modelled"

    def _time(self, flops: float, nbytes: float) -> float:
        compute = flops / (self.device.fp16_flops * COMPUTE_EFFICIENCY)
        memory = nbytes / (self.device.bandwidth * MEMORY_EFFICIENCY)
        return max(compute, memory) + LAYER_OVERHEAD_S

    def _hidden_bytes(self, tokens: int) -> int:
        return 2 * tokens * self.shape.hidden_size * self.full_bytes

    def prefill(self, bits: int, batch: int, prompt: int) -> float:
        s = self.shape
        tokens = batch * prompt
        # causal attention: half of the s×s scores, QKᵀ and PV, over every query head
        flops = 2 * tokens * s.layer_params + 2 * batch * prompt * prompt * s.q_size
        nbytes = weight_bytes(s, bits, self.full_bytes) + self._hidden_bytes(tokens)
        nbytes += 2 * tokens * s.kv_size * self.full_bytes  # the KV it writes
        if bits != FULL_BITS:  # dequantized to FP16 once per micro-batch: written, then read by the GEMM
            nbytes += 2 * s.layer_params * self.full_bytes
        return self._time(flops, nbytes)

    def decode(self, bits: int, batch: int, context: int) -> float:
        s = self.shape
        flops = 2 * batch * s.layer_params + 4 * batch * context * s.q_size
        kv = 2 * batch * context * s.kv_size * self.full_bytes
        nbytes = weight_bytes(s, bits, self.full_bytes) + kv + self._hidden_bytes(batch)
        return self._time(flops, nbytes)

    def decode_line(self, bits: int, batch: int) -> Callable[[int], float]:
        """decode(bits, batch, context) by the context alone, to the float: the terms that do not change from one
        step to the next counted once (a simulated decode run asks step after step; weighing INT4's groups each
        time was a tenth of a thousand-executor run's loop)."""
        s = self.shape
        flops, flops_per_token = 2 * batch * s.layer_params, 4 * batch * s.q_size
        weights, kv_per_token = weight_bytes(s, bits, self.full_bytes), 2 * batch * s.kv_size * self.full_bytes
        hidden = self._hidden_bytes(batch)
        compute_rate = self.device.fp16_flops * COMPUTE_EFFICIENCY
        memory_rate = self.device.bandwidth * MEMORY_EFFICIENCY

        def seconds(context: int) -> float:
            compute = (flops + flops_per_token * context) / compute_rate
            memory = (weights + kv_per_token * context + hidden) / memory_rate
            return max(compute, memory) + LAYER_OVERHEAD_S
        return seconds
