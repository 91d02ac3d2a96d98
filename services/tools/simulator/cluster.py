"""The discrete-event loop: simulated executors driven by the real monitor, controller and router.

Nothing here decides anything a real process decides; it only moves time and messages between the pieces
that do, all imported from the services:
- the gateway's router (shared/core/router.py) picks an executor for each arrival from the latest cluster state,
  and on a full queue tries the next with the refuser excluded, as the gateway's retry loop does, the refuser
  asked last by later arrivals until it reports again (router.Unreported);
- every executor reports ExecutorTelemetry every `telemetry_interval_s`, and at once after a step that
  raised its pressure events (a preemption, an admission held for KV pages, a refusal), as the executor's
  heartbeat does; the monitor reads each report for new pressure as it arrives and takes each executor's
  newest report, with the finished requests of those it replaced, into its ClusterView (monitor/aggregate.py)
  when it next publishes (monitor/held.py, as monitor/service.py holds them). A periodic report that the next
  tick would replace unread is not built;
- the monitor publishes the ClusterState every `publish_interval_s`, and at once when a report showed new
  pressure, once between two ticks at most (monitor/service.py's cap), at the pace its states' cost allows
  (monitor/pace.py, the cost `monitor_state_s` an executor); the controller (controller/loop.py's
  Controller.plan, with the policies its process would run) plans on every state, and
  shared/core/delivery.py says which planned commands go out (one command at a time per executor, none from
  a state older than the executor's last answer);
- a command reaches its executor after `bus_latency_s`, waits for the step boundary, takes what
  costs.swap_seconds says (the executor steps nothing meanwhile, as the engine thread is busy swapping), and
  its answer returns after `bus_latency_s` more.
- a request longer than its instance holds even empty (the executor's KV_CAPACITY refusal) goes to the
  gateway's AMOEBAs merge scheduler (merges.py, over gateway/tp_merges.py's and shared/core/tp_scheduler.py's
  decisions): it waits for the merge that holds it, whose tp_merge every member takes at its own step
  boundary; the merge happens once the last of them is there (the collective), and the request is admitted
  on the merged leader once the monitor's state shows it.
Executors: those of one world (the fleet's `world_size`, else all, as `morphling up` starts them on one host)
each serve as a TP1 instance that can merge within it; with `spare`, bench/modes.py's spare plan makes
instances of two (CoCoServe's start, instance.py). Windows replay one after another on the same cluster, with
the bench's rest between them (`rest`).
The reports and states are reporting.py's, the commands' delivery control.py's (mixed into Simulation).
Events in the audit shape (`command`, `pressure`) are kept so that the bench's events.actions and
events.reaction read a simulation as they read a real run.
"""

import gc
import heapq
import itertools
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from services.controller.loop import Controller
from services.gateway.admin import cluster_body
from services.tools.bench.client import CLUSTER_POLL_S
from services.tools.bench.modes import spare_plan
from services.tools.bench.rest import at_rest, shape
from services.tools.bench.trace import TraceRequest
from services.tools.simulator import tp
from services.tools.simulator.control import SimControl
from services.tools.simulator.executor import FollowerRefusal, SimExecutor, SimRequest
from services.tools.simulator.fleet import Fleet
from services.tools.simulator.instance import SimInstance
from services.tools.simulator.merges import MergeRoom
from services.tools.simulator.reporting import SimReporting
from shared.config import ControllerConfig, MonitorConfig
from shared.core.errors import KvCapacityError, QueueFullError
from shared.core.monitor.aggregate import ClusterView
from shared.core.monitor.held import HeldReports
from shared.core.plans import parse_plans
from shared.core.policies import ladder
from shared.core.policies.interface import PlannedCommand
from shared.core.router import Unreported, choose_executor, prompt_pages
from shared.messages import ClusterState, Event, ExecutorTelemetry, InstancePlan

PRESSURE_EVENT_EVERY_S = 1.0  # the executor's pressure events on the stream, at most one a second each


@dataclass(frozen=True)
class SimSettings:
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    static_bits: int = 16
    telemetry_interval_s: float = 0.1  # ExecutorConfig's
    # What a state costs the monitor (judging the held reports, building, encoding), per executor: 103 ms at
    # 1,000 executors on the GPU machine's host (docs/benchmarks.md, "On the GPU machine's 16 cores").
    monitor_state_s: float = 1.0e-4
    sample_interval_s: float = CLUSTER_POLL_S
    bus_latency_s: float = 0.001
    drain_s: float = 90.0  # after the last arrival, unfinished requests count as failed (the bench's drain)
    spare: bool = False  # instances of two, every layer on the first (bench/modes.py's spare plan)
    # decode-only batches advanced many steps at once (decode_run.py), a batch of decodes with its admissions
    # stepped as a batch (decode_batch.py): the same results as the scheduler's single steps, faster
    decode_runs: bool = True


@dataclass
class SimRun:
    """One window's replay. Requests and events carry simulated times; `origin` is the window's start, from which
    samples and elapsed_s count."""
    requests: list[SimRequest]
    samples: list[tuple[float, list[dict]]]  # (time, the live executors as GET /v1/cluster shows them)
    events: list[Event]  # in_time_order
    elapsed_s: float
    decisions: int = 0  # states the controller planned on
    plan_seconds: float = 0.0  # wall seconds its policies took, over all of them
    origin: float = 0.0
    drained: bool = False  # whether it ended at its drain, some requests unfinished


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """The simulation makes millions of objects and few cycles; the cyclic collector rescanning all of them as they
    pile up was 40% of a thousand-executor run's loop (77 s against 45 s, for 0.5 GiB more at the peak)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def in_time_order(events: list[Event], fleet: Fleet) -> list[Event]:
    """`events` by their time (a command's: when its answer came), those at one instant in the fleet's order of
    their executors, then in the order they happened: the order a window's events are read in, whichever
    processes simulated it (shards.py)."""
    rank = fleet.ranks
    return sorted(events, key=lambda e: (e.time, rank[e.data["executor"]]))


def traffic_turns(traffic: dict[str, float]) -> Iterator[str]:
    """The models in the turns their weights give them, smooth weighted round robin (as nginx spreads requests
    over weighted servers): every stretch of requests is shared in proportion, the lighter models interleaved."""
    credit, total = dict.fromkeys(traffic, 0.0), sum(traffic.values())
    while True:
        for name, weight in traffic.items():
            credit[name] += weight
        chosen = max(credit, key=credit.__getitem__)
        credit[chosen] -= total
        yield chosen


class Simulation(SimReporting, SimControl):
    def __init__(self, fleet: Fleet, settings: SimSettings, models: Collection[str] | None = None):
        """`models`: simulate only the executors and requests of these of the fleet's models (a shard,
        shards.py); the monitor's pace and the instances' ids stay the whole fleet's. Every model by default."""
        self.fleet, self.settings = fleet, settings
        self.models = set(fleet.models if models is None else models)
        if unknown := self.models - set(fleet.models):
            raise ValueError(f"the fleet serves no {', '.join(sorted(unknown))}; it serves {', '.join(fleet.models)}")
        shard = {s.id for s in fleet.executors if s.shape.name in self.models}
        self.worlds = [world for world in fleet.worlds() if len(world) > 1 and world[0] in shard]
        in_world = {name for world in self.worlds for name in world}
        arenas: dict = {}  # empty arenas and instance ledgers laid out: each a copy of the first laid out alike
        plans = fleet.start_plans(settings.static_bits)
        specs = {s.id: s for s in fleet.executors}
        layouts = {name: tp.member_shape(specs[name].shape, plan.tp, rank)
                   for plan in plans for rank, name in enumerate(plan.members)}
        with no_cycle_collection():  # a thousand arenas' lists: rescanned as they pile up, half of the set-up
            self.executors = {s.id: SimExecutor(s, fleet, settings.static_bits, in_world=s.id in in_world,
                                                decode_runs=settings.decode_runs, arenas=arenas,
                                                layout=layouts.get(s.id), starts_in_instance=s.id in layouts)
                              for s in fleet.executors if s.id in shard}
            form_worlds(self.executors, self.worlds, fleet, settings, plans, arenas)
        self.merges = MergeRoom(self, settings.controller.split_free_fraction)
        self._merging: dict[str, set[str]] = {}  # a merge's instance -> the members already at its collective
        self._joining: dict[str, dict] = {}  # a join's newcomer -> its sides already at its collective (control.py)
        self._refused_joins: dict[str, str] = {}  # a newcomer -> why its join, still to come, is refused
        self.view = ClusterView(settings.monitor)
        self.controller = Controller(settings.controller, ladder.policies_for(settings.controller))
        self.state: ClusterState | None = None
        self._urgent_open = True  # a report of new pressure may still publish before the next tick
        self.unreported = Unreported()  # the gateway's count of what it sent since each executor last reported
        self.now = 0.0
        self._heap: list = []
        self._order = itertools.count()
        self._rank = {name: rank for rank, name in enumerate(self.executors)}  # simultaneous step ends: in this order
        self._others = len(self._rank)  # what comes at an instant after every step end
        self._stepping: set[str] = set()
        self._blocked: set[str] = set()  # applying commands: no step starts
        self._inbox: dict[str, list[tuple[float, PlannedCommand]]] = {}
        self._busy: set[str] = set()  # a command in flight, as the controller sees it
        self._settled: dict[str, float] = {}
        self._published: dict[str, int] = {}  # pressure events in each executor's last report
        self._held: HeldReports[ExecutorTelemetry] = HeldReports()  # the monitor's, since its last state
        self._pressure_sent: dict[str, float] = {}
        self._unbuilt: dict[str, float] = {}  # periodic reports left unbuilt since the last state (_superseded)
        self._next_beat = float("inf")  # when the executors' next periodic reports are due (_beat)
        self._woken: set[str] = set()  # executors whose one report out of cycle since their last beat has gone
        self._next_tick = 0.0
        self.events: list[Event] = []
        self.samples: list[tuple[float, list[dict]]] = []
        self.decisions, self.plan_seconds = 0, 0.0
        self._at_rest: dict = {}  # the cluster as it started, by bench/rest.py's rule: what a rest returns to
        self._issued = 0  # requests made so far, over every window: their ids
        self._open: set[int] = set()  # the window's requests not finished or refused yet
        self._models = traffic_turns(fleet.traffic)  # the model each request asks for, in turn
        self._progress: Callable[[], None] | None = None
        self._last_polled: dict[str, dict] = {}  # each executor's last sample (_polled)

    # --- the loop -----------------------------------------------------------------------------------
    def at(self, t: float, handler, *args) -> None:
        heapq.heappush(self._heap, (t, self._others, next(self._order), handler, args))

    def _feed(self, requests: list[SimRequest]) -> None:
        """The arrivals, each on the heap only once the one before it has come, in the order they would have taken
        all pushed now: a whole trace's half a million on the heap made every event's pop dearer (6% of a
        thousand-executor run's time went to popping)."""
        first = next(self._order)
        self._order = itertools.count(first + len(requests))  # the order's numbers each arrival would have had
        self._arrive_next(iter(sorted(zip((r.arrival_s for r in requests), itertools.count(first), requests))))

    def _arrive_next(self, arrivals: Iterator[tuple[float, int, SimRequest]]) -> None:
        if (arrival := next(arrivals, None)) is not None:
            t, order, request = arrival
            heapq.heappush(self._heap, (t, self._others, order, self._arrive_in_turn, (arrivals, request)))

    def _arrive_in_turn(self, arrivals: Iterator[tuple[float, int, SimRequest]], request: SimRequest) -> None:
        self._arrive_next(arrivals)
        self.arrive(request)

    def _step_ends_at(self, t: float, name: str, serial: int) -> None:
        """A step's end comes before anything else at the same instant: a decode run's steps have ended by the
        time their end comes (`DecodeRun.begun_by`), so single steps must have too, or a tie tells them apart.
        Several executors' ends at one instant all end first (`_step_end`), then are followed up in the executors'
        order, not in the order they were planned in: a run plans its end many steps ahead, so that order would
        differ from single steps'."""
        heapq.heappush(self._heap, (t, self._rank[name], next(self._order), self._step_end, (name, serial)))

    def run(self, arrivals: list[TraceRequest], progress: Callable[[float], None] | None = None) -> SimRun:
        """Replay one window's arrivals from now on: on a fresh cluster, or on the one an earlier window and a
        rest left, as the bench replays its windows on one system. Requests unfinished `drain_s` after the last
        arrival count as failed and are cancelled, as the bench's client cancels them. `progress` is told the
        window's simulated seconds so far at each of the bench's polls."""
        origin = self.now
        self._progress = None if progress is None else (lambda: progress(self.now - origin))
        requests = [SimRequest(self._issued + i, origin + r.arrival_s, r.prompt_tokens, r.output_tokens, model)
                    for i, r in enumerate(arrivals) if (model := next(self._models)) in self.models]
        self._issued += len(arrivals)
        if self.state is None:  # a fresh cluster: its first reports and state
            self.at(self.now, self._beat)
            self.at(self.now, self._tick)
            self.at(self.now, self._sample)
            self._advance(self.now)
            self._at_rest = at_rest(cluster_body(self.state))  # the cluster as it starts: what a rest returns to
        self._open = {r.index for r in requests}
        mark = self._mark()
        self._feed(requests)
        self._advance(origin + max((r.arrival_s for r in arrivals), default=0.0) + self.settings.drain_s)
        unfinished = [r for r in requests if r.done_s is None]
        for r in unfinished:
            r.error = "unfinished at the end of the drain"
            self._cancel(r)
        self._progress = None  # the rest after it is not the window's
        samples, events, decisions, plan_seconds = self._since(mark, origin)
        return SimRun(requests, samples, in_time_order(events, self.fleet), self.now - origin, decisions, plan_seconds,
                      origin, drained=bool(unfinished))

    def lengthen(self, played: SimRun, until: float, drained: bool) -> SimRun:
        """`played`, the window this simulation has just played, as if it had ended at `until` (simulated
        seconds): as it does where another shard's requests (shards.py) kept the whole fleet's window open that
        long. Handled, as that window's loop would have: every event before `until`; at `until` the step ends
        (which come first), and, when the window ended at its drain (`drained`: some shard's requests were
        unfinished there), everything else."""
        mark = self._mark()
        self._advance(until, None if drained else self._others)
        origin = played.origin
        samples, events, decisions, plan_seconds = self._since(mark, origin)
        return replace(played, samples=played.samples + samples,
                       events=in_time_order(played.events + events, self.fleet), elapsed_s=self.now - origin,
                       decisions=played.decisions + decisions, plan_seconds=played.plan_seconds + plan_seconds,
                       drained=drained)

    def _mark(self) -> tuple[int, int, int, float]:
        """Where the samples, events, decisions and planning time stand now: what _since counts from."""
        return len(self.samples), len(self.events), self.decisions, self.plan_seconds

    def _since(self, mark: tuple[int, int, int, float], origin: float
               ) -> tuple[list[tuple[float, list[dict]]], list[Event], int, float]:
        """The samples (timed from `origin`), events, decisions and planning seconds since `mark`."""
        samples, events, decisions, plan_seconds = mark
        return ([(t - origin, seen) for t, seen in self.samples[samples:]], self.events[events:],
                self.decisions - decisions, self.plan_seconds - plan_seconds)

    def rest(self, rest_s: float, timeout_s: float, still_s: float = 3.0) -> tuple[float, bool]:
        """The bench's rest between two windows (bench/suite.py's settle): `rest_s` without arrivals, then until
        the cluster is back at rest as it started and unchanged for `still_s`, looked at once a second, up to
        `timeout_s` more. Returns (seconds it rested, whether it got there)."""
        began = self.now
        self._advance(began + rest_s)
        last, since = None, self.now
        while True:
            cluster = cluster_body(self.state)
            if (now := shape(cluster)) != last:
                last, since = now, self.now
            elif at_rest(cluster) == self._at_rest and self.now - since >= still_s:
                return self.now - began, True
            if self.now - began > rest_s + timeout_s:
                return self.now - began, False
            self._advance(self.now + 1.0)

    def _advance(self, until: float, before: int | None = None) -> None:
        """Handle every event up to `until`, or until the window's requests are all done when some are open.
        `before`: at `until` itself, only the events of an order before it (`self._others`: the step ends)."""
        waiting = bool(self._open)
        before = self._others + 1 if before is None else before
        with no_cycle_collection():
            while self._heap and (self._heap[0][0] < until or self._heap[0][0] == until and self._heap[0][1] < before
                                  ) and (self._open or not waiting):
                self.now, _, _, handler, args = heapq.heappop(self._heap)
                handler(*args)
        if not waiting or self._open:  # the drain's end comes: what is still open is cancelled then, not earlier
            self.now = max(self.now, until)

    def _cancel(self, request: SimRequest) -> None:
        """The client gave up on `request`: its executor drops it; one still waiting for a merge is dropped when
        the merge room hands it back (arrive, admit_on)."""
        key = str(request.index)
        for name, executor in self.executors.items():
            if key in executor.requests:
                self._cut(name)
                executor.cancel(key)
                return

    # --- requests -----------------------------------------------------------------------------------
    def arrive(self, request: SimRequest) -> None:
        if request.error is not None:  # cancelled at the end of its window, while it waited for a merge
            return
        refused: set[str] = set()
        unreported = self.unreported.view()
        while (name := choose_executor(self.state, refused, request.model, unreported=unreported)) is not None:
            try:
                self.executors[name].admit(request, self.now)
            except QueueFullError:
                refused.add(name)
                self.unreported.refused(name, self.now)
                self._after_pressure(name)
                continue
            except FollowerRefusal:
                refused.add(name)
                continue
            except KvCapacityError:
                self.merges.make_room(request)
                return
            self.unreported.add(name, self.now, prompt_pages(request.prompt_tokens, self.fleet.engine.block_size))
            if len(self.executors[name].scheduler.waiting) == 1:  # a run is planned only where the head cannot join
                self._cut(name)
            self._kick(name)
            return
        self.fail(request, "no executor could take it (queues full or none serving)")

    def fail(self, request: SimRequest, error: str) -> None:
        if request.error is not None:
            return
        request.done_s, request.error = self.now, error
        self._open.discard(request.index)

    def admit_on(self, name: str, request: SimRequest) -> None:
        """Admit `request` on the leader a merge made room on (the gateway's admission after make_room)."""
        if request.error is not None:
            return
        try:
            self.executors[name].admit(request, self.now)
        except (QueueFullError, KvCapacityError) as exc:
            self.fail(request, f"refused after the merge that was to hold it: {exc}")
            return
        self._cut(name)
        self._kick(name)

    def send(self, name: str, commands: list[PlannedCommand]) -> None:
        """A command from the gateway (a merge): delivered as the controller's are, outside its bookkeeping."""
        self.at(self.now + self.settings.bus_latency_s, self._deliver, name, commands, self.now)

    def _kick(self, name: str) -> None:
        """Start a step on an idle executor that has work."""
        if name in self._stepping or name in self._blocked:
            return
        executor = self.executors[name]
        if (ends := executor.start_step(self.now)) is not None:
            self._stepping.add(name)
            self._step_ends_at(ends, name, executor.step_serial)

    def _cut(self, name: str) -> None:
        """An arrival, a command or a cancel changes what `name`'s next step schedules: a decode run it is in ends
        with the step in flight."""
        executor = self.executors[name]
        if (ends := executor.cut(self.now)) is not None:
            self._step_ends_at(ends, name, executor.step_serial)

    def _step_end(self, name: str, serial: int) -> None:
        """Every step ending now ends before any of them is followed up (a report, the next step): what one
        executor's report publishes reads the others, and a decode run's steps have ended by their end."""
        ends = [(name, serial)]
        while self._heap and self._heap[0][0] == self.now and self._heap[0][1] < self._others:
            ends.append(heapq.heappop(self._heap)[4])
        ended = [n for n, s in ends if s == self.executors[n].step_serial]  # the others were cut earlier
        for n in ended:
            self._stepping.discard(n)
            for request in self.executors[n].finish_step(self.now):
                self._open.discard(request.index)
        for n in ended:
            self._after_pressure(n)
            self._take_next(n)

    def _take_next(self, name: str) -> None:
        """Free again (a step ended, commands applied): the commands delivered meanwhile first, else a step."""
        if self._inbox.get(name):
            self._apply(name)
        else:
            self._kick(name)

    def _after_pressure(self, name: str) -> None:
        """A step or a refusal that raised the pressure events: report at once, and say so on the stream."""
        if self.executors[name].pressure_events() <= self._published.get(name, 0):
            return
        self._report_pressure(name)
        if self.now - self._pressure_sent.get(name, float("-inf")) >= PRESSURE_EVENT_EVERY_S:
            self._pressure_sent[name] = self.now
            self.events.append(Event(kind="pressure", source=name, time=self.now, data={"executor": name}))


def form_worlds(executors: dict[str, SimExecutor], worlds: list[list[str]], fleet: Fleet, settings: "SimSettings",
                plans: list[InstancePlan], laid_out: dict) -> None:
    """Every executor in its world, serving alone, in an instance `up --tp` starts (of the fleet's `plans`,
    their ledgers of block ids copies of those `laid_out` alike), or, where the fleet has them serve alone, in
    the spare plan's pairs, numbered after the fleet's TP instances."""
    for names in worlds:
        for name in names:
            executors[name].join_world(names, settings.static_bits)
    for plan in plans:
        if plan.leader in executors:
            tp.started(plan, {name: executors[name] for name in plan.members}, laid_out)
    if not settings.spare or not worlds:
        return
    all_worlds = fleet.worlds()
    if any(len(names) < 2 or len(names) % 2 for names in all_worlds):
        raise ValueError(f"the spare plan runs instances of two executors of one world; the fleet's worlds "
                         f"hold {[len(names) for names in all_worlds]}")
    started = {name for plan in plans for name in plan.members}
    alone = {s.id: s.shape for s in fleet.executors if s.id not in started}
    if not alone:
        raise ValueError(f"the spare plan pairs executors serving alone; the fleet starts them in TP"
                         f"{fleet.tp} instances")
    if not (mine := [name for name in executors if name in alone]):
        return
    # Pairs in order: worlds of even sizes, each of one model, hold each pair whole; numbered over the fleet.
    pairs = [pair for shape in fleet.models.values()
             for pair in spare_plan(len(fleet.executors), shape.num_layers)["instances"]
             if alone.get(pair["leader"]) is shape]
    for k, pair in enumerate(pairs):
        pair["id"] = f"i{len(plans) + k}"
    for plan in parse_plans({"instances": [p for p in pairs if p["leader"] in executors]}, mine, None):
        SimInstance(plan, {m: executors[m] for m in plan.members})
