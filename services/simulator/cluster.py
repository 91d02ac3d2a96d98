"""The discrete-event loop: simulated executors driven by the real monitor, controller and router.

Nothing here decides anything a real process decides; it only moves time and messages between the pieces
that do, all imported from the services:
- the gateway's router (gateway/router.py) picks an executor for each arrival from the latest cluster state,
  and on a full queue tries the next with the refuser excluded, as the gateway's retry loop does;
- every executor reports ExecutorTelemetry every `telemetry_interval_s`, and at once after a step that
  raised its pressure events (a preemption, an admission held for KV pages, a refusal), as the executor's
  heartbeat does; each report goes through the monitor's ClusterView (monitor/aggregate.py);
- the monitor publishes the ClusterState every `publish_interval_s`, and at once when a report showed new
  pressure; the controller (controller/loop.py's Controller.plan, with the policies its process would run)
  plans on every state, and
  controller/dispatch.py says which planned commands go out (one command at a time per executor, none from
  a state older than the executor's last answer);
- a command reaches its executor after `bus_latency_s`, waits for the step boundary, takes what
  costs.swap_seconds says (the executor steps nothing meanwhile, as the engine thread is busy swapping), and
  its answer returns after `bus_latency_s` more.
Events in the audit shape (`command`, `pressure`) are kept so that the bench's events.actions and
events.reaction read a simulation as they read a real run.
"""

import heapq
import itertools
import time
from dataclasses import dataclass, field

from services.bench.trace import TraceRequest
from services.controller.dispatch import sendable
from services.controller.loop import Controller
from services.controller.policies import ladder
from services.controller.policies.interface import PlannedCommand
from services.executor.engine.errors import QueueFullError
from services.gateway.router import choose_executor
from services.monitor.aggregate import ClusterView
from services.simulator.executor import SimExecutor, SimRequest, SimulatedRefusal
from services.simulator.fleet import Fleet
from shared.config import ControllerConfig, MonitorConfig
from shared.messages import ClusterState, Event, pressure_events

MODEL = "simulated"
PRESSURE_EVENT_EVERY_S = 1.0  # the executor's pressure events on the stream, at most one a second each


@dataclass(frozen=True)
class SimSettings:
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    static_bits: int = 16
    telemetry_interval_s: float = 0.1  # ExecutorConfig's
    sample_interval_s: float = 0.25  # the bench's cluster poll
    bus_latency_s: float = 0.001
    drain_s: float = 90.0  # after the last arrival, unfinished requests count as failed (the bench's drain)


@dataclass
class SimRun:
    requests: list[SimRequest]
    samples: list[tuple[float, list[dict]]]  # (time, the live executors as GET /v1/cluster shows them)
    events: list[Event]
    elapsed_s: float
    decisions: int = 0  # states the controller planned on
    plan_seconds: float = 0.0  # wall seconds its policies took, over all of them


class Simulation:
    def __init__(self, fleet: Fleet, settings: SimSettings):
        self.fleet, self.settings = fleet, settings
        self.executors = {s.id: SimExecutor(s, fleet, settings.static_bits) for s in fleet.executors}
        self.view = ClusterView(settings.monitor)
        self.controller = Controller(settings.controller, ladder.policies_for(settings.controller))
        self.state: ClusterState | None = None
        self.now = 0.0
        self._heap: list = []
        self._order = itertools.count()
        self._stepping: set[str] = set()
        self._blocked: set[str] = set()  # applying commands: no step starts
        self._inbox: dict[str, list[tuple[float, PlannedCommand]]] = {}
        self._busy: set[str] = set()  # a command in flight, as the controller sees it
        self._settled: dict[str, float] = {}
        self._published: dict[str, int] = {}  # pressure events in each executor's last report
        self._pressure_sent: dict[str, float] = {}
        self.events: list[Event] = []
        self.samples: list[tuple[float, list[dict]]] = []
        self.decisions, self.plan_seconds = 0, 0.0
        self._ended = 0  # requests finished or refused

    # --- the loop -----------------------------------------------------------------------------------
    def at(self, t: float, handler, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._order), handler, args))

    def run(self, arrivals: list[TraceRequest]) -> SimRun:
        requests = [SimRequest(i, r.arrival_s, r.prompt_tokens, r.output_tokens) for i, r in enumerate(arrivals)]
        for name in self.executors:
            self.at(0.0, self._report, name, True)
        self.at(0.0, self._tick)
        self.at(0.0, self._sample)
        for r in requests:
            self.at(r.arrival_s, self._arrive, r)
        end = max((r.arrival_s for r in requests), default=0.0) + self.settings.drain_s
        while self._heap and self._heap[0][0] <= end and self._ended < len(requests):
            self.now, _, handler, args = heapq.heappop(self._heap)
            handler(*args)
        for r in requests:
            if r.done_s is None:
                r.error = "unfinished at the end of the drain"
        return SimRun(requests, self.samples, self.events, self.now, self.decisions, self.plan_seconds)

    # --- requests -----------------------------------------------------------------------------------
    def _arrive(self, request: SimRequest) -> None:
        refused: set[str] = set()
        while (name := choose_executor(self.state, refused, MODEL)) is not None:
            try:
                self.executors[name].admit(request, self.now)
            except QueueFullError:
                refused.add(name)
                self._after_pressure(name)
                continue
            self._kick(name)
            return
        request.done_s, request.error = self.now, "no executor could take it (queues full or none serving)"
        self._ended += 1

    def _kick(self, name: str) -> None:
        """Start a step on an idle executor that has work."""
        if name in self._stepping or name in self._blocked:
            return
        seconds = self.executors[name].start_step(self.now)
        if seconds is not None:
            self._stepping.add(name)
            self.at(self.now + seconds, self._step_end, name)

    def _step_end(self, name: str) -> None:
        self._stepping.discard(name)
        self._ended += len(self.executors[name].finish_step(self.now))
        self._after_pressure(name)
        if self._inbox.get(name):
            self._apply(name)
        else:
            self._kick(name)

    def _after_pressure(self, name: str) -> None:
        """A step or a refusal that raised the pressure events: report at once, and say so on the stream."""
        e = self.executors[name]
        count = pressure_events(e.scheduler.num_preemptions, e.scheduler.num_admission_blocked, e.rejected)
        if count <= self._published.get(name, 0):
            return
        self._report(name, False)
        if self.now - self._pressure_sent.get(name, float("-inf")) >= PRESSURE_EVENT_EVERY_S:
            self._pressure_sent[name] = self.now
            self.events.append(Event(kind="pressure", source=name, time=self.now, data={"executor": name}))

    # --- telemetry, the monitor and the controller --------------------------------------------------------
    def _report(self, name: str, periodic: bool) -> None:
        telemetry = self.executors[name].telemetry(self.now, MODEL)
        self._published[name] = telemetry.pressure_events
        if self.view.observe(telemetry, self.now):
            self._publish()
        if periodic:
            self.at(self.now + self.settings.telemetry_interval_s, self._report, name, True)

    def _tick(self) -> None:
        self._publish()
        self.at(self.now + self.settings.monitor.publish_interval_s, self._tick)

    def _publish(self) -> None:
        self.state = self.view.state(self.now)
        if not self.controller.policies:
            return
        began = time.perf_counter()
        planned = self.controller.plan(self.state)
        self.plan_seconds += time.perf_counter() - began
        self.decisions += 1
        reported = {e.executor: e.telemetry.time for e in self.state.executors}
        for name, commands in sendable(planned, self._busy, reported, self._settled).items():
            self._busy.add(name)
            self.at(self.now + self.settings.bus_latency_s, self._deliver, name, commands, self.now)

    def _deliver(self, name: str, commands: list[PlannedCommand], decided: float) -> None:
        self._inbox.setdefault(name, []).extend((decided, c) for c in commands)
        if name not in self._stepping:
            self._apply(name)

    def _apply(self, name: str) -> None:
        """At a step boundary: every delivered command in order, the executor blocked while they take."""
        executor, elapsed = self.executors[name], 0.0
        batch, self._inbox[name] = self._inbox.get(name, []), []
        for decided, planned in batch:
            try:
                state, seconds = executor.apply(planned.args)
                ok, error = True, None
            except SimulatedRefusal as exc:
                state, seconds, ok, error = {}, 0.0, False, str(exc)
            elapsed += seconds
            answered = self.now + elapsed + self.settings.bus_latency_s
            self.events.append(Event(kind="command", source="controller", time=answered, data={
                "executor": name, "kind": planned.args.kind, "args": planned.args.model_dump(by_alias=True),
                "ok": ok, "error": error, "latency_s": answered - decided, "state": state | {"seconds": seconds},
                "reason": planned.reason}))
            if not ok:
                break
        self._blocked.add(name)
        self.at(self.now + elapsed, self._applied, name, self.now + elapsed + self.settings.bus_latency_s)

    def _applied(self, name: str, answered: float) -> None:
        self._blocked.discard(name)
        self._busy.discard(name)
        self._settled[name] = answered
        self._kick(name)

    # --- what the bench's cluster poll would have seen ------------------------------------------------------
    def _sample(self) -> None:
        self.samples.append((self.now, [
            {"id": e.id, "kv": {"pages_base": s.pages_base, "pages_extension": s.pages_extension,
                                "pages_used": s.pages_kv_used}, "block_size": e.limits.block_size,
             "layers": list(e.layer_bits), "running": len(e.scheduler.running),
             "waiting": len(e.scheduler.waiting), "preemptions": e.scheduler.num_preemptions}
            for e in self.executors.values() for s in [e.ledger.snapshot()]]))
        self.at(self.now + self.settings.sample_interval_s, self._sample)
