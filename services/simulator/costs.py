"""What simulated work takes, in seconds, from the calibrated cost models.

- A step: every decoder layer's time at its bits from the executor's latency model (SplitQuant's, §IV-A:
  a measured profile, shared/planner/latency.py, or the roofline of the device's datasheet,
  shared/planner/roofline.py), plus the rest of the step (embedding, logits, sampling) from the speed-up
  profile's overhead line. The step's decodes are one decode batch of v sequences at their mean context; each
  prefill chunk is a prefill of one sequence of its length. The engine runs them as one batch, so this
  charges a mixed step the sum of its parts: what the profile measured, phase by phase.
- A swap of one layer: the measured seconds where the fleet gives them (docs/benchmarks.md has this CPU's),
  else copying the layer's weights at the target bits at the device's memory bandwidth (a restore copies full
  precision back; a quantize writes the smaller variant).
"""

from collections import Counter
from collections.abc import Sequence

from services.executor.engine.scheduling.scheduler import ScheduledChunk
from services.simulator.fleet import ExecutorSpec
from shared.planner.memory import weight_bytes
from shared.planner.roofline import MEMORY_EFFICIENCY
from shared.planner.shapes import ModelShape


def step_seconds(spec: ExecutorSpec, layer_bits: Sequence[int], chunks: Sequence[ScheduledChunk]) -> float:
    decodes = [c for c in chunks if c.length == 1 and c.start >= len(c.seq.prompt_ids)]
    prefills = [c for c in chunks if not (c.length == 1 and c.start >= len(c.seq.prompt_ids))]
    seconds = 0.0
    for bits, layers in Counter(layer_bits).items():
        per_layer = 0.0
        if decodes:
            context = sum(c.start + 1 for c in decodes) / len(decodes)
            per_layer += spec.latency.decode(bits, len(decodes), int(context))
        for c in prefills:
            per_layer += spec.latency.prefill(bits, 1, c.length)
        seconds += layers * per_layer
    return seconds + spec.overhead.at(sum(c.length for c in chunks))


def swap_seconds(spec: ExecutorSpec, shape: ModelShape, kind: str, bits: int) -> float:
    """One layer's quantize to `bits`, or restore (bits: full precision)."""
    if kind in spec.swap_s:
        return spec.swap_s[kind]
    return weight_bytes(shape, bits, spec.dtype_bytes) / (spec.device.bandwidth * MEMORY_EFFICIENCY)
