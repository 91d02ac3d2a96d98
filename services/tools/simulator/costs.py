"""What simulated work takes, in seconds, from the calibrated cost models.

- A step: every decoder layer's time at its bits from the executor's latency model (SplitQuant's, §IV-A:
  a measured profile, shared/core/planner/latency.py, or the roofline of the device's datasheet,
  shared/core/planner/roofline.py), plus the rest of the step (embedding, logits, sampling) from the speed-up
  profile's overhead line. The step's decodes are one decode batch of v sequences at their mean context, and
  its prefill chunks one prefill batch of as many sequences at their mean length: the engine packs a step's
  chunks into one forward pass (engine/runner.py), and the profile times prompts in batches. A mixed step is
  charged the sum of its two phases, what the profile measured phase by phase. Charging each prefill chunk
  alone, as this did first, paid a call per chunk: CoCoServe's leader, which takes every arrival, came out
  1.3-1.6x slow per token under a burst (docs/benchmarks.md, "The simulator against the measured runs").
- A swap of one layer: the measured seconds where the fleet gives them (docs/benchmarks.md has this CPU's),
  else copying the layer's weights at the target bits at the device's memory bandwidth (a restore copies full
  precision back; a quantize writes the smaller variant).
- A hop between two executors (a step's hidden states, an operation's weights and KV): the speed-up
  profile's hop line over the bytes moved (services/tools/simulator/fleet.py). A TP layer's two sums of hidden
  states: its all-reduce line, measured between a pair (gloo's costs 2-3x a hop on this CPU).
- An operation on an instance (replicate, migrate, evict, tp_merge, tp_split): the measured line over the
  layers it moves where the fleet gives one, else the bytes it moves over the hop line.
"""

import functools
from collections import Counter
from collections.abc import Callable, Sequence

from services.tools.simulator.fleet import ExecutorSpec
from shared.core.planner.memory import weight_bytes
from shared.core.planner.roofline import MEMORY_EFFICIENCY
from shared.core.planner.shapes import ModelShape
from shared.core.scheduling.phases import phases
from shared.core.scheduling.scheduler import ScheduledChunk


def phase_seconds(spec: ExecutorSpec, bits: int, decodes: int, context: int, prefills: list[int]) -> float:
    """One decoder layer at `bits`: `decodes` at their mean context, then the prefill chunks as one batch."""
    seconds = 0.0
    if decodes:
        seconds += spec.latency.decode(bits, decodes, int(context / decodes))
    if prefills:
        seconds += spec.latency.prefill(bits, len(prefills), max(1, round(sum(prefills) / len(prefills))))
    return seconds


def step_seconds(spec: ExecutorSpec, layer_bits: Sequence[int], chunks: Sequence[ScheduledChunk]) -> float:
    """A step of an executor serving alone."""
    return phased_step_seconds(spec, layer_bits, *phases(chunks))


def phased_step_seconds(spec: ExecutorSpec, layer_bits: Sequence[int], decodes: int, context: int,
                        prefills: list[int]) -> float:
    """step_seconds of a step given as its phases (`phases`): a decode batch's (decode_batch.py), without chunks."""
    seconds = sum(layers * phase_seconds(spec, bits, decodes, context, prefills)
                  for bits, layers in bits_count(layer_bits))
    return seconds + spec.overhead.at(decodes + sum(prefills))


def decode_step_seconds(spec: ExecutorSpec, layer_bits: Sequence[int], batch: int) -> Callable[[int], float]:
    """step_seconds of `batch` decodes, by their mean context in tokens: a decode run's steps (decode_run.py),
    which differ in nothing else. The same sums in the same order, to the float, without the chunks."""
    lines = [(layers, spec.latency.decode_line(bits, batch)) for bits, layers in bits_count(layer_bits)]
    overhead = spec.overhead.at(batch)

    def seconds(context: int) -> float:
        layers_s = 0
        for layers, decode in lines:
            layers_s += layers * decode(context)
        return layers_s + overhead
    return seconds


def bits_count(layer_bits: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(bits, the number of layers at them), for each bits: a step is timed once per bits, not per layer."""
    return _bits_count(tuple(layer_bits))


@functools.lru_cache(maxsize=1024)
def _bits_count(layer_bits: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    # Every step asks; counting 32 layers each time was a tenth of a thousand-executor simulation.
    return tuple(Counter(layer_bits).items())


def hop_seconds(spec: ExecutorSpec, nbytes: float) -> float:
    return spec.hop.at(nbytes) if nbytes > 0 else 0.0


def all_reduce_seconds(spec: ExecutorSpec, nbytes: float) -> float:
    """Summing `nbytes` across a TP instance's members: the measured pair's line (for any degree), else a hop."""
    if spec.all_reduce is None:
        return hop_seconds(spec, nbytes)
    return spec.all_reduce.at(nbytes) if nbytes > 0 else 0.0


def hidden_bytes(shape: ModelShape, dtype_bytes: int, tokens: int) -> int:
    """The hidden states of `tokens` tokens, as a hop carries them."""
    return tokens * shape.hidden_size * dtype_bytes


def operation_seconds(spec: ExecutorSpec, kind: str, layers: int, nbytes: float) -> float:
    """An operation on an instance moving `layers` layers and `nbytes` bytes between its members."""
    if kind in spec.operation_s:
        return spec.operation_s[kind].at(layers)
    return hop_seconds(spec, nbytes)


def swap_seconds(spec: ExecutorSpec, shape: ModelShape, kind: str, bits: int) -> float:
    """One layer's quantize to `bits`, or restore (bits: full precision)."""
    if kind in spec.swap_s:
        return spec.swap_s[kind]
    return weight_bytes(shape, bits, spec.dtype_bytes) / (spec.device.bandwidth * MEMORY_EFFICIENCY)
