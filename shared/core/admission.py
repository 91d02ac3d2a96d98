"""Queueing with a time bound: refuse a request whose predicted wait in the queue is too long.

A bounded waiting queue alone bounds memory, not time: on a slow or loaded device, the last of
`max_waiting` requests can wait minutes for its first token, long after its client gave up. So the
executor also predicts a new request's wait, Little's-law style, as the requests ahead of it divided
by the rate requests recently left the waiting queue, and refuses it (queue_full, which the gateway
turns into a 429 with Retry-After) when that is longer than `max_queue_wait_s`.

The prediction is deliberately forgiving where it knows nothing: an empty queue never waits, and with
no departure seen lately (a fresh or idle executor) the rate is unknown, so the request is admitted
and only the queue's length bounds it. Nor is a request ahead that the next step starts in a free
batch slot a wait: counted as one, a few requests sent together to an idle executor after a slow
minute were refused each other's wait.
"""

import time
from collections import deque


def waiting_ahead(waiting: int, running: int, max_num_seqs: int) -> int:
    """Of `waiting` requests, those a new one waits behind: the ones beyond the batch slots that `running`
    sequences leave free for the next step."""
    return max(0, waiting - max(0, max_num_seqs - running))


def predicted_wait_s(ahead: int, departures: int, span_s: float) -> float | None:
    """Seconds a request joining behind `ahead` waiting requests should wait, when `departures`
    requests left the queue over the last `span_s` seconds; None when the rate is unknown."""
    if ahead <= 0:
        return 0.0
    if departures <= 0 or span_s <= 0:
        return None
    return ahead * span_s / departures


def queue_wait_s(waiting: int, running: int, max_num_seqs: int, departures: int, span_s: float) -> float | None:
    """What a request joining the waiting queue now should wait (ExecutorTelemetry.predicted_wait_s): behind the
    requests the next step's free batch slots do not take, at the rate requests left the queue lately."""
    return predicted_wait_s(waiting_ahead(waiting, running, max_num_seqs), departures, span_s)


def admits(ahead: int, departures: int, span_s: float, bound_s: float) -> bool:
    """Whether a request joining behind `ahead` waiting requests stays within `bound_s` (0: no bound)."""
    if bound_s <= 0:
        return True
    wait = predicted_wait_s(ahead, departures, span_s)
    return wait is None or wait <= bound_s


class Departures:
    """When requests left the waiting queue, over the last `window_s` seconds (used from one thread)."""

    def __init__(self, window_s: float, now: float | None = None):
        self.window_s = window_s
        self._started = time.monotonic() if now is None else now
        self._times: deque[float] = deque()
        self.recorded = 0  # departures ever recorded: whether any came since an earlier count

    def record(self, now: float | None = None) -> None:
        self._times.append(time.monotonic() if now is None else now)
        self.recorded += 1

    def any_within(self, now: float) -> bool:
        """Whether a departure is still within the window at `now` (as recent() counts them): with none the rate
        is unknown."""
        return bool(self._times) and not self._times[-1] < now - self.window_s

    def recent(self, now: float | None = None) -> tuple[int, float]:
        """(departures, seconds they were counted over): the window, or less on a younger executor, whose
        short history would otherwise read as a slow rate."""
        now = time.monotonic() if now is None else now
        while self._times and self._times[0] < now - self.window_s:
            self._times.popleft()
        return len(self._times), min(self.window_s, now - self._started)
