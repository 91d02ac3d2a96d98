"""The controller's machinery: run pure policies on each cluster state and deliver their commands.

Policies are pure functions so that the same code runs live and in the simulator; everything that
touches the bus is here. Commands go out through shared.commands.CommandSender (sequence numbers,
retries, the audit trail); which of the planned ones go out at all is dispatch.py's rule (one command
at a time per executor, none from a state older than its last answer), which the simulator runs too.
"""

import asyncio
import logging
import time
from collections import deque

from services.controller.dispatch import sendable
from services.controller.policies.interface import PlannedCommand, Policy
from shared import subjects
from shared.bus import Bus, Incoming, unsubscribe
from shared.commands import CommandSender
from shared.config import ControllerConfig
from shared.messages import ClusterState, CommandResult

log = logging.getLogger(__name__)


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
