"""The engine thread: the only code that changes the engine once the executor serves.

Torch work blocks, so the engine runs in one dedicated thread; the asyncio side only submits
operations (add, cancel, abort-all), checks admissions against the engine without changing it, and
reads the `snapshot` this thread refreshes after every iteration, the latencies of the requests
finished since its last telemetry report (each handed out once) and how busy the thread is stepping.
Both sides send through the service's single ordered outbox, so a request's Admission reply is
written before its first TokenBatch and each request's deltas leave in step order.

What each request is owed and how long it took is kept in its records (records.py). An admission is answered
at once on the asyncio side (admission.py); an accepted request is then added by the engine thread between two
steps. Should the engine have changed by then so that it cannot take it after all (it joined another's instance,
or holds less KV after a restore), the request ends before its first token with code NOT_STARTED, and the
gateway moves it elsewhere.

Operations wait for the thread between two steps, each kind bounded by what holding and losing it
costs. Accepted requests wait there as the waiting queue's newest, so the queue's bounds (its length,
`max_waiting`, and the predicted wait) count them, and one more is refused at once with queue_full,
which sends the gateway to another executor (or the client a 429). Cancels are never refused, since a lost cancel keeps
generating for a client that left; they wait as a set of request ids, so repeats collapse and the set
holds no more than the distinct ids cancelled between two iterations. Command calls are rare and each
is awaited by its caller, so they need no bound.

A cancel that finds no request is remembered for an admission still on its way (admission.Cancels), and an
admission reached after its `admit_by` is refused too.
"""

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from services.executor.admission import Cancels, Prompt, answer, rejection
from services.executor.fabric.world import FabricError
from services.executor.records import RequestRecords, owed_indices
from services.executor.tp_role import TpRole
from shared import subjects
from shared.bus import BusError, Incoming
from shared.core.latency import BusyWindow, TrackedRequest
from shared.core.scheduling.growth import pages_growth
from shared.core.scheduling.phases import StepsLoad
from shared.messages import (ADMISSION_EXPIRED, INSTANCE_BROKEN, NOT_STARTED, Admission, Cancel,
                             ErrorInfo, GenerateRequest, Message, TokenBatch, TokenDelta, pressure_events)
from shared.telemetry import RECORD_CONTENT

if TYPE_CHECKING:  # annotations only
    from services.executor.engine.engine import LLMEngine

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long the thread waits for work when the engine has none
BUSY_WINDOW_S = 1.0  # telemetry's `busy`: the share of the last second spent stepping

Send = Callable[[Callable[[], Awaitable[None]]], None]


@dataclass(frozen=True)
class Snapshot:
    """What the asyncio side may read about the engine, replaced whole by the engine thread."""
    stats: object  # EngineStats, its `waiting` counting the accepted requests not yet added
    in_flight: int  # accepted requests not yet finished
    layers: list[int]  # bits per decoder layer, never read halfway through a swap
    max_num_seqs: int  # the scheduler's batch cap now
    pages_growth: int  # KV pages the running sequences still take (shared/core/scheduling/growth.py)
    longest_blocks: int = 0  # KV blocks the longest sequence running or waiting takes at its end
    kv_units: dict[int, int] = field(default_factory=dict)  # TP degree -> KV head units (merge.kv_units)
    departures: tuple[int, float] = (0, 0.0)  # Departures.recent(): requests that left the waiting queue lately
    accepted: int = 0  # requests accepted by then (EngineWorker._accepted); stats.waiting counts those not added
    taken: float = field(default_factory=time.time)  # telemetry carries this time: when it was true
    steps_load: StepsLoad | None = None  # the engine's steps so far, where it counts them (phases.py)


class EngineWorker:
    def __init__(self, engine: "LLMEngine", executor: str, model_name: str, latency_window_s: float, send: Send,
                 answer: Send,
                 publish: Callable[[str, Message], Awaitable[None]], max_queue_wait_s: float = 0.0,
                 on_broken: Callable[[Exception], None] = lambda exc: None,
                 on_pressure: Callable[[], None] = lambda: None):
        """`send` queues what the engine thread sends (it may wait for room), `answer` what the asyncio side
        sends (it never waits), both in one order. `on_broken` is called (from the engine thread) once the
        instance this engine leads loses a member; `on_pressure` (from the engine thread) after a step that
        preempted, left the queue's head waiting for KV pages, or followed a refusal for a full queue: the
        controller should hear of those at once."""
        self.engine = engine
        self.broken = False
        self._on_broken = on_broken
        self._on_pressure = on_pressure
        self._rejected = 0  # requests refused for a full queue, from either thread
        self._rejected_lock = threading.Lock()
        self._pressure_seen = 0
        self.executor = executor
        self.model_name = model_name
        self.draining = False  # set by the service; admissions seen after it are refused
        self.records = RequestRecords(executor, latency_window_s)
        self.busy = BusyWindow(BUSY_WINDOW_S)
        self._send, self._answer, self._publish = send, answer, publish
        self._ops: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # Requests accepted (asyncio side) and added or dropped (engine thread), counted for ever: those
        # accepted and not yet added wait as much as those in the engine's queue.
        self._accepted = 0
        self._added = 0
        self.cancels = Cancels()
        self.max_queue_wait_s = max_queue_wait_s
        self.tp = TpRole(engine, self.records, executor)  # AMOEBAs: what merges and splits make of it
        self.snapshot = self._take_snapshot()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{executor}-engine", daemon=True)

    # --- called from the asyncio side ---------------------------------------------------------
    def start(self) -> None:
        # The engine may have changed since construction (static bits): the first heartbeat, which can
        # go out before the thread's first iteration, must already describe it.
        self.snapshot = self._take_snapshot()
        self._thread.start()

    def join(self) -> None:
        """Stop the thread (blocking): late admissions are refused, leftovers aborted and flushed."""
        self._stop.set()
        self._thread.join()

    def admit(self, req: GenerateRequest, incoming: Incoming) -> None:
        """Answer `req`'s admission now, through the outbox (so the answer leaves before its first tokens);
        an accepted request is queued for the engine thread to add."""
        admission, prompt = self._admission(req)
        self._answer(lambda: incoming.reply(admission))
        if prompt is not None:
            self._accepted += 1
            accepted = time.time()
            self._ops.put(lambda: self._add(req, prompt, incoming, accepted))

    def _admission(self, req: GenerateRequest) -> tuple[Admission, Prompt | None]:
        """The answer, and for an accepted request its prompt as rendered and as token ids."""
        if self.draining or self._stop.is_set():
            return rejection(self.executor, req, "unavailable", "executor is draining"), None
        if (following := self.tp.following) is not None:
            return rejection(self.executor, req, "unavailable", f"{self.executor} follows {following.leader} in "
                             f"instance {following.plan.id}: requests go to the leader"), None
        if self.cancels.came_before(req.request_id):
            return rejection(self.executor, req, "unavailable", "the request was cancelled before its admission",
                             code="cancelled"), None
        if req.admit_by is not None and (late := time.time() - req.admit_by) > 0:
            return rejection(self.executor, req, "unavailable",
                             f"the admission was reached {late:.2f} s after the gateway stopped waiting for it",
                             code=ADMISSION_EXPIRED), None
        snapshot = self.snapshot
        waiting = snapshot.stats.waiting + self._accepted - snapshot.accepted
        admission, prompt, queue_full = answer(self.executor, req, self.engine, waiting, snapshot.stats.running,
                                               snapshot.max_num_seqs, snapshot.departures, self.max_queue_wait_s)
        if queue_full:
            self.count_rejection()
        return admission, prompt

    def cancel(self, request_id: str) -> None:
        self.cancels.add(request_id)

    def abort_all(self) -> None:
        self._ops.put(self._abort_all)

    def drop_gateway(self, gateway: str, admitted_before: float | None = None) -> None:
        """Cancel the requests of `gateway` (admitted before that time.time(), if given): it is gone, and
        nobody reads their tokens (gateways.py)."""
        def drop() -> None:
            gone = [rid for rid, t in self.records.tracked.items() if t.gateway == gateway
                    and (admitted_before is None or t.admitted < admitted_before)]
            if gone:
                log.warning("executor %s: gateway %s is gone: cancelling its %d requests", self.executor, gateway,
                            len(gone))
            for request_id in gone:
                self.cancels.add(request_id)
        self._ops.put(drop)

    def count_rejection(self) -> None:
        with self._rejected_lock:
            self._rejected += 1

    @property
    def rejected(self) -> int:
        return self._rejected

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` in the engine thread between two steps (where swapping layers is safe)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:  # handed to the caller, who turns it into a rejected command
                future.set_exception(exc)

        self._ops.put(run)
        return future

    # --- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                # With work to do, never wait: a waiting step would add latency to every running request.
                busy = self.tp.following is not None or self.engine.has_unfinished()
                self._apply_ops_then_cancels(wait=0.0 if busy else IDLE_WAIT_S)
                if self.tp.following is not None:
                    self.tp.follow()
                elif self.engine.has_unfinished():
                    self._step()
                elif not self.broken:
                    self.engine.keepalive()
                self.snapshot = self._take_snapshot()
                self._report_pressure()
            except FabricError as exc:
                self._break(exc)
            except Exception:  # the thread is the executor: it must outlive any single failure
                log.exception("executor %s: engine loop iteration failed", self.executor)
                time.sleep(IDLE_WAIT_S)
        self._apply_ops_then_cancels(wait=0.0)
        self._abort_all()
        for _ in range(3):  # abort deltas come out of the next step
            if not self.engine.has_unfinished():
                break
            self._step()
        self.snapshot = self._take_snapshot()

    def _take_snapshot(self) -> Snapshot:
        scheduler = self.engine.scheduler
        longest = max((self.engine.kv_blocks_at_end(len(s.prompt_ids), s.params.max_tokens)
                       for s in [*scheduler.running, *scheduler.waiting]), default=0)
        accepted, stats = self._accepted, self.engine.stats()
        if (not_added := accepted - self._added) > 0:
            stats = replace(stats, waiting=stats.waiting + not_added)
        return Snapshot(stats, len(self.records) + not_added, list(self.engine.model.layer_bits),
                        scheduler.max_num_seqs,
                        pages_growth(scheduler.running, scheduler.blocks, self.engine.max_model_len), longest,
                        self.tp.units(), self.records.departures.recent(), accepted,
                        steps_load=replace(counted) if (counted := self.engine.steps_load) else None)

    def _report_pressure(self) -> None:
        stats = self.snapshot.stats
        count = pressure_events(stats.preemptions, stats.admission_blocked, self._rejected)
        if count > self._pressure_seen:
            self._pressure_seen = count
            self._on_pressure()

    def _apply_ops_then_cancels(self, wait: float) -> None:
        # Cancels are taken once the operations are drained, so that one whose admission was queued first
        # finds the request before it takes a step; one that finds nothing is remembered, for an admission
        # still on its way.
        self._apply_ops(wait)
        for request_id in self.cancels.take():
            try:
                if self.engine.abort(request_id):
                    continue
                if (elsewhere := self.records.moved_to(request_id)) is not None:  # a TP merge or split moved it
                    self._forward_cancel(elsewhere, request_id)
                else:
                    self.cancels.unmatched(request_id)
            except Exception:
                log.exception("executor %s: cancelling %s failed", self.executor, request_id)

    def _apply_ops(self, wait: float) -> None:
        try:
            op = self._ops.get(timeout=wait) if wait > 0 else self._ops.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                op()
            except Exception:
                log.exception("executor %s: engine operation failed", self.executor)
            try:
                op = self._ops.get_nowait()
            except queue.Empty:
                return

    def _add(self, req: GenerateRequest, prompt: Prompt, incoming: Incoming,
             accepted: float) -> None:
        """Add a request accepted on the asyncio side, unless the engine can no longer take it (NOT_STARTED) or
        its gateway cancelled it meanwhile (then nobody waits for it)."""
        self._added += 1
        if self.cancels.came_before(req.request_id):
            return
        text, prompt_ids = prompt
        if self.broken or self._stop.is_set():
            reason = "it stopped serving"
        elif self.tp.following is not None:
            reason = f"it joined instance {self.tp.following.plan.id}"
        else:
            try:
                self.engine.add_request(req.request_id, prompt_ids, req.sampling, deadline=req.deadline,
                                        arrival_time=accepted, resume=req.resume)
                reason = None
            except Exception as exc:  # KvCapacityError after a restore, and the like: the engine changed
                reason = str(exc)
        if reason is not None:
            log.info("executor %s: %s accepted but not started: %s", self.executor, req.request_id, reason)
            error = ErrorInfo(type="unavailable", message=f"{self.executor} could not start the request: {reason}",
                              code=NOT_STARTED)
            self._publish_batch(req.gateway, [TokenDelta(
                request_id=req.request_id, index=index, token_ids=[], text="", timestamps=[], finished=True,
                finish_reason="error", prompt_tokens=len(prompt_ids), output_tokens=0, error=error)
                for index in owed_indices(req)])
            return
        self.records.tracked[req.request_id] = TrackedRequest(
            req.request_id, req.gateway, owed_indices(req), len(prompt_ids), self.model_name,
            req.sampling.max_tokens, req.sampling.temperature, incoming.trace_context, accepted,
            prompt_text=text if RECORD_CONTENT and isinstance(text, str) else None)

    def _step(self) -> None:
        try:
            with self.busy.measuring():
                deltas = self.engine.step()
        except Exception as exc:
            log.exception("executor %s: engine step failed; failing %d requests", self.executor, len(self.records))
            if isinstance(exc, FabricError):
                self._fail_all("the instance lost a member while generating", INSTANCE_BROKEN)
                self._break(exc)
            else:
                self._fail_all("the executor failed while generating")
            return
        for gateway, batch in self.records.observe(deltas, self.engine.tokenizer, self.engine.has_request).items():
            self._publish_batch(gateway, batch)

    def _publish_batch(self, gateway: str, deltas: list[TokenDelta]) -> None:
        batch = TokenBatch(executor=self.executor, deltas=deltas)

        async def send() -> None:
            try:
                await self._publish(subjects.tokens(gateway), batch)
            except BusError:
                # A lost batch leaves a hole in these streams: end them rather than let them go on without it.
                for request_id in {d.request_id for d in deltas if not d.finished}:
                    self.cancel(request_id)
                raise

        self._send(send)

    def _forward_cancel(self, executor: str, request_id: str) -> None:
        async def send() -> None:
            await self._publish(subjects.cancel(executor), Cancel(request_id=request_id))

        self._send(send)

    def _break(self, exc: FabricError) -> None:
        """The instance lost a member: admit nothing more, and tell the service, which falls back to TP1."""
        if self.broken:
            return
        self.broken = True
        self.draining = True
        self._on_broken(exc)

    def _fail_all(self, message: str, code: str | None = None) -> None:
        """After a failed step: end every in-flight request with an error delta and free its pages."""
        request_ids = list(self.records.tracked)
        by_gateway = self.records.fail_all(message, code)
        for request_id in request_ids:
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("executor %s: aborting %s after a failed step failed", self.executor, request_id)
        for gateway, batch in by_gateway.items():
            self._publish_batch(gateway, batch)

    def _abort_all(self) -> None:
        for request_id in list(self.records.tracked):
            self.engine.abort(request_id)
