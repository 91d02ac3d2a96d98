"""Which windows of a trace `morphling bench` replays, by a rule rather than by hand.

The trace (times from its first row) is cut into consecutive windows of `duration_s`, starting at 0;
only whole windows count, i.e. those that end at or before the last arrival, since a window cut off
by the end of the recording would look calmer than it was. Each window's arrivals are counted over
[start, start + duration), the same half-open interval the replay cuts out, and then:

- busy: the `k_busy` windows with the most arrivals (ties: the earlier window first);
- ordinary: the `k_ordinary` windows whose count is closest to the median count over all whole
  windows (ties: the earlier window first), never one already taken as busy.

The picked windows come back in order of start time. Anyone can check a pick by counting the rows of
the CSV in each window of the same width.

The load is scaled against the ordinary (median) rate: `rate_scale_for` plays the median window at
`load` times the baseline's measured capacity, so a busy window exceeds the capacity by as much as the
trace's bursts exceed its median, and the burstiness of the replay is the trace's own.
"""

import math
import random
import statistics
from bisect import bisect_left
from dataclasses import dataclass
from typing import Literal

from services.tools.bench.trace import TraceError, TraceRequest, TraceRow, scale_lengths

WindowKind = Literal["busy", "ordinary"]


@dataclass(frozen=True)
class Window:
    start_s: float  # trace seconds from the first row
    duration_s: float
    kind: WindowKind
    arrivals: int  # rows arriving in [start_s, start_s + duration_s)

    @property
    def rate(self) -> float:
        """Arrivals per trace second."""
        return self.arrivals / self.duration_s

    @property
    def name(self) -> str:
        return f"{self.kind}@{self.start_s:g}s"


def _window_counts(rows: list[TraceRow], duration_s: float) -> list[int]:
    """Arrivals in each whole window [i * duration_s, (i + 1) * duration_s), i = 0, 1, ..."""
    if duration_s <= 0:
        raise TraceError(f"window duration must be positive, got {duration_s}")
    if not rows:
        raise TraceError("the trace has no requests to cut windows from")
    times = sorted(r.time_s for r in rows)
    whole = math.floor(times[-1] / duration_s)
    if whole == 0:
        raise TraceError(f"the trace spans {times[-1]:.1f} s: not one whole window of {duration_s:g} s")
    # Bounds computed exactly as requests_in compares them, so a window's count is the number of
    # requests it replays even for a row that sits on a boundary up to floating-point rounding.
    counts = []
    for i in range(whole):
        start = i * duration_s
        counts.append(bisect_left(times, start + duration_s) - bisect_left(times, start))
    return counts


def pick_windows(rows: list[TraceRow], duration_s: float, k_busy: int, k_ordinary: int) -> list[Window]:
    """The k_busy busiest and the k_ordinary most median-like whole windows, in order of start time."""
    if k_busy < 0 or k_ordinary < 0 or k_busy + k_ordinary == 0:
        raise TraceError(f"need k_busy, k_ordinary >= 0 and at least one window, got {k_busy} and {k_ordinary}")
    counts = _window_counts(rows, duration_s)
    if len(counts) < k_busy + k_ordinary:
        raise TraceError(f"the trace holds {len(counts)} whole windows of {duration_s:g} s, fewer than the "
                         f"{k_busy} busy + {k_ordinary} ordinary asked for")
    indices = range(len(counts))
    # Sorting is stable, but the index in the key states the tie rule outright.
    busy = sorted(indices, key=lambda i: (-counts[i], i))[:k_busy]
    median = statistics.median(counts)
    taken = set(busy)
    ordinary = sorted((i for i in indices if i not in taken), key=lambda i: (abs(counts[i] - median), i))[:k_ordinary]
    picked = [(i, "busy") for i in busy] + [(i, "ordinary") for i in ordinary]
    return [Window(i * duration_s, duration_s, kind, counts[i]) for i, kind in sorted(picked)]


def median_rate(rows: list[TraceRow], duration_s: float) -> float:
    """The median arrivals per second over the whole windows of duration_s: the trace's ordinary rate."""
    return statistics.median(_window_counts(rows, duration_s)) / duration_s


def rate_scale_for(capacity_rps: float, ordinary_rps: float, load: float = 1.0) -> float:
    """The rate_scale that replays the trace's ordinary rate at `load` x the measured capacity.

    Replayed arrival times are trace times divided by rate_scale, so every rate is multiplied by
    it: the median rate becomes load x capacity and a busy window keeps its ratio to the median."""
    if capacity_rps <= 0 or ordinary_rps <= 0 or load <= 0:
        raise ValueError(f"capacity, ordinary rate and load must be positive, got {capacity_rps}, "
                         f"{ordinary_rps} and {load}")
    return load * capacity_rps / ordinary_rps


def gamma_arrivals(count: int, duration_s: float, burstiness: float, seed: str) -> list[float]:
    """`count` arrival times from 0 at the mean rate count / duration_s, with Gamma-distributed gaps of shape
    `burstiness` and mean 1 / rate: `vllm bench serve --burstiness`'s rule (1 is Poisson; below 1, burstier)."""
    if burstiness <= 0:
        raise TraceError(f"burstiness must be positive, got {burstiness}")
    rate = count / duration_s
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(count):
        times.append(t)
        t += rng.gammavariate(burstiness, 1 / (rate * burstiness))
    return times


def requests_in(rows: list[TraceRow], window: Window, rate_scale: float, len_scale: float,
                max_len: int, burstiness: float | None = None, seed: int = 0) -> list[TraceRequest]:
    """The requests of `window`, replay-ready: what trace.load_trace gives for it, from rows already read
    (picking windows needs every row, so the CSV is read once, not once per window).

    With `burstiness`, the window keeps its requests, their lengths and their order, but their arrival times are
    drawn (gamma_arrivals, seeded by `seed` and the window) at the window's own mean rate, then scaled alike."""
    if rate_scale <= 0 or len_scale <= 0:
        raise TraceError(f"rate and length scales must be positive, got {rate_scale} and {len_scale}")
    if max_len < 2:
        raise TraceError(f"max_len must leave room for a prompt and an output token, got {max_len}")
    end = window.start_s + window.duration_s
    # The replay sends requests in list order, so they must be in arrival order whatever the rows are.
    mine = [r for r in sorted(rows, key=lambda r: r.time_s) if window.start_s <= r.time_s < end]
    if not mine:
        # As load_trace does: a replay of nothing would measure nothing, and say nothing about it.
        raise TraceError(f"no request arrives in window {window.name} [{window.start_s:g}, {end:g}) s")
    times = ([r.time_s - window.start_s for r in mine] if burstiness is None
             else gamma_arrivals(len(mine), window.duration_s, burstiness, f"{seed}:{window.start_s}"))
    return [TraceRequest(t / rate_scale, *scale_lengths(r.prompt_tokens, r.output_tokens, len_scale, max_len))
            for t, r in zip(times, mine)]
