"""The cluster view: raw executor telemetry in, smoothed per-executor state and liveness out.

Pure on purpose: the caller passes `now` to every call, so the same code runs in the monitor process
(wall clock), in tests (any times) and in the simulator (simulated time), and nothing here reads a
clock or touches the bus.

Raw telemetry is noisy at the ~100 ms reporting rate, and the controller's hysteresis compares
pressure to marks, so KV usage, queueing delay and the waiting count are smoothed with a time-aware
EWMA: a sample's weight depends on how long ago the previous one came, so the half-life holds in
seconds whatever the reporting rate, and a late report does not count as several.

Liveness is judged on the monitor's clock (when telemetry arrived), not the executor's `time`
field, so clock skew between hosts cannot make an executor look dead or alive. Silence has two
marks, because a stall (a long prefill step, a GC pause, a starved CPU) looks like a death at first:
after `suspect_after_s` an executor gets no new requests but keeps its running ones; only after
`dead_after_s` are they given up. A process that is really gone is told apart sooner by the caller
(nobody answers on its subjects any more: `mark_gone`), and a process that restarted by the new
`instance` in its telemetry, which counts a restart even when no heartbeat was missed.

Each executor's finished requests feed its SLO window (slo.py), which a restart starts afresh like the
smoothed load. The samples themselves are left out of the raw report the state carries: the state goes out
less often than reports come, so the samples it showed would be some of them, and the window has them all.

The instances (DESIGN.md, "Instances across executors") are read off the live leaders' telemetry: a
leader is the one member that takes requests, so an instance whose leader is dead is no instance the
gateway can use, whatever its followers still report.
"""

import math
from dataclasses import dataclass, field

from shared.config import MonitorConfig
from shared.core.monitor.slo import SloTracker
from shared.messages import ClusterState, ExecutorState, ExecutorTelemetry, InstancePlan

UP = "up"
DOWN = "down"


def ewma_alpha(dt: float, half_life: float) -> float:
    """The weight of a new sample that arrives `dt` seconds after the previous one."""
    if half_life <= 0:
        return 1.0
    if dt <= 0:
        return 0.0
    return 1.0 - math.pow(2.0, -dt / half_life)


def kv_usage(t: ExecutorTelemetry) -> float:
    """Used over all KV pages (free + used): the pressure signal. No KV pages at all reads as full."""
    total = t.kv.pages_used + t.kv.pages_free
    return t.kv.pages_used / total if total > 0 else 1.0


@dataclass
class _Executor:
    telemetry: ExecutorTelemetry
    last_seen: float
    kv_usage: float
    queue_delay_s: float
    waiting: float
    slo: SloTracker
    restarts: int = 0
    gone: bool = False  # its process was found gone (mark_gone) and has not reported since
    reported: str | None = None  # the last transition handed out: None before the first "up"
    pending: list[str] = field(default_factory=list)  # transitions seen by observe, not yet handed out


class ClusterView:
    def __init__(self, config: MonitorConfig):
        self.config = config
        self._executors: dict[str, _Executor] = {}

    def alive(self, executor: str, now: float) -> bool:
        e = self._executors.get(executor)
        return e is not None and not e.gone and now - e.last_seen <= self.config.dead_after_s

    def suspect(self, executor: str, now: float) -> bool:
        """Alive, but silent for longer than suspect_after_s."""
        e = self._executors.get(executor)
        return self.alive(executor, now) and now - e.last_seen > self.config.suspect_after_s

    def suspects(self, now: float) -> list[str]:
        return [name for name in sorted(self._executors) if self.suspect(name, now)]

    def mark_gone(self, executor: str, checked_at: float) -> None:
        """Its process is gone (found at `checked_at`): dead now, not after dead_after_s. Telemetry that
        arrived after the check (a restart already reporting) wins."""
        e = self._executors.get(executor)
        if e is not None and e.last_seen < checked_at:
            e.gone = True

    def _slo_tracker(self) -> SloTracker:
        return SloTracker(self.config.slo_ttft_s, self.config.slo_tpot_s, self.config.slo_window_s)

    def observe(self, t: ExecutorTelemetry, now: float) -> bool:
        """Take in one report; True when it shows pressure events (preemptions, admissions waiting for KV,
        refusals) its predecessor from the same process had not: the state should go out now, not at the tick."""
        samples, t = t.requests, (t.model_copy(update={"requests": []}) if t.requests else t)
        e = self._executors.get(t.executor)
        if e is None:
            e = _Executor(t, now, kv_usage(t), t.queue_delay_s, float(t.waiting), self._slo_tracker())
            e.slo.add(samples, now)
            self._executors[t.executor] = e
            return t.pressure_events > 0
        restarted = t.instance != e.telemetry.instance
        pressure_rose = t.pressure_since(e.telemetry.instance, e.telemetry.pressure_events) > 0
        if e.reported == UP and (restarted or not self.alive(t.executor, now)):
            # It died and came back between two transitions() calls: the "down" must not be lost,
            # or the events would claim an executor that restarted had never gone away.
            e.pending.append(DOWN)
            e.reported = DOWN
        if restarted:
            # A new process starts from nothing: its predecessor's load says nothing about it.
            e.restarts += 1
            e.kv_usage, e.queue_delay_s, e.waiting = kv_usage(t), t.queue_delay_s, float(t.waiting)
            e.slo = self._slo_tracker()
        else:
            a = ewma_alpha(now - e.last_seen, self.config.ewma_half_life_s)
            e.kv_usage += a * (kv_usage(t) - e.kv_usage)
            e.queue_delay_s += a * (t.queue_delay_s - e.queue_delay_s)
            e.waiting += a * (t.waiting - e.waiting)
        e.slo.add(samples, now)
        e.telemetry = t
        e.gone = False
        e.last_seen = max(e.last_seen, now)
        return pressure_rose

    def state(self, now: float) -> ClusterState:
        return ClusterState(time=now, executors=[
            ExecutorState(executor=name, alive=self.alive(name, now), suspect=self.suspect(name, now),
                          restarts=e.restarts, last_seen=e.last_seen,
                          kv_usage=e.kv_usage, queue_delay_s=e.queue_delay_s, waiting=e.waiting,
                          telemetry=e.telemetry, slo=e.slo.window(now))
            for name, e in sorted(self._executors.items())], instances=self.instances(now))

    def instances(self, now: float) -> list[InstancePlan]:
        """The plans of the live leaders, one per id, by id. Executors without a plan (standalone) add none."""
        plans: dict[str, InstancePlan] = {}
        for name, e in sorted(self._executors.items()):
            plan = e.telemetry.plan
            if plan is not None and plan.leader == name and self.alive(name, now):
                plans.setdefault(plan.id, plan)
        return [plans[i] for i in sorted(plans)]

    def transitions(self, now: float) -> list[tuple[str, str]]:
        """(executor, "up"|"down") for each change since the last call; per executor they alternate,
        starting with "up" when it is first seen alive."""
        out: list[tuple[str, str]] = []
        for name, e in sorted(self._executors.items()):
            out.extend((name, kind) for kind in e.pending)
            e.pending.clear()
            current = UP if self.alive(name, now) else DOWN
            if current != e.reported and not (e.reported is None and current == DOWN):
                out.append((name, current))
                e.reported = current
        return out
