"""An executor that follows its instance's leader: no scheduler, no requests, its part of every step.

Its thread waits for the leader's steps and runs its layers or shards (InstanceMember). On the bus it is an
executor like any other (telemetry, so the monitor sees it live and in which instance; ping and drain),
but requests go to the leader: one that reaches it anyway is refused, and so is a morph, which an instance
takes as a whole. When the instance breaks, `broken` is set and the process falls back to serving alone.
"""

import asyncio
import logging
import threading
import time
import uuid

from services.executor.fabric.member import InstanceMember
from services.executor.fabric.world import FabricError
from services.executor.service import heartbeat
from shared import subjects
from shared.bus import Bus, Incoming, unsubscribe
from shared.config import ExecutorConfig, served_model_name
from shared.core.roles import Role, refusal
from shared.core.telemetry import NO_QUEUE, Served, executor_telemetry
from shared.errors import InvalidCommandError
from shared.messages import Admission, Command, CommandResult, ErrorInfo, ExecutorTelemetry, GenerateRequest, PingArgs

log = logging.getLogger(__name__)


class FollowerService:
    def __init__(self, config: ExecutorConfig, member: InstanceMember, max_model_len: int):
        self.config, self.member, self.max_model_len = config, member, max_model_len
        self.id = config.executor_id
        self.instance = uuid.uuid4().hex
        self.model_name = served_model_name(config.engine.model)
        self._served = Served(executor=self.id, instance=self.instance, model=self.model_name,
                              max_model_len=max_model_len, block_size=config.engine.block_size,
                              page_bytes=member.arena.page_bytes, layer_pages=member.arena.slot_pages, kv_heads=0,
                              max_waiting=config.engine.max_waiting)
        self.draining = False
        self.broken = asyncio.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=f"{self.id}-follower", daemon=True)
        self._bus: Bus | None = None
        self._subs: list = []
        self._telemetry_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, bus: Bus) -> None:
        self._bus, self._loop = bus, asyncio.get_running_loop()
        self._thread.start()
        self._subs = [await bus.subscribe(subjects.infer(self.id), GenerateRequest, self._on_infer),
                      await bus.subscribe(subjects.command(self.id), Command, self._on_command)]
        await bus.flush()
        self._telemetry_task = asyncio.create_task(
            heartbeat(bus, self.id, self.telemetry, self.config.telemetry_interval_s), name=f"{self.id}-telemetry")
        log.info("executor %s follows %s in instance %s", self.id, self.member.leader, self.member.plan.id)

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Stop following. A thread blocked waiting for the leader is left to its timeout (it only reads)."""
        self._stop.set()
        for sub in self._subs:
            await unsubscribe(sub)
        if self._telemetry_task is not None:
            self._telemetry_task.cancel()
            await asyncio.gather(self._telemetry_task, return_exceptions=True)

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                self.member.follow_one()
            except FabricError as exc:
                log.warning("executor %s: instance %s is broken: %s", self.id, self.member.plan.id, exc)
                self._loop.call_soon_threadsafe(self.broken.set)
                return

    async def _on_infer(self, incoming: Incoming) -> None:
        await incoming.reply(Admission(
            request_id=incoming.message.request_id, executor=self.id, accepted=False,
            error=ErrorInfo(type="unavailable", message=f"{self.id} follows {self.member.leader} in instance "
                                                        f"{self.member.plan.id}: requests go to the leader")))

    async def _on_command(self, incoming: Incoming) -> None:
        cmd: Command = incoming.message
        result = CommandResult(seq=cmd.seq, issuer=cmd.issuer, executor=self.id, kind=cmd.kind, ok=True)
        try:
            args = cmd.parsed_args()
            if (why := refusal(Role.MEMBER, cmd.kind, self.id, self.member.plan.id, self.member.leader)) is not None:
                raise InvalidCommandError(why, "kind")
            if isinstance(args, PingArgs):
                result.state = {"running": 0, "waiting": 0, "draining": self.draining, "leader": self.member.leader}
            else:  # drain, the one other command a member takes
                self.draining = True
                result.state = {"in_flight": 0}
        except InvalidCommandError as exc:
            result.ok, result.error = False, f"{cmd.kind} refused: {exc}"
        if incoming.can_reply:
            await incoming.reply(result)

    def telemetry(self) -> ExecutorTelemetry:
        member, plan = self.member, self.member.plan
        return executor_telemetry(self._served, time.time(), member.snapshot(), NO_QUEUE, layers=[], swap_order=[],
                                  member_of=plan, plan=plan, free_pages=member.arena.ledger.num_free,
                                  busy=member.busy.share(), draining=self.draining)
