"""One simulated executor: the engine's own scheduler, block manager and page ledger, with the forward pass
replaced by the cost model's seconds.

What is real here is what decides who waits: the continuous-batching rules (shared/core/scheduling/), the block
tables and copy-on-write and the arena's ledger (shared/core/memory/), imported, not copied. The arena is laid out
as the engine lays it out: a page is one KV block for every layer, each decoder layer owns a slot of pages sized for
full precision at the low end, and quantizing a layer releases its slot's tail as KV pages, restoring moves live KV
out and takes it back (engine/morphing/swapper.py). What is modelled is time: a step takes what costs.step_seconds
says, a swap what costs.swap_seconds says, and tokens carry no values (every generated token is 0; a request runs to
its max_tokens, as the bench asks with ignore_eos). How it steps is stepping.py's; the commands it takes,
commands.py's.

Telemetry is the executor service's ExecutorTelemetry, built by the same builder from the same windows
(shared/core/telemetry.py, latency.py) so that the monitor and the controller read a simulated executor exactly as a
real one, with what the service reports of instances: the plan it serves in, the batch cap, a slot's pages, the
pages a replica may take, its world with its KV head units at each TP degree it could merge into, and a merge's
hold.

In an instance of several executors (instance.py: CoCoServe's placements and replicas; tp.py: an AMOEBAs
merge) the leader's scheduler is the instance's, whose block ids every member backs with pages of its arena;
`hold` and `map_blocks` keep this arena's slots and backing pages as the fabric's member keeps them.
"""

import functools
import math
from array import array
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel

from services.tools.simulator import decode_run
from services.tools.simulator.commands import SimCommands
from services.tools.simulator.decode_batch import DecodeBatch
from services.tools.simulator.fleet import DEFAULT_MODEL, ExecutorSpec, Fleet
from services.tools.simulator.instance import SimulatedRefusal
from services.tools.simulator.member import MemberArena
from services.tools.simulator.stepping import SimStepping
from services.tools.simulator.tokens import CountedTokens
from shared.config import ExecutorConfig
from shared.core.admission import Departures, admits, waiting_ahead
from shared.core.errors import KvCapacityError, QueueFullError
from shared.core.latency import BusyWindow, FinishedSamples, LatencyWindow
from shared.core.memory.block_manager import BlockManager
from shared.core.memory.ledger import PageLedger
from shared.core.planner.memory import FULL_BITS, weight_bytes
from shared.core.planner.shapes import ModelShape
from shared.core.plans import alone
from shared.core.scheduling.growth import pages_growth
from shared.core.scheduling.phases import LatencyReports, StepsLoad
from shared.core.scheduling.scheduler import Scheduler, SchedulerOutput
from shared.core.scheduling.sequence import Sequence
from shared.core.slots import slot_moves
from shared.core.telemetry import Queue, Served, executor_telemetry
from shared.messages import ExecutorTelemetry, InstancePlan, KvUnits, pressure_events
from shared.sampling import SamplingOptions

LATENCY_WINDOW_S = ExecutorConfig.latency_window_s  # the telemetry's mean TTFT, TPOT and queue delay
__all__ = ["FollowerRefusal", "SimExecutor", "SimRequest", "SimulatedRefusal"]


class FollowerRefusal(Exception):
    """A request reached a member of an instance that is not its leader (routed on a state older than the
    instance): refused, as follower.py refuses it; the gateway tries the next executor."""


M = TypeVar("M", bound=BaseModel)
_TEMPLATES: dict[type, dict] = {}  # a message's fields in order at their plain defaults (None where it has none)


@functools.cache
def sampling(max_tokens: int) -> SamplingOptions:
    """A simulated request's sampling: `max_tokens` of them whatever comes. One per length, shared by the
    sequences, which only read it: validating one per arrival was a percent of a saturated fleet's time."""
    return SamplingOptions(max_tokens=max_tokens, ignore_eos=True)


def unvalidated(message: type[M], **fields) -> M:
    """`message` of `fields`, every one of the type it declares, as validation would have made it but without
    it: a thousand executors build 5,000 reports a simulated second, and validating one (11 us) was a fifth of
    building it. Every field without a plain default (required, or a factory's fresh list) must be given; the
    simulator's tests hold its reports equal to validated ones, field by field and type by type."""
    if (template := _TEMPLATES.get(message)) is None:
        template = _TEMPLATES[message] = {
            name: None if f.is_required() or f.default_factory is not None else f.default
            for name, f in message.model_fields.items()}
    built = object.__new__(message)
    values = template.copy()
    values.update(fields)  # keys kept in the declared order, as validation leaves them
    object.__setattr__(built, "__dict__", values)
    object.__setattr__(built, "__pydantic_fields_set__", set(fields))
    object.__setattr__(built, "__pydantic_extra__", None)
    object.__setattr__(built, "__pydantic_private__", None)
    return built


@dataclass
class SimRequest:
    """One request's life as the client would see it (times in simulated seconds)."""
    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    model: str = DEFAULT_MODEL  # the model it asks for (a fleet of several: its traffic's turn, cluster.py)
    executor: str | None = None
    admitted_s: float | None = None
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    tokens: int = 0
    done_s: float | None = None
    error: str | None = None
    token_bits: dict[tuple[int, int], int] = field(default_factory=dict)  # (INT8, INT4 layers) -> tokens


class SimExecutor(MemberArena, SimStepping, SimCommands):
    def __init__(self, spec: ExecutorSpec, fleet: Fleet, static_bits: int = FULL_BITS, started_s: float = 0.0,
                 in_world: bool = False, decode_runs: bool = True, arenas: dict | None = None,
                 layout: ModelShape | None = None, starts_in_instance: bool = False):
        """`in_world`: one of several executors, which need hold only one block alone (process.py: a TP merge
        holds the longest sequence). `decode_runs`: advance decode-only batches many steps at once
        (decode_run.py), and step a batch of decodes with its admissions as a batch (decode_batch.py); without,
        the scheduler schedules every step (the same results, slower). `arenas`: empty
        arenas laid out before, shared by a fleet's executors (`_lay_out`). `layout`: the layers its arena
        holds, a TP member's shard of them (tp.member_shape); the model's by default. `starts_in_instance`: a
        member of an instance `up --tp` starts, whose arena is the one laid out alike in `arenas` itself until
        the instance gives it its own (tp.started, MemberArena.back_first_blocks)."""
        self.spec, self.id, self.shape = spec, spec.id, spec.shape
        self.limits, self.max_model_len = fleet.engine, fleet.max_model_len(spec.shape)
        block, self.layout = self.limits.block_size, layout or self.shape
        self.page_bytes = 2 * self.layout.num_layers * self.layout.kv_size * spec.dtype_bytes * block
        self.slot_pages = {bits: math.ceil(weight_bytes(self.layout, bits, spec.dtype_bytes) / self.page_bytes)
                           for bits in (FULL_BITS, 8, 4)}
        num_pages = spec.memory // self.page_bytes
        need = self.shape.num_layers * self.slot_pages[FULL_BITS] + (
            1 if in_world else self.sequence_blocks())
        if num_pages < need:
            raise ValueError(f"{self.id}: {spec.memory / (1 << 30):.2f} GiB holds {num_pages} pages of "
                             f"{self.page_bytes} bytes; the layers and " + ("one block" if in_world else
                             f"one sequence of {self.max_model_len} tokens") + f" need {need}")
        arenas = {} if arenas is None else arenas
        self.laid_out_as = self._lay_out(num_pages, static_bits, arenas)
        self.take_arena(arenas[self.laid_out_as] if starts_in_instance else arenas[self.laid_out_as].copy())
        self.layer_bits = [static_bits] * self.shape.num_layers
        self.swap_order = list(range(self.shape.num_layers))
        self.instance = f"{self.id}@{started_s:g}"  # a process: a restart would be a new one
        self.served = Served(executor=self.id, instance=self.instance, model=self.shape.name,
                             max_model_len=self.max_model_len, block_size=block, page_bytes=self.page_bytes,
                             layer_pages=self.slot_pages[FULL_BITS], kv_heads=self.shape.num_kv_heads,
                             max_waiting=self.limits.max_waiting)
        self.queue_delay, self.ttft = LatencyWindow(LATENCY_WINDOW_S), LatencyWindow(LATENCY_WINDOW_S)
        self.tpot, self.finished, self.busy = LatencyWindow(LATENCY_WINDOW_S), FinishedSamples(), BusyWindow(1.0)
        self.departures = Departures(LATENCY_WINDOW_S, now=started_s)  # requests leaving the waiting queue
        self.refusing: tuple | None = None  # the queue, batch and departures it last refused a wait on (admit)
        self.max_queue_wait_s = ExecutorConfig.max_queue_wait_s
        self.requests: dict[str, SimRequest] = {}  # those running or waiting: the scheduler's sequences, by id
        self.longest: int | None = 0  # the most tokens one of `requests` ends with; None: to count again
        self.cancelled: set[str] = set()  # given up by their clients during the step running
        self.rejected = 0
        self.counts = {"prompt_tokens": 0, "generated_tokens": 0}
        self.stepping: SchedulerOutput | None = None
        self.decoding: list[Sequence] = []  # a run's last step's decodes, outside `stepping`'s chunks
        self.batch: DecodeBatch | None = None  # its running sequences stepped as a batch (decode_batch.py)
        self.batched = False  # whether the step running is the batch's
        self.batch_mix = (0, 0)  # the (INT8, INT4) layers the batch's tokens came from: commands release it first
        self.decode_runs = decode_runs
        self.run: decode_run.DecodeRun | None = None  # steps ahead of a decode-only batch, settled lazily
        self.step_serial = 0  # which step or run the cluster's next step end is for: a cut moves it on
        self.step_started_s = 0.0
        self.held = set(range(self.shape.num_layers))  # layers whose slot holds their weights
        self.world: list[str] = []  # the executors it can merge with (`up` puts several in one world)
        self.plan: InstancePlan | None = None  # None: outside any world, as the service reports it
        self.group = None  # the instance of several executors it serves in (instance.py, tp.py)
        self.mapped = array("i")  # in an instance: the pages of ours backing its blocks, by block id
        self.hold_until = 0.0  # a merged instance's leader: no split before
        self.units: list[KvUnits] = []  # the KV head units it last reported serving alone
        self.units_key: tuple | None = None  # what they were computed from
        # Where it reports its latency profile (`reports_latency`): its steps' phases, counted as the engine counts
        # them, what it reports of them, and a decode run's batch and first step's contexts.
        self.steps_load = StepsLoad()
        self.latency_reports = (LatencyReports(spec.latency, FULL_BITS, LATENCY_WINDOW_S) if spec.reports_latency
                                else None)
        self.run_began: tuple[int, int] = (0, 0)

    def _lay_out(self, num_pages: int, bits: int, arenas: dict) -> tuple:
        """The key in `arenas` of an empty arena of `num_pages` with every layer's slot at `bits`, as set_bits
        leaves one started at full precision, laid out there first (laying out a thousand alike was half of a
        simulated fleet's set-up: the others copy it)."""
        layout = (num_pages, self.shape.num_layers, self.slot_pages[FULL_BITS], self.slot_pages[bits])
        if layout not in arenas:
            ledger = PageLedger(num_pages)
            for layer in range(self.shape.num_layers):
                ledger.assign_slot(layer, self._slot(layer))
            for layer in range(self.shape.num_layers):
                _, release = slot_moves(self._slot(layer), self.slot_pages[FULL_BITS], self.slot_pages[bits])
                ledger.release_slot_pages(layer, release)
            arenas[layout] = ledger
        return layout

    def take_arena(self, ledger: PageLedger) -> None:
        """The arena `ledger` its own, with the block manager and scheduler it serves alone with (a member's stay
        with it through its instance, for a split)."""
        self.ledger = ledger
        self.blocks = BlockManager(ledger, self.limits.block_size)
        self.scheduler = Scheduler(self.blocks, self.limits.max_num_seqs, self.limits.max_num_batched_tokens,
                                   self.limits.max_waiting)

    def join_world(self, names: list[str], bits: int) -> None:
        """One of the executors `names`, which can merge with each other, serving alone at `bits` as its own
        TP1 instance (as `up` starts them)."""
        self.world, self.plan = names, alone(self.id, self.shape.num_layers, bits)

    def pressure_events(self) -> int:
        """What its next report's pressure_events will be (shared/messages.py)."""
        return pressure_events(self.scheduler.num_preemptions, self.scheduler.num_admission_blocked, self.rejected)

    # --- requests -------------------------------------------------------------------------------
    def admit(self, request: SimRequest, now: float) -> None:
        """Queue `request`; QueueFullError when the waiting queue is full or would hold it longer than
        max_queue_wait_s (the executor's admission, shared/core/admission.py), FollowerRefusal on a member that
        does not lead its instance: the gateway tries another."""
        if self.group is not None and self.group.leader is not self:
            raise FollowerRefusal(f"{self.id} follows {self.group.leader.id} in instance {self.group.plan.id}: "
                                  f"requests go to the leader")
        scheduler = self.scheduler
        waiting, running = len(scheduler.waiting), len(scheduler.running)
        queue = (waiting, running, scheduler.max_num_seqs, self.departures.recorded)
        if self._refused_before(queue, now):
            self.rejected += 1
            raise QueueFullError(waiting, self.limits.max_waiting)
        departures, span_s = self.departures.recent(now)
        if not admits(waiting_ahead(waiting, running, scheduler.max_num_seqs), departures, span_s,
                      self.max_queue_wait_s):
            self.refusing = queue
            self.rejected += 1
            raise QueueFullError(waiting, self.limits.max_waiting)
        blocks, capacity = self.blocks_at_end(request.prompt_tokens, request.output_tokens), self.kv_capacity()
        if blocks > capacity:
            raise KvCapacityError(request.prompt_tokens, request.prompt_tokens + request.output_tokens, blocks,
                                  capacity)
        if waiting >= scheduler.max_waiting:  # Scheduler.add's refusal, before a sequence is made for nothing
            self.rejected += 1
            raise QueueFullError(waiting, scheduler.max_waiting)
        seq = Sequence(str(request.index), 0, CountedTokens(request.prompt_tokens),
                       sampling(request.output_tokens), now, output_ids=CountedTokens())
        scheduler.add(seq)
        request.executor, request.admitted_s = self.id, now
        self.requests[seq.request_id] = request
        if self.longest is not None:
            self.longest = max(self.longest, request.prompt_tokens + request.output_tokens)

    def _refused_before(self, queue: tuple, now: float) -> bool:
        """Whether admit() refused a wait on the same `queue` (its waiting, running, batch cap and departures so far)
        and would again: with them unchanged the predicted wait only grows, until the last departure leaves the
        window and the rate is unknown again (admission.py). Past its capacity a fleet's every arrival is offered to
        every full executor in turn, two hundred refusals an arrival: predicted afresh, four fifths of the
        overloaded trace's time."""
        return queue == self.refusing and self.departures.any_within(now)

    def cancel(self, request_id: str) -> None:
        """Its client gave up: the sequence leaves the scheduler at the step boundary (at once when no step
        runs), its pages freed, and nothing more is recorded of it."""
        self.cancelled.add(request_id)
        if self.stepping is None and self.run is None:
            self._drop_cancelled()
        elif self.batch is not None:  # its tokens so far, recorded now as single steps would have them
            self.batch.write_all()

    def _drop_cancelled(self) -> None:
        self.release_batch()
        for seq in [s for s in (*self.scheduler.running, *self.scheduler.waiting) if s.request_id in self.cancelled]:
            self.scheduler.remove(seq)
            self._forget(self.requests.pop(seq.request_id))
            if self.group is not None:
                self.group.forget(seq.request_id)
        self.cancelled.clear()

    def _finish(self, request_id: str, now: float, error: str | None = None) -> SimRequest:
        request = self._forget(self.requests.pop(request_id))
        if self.group is not None:
            self.group.forget(request_id)
        request.done_s, request.error = now, error
        tpot = ((request.last_token_s - request.first_token_s) / (request.tokens - 1)
                if request.tokens > 1 else None)
        if tpot is not None:
            self.tpot.record(tpot, now)
        if request.first_token_s is not None:
            self.finished.add(request.first_token_s - request.admitted_s, tpot or 0.0)
        return request

    def _pages_growth(self) -> int:
        """pages_growth of the running sequences: a decode batch's members' as it counts them (between its steps
        they are all that run; during one, those it admits follow them)."""
        running = self.scheduler.running
        if self.batch is None:
            return pages_growth(running, self.blocks, self.max_model_len)
        return self.batch.growth + pages_growth(running[len(self.batch.marks):], self.blocks, self.max_model_len)

    def _forget(self, request: SimRequest) -> SimRequest:
        """`request` has left: the longest may have been it."""
        if request.prompt_tokens + request.output_tokens == self.longest:
            self.longest = None
        return request

    # --- telemetry --------------------------------------------------------------------------------
    def telemetry(self, now: float) -> ExecutorTelemetry:
        (self if self.group is None else self.group.leader).settle(now)  # a member's busy spans are the leader's
        leads = self.leads
        snap = self.ledger.snapshot()
        # The most blocks a sequence ends holding: blocks_at_end grows with its tokens, so the longest's, asked once;
        # counted again only when the longest leaves (over a queue of a thousand, ten times a second, it was a tenth
        # of a saturated fleet's time)
        if self.longest is None:
            self.longest = max((r.prompt_tokens + r.output_tokens for r in self.requests.values()), default=0)
        longest = self.longest if leads else 0
        scheduler = self.scheduler
        queue = Queue(running=len(scheduler.running), waiting=len(scheduler.waiting),
                      max_num_seqs=scheduler.max_num_seqs if leads else 0, preemptions=scheduler.num_preemptions,
                      admission_blocked=scheduler.num_admission_blocked, rejected=self.rejected,
                      prompt_tokens=self.counts["prompt_tokens"], generated_tokens=self.counts["generated_tokens"],
                      queue_delay_s=self.queue_delay.mean(now), ttft_s=self.ttft.mean(now), tpot_s=self.tpot.mean(now),
                      departures=self.departures.recent(now), pages_growth=self._pages_growth(),
                      longest_blocks=self.blocks_at_end(longest, 0) if longest else 0,
                      requests=self.finished.drain())
        group = self.group
        return executor_telemetry(
            self.served, now, self.reported_pages(snap), queue, layers=list(self.layer_bits),
            swap_order=list(self.swap_order), member_of=group.plan if group is not None else None, plan=self.plan,
            free_pages=self.ledger.num_free, busy=self.busy.share(now), draining=False,
            hold_s=max(0.0, self.hold_until - now) if group is not None else 0.0, world=self.world,
            kv_units=self.kv_units(snap.pages_kv),
            layer_seconds=self.latency_reports.report(self.steps_load, now) if self.latency_reports else {},
            build=unvalidated)
