"""Per-request bookkeeping of the executor: latency windows for telemetry and the request's trace spans.

The engine only knows sequences; the service needs, per request, where its tokens go (the gateway),
when it was admitted, first scheduled, produced its first and last token, and the trace context it
arrived with. All of that is recorded by the engine thread; the telemetry task only reads the windows,
the finished requests' samples and the busy time, which are therefore guarded by locks.
"""

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace

from shared.messages import RequestLatency
from shared.telemetry import RECORD_CONTENT, tracer

# Finished requests' samples kept for the next telemetry report. Reports go out every ~0.1 s, so this many
# only fill up when the telemetry task is stalled; then the oldest go, rather than memory without bound.
FINISHED_SAMPLES_LIMIT = 4096


class LatencyWindow:
    """Mean of the values recorded over the last `window_s` seconds (0.0 when there are none)."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque()
        self._sum = 0.0  # of the values in _items: every report asks for the mean of a window of many
        self._lock = threading.Lock()

    def record(self, value: float, now: float | None = None) -> None:
        with self._lock:
            self._items.append((now if now is not None else time.monotonic(), value))
            self._sum += value

    def mean(self, now: float | None = None) -> float:
        cutoff = (now if now is not None else time.monotonic()) - self.window_s
        with self._lock:
            while self._items and self._items[0][0] < cutoff:
                self._sum -= self._items.popleft()[1]
            if not self._items:
                self._sum = 0.0  # what subtracting left of rounding goes with the last value
                return 0.0
            return self._sum / len(self._items)


class FinishedSamples:
    """The latencies of requests finished since the last `drain`: each sample is handed out once.

    Holds at most `limit`, dropping the oldest beyond it.
    """

    def __init__(self, limit: int = FINISHED_SAMPLES_LIMIT):
        self._items: deque[RequestLatency] = deque(maxlen=limit)
        self._lock = threading.Lock()

    def add(self, ttft_s: float, tpot_s: float) -> None:
        with self._lock:
            self._items.append(RequestLatency(ttft_s=ttft_s, tpot_s=tpot_s))

    def drain(self) -> list[RequestLatency]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items


class BusyWindow:
    """The share of the last `window_s` seconds spent inside busy spans.

    A span still going counts up to now, so that a long step (a big prefill) reads as busy while it runs,
    not only once it ends. One thread marks the spans, one after another, and another reads the share.
    """

    def __init__(self, window_s: float = 1.0):
        self.window_s = window_s
        self._spans: deque[tuple[float, float]] = deque()  # (start, end), oldest first, none overlapping
        self._total = 0.0  # their lengths: every report asks, and a window holds a step's worth of spans
        self._started: float | None = None
        self._lock = threading.Lock()

    def begin(self, now: float | None = None) -> None:
        with self._lock:
            self._started = now if now is not None else time.monotonic()

    def end(self, now: float | None = None) -> None:
        end = now if now is not None else time.monotonic()
        with self._lock:
            if self._started is None:
                return
            self._add(self._started, end)
            self._started = None

    def spans(self, spans: list[tuple[float, float]]) -> None:
        """begin(start) then end(end) for each (start, end) of `spans` in order (a simulated instance's member,
        marked busy for its parts of a decode run's steps at once)."""
        with self._lock:
            for start, end in spans:
                self._add(start, end)
            self._started = None

    def back_to_back(self, ends: list[float]) -> None:
        """end(t) then begin(t) at each of `ends` in order: spans back to back (the simulator's decode runs)."""
        with self._lock:
            for end in ends:
                if self._started is not None:
                    self._add(self._started, end)
                self._started = end

    @contextmanager
    def measuring(self) -> Iterator[None]:
        self.begin()
        try:
            yield
        finally:
            self.end()

    def share(self, now: float | None = None) -> float:
        now = now if now is not None else time.monotonic()
        cutoff = now - self.window_s
        with self._lock:
            self._forget_before(cutoff)
            busy = self._total
            if self._spans:
                busy -= max(0.0, cutoff - self._spans[0][0])  # only the oldest can begin before the window
                for start, end in reversed(self._spans):  # a simulated member's span may end after now
                    if end <= now:
                        break
                    busy -= end - max(start, now)
            if self._started is not None:
                busy += max(0.0, now - max(self._started, cutoff))
        return min(1.0, max(0.0, busy) / self.window_s)

    def _add(self, start: float, end: float) -> None:
        """A span, and those that left the window as it ended forgotten (the lock held)."""
        self._spans.append((start, end))
        self._total += end - start
        if self._spans[0][1] <= end - self.window_s:  # most spans forget nothing: no call for them
            self._forget_before(end - self.window_s)

    def _forget_before(self, cutoff: float) -> None:
        while self._spans and self._spans[0][1] <= cutoff:
            start, end = self._spans.popleft()
            self._total -= end - start
        if not self._spans:
            self._total = 0.0  # what subtracting left of rounding goes with the last span


@dataclass
class TrackedRequest:
    """What the service remembers about an admitted request until all its sequences have finished."""
    request_id: str
    gateway: str
    indices: tuple[int, ...]  # the completions owed to the gateway: all n, or those a resume continues
    prompt_tokens: int
    model: str
    max_tokens: int | None
    temperature: float
    trace_context: otel_context.Context
    admitted: float  # time.time() when the engine accepted it
    first_scheduled: float | None = None  # from the engine's deltas, once it scheduled the request
    prompt_text: str | None = None  # only kept when content recording is on
    first_token: float | None = None
    last_token: float | None = None
    output_tokens: dict[int, int] = field(default_factory=dict)  # per completion index
    finish_reasons: dict[int, str] = field(default_factory=dict)

    def observe(self, index: int, timestamps: list[float], output_tokens: int) -> None:
        if timestamps:
            self.first_token = min(self.first_token or timestamps[0], timestamps[0])
            self.last_token = max(self.last_token or timestamps[-1], timestamps[-1])
        self.output_tokens[index] = output_tokens

    @property
    def tpot(self) -> float | None:
        longest = max(self.output_tokens.values(), default=0)
        if self.first_token is None or self.last_token is None or longest < 2:
            return None
        return (self.last_token - self.first_token) / (longest - 1)


def _ns(t: float) -> int:
    return int(t * 1e9)


def emit_spans(req: TrackedRequest, end: float) -> None:
    """Record the request's spans after the fact, with the times the engine measured.

    Creating them at the end (with explicit start and end times) costs nothing on the hot path and
    gives exact phase boundaries: queue (admission → first scheduled), prefill (→ first token),
    decode (first → last token).
    """
    t = tracer("morphling.executor")
    attrs = {
        "gen_ai.system": "morphling",
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": req.model,
        "gen_ai.request.temperature": req.temperature,
        "gen_ai.usage.input_tokens": req.prompt_tokens,
        "gen_ai.usage.output_tokens": sum(req.output_tokens.values()),
        "gen_ai.response.finish_reasons": [req.finish_reasons[i] for i in sorted(req.finish_reasons)],
        "morphling.request_id": req.request_id,
    }
    if req.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = req.max_tokens
    if RECORD_CONTENT and req.prompt_text is not None:
        attrs["gen_ai.prompt"] = req.prompt_text
    # SERVER: the receiving side of the gateway's request over the bus, as an RPC server is.
    root = t.start_span("executor.request", context=req.trace_context, kind=trace.SpanKind.SERVER,
                        start_time=_ns(req.admitted), attributes=attrs)
    inside = trace.set_span_in_context(root)
    scheduled = req.first_scheduled
    t.start_span("executor.queue", context=inside, start_time=_ns(req.admitted)).end(
        end_time=_ns(scheduled if scheduled is not None else end))
    if scheduled is not None:
        first = req.first_token if req.first_token is not None else end
        t.start_span("executor.prefill", context=inside, start_time=_ns(scheduled)).end(end_time=_ns(first))
    if req.first_token is not None and req.last_token is not None:
        t.start_span("executor.decode", context=inside, start_time=_ns(req.first_token)).end(
            end_time=_ns(req.last_token))
    root.end(end_time=_ns(end))
