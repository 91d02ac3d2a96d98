"""What a latency profile reads of a step (shared/core/planner/latency.py): its phases, and many steps' summed.

The executor counts its steps' phases (`StepsLoad`) so that its telemetry can say what its latency profile
predicts a decoder layer takes at each width over its recent steps (`ExecutorTelemetry.layer_seconds`): the
morph rung reads it before it quantizes for a queue (shared/core/policies/morph.py). The simulator
times its steps from the same phases (services/tools/simulator/costs.py).
"""

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.core.scheduling.scheduler import ScheduledChunk

if TYPE_CHECKING:  # numpy and scipy: the engine reads a profile only when given one
    from shared.core.planner.latency import FittedLatency
    from shared.core.planner.roofline import RooflineLatency

Phases = tuple[int, int, list[int]]


def phases(chunks: list[ScheduledChunk]) -> Phases:
    """(a step's decodes, the sum of their contexts, its prefill chunks' lengths): what a latency profile reads of
    a step (`StepsLoad.layer_seconds`)."""
    decodes, context, prefills = 0, 0, []
    for c in chunks:
        if c.length == 1 and c.start >= len(c.seq.prompt_ids):
            decodes += 1
            context += c.start + 1
        else:
            prefills.append(c.length)
    return decodes, context, prefills


@dataclass
class StepsLoad:
    """Steps as a latency profile reads them (the scheduler's `phases` of each), summed: how many had decodes and
    their decodes and contexts, how many had prefill chunks and their chunks and tokens. Counted from a process's
    start, so that the steps between two reports are the difference of two counts (`since`)."""
    decode_steps: int = 0
    decodes: int = 0
    context: int = 0
    prefill_steps: int = 0
    chunks: int = 0
    tokens: int = 0

    def add(self, decodes: int, context: int, prefills: list[int], steps: int = 1) -> None:
        """`steps` steps of these phases (a decode run's: `context` their mean step's)."""
        if decodes:
            self.decode_steps += steps
            self.decodes += steps * decodes
            self.context += steps * context
        if prefills:
            self.prefill_steps += steps
            self.chunks += steps * len(prefills)
            self.tokens += steps * sum(prefills)

    def since(self, earlier: "StepsLoad") -> "StepsLoad":
        # Field by field: astuple deep-copies, and a thousand simulated executors ask ten times a second.
        return StepsLoad(self.decode_steps - earlier.decode_steps, self.decodes - earlier.decodes,
                         self.context - earlier.context, self.prefill_steps - earlier.prefill_steps,
                         self.chunks - earlier.chunks, self.tokens - earlier.tokens)

    def copy(self) -> "StepsLoad":
        return StepsLoad(self.decode_steps, self.decodes, self.context, self.prefill_steps, self.chunks, self.tokens)

    def layer_seconds(self, latency: "FittedLatency | RooflineLatency", bits: int) -> float:
        """One decoder layer's seconds at `bits` over these steps: each phase as that many steps of its mean."""
        seconds = 0.0
        if self.decode_steps:
            seconds += self.decode_steps * latency.decode(bits, round(self.decodes / self.decode_steps),
                                                          int(self.context / self.decodes))
        if self.prefill_steps:
            seconds += self.prefill_steps * latency.prefill(bits, round(self.chunks / self.prefill_steps),
                                                            max(1, round(self.tokens / self.chunks)))
        return seconds

    def widths_seconds(self, latency: "FittedLatency", full_bits: int) -> dict[int, float]:
        """layer_seconds at each width the profile holds, its widest under `full_bits`, the width an executor
        reports its unquantized layers at (32 on a CPU serving float32, whose profile calls full precision 16):
        what the executor's telemetry reports as `layer_seconds`; empty over no steps."""
        if not (self.decode_steps or self.prefill_steps):
            return {}
        widest = latency.bits[0]
        return {full_bits if bits == widest else bits: self.layer_seconds(latency, bits) for bits in latency.bits}


class LatencyReports:
    """What an executor given a latency profile reports of it (`layer_seconds`): widths_seconds over its steps of the
    last `window_s` seconds, the window its telemetry's latencies are means over (ExecutorConfig.latency_window_s).
    A report's own interval (a tenth of a second) may hold one decode run and no prefill: a verdict on what a
    quantize would serve that the prefills around it can reverse (docs/controller.md, "When fewer bits are
    slower")."""

    def __init__(self, latency: "FittedLatency", full_bits: int, window_s: float):
        self.latency, self.full_bits, self.window_s = latency, full_bits, window_s
        # (when, the count then) at each report within the window, and the last one before it: the window's start
        self.counts: deque[tuple[float, StepsLoad]] = deque([(float("-inf"), StepsLoad())])

    def report(self, steps: StepsLoad, now: float) -> dict[int, float]:
        """`steps`: the executor's count so far, at `now` (seconds, the clock of its reports)."""
        counts = self.counts
        counts.append((now, steps.copy()))
        while counts[1][0] <= now - self.window_s:
            counts.popleft()
        return steps.since(counts[0][1]).widths_seconds(self.latency, self.full_bits)
