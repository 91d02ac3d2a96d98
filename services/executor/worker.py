"""The engine thread: the only code that changes the engine once the executor serves.

Torch work blocks, so the engine runs in one dedicated thread; the asyncio side only submits
operations (add, cancel, abort-all), checks admissions against the engine without changing it, and
reads the `snapshot` this thread refreshes after every iteration, the latencies of the requests
finished since its last telemetry report (each handed out once) and how busy the thread is stepping.
Both sides send through the service's single ordered outbox, so a request's Admission reply is
written before its first TokenBatch and each request's deltas leave in step order.

The gateway is promised exactly one finished delta per completion it waits for (all n, or those a
resumed request continues). The engine emits a single index-0 delta when a request with n > 1 is
aborted or expires before it forked, so the missing indices are filled in here.

An admission is answered at once, on the asyncio side, and never waits for a step: a prefill step or a
layer swap can outlast the gateway's admission timeout, and a request refused for that is refused for
nothing (vLLM's front end validates and queues a request the same way, without its engine). The answer
reads what the engine thread leaves in the `snapshot` and the engine's own `check_request`, which
changes nothing; an accepted request is then added by the engine thread between two steps. Should the
engine have changed by then so that it cannot take it after all (it joined another's instance, or holds
less KV after a restore), the request ends before its first token with code NOT_STARTED, and the
gateway moves it elsewhere.

Operations wait for the thread between two steps, each kind bounded by what holding and losing it
costs. Accepted requests wait there as the waiting queue's newest, so the queue's bounds (its length,
`max_waiting`, and the predicted wait) count them, and one more is refused at once with queue_full,
which sends the gateway to another executor (or the client a 429). Cancels are never refused, since a lost cancel keeps
generating for a client that left; they wait as a set of request ids, so repeats collapse and the set
holds no more than the distinct ids cancelled between two iterations. Command calls are rare and each
is awaited by its caller, so they need no bound.

A gateway that stopped waiting for an admission (its request/reply timed out) cancels it, and the
request must then never run behind its client's back. The admission may arrive after the cancel: a
cancel that finds nothing is remembered (a bounded number of them) and refuses the admission when it
comes, and an admission reached after its `admit_by` is refused too.
"""

import concurrent.futures
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from opentelemetry.context import Context

from services.executor.deltas import token_delta
from services.executor.fabric import step as wire
from services.executor.fabric import transform
from services.executor.fabric.kv_heads import KvPlanError
from services.executor.fabric.member import InstanceMember
from services.executor.fabric.merge import kv_units
from services.executor.fabric.world import FabricError, World
from services.executor.tokenization import render
from shared import subjects
from shared.bus import BusError, Incoming
from shared.core.admission import Departures, admits, predicted_wait_s, waiting_ahead
from shared.core.errors import KvCapacityError, QueueFullError
from shared.core.latency import BusyWindow, FinishedSamples, LatencyWindow, TrackedRequest, emit_spans
from shared.core.scheduling.growth import pages_growth
from shared.core.scheduling.phases import StepsLoad
from shared.errors import InvalidCommandError, InvalidRequestError
from shared.messages import (ADMISSION_EXPIRED, INSTANCE_BROKEN, KV_CAPACITY, NOT_STARTED, Admission, Cancel,
                             ErrorInfo, GenerateRequest, Message, TokenBatch, TokenDelta, pressure_events)
from shared.telemetry import RECORD_CONTENT

if TYPE_CHECKING:  # annotations only
    from services.executor.engine.engine import LLMEngine

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long the thread waits for work when the engine has none
# Cancels that found no request, remembered in case the admission they meant is still on its way; a
# gateway cancels an admission only after giving up on it, within seconds, so a few thousand cover it.
UNMATCHED_CANCEL_MEMORY = 4096
MOVED_MEMORY = 4096  # requests handed to another executor by a TP merge or split, for their cancels
BUSY_WINDOW_S = 1.0  # telemetry's `busy`: the share of the last second spent stepping

Send = Callable[[Callable[[], Awaitable[None]]], None]


@dataclass(frozen=True)
class Snapshot:
    """What the asyncio side may read about the engine, replaced whole by the engine thread."""
    stats: object  # EngineStats, its `waiting` counting the accepted requests not yet added
    in_flight: int  # accepted requests not yet finished
    layers: list[int]  # bits per decoder layer, never read halfway through a swap
    max_num_seqs: int  # the scheduler's batch cap now
    pages_growth: int  # KV pages the running sequences still take (engine/scheduling/growth.py)
    longest_blocks: int = 0  # KV blocks the longest sequence running or waiting takes at its end
    kv_units: dict[int, int] = field(default_factory=dict)  # TP degree -> KV head units (merge.kv_units)
    departures: tuple[int, float] = (0, 0.0)  # Departures.recent(): requests that left the waiting queue lately
    accepted: int = 0  # requests accepted by then (EngineWorker._accepted); stats.waiting counts those not added
    taken: float = field(default_factory=time.time)  # telemetry carries this time: when it was true
    steps_load: StepsLoad | None = None  # the engine's steps so far, where it counts them (phases.py)


def rejection(executor: str, req: GenerateRequest, kind: str, message: str, param: str | None = None,
              code: str | None = None) -> Admission:
    return Admission(request_id=req.request_id, executor=executor, accepted=False,
                     error=ErrorInfo(type=kind, message=message, param=param, code=code))


def owed_indices(req: GenerateRequest) -> tuple[int, ...]:
    """The completions the gateway waits for from here: all n, or only those a resume continues."""
    if req.resume:
        return tuple(sorted(r.index for r in req.resume))
    return tuple(range(req.sampling.n))


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
        self.queue_delay = LatencyWindow(latency_window_s)
        self.ttft = LatencyWindow(latency_window_s)
        self.tpot = LatencyWindow(latency_window_s)
        self.finished = FinishedSamples()  # drained by each telemetry report
        self.busy = BusyWindow(BUSY_WINDOW_S)
        self._send, self._answer, self._publish = send, answer, publish
        self._ops: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # Requests accepted (asyncio side) and added or dropped (engine thread), counted for ever: those
        # accepted and not yet added wait as much as those in the engine's queue.
        self._accepted = 0
        self._added = 0
        self._cancels: set[str] = set()
        self._cancels_lock = threading.Lock()
        self._unmatched_cancels: OrderedDict[str, None] = OrderedDict()  # under _cancels_lock
        self.max_queue_wait_s = max_queue_wait_s
        self._departures = Departures(latency_window_s)  # requests leaving the waiting queue
        self._tracked: dict[str, TrackedRequest] = {}
        # AMOEBAs: the merged instance this executor follows (its engine then runs no requests of its own),
        # and where the requests it handed over went, so that their cancels follow them.
        self.following: InstanceMember | None = None
        self.tp_degrees: list[int] = []  # those its world can merge it into (set by the service)
        self.hold_until = 0.0  # time.monotonic() until which the merged instance it leads is held merged
        self._kv_units: tuple[tuple, dict[int, int]] = ((), {})  # for the layer bits and degrees they were for
        self._moved: OrderedDict[str, str] = OrderedDict()
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

    def _admission(self, req: GenerateRequest) -> tuple[Admission, tuple[str | list[int], list[int]] | None]:
        """The answer, and for an accepted request its prompt as rendered and as token ids."""
        if self.draining or self._stop.is_set():
            return rejection(self.executor, req, "unavailable", "executor is draining"), None
        if self.following is not None:
            return rejection(self.executor, req, "unavailable", f"{self.executor} follows {self.following.leader} in "
                             f"instance {self.following.plan.id}: requests go to the leader"), None
        if self._cancelled_before(req.request_id):
            return rejection(self.executor, req, "unavailable", "the request was cancelled before its admission",
                             code="cancelled"), None
        if req.admit_by is not None and (late := time.time() - req.admit_by) > 0:
            return rejection(self.executor, req, "unavailable",
                             f"the admission was reached {late:.2f} s after the gateway stopped waiting for it",
                             code=ADMISSION_EXPIRED), None
        try:  # a bad request is told so (400) whatever the queue holds
            prompt = render(self.engine.tokenizer, req.prompt, req.messages, req.chat_template_kwargs)
            prompt_ids = self.engine.check_request(prompt, req.sampling, req.resume)
        except InvalidRequestError as exc:
            return rejection(self.executor, req, "invalid_request_error", str(exc), exc.param), None
        except KvCapacityError as exc:
            refused = rejection(self.executor, req, "unavailable", str(exc), code=KV_CAPACITY)
            return refused.model_copy(update={"prompt_tokens": exc.prompt_tokens}), None
        except Exception as exc:
            log.exception("executor %s: admitting %s failed", self.executor, req.request_id)
            return rejection(self.executor, req, "internal_error", f"admission failed: {type(exc).__name__}"), None
        snapshot = self.snapshot
        waiting = snapshot.stats.waiting + self._accepted - snapshot.accepted
        ahead = waiting_ahead(waiting, snapshot.stats.running, snapshot.max_num_seqs)
        # A request moving here mid-stream has a client already reading it: it is not refused for the wait.
        if not req.resume and not admits(ahead, *snapshot.departures, self.max_queue_wait_s):
            self.count_rejection()
            wait = predicted_wait_s(ahead, *snapshot.departures)
            return rejection(self.executor, req, "queue_full",
                             f"the waiting queue would hold the request about {wait:.0f} s ({ahead} requests "
                             f"ahead), longer than the {self.max_queue_wait_s:g} s bound"), None
        if waiting >= (max_waiting := self.engine.scheduler.max_waiting):
            self.count_rejection()
            return rejection(self.executor, req, "queue_full", str(QueueFullError(waiting, max_waiting))), None
        return Admission(request_id=req.request_id, executor=self.executor, accepted=True,
                         prompt_tokens=len(prompt_ids)), (prompt, prompt_ids)

    def _cancelled_before(self, request_id: str) -> bool:
        """Whether a cancel came for `request_id` before it reached the engine (forgotten once asked)."""
        with self._cancels_lock:
            if request_id not in self._unmatched_cancels:
                return False
            del self._unmatched_cancels[request_id]
            return True

    def cancel(self, request_id: str) -> None:
        with self._cancels_lock:
            self._cancels.add(request_id)

    def abort_all(self) -> None:
        self._ops.put(self._abort_all)

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
                busy = self.following is not None or self.engine.has_unfinished()
                self._apply_ops_then_cancels(wait=0.0 if busy else IDLE_WAIT_S)
                if self.following is not None:
                    self._follow()
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
        return Snapshot(stats, len(self._tracked) + not_added, list(self.engine.model.layer_bits),
                        scheduler.max_num_seqs,
                        pages_growth(scheduler.running, scheduler.blocks, self.engine.max_model_len), longest,
                        self._units(), self._departures.recent(), accepted,
                        steps_load=replace(counted) if (counted := self.engine.steps_load) else None)

    def _report_pressure(self) -> None:
        stats = self.snapshot.stats
        count = pressure_events(stats.preemptions, stats.admission_blocked, self._rejected)
        if count > self._pressure_seen:
            self._pressure_seen = count
            self._on_pressure()

    def _units(self) -> dict[int, int]:
        """merge.kv_units, recomputed only when the layers' bits change. In a merged instance (whose bits do
        not change) the last ones stand: what it holds once it splits."""
        if not self.tp_degrees or self.engine.member is not None or self.following is not None:
            return self._kv_units[1]
        key = (tuple(self.engine.model.layer_bits), tuple(self.tp_degrees))
        if self._kv_units[0] != key:
            self._kv_units = (key, kv_units(self.engine.model, self.engine.arena, self.tp_degrees))
        return self._kv_units[1]

    def _apply_ops_then_cancels(self, wait: float) -> None:
        # Cancels are taken once the operations are drained, so that one whose admission was queued first
        # finds the request before it takes a step; one that finds nothing is remembered, for an admission
        # still on its way.
        self._apply_ops(wait)
        with self._cancels_lock:
            cancels, self._cancels = self._cancels, set()
        for request_id in cancels:
            try:
                if self.engine.abort(request_id):
                    continue
                if (elsewhere := self._moved.get(request_id)) is not None:  # a TP merge or split moved it
                    self._forward_cancel(elsewhere, request_id)
                else:  # finished already, or its admission not here yet
                    with self._cancels_lock:
                        self._unmatched_cancels[request_id] = None
                        while len(self._unmatched_cancels) > UNMATCHED_CANCEL_MEMORY:
                            self._unmatched_cancels.popitem(last=False)
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

    def _add(self, req: GenerateRequest, prompt: tuple[str | list[int], list[int]], incoming: Incoming,
             accepted: float) -> None:
        """Add a request accepted on the asyncio side, unless the engine can no longer take it (NOT_STARTED) or
        its gateway cancelled it meanwhile (then nobody waits for it)."""
        self._added += 1
        if self._cancelled_before(req.request_id):
            return
        text, prompt_ids = prompt
        if self.broken or self._stop.is_set():
            reason = "it stopped serving"
        elif self.following is not None:
            reason = f"it joined instance {self.following.plan.id}"
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
        self._tracked[req.request_id] = TrackedRequest(
            req.request_id, req.gateway, owed_indices(req), len(prompt_ids), self.model_name,
            req.sampling.max_tokens, req.sampling.temperature, incoming.trace_context, accepted,
            prompt_text=text if RECORD_CONTENT and isinstance(text, str) else None)

    def _step(self) -> None:
        try:
            with self.busy.measuring():
                deltas = self.engine.step()
        except Exception as exc:
            log.exception("executor %s: engine step failed; failing %d requests", self.executor, len(self._tracked))
            if isinstance(exc, FabricError):
                self._fail_all("the instance lost a member while generating", INSTANCE_BROKEN)
                self._break(exc)
            else:
                self._fail_all("the executor failed while generating")
            return
        by_gateway: dict[str, list[TokenDelta]] = {}
        now = time.time()
        ended: dict[str, TrackedRequest] = {}
        for d in deltas:
            req = self._tracked.get(d.request_id)
            if req is None:  # a request already failed by us: its abort leftovers are not news
                continue
            if req.first_scheduled is None:
                req.first_scheduled = d.first_scheduled
                if d.first_scheduled is not None:
                    self._departures.record()
            if req.first_token is None and d.timestamps:
                if req.first_scheduled is not None:
                    self.queue_delay.record(req.first_scheduled - req.admitted)
                self.ttft.record(d.timestamps[0] - req.admitted)
            req.observe(d.index, d.timestamps, d.num_output_tokens)
            by_gateway.setdefault(req.gateway, []).append(token_delta(d, self.engine.tokenizer))
            if d.finished:
                req.finish_reasons[d.index] = d.finish_reason
                ended[d.request_id] = req
        # Only once the whole step is read: all n sequences may finish in the same step.
        for request_id, req in ended.items():
            if self.engine.has_request(request_id):  # some of its sequences are still going
                continue
            out = by_gateway[req.gateway]
            last = next(t for t in reversed(out) if t.request_id == request_id)
            for index in req.indices:
                if index not in req.finish_reasons:  # cancelled or expired before the fork
                    req.finish_reasons[index] = last.finish_reason
                    out.append(last.model_copy(update={"index": index, "token_ids": [], "text": "",
                                                       "timestamps": [], "logprobs": None, "output_tokens": 0}))
            self._finish(req, now)
        for gateway, batch in by_gateway.items():
            self._publish_batch(gateway, batch)

    def _finish(self, req: TrackedRequest, now: float) -> None:
        del self._tracked[req.request_id]
        if req.first_scheduled is None:  # it left the waiting queue without running (aborted, expired)
            self._departures.record()
        if req.tpot is not None:
            self.tpot.record(req.tpot)
        if req.first_token is not None:
            self.finished.add(req.first_token - req.admitted, req.tpot if req.tpot is not None else 0.0)
        try:
            emit_spans(req, now)
        except Exception:
            log.exception("executor %s: recording spans of %s failed", self.executor, req.request_id)

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

    # --- AMOEBAs' merge and split (fabric/transform.py), in this thread between two steps -------------
    def merge(self, world: World, members: list[str], instance_id: str, hold_s: float = 0.0) -> dict:
        """Take this executor's part in merging `members` into `instance_id`. The leader's engine then steps
        the instance and its requests' records join ours; a follower's go with its sequences, and it follows.
        The instance is held merged `hold_s` (merge_hold_s)."""
        if self.engine.member is not None or self.following is not None:  # merged since the service checked
            raise InvalidCommandError(f"{self.executor} is in an instance already: only executors serving alone "
                                      f"merge", "kind")
        # The leader keeps its records; trace contexts do not pickle, so those sent go without theirs.
        carry = [] if members[0] == self.executor else \
            [replace(t, trace_context=Context()) for t in self._tracked.values()]
        member = transform.merge(self.engine, world, members, self.executor, instance_id, carry)
        if member.is_leader:
            self.hold_until = time.monotonic() + hold_s
            for carried in member.merged_state.carried[1:]:
                self._tracked.update((t.request_id, t) for t in carried)
        else:
            self._hand_over(list(self._tracked), member.leader)
            self.following = member
        return member.merged_state.report

    def split(self) -> dict:
        """The leader's part in splitting its merged instance (the followers' starts with the SPLIT step)."""
        result = transform.split(self.engine, self.engine.member,
                                 lambda ids: [replace(self._tracked[i], trace_context=Context()) for i in ids])
        return self._after_split(result)

    def _follow(self) -> None:
        member = self.following
        if member.follow_one() != wire.SPLIT:
            return
        try:
            result = transform.split(self.engine, member)
        except KvPlanError as exc:  # refused alike by every member: the instance stays merged, and we follow
            log.warning("executor %s: %s", self.executor, exc)
            return
        self.following = None
        self._after_split(result)

    def _after_split(self, result: dict) -> dict:
        self._tracked.update((t.request_id, t) for t in result.pop("carried") or [])
        for request_id, executor in result.pop("moved").items():
            self._hand_over([request_id], executor)
        return result

    def _hand_over(self, request_ids: list[str], executor: str) -> None:
        for request_id in request_ids:
            if self._tracked.pop(request_id, None) is not None:
                self._moved[request_id] = executor
        while len(self._moved) > MOVED_MEMORY:
            self._moved.popitem(last=False)

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
        by_gateway: dict[str, list[TokenDelta]] = {}
        now = time.time()
        for req in list(self._tracked.values()):
            for index in req.indices:
                if index in req.finish_reasons:
                    continue
                req.finish_reasons[index] = "error"
                by_gateway.setdefault(req.gateway, []).append(TokenDelta(
                    request_id=req.request_id, index=index, token_ids=[], text="", timestamps=[],
                    finished=True, finish_reason="error", prompt_tokens=req.prompt_tokens,
                    output_tokens=req.output_tokens.get(index, 0),
                    error=ErrorInfo(type="internal_error", message=message, code=code)))
            self._finish(req, now)
            try:
                self.engine.abort(req.request_id)
            except Exception:
                log.exception("executor %s: aborting %s after a failed step failed", self.executor, req.request_id)
        for gateway, batch in by_gateway.items():
            self._publish_batch(gateway, batch)

    def _abort_all(self) -> None:
        for request_id in list(self._tracked):
            self.engine.abort(request_id)
