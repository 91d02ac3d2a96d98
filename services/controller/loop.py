"""The controller's machinery: run pure policies on each cluster state and deliver their commands.

Policies are pure functions so that the same code runs live and in the simulator; everything that
touches the bus is here. Commands go out through shared.commands.CommandSender (sequence numbers,
retries, the audit trail); which of the planned ones go out at all is dispatch.py's rule (one command
at a time per executor, none from a state older than its last answer), which the simulator runs too.

A state is validated only when it is planned: the subscription keeps the newest one unpacked, and one that a
newer one replaced before the planner got to it costs an unpack, not a validation too (a state of 1,000
executors is 0.9 MB: ~30 ms to unpack and validate, the larger part validating). Validating and planning run in
a worker thread, so that the event loop goes on reading the bus meanwhile: when states come faster than it
plans, it plans on the latest and drops the rest, instead of planning each in turn while the newer ones pile up
unread in the server (which cut the controller off as a slow consumer at 1,000 executors).

Every `stats_interval_s` it publishes a "stats" event with its counts since it started: states received,
states planned (fewer when states came faster than it planned) and the seconds validating, planning and
dispatching them took, so that its decision time at scale is read off the bus. The executors it wants
(shared/core/policies/capacity.py) ride on it, and a change of them is a "scale" event at once.
"""

import asyncio
import logging
import time
from collections import deque

from shared import subjects
from shared.bus import BadMessage, Bus, BusError, unsubscribe, validate
from shared.commands import CommandSender
from shared.config import ControllerConfig
from shared.core.delivery import sendable
from shared.core.policies.capacity import CapacityAdvice, capacity_settings
from shared.core.policies.interface import PlannedCommand, Policy
from shared.messages import ClusterState, CommandResult, Event

log = logging.getLogger(__name__)


class Controller:
    def __init__(self, config: ControllerConfig, policies: list[Policy], history_len: int = 25):
        self.config = config
        self.policies = list(policies)
        # The earlier states a policy is given. The ladder's rungs keep what they need of the past in memories of
        # their own (hysteresis windows, dwell times) and read none of these, while each held state costs memory
        # in proportion to the executors: with two minutes of them (600) the controller grew to 640-860 MiB within
        # ~30 s at 300 executors (docs/benchmarks.md, `morphling bench-bus`).
        self.history: deque[ClusterState] = deque(maxlen=history_len)
        self.results: deque[CommandResult] = deque(maxlen=1000)
        self.sender: CommandSender | None = None
        self._sub = None
        self._busy: dict[str, asyncio.Task] = {}
        self._settled: dict[str, float] = {}  # when each executor's last command finished
        self._pending: dict | None = None  # the newest state not planned yet, unvalidated
        self._wake = asyncio.Event()
        self._runner: asyncio.Task | None = None
        self._reporter: asyncio.Task | None = None
        self.received = 0  # cluster states received
        self.planned = 0  # of them, planned
        self.plan_s = 0.0  # seconds planning and dispatching them took
        self.plan_max_s = 0.0  # the longest since the last stats event
        self.capacity = CapacityAdvice(capacity_settings(**dict(config.capacity_overrides)))
        self.desired_executors: int | None = None
        self._bus: Bus | None = None

    @property
    def latest(self) -> ClusterState | None:
        return self.history[-1] if self.history else None

    async def start(self, bus: Bus) -> None:
        self._bus = bus
        self.sender = CommandSender(bus, self.config.controller_id, self.config.command_timeout_s,
                                    self.config.command_retries)
        self._runner = asyncio.create_task(self._run(), name="controller-plan")
        if self.config.stats_interval_s:
            self._reporter = asyncio.create_task(self._report(bus), name="controller-stats")
        self._sub = await bus.subscribe_bodies(subjects.STATE, self._on_state)
        await bus.flush()

    async def stop(self) -> None:
        if self._sub is not None:
            await unsubscribe(self._sub)
            self._sub = None
        tasks = [t for t in [self._runner, self._reporter, *self._busy.values()] if t is not None]
        for task in tasks:
            task.cancel()  # an interrupted command is safe: a repeat with its seq is idempotent
        await asyncio.gather(*tasks, return_exceptions=True)
        self._runner = self._reporter = None
        self._busy.clear()

    def _on_state(self, subject: str, body: dict) -> None:
        # The subscription callback only records; planning runs in its own task so that a slow
        # policy never backs up the state stream, and only the newest unplanned state is planned.
        self.received += 1
        self._pending = body
        self._wake.set()

    def plan(self, state: ClusterState) -> list[PlannedCommand]:
        """Record `state` and run every policy on it (the simulator calls this directly)."""
        earlier = list(self.history)
        self.history.append(state)
        planned: list[PlannedCommand] = []
        for policy in self.policies:
            try:
                planned.extend(policy(state, earlier, self.config))
            except Exception:  # one broken policy must not silence the others
                log.exception("policy %s failed", getattr(policy, "__name__", policy))
        return planned

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            body, self._pending = self._pending, None
            if body is None:
                continue
            started = time.perf_counter()
            try:
                planned = await asyncio.to_thread(self._plan_body, body)
                if planned is None:
                    continue
                self.dispatch(planned)
                await self._advise(planned)
            except Exception:  # planning must survive one bad state, or the controller goes quiet
                log.exception("planning on the state of %s failed", body.get("time"))
            took = time.perf_counter() - started
            self.planned += 1
            self.plan_s += took
            self.plan_max_s = max(self.plan_max_s, took)

    def _plan_body(self, body: dict) -> list[PlannedCommand] | None:
        """The plan for an unvalidated state; None for one that does not validate."""
        try:
            state = validate(body, ClusterState)
        except BadMessage as exc:
            log.warning("dropped a cluster state: %s", exc)
            return None
        return self.plan(state)

    async def _advise(self, planned: list[PlannedCommand]) -> None:
        """The executors wanted after the latest state; a change of them goes out at once."""
        state = self.history[-1]
        desired = self.capacity.desired(state, len(planned))
        if desired == self.desired_executors:
            return
        first, self.desired_executors = self.desired_executors is None, desired
        if first and desired == sum(e.alive for e in state.executors):
            return  # as many as there are: the stats events say so
        data = {"desired_executors": desired, "live_executors": sum(e.alive for e in state.executors),
                "reason": self.capacity.reason(state, desired)}
        log.info("desired executors: %d (%s)", desired, data["reason"])
        try:
            await self._bus.publish(subjects.EVENTS, Event(kind="scale", source=self.config.controller_id,
                                                           time=time.time(), data=data))
        except BusError as exc:  # the next stats event carries it
            log.debug("scale event not published: %s", exc)

    async def _report(self, bus: Bus) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            data = {"states": self.received, "planned": self.planned, "plan_s": self.plan_s,
                    "plan_max_s": self.plan_max_s, "in_flight": len(self._busy),
                    "desired_executors": self.desired_executors}
            self.plan_max_s = 0.0
            try:
                await bus.publish(subjects.EVENTS, Event(kind="stats", source=self.config.controller_id,
                                                         time=time.time(), data=data))
            except BusError as exc:  # stats are best effort; the next ones count from the start anyway
                log.debug("stats not published: %s", exc)

    def dispatch(self, planned: list[PlannedCommand]) -> None:
        """Start sending what dispatch.sendable lets go of `planned`, in order per executor."""
        reported = {e.executor: e.telemetry.time for e in self.history[-1].executors} if self.history else {}
        chosen = sendable(planned, self._busy, reported, self._settled)
        if len(chosen) < len({p.executor for p in planned}):
            log.debug("dropped plans for %s (a command in flight, or a state older than its last answer)",
                      sorted({p.executor for p in planned} - set(chosen)))
        for executor, commands in chosen.items():
            task = asyncio.create_task(self._send_all(executor, commands), name=f"cmd-{executor}")
            self._busy[executor] = task
            task.add_done_callback(lambda _t, e=executor: self._command_done(e))

    def _command_done(self, executor: str) -> None:
        self._busy.pop(executor, None)
        self._settled[executor] = time.time()

    async def _send_all(self, executor: str, commands: list[PlannedCommand]) -> None:
        assert self.sender is not None
        for p in commands:
            result = await self.sender.send(executor, p.args, p.reason, p.inputs)
            self.results.append(result)
            if not result.ok:
                # Later commands of one plan build on the earlier ones; the next plan starts afresh.
                log.warning("command %s to %s failed: %s", p.args.kind, executor, result.error)
                return

    async def wait_idle(self) -> None:
        """Until no command is in flight (tests and orderly shutdown)."""
        while self._busy:
            await asyncio.gather(*list(self._busy.values()), return_exceptions=True)
