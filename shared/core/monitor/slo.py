"""CoCoServe's SLO-violation rate: per executor, the requests finished over the last window against the SLOs.

Executors report each finished request's TTFT and TPOT once (ExecutorTelemetry.requests); the window holds
them by when they arrived here, on the monitor's clock passed in as `now` (as in aggregate.py), so clock
skew between hosts cannot move a request in or out of it. A request violates the SLOs when its TTFT is over
slo_ttft_s or its TPOT over slo_tpot_s.

The window's percentiles are nearest-rank (the smallest sample with at least p% of the samples at or below
it): always one of the samples, never an interpolation between two. A one-token completion has no TPOT
(it reports 0), so it counts toward the TTFT percentiles and the violation rate, not the TPOT percentiles.
"""

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable

from shared.messages import RequestLatency, SloWindow


def nearest_rank(ordered: list[float], percent: int) -> float:
    """The nearest-rank `percent` percentile of the ascending `ordered`; 0.0 when it is empty."""
    if not ordered:
        return 0.0
    rank = max(1, -(-percent * len(ordered) // 100))  # in integers: 0.95 * 20 is not exactly 19 in floats
    return ordered[rank - 1]


class SloTracker:
    def __init__(self, ttft_s: float, tpot_s: float, window_s: float):
        self.ttft_s, self.tpot_s, self.window_s = ttft_s, tpot_s, window_s
        self._samples: deque[tuple[float, RequestLatency]] = deque()  # (arrival, sample), oldest first
        self._last: SloWindow | None = None  # the window of the samples as they are now, every one inside
        # The samples' latencies kept in order as they come and go: at a thousand executors sorting each window
        # again at every state where a request finished was a tenth of a saturated simulation's time.
        self._ttft: list[float] = []  # ascending
        self._tpot: list[float] = []  # those over 0, ascending
        self._violations = 0
        self._unordered = 0  # samples with a latency that is not a number, which no order holds

    def add(self, samples: Iterable[RequestLatency], now: float) -> None:
        for s in samples:
            self._samples.append((now, s))
            self._count(s, +1)
            self._last = None

    def window(self, now: float) -> SloWindow:
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._count(self._samples.popleft()[1], -1)
            self._last = None
        # The monitor asks every executor's window for every state, and most have not changed since the last.
        if self._last is not None and (not self._samples or self._samples[-1][0] <= now):
            return self._last
        if self._unordered or (self._samples and self._samples[-1][0] > now):
            inside = [s for arrival, s in self._samples if arrival <= now]
            window = _window(inside, self.ttft_s, self.tpot_s)
        else:
            window = _ordered_window(len(self._samples), self._violations, self._ttft, self._tpot)
        if not self._samples or self._samples[-1][0] <= now:
            self._last = window
        return window

    def _count(self, s: RequestLatency, sign: int) -> None:
        """`s` into the window's counts (`sign` +1) or out of them (-1)."""
        self._violations += sign * _violates(s, self.ttft_s, self.tpot_s)
        if math.isnan(s.ttft_s) or math.isnan(s.tpot_s):
            self._unordered += sign
            return
        _place(self._ttft, s.ttft_s, sign)
        if s.tpot_s > 0:
            _place(self._tpot, s.tpot_s, sign)


def _place(ordered: list[float], value: float, sign: int) -> None:
    if sign > 0:
        insort(ordered, value)
    else:
        del ordered[bisect_left(ordered, value)]


def _violates(s: RequestLatency, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    return s.ttft_s > slo_ttft_s or s.tpot_s > slo_tpot_s


def _ordered_window(requests: int, violations: int, ttft: list[float], tpot: list[float]) -> SloWindow:
    """_window of `requests` samples given as their violations and their latencies in order."""
    if not requests:
        return SloWindow()
    return SloWindow(requests=requests, violation_rate=violations / requests,
                     ttft_p50_s=nearest_rank(ttft, 50), ttft_p95_s=nearest_rank(ttft, 95),
                     tpot_p50_s=nearest_rank(tpot, 50), tpot_p95_s=nearest_rank(tpot, 95))


def _window(inside: list[RequestLatency], slo_ttft_s: float, slo_tpot_s: float) -> SloWindow:
    return _ordered_window(len(inside), sum(_violates(s, slo_ttft_s, slo_tpot_s) for s in inside),
                           sorted(s.ttft_s for s in inside), sorted(s.tpot_s for s in inside if s.tpot_s > 0))
