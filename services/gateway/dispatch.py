"""The bus side of a request: admission across executors, token routing, re-dispatch and cancellation.

Separated from app.py so the HTTP layer only turns these outcomes into responses. Every admission
attempt uses a fresh request id: an executor whose reply timed out may still have admitted the
request, and its stray tokens must not mix into the stream of the attempt that won.

A request's deltas wait in its queue until the client reads them. A client that stops reading (its
socket full, its stream suspended) must not make the gateway buffer without end while the executor
keeps generating, so a queue holds at most `stream_buffer` deltas: one more cancels the request on its
executor, drops what was queued and ends the stream with a slow_consumer error. Ending it, rather than
dropping only the overflow, is what keeps a stream that goes on from silently missing tokens.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry import context as otel_context

from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_api import ApiError
from services.gateway.router import choose_executor, serving
from shared import subjects
from shared.bus import Bus, BusError, Incoming
from shared.config import GatewayConfig
from shared.messages import Admission, Cancel, ClusterState, ErrorInfo, GenerateRequest, TokenBatch, TokenDelta

log = logging.getLogger(__name__)

# Slack past a request's deadline before the gateway gives up on an executor that went silent
# without the monitor noticing (e.g. the monitor itself is down).
_DEADLINE_GRACE_S = 5.0


class _Lost:
    """Queued for a request whose executor the monitor reports dead."""


class _Overflowed:
    """Queued, alone, for a request whose client fell `stream_buffer` deltas behind."""


LOST = _Lost()
OVERFLOWED = _Overflowed()


@dataclass
class Ticket:
    """An admitted request: where it runs and where its tokens arrive."""
    request: GenerateRequest
    model: str
    executor: str
    queue: asyncio.Queue
    prompt_tokens: int
    admitted_at: float
    ctx: otel_context.Context | None = None
    tried: set[str] = field(default_factory=set)
    attempt: int = 0
    got_tokens: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id


def unavailable(message: str, code: str) -> ApiError:
    return ApiError(503, message, "server_error", None, code)


def slow_consumer(buffer: int) -> ApiError:
    return unavailable(f"the client did not read the response fast enough ({buffer} chunks behind); "
                       "the request was cancelled", "slow_consumer")


def finish_error(delta: TokenDelta) -> ApiError:
    """The API error for a completion that ended neither by stop nor by length."""
    if delta.finish_reason == "deadline":
        return ApiError(504, "the request did not finish before its deadline", "timeout", None, "deadline_exceeded")
    if delta.finish_reason == "abort":
        return unavailable("the executor aborted the request", "aborted")
    message = delta.error.message if delta.error else "the executor failed the request"
    return ApiError(500, message, "server_error", None, "internal_error")


class Dispatcher:
    def __init__(self, bus: Bus, config: GatewayConfig, metrics: GatewayMetrics):
        self.bus, self.config, self.metrics = bus, config, metrics
        self.state: ClusterState | None = None
        # Unbounded as queues: _on_tokens bounds them, and the LOST and OVERFLOWED markers must always fit.
        self._queues: dict[str, asyncio.Queue] = {}
        self._running_on: dict[str, str] = {}  # request id -> executor, until the executor is lost
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.bus.subscribe(subjects.tokens(self.config.gateway_id), TokenBatch, self._on_tokens)
        await self.bus.subscribe(subjects.STATE, ClusterState, self._on_state)
        await self.bus.flush()

    async def _on_tokens(self, incoming: Incoming) -> None:
        for delta in incoming.message.deltas:
            queue = self._queues.get(delta.request_id)
            if queue is None:  # a request already finished, cancelled, re-dispatched or overflowed
                continue
            if queue.qsize() < self.config.stream_buffer:
                queue.put_nowait(delta)
            else:
                self._overflow(delta.request_id, incoming.message.executor, queue)

    def _overflow(self, request_id: str, executor: str, queue: asyncio.Queue) -> None:
        """Stop the request now, so that its executor frees its pages, rather than when the client reads again."""
        self._queues.pop(request_id)
        self._running_on.pop(request_id, None)
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(OVERFLOWED)
        self._cancel_later(executor, request_id)
        self.metrics.slow_consumers.inc()
        log.warning("client of %s fell %d chunks behind: cancelled on %s", request_id, self.config.stream_buffer,
                    executor)

    async def _on_state(self, incoming: Incoming) -> None:
        state: ClusterState = incoming.message
        self.state = state
        self.metrics.observe_state(state)
        live = {e.executor for e in state.executors if e.alive}
        for request_id, executor in list(self._running_on.items()):
            if executor not in live:
                del self._running_on[request_id]
                if request_id in self._queues:
                    self._queues[request_id].put_nowait(LOST)

    # --- admission -------------------------------------------------------------------------------
    def live_count(self) -> int:
        return len(serving(self.state))

    def check_model(self, model: str) -> None:
        """404 for a model no live executor serves; 503 when nothing is alive to ask."""
        alive = [e for e in (self.state.executors if self.state else []) if e.alive]
        if not alive:
            raise unavailable("no executor is available", "no_executor")
        if not any(e.telemetry.model == model for e in alive):
            raise ApiError(404, f"The model `{model}` does not exist", "invalid_request_error", "model",
                           "model_not_found")

    async def submit(self, request: GenerateRequest, model: str, ctx: otel_context.Context | None,
                     tried: set[str] | None = None, attempt: int = 0) -> Ticket:
        """Admit `request` on the best executor that takes it; ApiError(429/503/400) when none does."""
        base_id = request.request_id.split(".", 1)[0]
        tried = set() if tried is None else tried
        saw_full = False
        while (executor := choose_executor(self.state, tried, model)) is not None:
            tried.add(executor)
            attempt_req = request.model_copy(update={"request_id": f"{base_id}.{attempt}"})
            attempt += 1
            queue: asyncio.Queue = asyncio.Queue()
            self._queues[attempt_req.request_id] = queue
            try:
                admission = await self.bus.request(subjects.infer(executor), attempt_req, Admission,
                                                   timeout=self.config.admission_timeout_s, ctx=ctx)
            except BusError as exc:
                log.warning("admission on %s failed: %s", executor, exc)
                self._queues.pop(attempt_req.request_id, None)
                # A late admission would start work nobody reads: ask the executor to drop it.
                self._cancel_later(executor, attempt_req.request_id)
                continue
            if admission.accepted:
                self._running_on[attempt_req.request_id] = executor
                return Ticket(attempt_req, model, executor, queue, admission.prompt_tokens, time.time(), ctx,
                              tried, attempt)
            self._queues.pop(attempt_req.request_id, None)
            err = admission.error or ErrorInfo(message="refused", type="unavailable")
            if err.type == "invalid_request_error":
                raise ApiError(400, err.message, "invalid_request_error", err.param, err.code)
            saw_full |= err.type == "queue_full"
            log.info("executor %s refused %s: %s (%s)", executor, attempt_req.request_id, err.type, err.message)
        if saw_full:
            raise ApiError(429, "all executors are at capacity; retry later", "rate_limit_error", None,
                           "queue_full")
        raise unavailable("no executor could take the request", "no_executor")

    # --- tokens ----------------------------------------------------------------------------------
    async def events(self, ticket: Ticket) -> AsyncIterator[TokenDelta]:
        """The request's deltas until all n completions finished; re-dispatches transparently when the
        executor dies before the first token, raises ApiError(503) when it dies after."""
        finished: set[int] = set()
        n = ticket.request.sampling.n
        deadline = (ticket.request.deadline or time.time() + self.config.request_timeout_s) + _DEADLINE_GRACE_S
        while len(finished) < n:
            try:
                item = await asyncio.wait_for(ticket.queue.get(), max(0.0, deadline - time.time()))
            except asyncio.TimeoutError:
                self.cancel(ticket)
                raise ApiError(504, "the request did not finish before its deadline", "timeout", None,
                               "deadline_exceeded") from None
            if item is OVERFLOWED:
                raise slow_consumer(self.config.stream_buffer)
            if item is LOST:
                self.release(ticket)
                if ticket.got_tokens:
                    raise unavailable(f"executor {ticket.executor} failed while serving the request",
                                      "executor_lost")
                log.warning("executor %s died before the first token of %s: re-dispatching", ticket.executor,
                            ticket.request_id)
                fresh = await self.submit(ticket.request, ticket.model, ticket.ctx, ticket.tried, ticket.attempt)
                ticket.request, ticket.executor, ticket.queue = fresh.request, fresh.executor, fresh.queue
                ticket.attempt, ticket.prompt_tokens = fresh.attempt, fresh.prompt_tokens
                continue
            ticket.got_tokens = True
            if item.finished:
                finished.add(item.index)
            yield item
        self.release(ticket)

    def release(self, ticket: Ticket) -> None:
        self._queues.pop(ticket.request_id, None)
        self._running_on.pop(ticket.request_id, None)

    def cancel(self, ticket: Ticket) -> None:
        """Stop the request on its executor. Fire-and-forget, because it is called from code that is
        being cancelled itself (a disconnected client), where awaiting is not possible."""
        self.release(ticket)
        self._cancel_later(ticket.executor, ticket.request_id)

    def _cancel_later(self, executor: str, request_id: str) -> None:
        async def send() -> None:
            try:
                await self.bus.publish(subjects.cancel(executor), Cancel(request_id=request_id))
            except Exception as exc:  # the bus being down must not surface in an unrelated request
                log.warning("cancel of %s on %s not sent: %s", request_id, executor, exc)

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
