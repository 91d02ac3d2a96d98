"""The bus side of a request: admission across executors, token routing, failover and cancellation.

Separated from app.py so the HTTP layer only turns these outcomes into responses. Every admission
attempt uses a fresh request id: an executor whose reply timed out may still have admitted the
request, and its stray tokens must not mix into the stream of the attempt that won.

A request's deltas wait in its queue until the client reads them. A client that stops reading (its
socket full, its stream suspended) must not make the gateway buffer without end while the executor
keeps generating, so a queue holds at most `stream_buffer` deltas: one more cancels the request on its
executor, drops what was queued and ends the stream with a slow_consumer error. Ending it, rather than
dropping only the overflow, is what keeps a stream that goes on from silently missing tokens.

When the executor running a request is lost, the request moves: it is admitted on another executor
with what the client already has of each completion (the tokens sent, how much of their text), which
that executor prefills and goes on from, so the client sees one unbroken stream. Only when no
executor takes it within failover_timeout_s does the stream end with executor_lost.
"""

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from opentelemetry import context as otel_context

from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_api import ApiError
from services.gateway.tp_merges import MergeScheduler
from shared import subjects
from shared.bus import Bus, BusError, BusUnavailable, Incoming, PayloadTooLarge, ReplyTimeout
from shared.commands import CommandSender
from shared.config import GatewayConfig
from shared.core.router import Unreported, choose_executor, prompt_pages, serving
from shared.core.tp_scheduler import MAX_TP, instances_from
from shared.messages import (ADMISSION_EXPIRED, INSTANCE_BROKEN, KV_CAPACITY, NOT_STARTED, Admission, Cancel,
                             ClusterState, ErrorInfo, GenerateRequest, ResumedCompletion, TokenBatch, TokenDelta)

log = logging.getLogger(__name__)

# Slack past a request's deadline before the gateway gives up on an executor that went silent
# without the monitor noticing (e.g. the monitor itself is down).
_DEADLINE_GRACE_S = 5.0
_FAILOVER_RETRY_S = 0.25  # between admissions of a request being moved, while no executor takes it
# Moves of one request: a request that keeps losing its executor (or its tokens) is more likely the
# cause than the victim, and must end rather than move for ever.
_MAX_MOVES = 3


class _Lost:
    """Queued for a request whose executor the monitor reports dead."""


class _Overflowed:
    """Queued, alone, for a request whose client fell `stream_buffer` deltas behind."""


class _BusLost:
    """Queued for every request in flight once the bus has been gone bus_outage_s: none of their tokens
    can arrive any more (and their executors abort them too)."""


LOST = _Lost()
OVERFLOWED = _Overflowed()
BUS_LOST = _BusLost()


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
    attempts: Iterator[int] = field(default_factory=itertools.count)  # numbers the admission ids
    # What the client has been handed of each completion: a failover resumes from exactly this.
    sent_tokens: dict[int, list[int]] = field(default_factory=dict)
    sent_chars: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    moves: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def record(self, delta: TokenDelta) -> None:
        self.sent_tokens.setdefault(delta.index, []).extend(delta.token_ids)
        self.sent_chars[delta.index] = self.sent_chars.get(delta.index, 0) + len(delta.text)
        if delta.finished:
            self.finished.add(delta.index)

    def resume(self) -> list[ResumedCompletion] | None:
        """The unfinished completions as another executor continues them; None while nothing was sent,
        since then a fresh start is the same request."""
        if not any(self.sent_tokens.values()):
            return None
        return [ResumedCompletion(index=i, token_ids=self.sent_tokens.get(i, []), text_chars=self.sent_chars.get(i, 0))
                for i in range(self.request.sampling.n) if i not in self.finished]


def unavailable(message: str, code: str) -> ApiError:
    return ApiError(503, message, "server_error", None, code)


def bus_unavailable(message: str = "the gateway has lost its connection to the bus; retry later") -> ApiError:
    return unavailable(message, "bus_unavailable")


def bus_lost_error(outage_s: float) -> ApiError:
    """What ends a request in flight when the BUS_LOST marker reaches it."""
    return bus_unavailable(f"the gateway lost its connection to the bus for {outage_s:g} s; the request could "
                           "not go on")


def slow_consumer(buffer: int) -> ApiError:
    return unavailable(f"the client did not read the response fast enough ({buffer} chunks behind); "
                       "the request was cancelled", "slow_consumer")


def _ended_elsewhere(delta: TokenDelta) -> bool:
    """Ended for its instance's sake, not its own: another instance can take it if nothing reached the client."""
    return delta.finished and delta.error is not None and delta.error.code in (INSTANCE_BROKEN, NOT_STARTED)


def finish_error(delta: TokenDelta) -> ApiError:
    """The API error for a completion that ended neither by stop nor by length."""
    if delta.finish_reason == "deadline":
        return ApiError(504, "the request did not finish before its deadline", "timeout", None, "deadline_exceeded")
    if delta.finish_reason == "abort":
        return unavailable("the executor aborted the request", "aborted")
    if _ended_elsewhere(delta):
        return unavailable(delta.error.message, delta.error.code)
    message = delta.error.message if delta.error else "the executor failed the request"
    return ApiError(500, message, "server_error", None, "internal_error")


class _TooLong(Exception):
    """Every executor that refused a request said it holds less KV than the request needs."""

    def __init__(self, message: str, prompt_tokens: int, max_model_len: int, executor: str):
        super().__init__(message)
        self.message, self.prompt_tokens, self.max_model_len = message, prompt_tokens, max_model_len
        self.executor = executor  # the last that refused it


class Dispatcher:
    def __init__(self, bus: Bus, config: GatewayConfig, metrics: GatewayMetrics,
                 commands: CommandSender | None = None):
        """`commands`: how AMOEBAs' merges are sent (tp_merges.py); without it, a request that fits no instance
        is a 503."""
        self.bus, self.config, self.metrics = bus, config, metrics
        self.merges = MergeScheduler(commands, lambda: self.state, config.tp_scheduler, config.split_free_fraction) \
            if commands is not None and config.tp_scheduler != "off" else None
        self._turn = itertools.count()  # round-robin's (the rr scheduler)
        self.state: ClusterState | None = None
        self._unreported = Unreported()  # asked of or admitted since each executor's last report: routing counts them
        self._block_sizes: dict[str, int] = {}
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
            if delta.request_id in self._running_on:  # a TP merge or split moves requests between executors
                self._running_on[delta.request_id] = incoming.message.executor
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
        self._unreported.forget_reported(state)
        self._block_sizes = {e.executor: e.telemetry.block_size for e in state.executors}
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
                     attempts: Iterator[int] | None = None) -> Ticket:
        """Admit `request` on the best executor that takes it, after a TP merge when no instance holds it
        (tp_merges.py); when none does, ApiError: 400 (invalid, or longer than any instance the cluster can
        form holds), 413 (more than the bus carries), 429 (all full, or too slow to answer:
        admission_timeout), 503 (nobody to ask, no merge can be made now: no_capacity, or the bus is down:
        bus_unavailable)."""
        if self.bus.disconnected_since is not None:  # an admission now could only wait out its timeout
            raise bus_unavailable()
        attempts = itertools.count() if attempts is None else attempts
        # A request no instance holds waits for a merge that holds it (tp_merges.py) and goes there; a few
        # rounds more when the cluster view is behind what the executors said.
        for _ in range(MAX_TP.bit_length() + 1):
            try:
                return await self._admit(request, model, ctx, attempts, await self._closed(model))
            except _TooLong as too_long:
                if self.merges is None:
                    raise unavailable(f"no instance holds the request: {too_long.message}", "no_capacity") from None
                tokens = too_long.prompt_tokens + (request.sampling.max_tokens or too_long.max_model_len)
                leader = await self.merges.make_room(min(tokens, too_long.max_model_len) - 1, model,
                                                     too_long.executor)
                if leader is not None:
                    return await self._admit(request, model, ctx, attempts, set(), only=leader)
        raise unavailable("no instance could be formed to hold the request", "no_capacity")

    async def _closed(self, model: str) -> set[str]:
        """Leaders of merged instances draining towards their split: they take no new requests. When no other
        instance serves, the request waits for the split (failover_timeout_s at most, then goes there anyway)."""
        give_up = time.monotonic() + self.config.failover_timeout_s
        while self.merges is not None:
            closed = {i.members[0].executor for i in instances_from(self.state, model, self.config.split_free_fraction)
                      if not i.accepting}
            if not closed or not closed >= {e.executor for e in serving(self.state, model)}:
                return closed
            if time.monotonic() >= give_up:
                break
            await asyncio.sleep(_FAILOVER_RETRY_S)
        return set()

    async def _ask(self, executor: str, request: GenerateRequest, timeout: float,
                   ctx: otel_context.Context | None) -> Admission:
        """`executor`'s answer to admitting `request`. Routing counts the request as sent it from now on, not from
        the answer: a burst is routed before the first answer comes back, and counted at the answers, all of it
        went to the one executor that looked least loaded."""
        self._unreported.asking(executor)
        admission = None
        try:
            admission = await self.bus.request(subjects.infer(executor), request, Admission, timeout=timeout,
                                               ctx=ctx, give_up_on_disconnect=True)
            return admission
        finally:
            if admission is not None and admission.accepted:
                self._unreported.admitted(executor, time.time(),
                                          prompt_pages(admission.prompt_tokens, self._block_sizes.get(executor, 1)))
            else:
                self._unreported.not_admitted(executor)

    async def _admit(self, request: GenerateRequest, model: str, ctx: otel_context.Context | None,
                     attempts: Iterator[int], closed: set[str], only: str | None = None) -> Ticket:
        """One round of submit(): each serving executor in the strategy's order until one admits the request;
        _TooLong when those that refused it said it needs more KV than they hold."""
        base_id = request.request_id.split(".", 1)[0]
        tried: set[str] = set(closed)
        saw_full = saw_timeout = False
        too_long: _TooLong | None = None
        turn = next(self._turn)
        while True:
            if only is not None:
                executor = None if only in tried else only
            else:
                executor = choose_executor(self.state, tried, model, self.config.tp_scheduler, turn,
                                           self._unreported.view())
            if executor is None:
                break
            tried.add(executor)
            timeout = self.config.admission_timeout_s
            # The executor refuses what it reaches after this, so a request that timed out here never runs.
            attempt_req = request.model_copy(update={"request_id": f"{base_id}.{next(attempts)}",
                                                     "admit_by": time.time() + timeout})
            queue: asyncio.Queue = asyncio.Queue()
            self._queues[attempt_req.request_id] = queue
            try:
                admission = await self._ask(executor, attempt_req, timeout, ctx)
            except PayloadTooLarge as exc:  # never sent, so nothing to cancel
                self._queues.pop(attempt_req.request_id, None)
                raise ApiError(413, f"the request is too large to pass to an executor ({exc.problem})",
                               "invalid_request_error", None, "request_too_large") from exc
            except BusUnavailable as exc:  # a late admission is refused by admit_by; a cancel could not go
                self._queues.pop(attempt_req.request_id, None)
                raise bus_unavailable() from exc
            except BusError as exc:
                log.warning("admission on %s failed: %s", executor, exc)
                self._queues.pop(attempt_req.request_id, None)
                # A late admission would start work nobody reads: ask the executor to drop it.
                self._cancel_later(executor, attempt_req.request_id)
                saw_timeout |= isinstance(exc, ReplyTimeout)
                continue
            if admission.accepted:
                self._running_on[attempt_req.request_id] = executor
                return Ticket(attempt_req, model, executor, queue, admission.prompt_tokens, time.time(), ctx,
                              attempts)
            self._queues.pop(attempt_req.request_id, None)
            err = admission.error or ErrorInfo(message="refused", type="unavailable")
            if err.type == "invalid_request_error":
                raise ApiError(400, err.message, "invalid_request_error", err.param, err.code)
            if err.code == KV_CAPACITY:
                too_long = _TooLong(err.message, admission.prompt_tokens, self._max_model_len(executor), executor)
                if self.config.tp_scheduler in ("rr", "llf"):  # the baselines merge the instance they chose
                    break
            if err.type == "queue_full":
                saw_full = True
                self._unreported.refused(executor, time.time())
            # Reached after admit_by (its answer beat our own timeout): as slow as a timeout.
            saw_timeout |= err.code == ADMISSION_EXPIRED
            log.info("executor %s refused %s: %s (%s)", executor, attempt_req.request_id, err.type, err.message)
        if saw_full:
            raise ApiError(429, "all executors are at capacity; retry later", "rate_limit_error", None,
                           "queue_full")
        if too_long is not None:
            raise too_long
        if saw_timeout:  # alive, but too busy to answer in time: overload, not absence
            raise ApiError(429, f"no executor answered the admission within {self.config.admission_timeout_s:g} s;"
                                " retry later", "rate_limit_error", None, "admission_timeout")
        raise unavailable("no executor could take the request", "no_executor")

    def _max_model_len(self, executor: str) -> int:
        found = [e.telemetry.max_model_len for e in (self.state.executors if self.state else [])
                 if e.executor == executor]
        return found[0] if found else 0

    def bus_lost(self) -> None:
        """The bus has been gone bus_outage_s: end every request in flight (their events() raise bus_lost_error)."""
        if self._queues:
            log.warning("the bus has been gone %.1f s: ending %d requests in flight", self.config.bus_outage_s,
                        len(self._queues))
        for queue in list(self._queues.values()):
            queue.put_nowait(BUS_LOST)

    # --- tokens ----------------------------------------------------------------------------------
    async def events(self, ticket: Ticket) -> AsyncIterator[TokenDelta]:
        """The request's deltas until all n completions finished, moving it to another executor when its
        own is lost; raises ApiError(503) when none takes it in time."""
        n = ticket.request.sampling.n
        deadline = (ticket.request.deadline or time.time() + self.config.request_timeout_s) + _DEADLINE_GRACE_S
        while len(ticket.finished) < n:
            try:
                item = await asyncio.wait_for(ticket.queue.get(), max(0.0, deadline - time.time()))
            except asyncio.TimeoutError:
                self.cancel(ticket)
                raise ApiError(504, "the request did not finish before its deadline", "timeout", None,
                               "deadline_exceeded") from None
            if item is BUS_LOST:
                self.release(ticket)
                raise bus_lost_error(self.config.bus_outage_s)
            if item is OVERFLOWED:
                raise slow_consumer(self.config.stream_buffer)
            if item is LOST:
                await self._fail_over(ticket)
                continue
            if _ended_elsewhere(item) and not any(ticket.sent_tokens.values()):
                # Nothing reached the client yet: another instance (a survivor, once it serves alone) starts it.
                await self._fail_over(ticket)
                continue
            if item.output_tokens != len(ticket.sent_tokens.get(item.index, ())) + len(item.token_ids):
                # A batch went missing (NATS delivers at most once, e.g. across a short outage): rather
                # than stream on with a hole, go on from what the client has, as after a lost executor.
                log.warning("%s: tokens of completion %d went missing on the way from %s", ticket.request_id,
                            item.index, ticket.executor)
                await self._fail_over(ticket)
                continue
            ticket.record(item)
            yield item
        self.release(ticket)

    async def _fail_over(self, ticket: Ticket) -> None:
        """Admit the rest of the request on another executor, retrying until failover_timeout_s (the others
        may be full for a moment); the ticket then reads from there. The same executor may take it again:
        after a restart, or after a gap when it is the best one."""
        lost = ticket.executor
        # If it was only stalled and wakes up, it must not go on generating what nobody reads.
        self.cancel(ticket)
        if ticket.moves >= _MAX_MOVES:
            raise unavailable(f"executor {lost} failed while serving the request, which had already moved "
                              f"{ticket.moves} times", "executor_lost")
        ticket.moves += 1
        request = ticket.request.model_copy(update={"resume": ticket.resume()})
        log.warning("executor %s lost or gave up %s after %d tokens: moving it", lost, ticket.request_id,
                    sum(map(len, ticket.sent_tokens.values())))
        give_up = time.monotonic() + self.config.failover_timeout_s
        while True:
            try:
                fresh = await self.submit(request, ticket.model, ticket.ctx, ticket.attempts)
                break
            except ApiError as err:
                if err.status == 400 or err.code == "bus_unavailable" or time.monotonic() >= give_up:
                    raise unavailable(f"executor {lost} failed while serving the request and no other executor "
                                      f"took it over within {self.config.failover_timeout_s:g} s ({err.message})",
                                      "executor_lost") from None
            await asyncio.sleep(_FAILOVER_RETRY_S)
        self.metrics.failovers.inc()
        ticket.request, ticket.executor, ticket.queue = fresh.request, fresh.executor, fresh.queue
        log.info("%s continues on %s", ticket.request_id, ticket.executor)

    def release(self, ticket: Ticket) -> None:
        self._queues.pop(ticket.request_id, None)
        self._running_on.pop(ticket.request_id, None)

    def cancel(self, ticket: Ticket) -> None:
        """Stop the request on its executor (the one its tokens last came from). Fire-and-forget, because it is
        called from code that is being cancelled itself (a disconnected client), where awaiting is not possible."""
        executor = self._running_on.get(ticket.request_id, ticket.executor)
        self.release(ticket)
        self._cancel_later(executor, ticket.request_id)

    def _cancel_later(self, executor: str, request_id: str) -> None:
        async def send() -> None:
            try:
                await self.bus.publish(subjects.cancel(executor), Cancel(request_id=request_id))
            except Exception as exc:  # the bus being down must not surface in an unrelated request
                log.warning("cancel of %s on %s not sent: %s", request_id, executor, exc)

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
