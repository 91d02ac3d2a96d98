"""The requests an executor runs, as their gateways see them: what each is owed, how long it waited and took, and
where those a TP merge or split handed over went (their cancels follow them there). The engine thread alone keeps
them; the latency windows they fill are read by telemetry.

The gateway is promised exactly one finished delta per completion it waits for (all n, or those a resumed request
continues). The engine emits a single index-0 delta when a request with n > 1 is aborted or expires before it
forked, so the missing indices are filled in here.
"""

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.executor.deltas import token_delta
from shared.core.admission import Departures
from shared.core.latency import FinishedSamples, LatencyWindow, TrackedRequest, emit_spans
from shared.messages import ErrorInfo, GenerateRequest, TokenDelta

if TYPE_CHECKING:  # annotations only
    from services.executor.engine.model.tokenizer import Tokenizer
    from services.executor.engine.scheduling.outputs import CompletionDelta

log = logging.getLogger(__name__)

MOVED_MEMORY = 4096  # requests handed to another executor by a TP merge or split, for their cancels


def owed_indices(req: GenerateRequest) -> tuple[int, ...]:
    """The completions the gateway waits for from here: all n, or only those a resume continues."""
    if req.resume:
        return tuple(sorted(r.index for r in req.resume))
    return tuple(range(req.sampling.n))


class RequestRecords:
    def __init__(self, executor: str, latency_window_s: float):
        self.executor = executor
        self.tracked: dict[str, TrackedRequest] = {}
        self.queue_delay = LatencyWindow(latency_window_s)
        self.ttft = LatencyWindow(latency_window_s)
        self.tpot = LatencyWindow(latency_window_s)
        self.finished = FinishedSamples()  # drained by each telemetry report
        self.departures = Departures(latency_window_s)  # requests leaving the waiting queue
        self._moved: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self.tracked)

    def observe(self, deltas: list["CompletionDelta"], tokenizer: "Tokenizer", has_request: Callable[[str], bool]
                ) -> dict[str, list[TokenDelta]]:
        """A step's engine deltas as each gateway's TokenDeltas, with the requests they end finished here."""
        by_gateway: dict[str, list[TokenDelta]] = {}
        now = time.time()
        ended: dict[str, TrackedRequest] = {}
        for d in deltas:
            req = self.tracked.get(d.request_id)
            if req is None:  # a request already failed by us: its abort leftovers are not news
                continue
            if req.first_scheduled is None:
                req.first_scheduled = d.first_scheduled
                if d.first_scheduled is not None:
                    self.departures.record()
            if req.first_token is None and d.timestamps:
                if req.first_scheduled is not None:
                    self.queue_delay.record(req.first_scheduled - req.admitted)
                self.ttft.record(d.timestamps[0] - req.admitted)
            req.observe(d.index, d.timestamps, d.num_output_tokens)
            by_gateway.setdefault(req.gateway, []).append(token_delta(d, tokenizer))
            if d.finished:
                req.finish_reasons[d.index] = d.finish_reason
                ended[d.request_id] = req
        # Only once the whole step is read: all n sequences may finish in the same step.
        for request_id, req in ended.items():
            if has_request(request_id):  # some of its sequences are still going
                continue
            out = by_gateway[req.gateway]
            last = next(t for t in reversed(out) if t.request_id == request_id)
            for index in req.indices:
                if index not in req.finish_reasons:  # cancelled or expired before the fork
                    req.finish_reasons[index] = last.finish_reason
                    out.append(last.model_copy(update={"index": index, "token_ids": [], "text": "",
                                                       "timestamps": [], "logprobs": None, "output_tokens": 0}))
            self.finish(req, now)
        return by_gateway

    def fail_all(self, message: str, code: str | None) -> dict[str, list[TokenDelta]]:
        """End every request with an error delta for each completion it is still owed, by gateway."""
        by_gateway: dict[str, list[TokenDelta]] = {}
        now = time.time()
        for req in list(self.tracked.values()):
            for index in req.indices:
                if index in req.finish_reasons:
                    continue
                req.finish_reasons[index] = "error"
                by_gateway.setdefault(req.gateway, []).append(TokenDelta(
                    request_id=req.request_id, index=index, token_ids=[], text="", timestamps=[],
                    finished=True, finish_reason="error", prompt_tokens=req.prompt_tokens,
                    output_tokens=req.output_tokens.get(index, 0),
                    error=ErrorInfo(type="internal_error", message=message, code=code)))
            self.finish(req, now)
        return by_gateway

    def finish(self, req: TrackedRequest, now: float) -> None:
        del self.tracked[req.request_id]
        if req.first_scheduled is None:  # it left the waiting queue without running (aborted, expired)
            self.departures.record()
        if req.tpot is not None:
            self.tpot.record(req.tpot)
        if req.first_token is not None:
            self.finished.add(req.first_token - req.admitted, req.tpot if req.tpot is not None else 0.0)
        try:
            emit_spans(req, now)
        except Exception:
            log.exception("executor %s: recording spans of %s failed", self.executor, req.request_id)

    def hand_over(self, request_ids: list[str], executor: str) -> None:
        """`request_ids` go on at `executor` now: forget them, remembering where they went."""
        for request_id in request_ids:
            if self.tracked.pop(request_id, None) is not None:
                self._moved[request_id] = executor
        while len(self._moved) > MOVED_MEMORY:
            self._moved.popitem(last=False)

    def moved_to(self, request_id: str) -> str | None:
        return self._moved.get(request_id)
