"""The controller's machinery: run pure policies on each cluster state and deliver their commands.

Policies are pure functions so that the same code runs live and in the simulator; everything that
touches the bus is here. Delivery rules, and why:
- each command carries a sequence number that increases per controller and starts from the clock,
  so a restarted controller never reuses one an executor has on record;
- a command that gets no answer is retried with the SAME seq: if the first attempt did arrive and
  only its answer was lost, the executor answers the repeat from its record instead of, say,
  quantizing a second layer;
- bus failures never raise out of `send`: the caller gets CommandResult(ok=False) and decides;
- every command, answered or not, becomes an audit Event on the events subject;
- an executor gets one command at a time: while one is in flight, plans for that executor are
  dropped, because they were made from a state the running command is about to change.
"""

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared import subjects
from shared.bus import Bus, BusError, Incoming, unsubscribe
from shared.config import ControllerConfig
from shared.messages import ClusterState, Command, CommandResult, Event
from shared.telemetry import tracer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedCommand:
    executor: str
    kind: str
    args: dict[str, Any] = field(default_factory=dict)


# (current state, earlier states oldest first, config) -> commands to send.
Policy = Callable[[ClusterState, list[ClusterState], ControllerConfig], list[PlannedCommand]]


class CommandSender:
    def __init__(self, bus: Bus, controller_id: str, timeout_s: float, retries: int):
        self.bus = bus
        self.controller_id = controller_id
        self.timeout_s = timeout_s
        self.retries = max(0, retries)
        # Microseconds since the epoch: a restarted controller starts above every seq it used before
        # unless it sent more than a million commands a second, which it never does.
        self._seq = time.time_ns() // 1000

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def send(self, executor: str, kind: str, args: dict | None = None) -> CommandResult:
        # Built outside the retry loop: an invalid kind is a programming error and raises here.
        command = Command(seq=self.next_seq(), issuer=self.controller_id, kind=kind, args=args or {})
        subject = subjects.command(executor)
        started = time.monotonic()
        errors: list[str] = []
        result: CommandResult | None = None
        attempts = 0
        with tracer(__name__).start_as_current_span(f"command {kind}") as span:
            span.set_attributes({"morphling.executor": executor, "morphling.command.kind": kind,
                                 "morphling.command.seq": command.seq})
            for attempt in range(self.retries + 1):
                attempts = attempt + 1
                if attempt:
                    # "No responders" comes back at once; give a restarting executor a moment.
                    await asyncio.sleep(min(0.05 * 2 ** attempt, self.timeout_s))
                try:
                    reply = await self.bus.request(subject, command, CommandResult, timeout=self.timeout_s)
                except BusError as exc:
                    errors.append(exc.problem)
                    log.info("command %s seq %d to %s: attempt %d failed: %s", kind, command.seq,
                             executor, attempts, exc.problem)
                    continue
                except Exception as exc:  # e.g. connection closed: still a bus failure, not a crash
                    errors.append(f"{type(exc).__name__}: {exc}")
                    log.warning("command %s seq %d to %s: attempt %d failed: %r", kind, command.seq,
                                executor, attempts, exc)
                    continue
                if reply.seq != command.seq or reply.issuer != command.issuer:
                    errors.append(f"answer for {reply.issuer} seq {reply.seq}, not ours")
                    continue
                result = reply
                break
            if result is None:
                result = CommandResult(seq=command.seq, issuer=self.controller_id, executor=executor,
                                       kind=command.kind, ok=False,
                                       error=f"no answer after {attempts} attempt(s): {'; '.join(errors)}")
            span.set_attributes({"morphling.command.ok": result.ok, "morphling.command.attempts": attempts})
        latency = time.monotonic() - started
        await self._audit(executor, command, result, attempts, latency)
        return result

    async def _audit(self, executor: str, command: Command, result: CommandResult, attempts: int,
                     latency: float) -> None:
        event = Event(kind="command", source=self.controller_id, time=time.time(), data={
            "executor": executor, "kind": command.kind, "seq": command.seq, "args": command.args,
            "ok": result.ok, "error": result.error, "attempts": attempts, "latency_s": latency})
        try:
            await self.bus.publish(subjects.EVENTS, event)
        except Exception as exc:  # the audit trail is best effort; the command's outcome stands
            log.warning("could not publish the audit event of seq %d: %r", command.seq, exc)


class Controller:
    def __init__(self, config: ControllerConfig, policies: list[Policy], history_len: int = 600):
        self.config = config
        self.policies = list(policies)
        # 600 states at the monitor's 5 Hz: two minutes, enough for every hysteresis window.
        self.history: deque[ClusterState] = deque(maxlen=history_len)
        self.results: deque[CommandResult] = deque(maxlen=1000)
        self.sender: CommandSender | None = None
        self._sub = None
        self._busy: dict[str, asyncio.Task] = {}
        self._settled: dict[str, float] = {}  # when each executor's last command finished
        self._pending: ClusterState | None = None
        self._wake = asyncio.Event()
        self._runner: asyncio.Task | None = None

    @property
    def latest(self) -> ClusterState | None:
        return self.history[-1] if self.history else None

    async def start(self, bus: Bus) -> None:
        self.sender = CommandSender(bus, self.config.controller_id, self.config.command_timeout_s,
                                    self.config.command_retries)
        self._runner = asyncio.create_task(self._run(), name="controller-plan")
        self._sub = await bus.subscribe(subjects.STATE, ClusterState, self._on_state)
        await bus.flush()

    async def stop(self) -> None:
        if self._sub is not None:
            await unsubscribe(self._sub)
            self._sub = None
        tasks = [t for t in [self._runner, *self._busy.values()] if t is not None]
        for task in tasks:
            task.cancel()  # an interrupted command is safe: a repeat with its seq is idempotent
        await asyncio.gather(*tasks, return_exceptions=True)
        self._runner = None
        self._busy.clear()

    async def _on_state(self, incoming: Incoming) -> None:
        # The subscription callback only records; planning runs in its own task so that a slow
        # policy never backs up the state stream, and only the newest unplanned state is planned.
        self._pending = incoming.message
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
            state, self._pending = self._pending, None
            if state is None:
                continue
            try:
                self.dispatch(self.plan(state))
            except Exception:  # planning must survive one bad state, or the controller goes quiet
                log.exception("planning on the state of %.3f failed", state.time)

    def dispatch(self, planned: list[PlannedCommand]) -> None:
        """Start sending `planned`, in order per executor; executors already busy are skipped."""
        by_executor: dict[str, list[PlannedCommand]] = {}
        for p in planned:
            by_executor.setdefault(p.executor, []).append(p)
        # A state whose telemetry predates the end of the executor's last command does not show its effect
        # yet (and a swap changes layers one by one): acting on it would repeat what was just done.
        reported = {e.executor: e.telemetry.time for e in self.history[-1].executors} if self.history else {}
        for executor, commands in by_executor.items():
            if executor in self._busy:
                log.debug("executor %s busy: dropped %d planned command(s)", executor, len(commands))
                continue
            if reported.get(executor, float("inf")) <= self._settled.get(executor, float("-inf")):
                log.debug("executor %s: state predates its last command; dropped %d", executor, len(commands))
                continue
            task = asyncio.create_task(self._send_all(executor, commands), name=f"cmd-{executor}")
            self._busy[executor] = task
            task.add_done_callback(lambda _t, e=executor: self._command_done(e))

    def _command_done(self, executor: str) -> None:
        self._busy.pop(executor, None)
        self._settled[executor] = time.time()

    async def _send_all(self, executor: str, commands: list[PlannedCommand]) -> None:
        assert self.sender is not None
        for p in commands:
            try:
                result = await self.sender.send(executor, p.kind, p.args)
            except Exception:  # e.g. a policy planned an unknown kind
                log.exception("command %s to %s could not be sent", p.kind, executor)
                return
            self.results.append(result)
            if not result.ok:
                # Later commands of one plan build on the earlier ones; the next plan starts afresh.
                log.warning("command %s to %s failed: %s", p.kind, executor, result.error)
                return

    async def wait_idle(self) -> None:
        """Until no command is in flight (tests and orderly shutdown)."""
        while self._busy:
            await asyncio.gather(*list(self._busy.values()), return_exceptions=True)
