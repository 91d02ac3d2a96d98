"""Commands to one executor (shared/messages.Command): each answered once per (issuer, seq), refused where its role
does not take the kind (shared/core/roles.py) or its arguments cannot hold here, and carried out in the engine
thread between two steps (EngineWorker.call)."""

import asyncio
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from services.executor.fabric.kv_heads import KvPlanError
from shared.bus import BadMessage, Incoming
from shared.core.errors import EngineError
from shared.core.roles import Role, refusal, role_of
from shared.core.tp_scheduler import MAX_TP, world_allows
from shared.errors import InvalidCommandError
from shared.messages import (BatchArgs, Command, CommandResult, DrainArgs, EvictArgs, InstancePlan, JoinArgs,
                             MigrateArgs, PingArgs, QuantizeArgs, ReplicateArgs, RestoreArgs, TpMergeArgs, TpSplitArgs)

if TYPE_CHECKING:  # annotations only
    from services.executor.engine.engine import LLMEngine
    from services.executor.service import ExecutorService

log = logging.getLogger(__name__)

COMMAND_MEMORY = 1024  # (issuer, seq) results remembered for idempotent replies


def morph(engine: "LLMEngine", args: QuantizeArgs | RestoreArgs) -> dict:
    """Apply a quantize or restore command in the engine thread; returns what changed."""
    swapper = engine.swapper
    bits = args.bits if isinstance(args, QuantizeArgs) else engine.model.full_bits
    layers = swapper.next_layers(args.layers, bits) if isinstance(args.layers, int) else args.layers
    report = swapper.set_bits(layers, bits)
    return {"changed": report.layers, "bits": report.bits, "pages_released": report.pages_released,
            "pages_reclaimed": report.pages_reclaimed, "blocks_relocated": report.blocks_relocated,
            "seconds": report.seconds}


class Commands:
    """The command handler of an executor service that runs an engine (a follower's are its own: follower.py)."""

    def __init__(self, service: "ExecutorService"):
        self.service = service
        self._results: OrderedDict[tuple[str, int], CommandResult] = OrderedDict()

    def refuse(self, bad: BadMessage) -> CommandResult | None:
        body = bad.body if isinstance(bad.body, dict) else {}
        seq, issuer = body.get("seq"), body.get("issuer")
        if not isinstance(seq, int) or not isinstance(issuer, str):
            return None
        return CommandResult(seq=seq, issuer=issuer, executor=self.service.id, kind=str(body.get("kind")), ok=False,
                             error=f"refused: {bad.problem}")

    async def on_command(self, incoming: Incoming) -> None:
        cmd: Command = incoming.message
        key = (cmd.issuer, cmd.seq)
        result = self._results.get(key)
        # nats-py runs one subscription's callbacks one at a time, so a retry of a command still running
        # waits behind it and is answered from the record below: a swap never runs twice.
        if result is None:
            result = await self._run(cmd)
            self._results[key] = result
            while len(self._results) > COMMAND_MEMORY:
                self._results.popitem(last=False)
        if incoming.can_reply:
            await incoming.reply(result)

    async def _run(self, cmd: Command) -> CommandResult:
        service, worker, engine = self.service, self.service.worker, self.service.engine
        result = CommandResult(seq=cmd.seq, issuer=cmd.issuer, executor=service.id, kind=cmd.kind, ok=True)
        snap = worker.snapshot

        async def in_engine_thread(fn):
            return await asyncio.wrap_future(worker.call(fn))

        try:
            args = cmd.parsed_args()
            if (why := refusal(self._role(), cmd.kind, service.id, *self._instance_and_leader())) is not None:
                raise InvalidCommandError(why, "kind")
            if isinstance(args, PingArgs):
                result.state = {"running": snap.stats.running, "waiting": snap.stats.waiting,
                                "draining": service.draining}
            elif isinstance(args, DrainArgs):
                worker.draining = True
                result.state = {"in_flight": snap.in_flight}
            elif isinstance(args, TpMergeArgs):
                self._check_merge(args)
                report = await in_engine_thread(
                    lambda: worker.tp.merge(service.world, args.executors, args.instance, args.hold_s))
                result.state = {"plan": service.plan.model_dump(), **report}
            elif isinstance(args, TpSplitArgs):
                self._check_instance(args.instance)
                result.state = await in_engine_thread(worker.tp.split)
            elif isinstance(args, JoinArgs):
                self._check_join(args)
                result.state = await in_engine_thread(lambda: worker.tp.join(service.world, args.leader,
                                                                             args.instance))
            elif isinstance(args, (ReplicateArgs, MigrateArgs)) and service.plan is not None \
                    and args.to not in service.plan.members:  # onto an executor serving alone: it joins
                self._check_instance(args.instance)
                self._check_join(args)
                result.state = await in_engine_thread(
                    lambda: self._after(worker.tp.recruit(service.world, args.to, args, service.plan)))
            elif isinstance(args, (ReplicateArgs, MigrateArgs, EvictArgs, BatchArgs)):
                self._check_instance(args.instance)
                result.state = await in_engine_thread(lambda: self._reshape(args))
            elif engine.member is not None:  # quantize or restore, taken by the instance as a whole
                before = [layer.bits for layer in service.plan.layers]
                report = await in_engine_thread(lambda: self._reshape(args))
                result.state = {"changed": [i for i, (a, b) in enumerate(zip(report["layers"], before)) if a != b],
                                **report}
            else:
                report = await in_engine_thread(lambda: morph(engine, args))
                result.state = {"layers": list(engine.model.layer_bits), **report}
        except (InvalidCommandError, EngineError, KvPlanError) as exc:  # SwapError among them
            result.ok, result.error = False, f"{cmd.kind} refused: {exc}"
        log.info("executor %s: command %s #%d from %s: ok=%s", service.id, cmd.kind, cmd.seq, cmd.issuer, result.ok)
        return result

    def _role(self) -> Role:
        service, following = self.service, self.service.worker.tp.following
        return role_of(in_instance=following is not None or service.engine.member is not None,
                       leads=following is None, merged=service.plan is not None and service.plan.merged)

    def _instance_and_leader(self) -> tuple[str | None, str | None]:
        if (following := self.service.worker.tp.following) is not None:
            return following.plan.id, following.leader
        return self.service.instance_id, self.service.id

    def _check_merge(self, args: TpMergeArgs) -> None:
        """What every member can check alone before the merge's first collective, so that none of them waits
        for a member that will not come (the gateway checks the same against the cluster state first)."""
        me, plan, world = self.service.id, self.service.plan, self.service.world
        if self.service.engine.member is not None or len(plan.members) > 1:
            raise InvalidCommandError(f"{me} is already in instance {self.service.instance_id} of "
                                      f"{len(plan.members)}: only executors serving alone merge", "kind")
        if world is None:
            raise InvalidCommandError(f"{me} is in no world of executors: it has nobody to merge with", "kind")
        if me not in args.executors or len(set(args.executors)) != len(args.executors) \
                or len(args.executors) not in (2, MAX_TP):
            raise InvalidCommandError(f"executors must be 2 or {MAX_TP} distinct executors, {me} among them; "
                                      f"got {args.executors}", "args.executors")
        if not world_allows(world.names, args.executors):
            raise InvalidCommandError(f"executors {args.executors} cannot form one instance in this world "
                                      f"({world.names}): any two can, four only as consecutive ranks "
                                      f"from a multiple of four", "args.executors")

    def _check_join(self, args: JoinArgs | ReplicateArgs | MigrateArgs) -> None:
        """Before a join's first collective (the gateway checks the same against the cluster state first): both
        ends must be peers of one world."""
        me, world = self.service.id, self.service.world
        other = args.leader if isinstance(args, JoinArgs) else args.to
        if world is None or world.peer(other) is None:
            raise InvalidCommandError(f"{other} is not a peer of {me}'s world of executors: it cannot join an "
                                      f"instance with {me}", "args.leader" if isinstance(args, JoinArgs) else "args.to")
        if self.service.draining:
            raise InvalidCommandError(f"{me} is draining", "kind")

    def _check_instance(self, instance: str) -> None:
        if instance != self.service.instance_id:
            raise InvalidCommandError(f"{self.service.id} leads instance {self.service.instance_id!r}, not "
                                      f"{instance!r}", "args.instance")

    def _reshape(self, args: ReplicateArgs | MigrateArgs | EvictArgs | QuantizeArgs | RestoreArgs | BatchArgs
                 ) -> dict:
        """In the engine thread, between two steps."""
        engine = self.service.engine
        if isinstance(args, BatchArgs):
            before = engine.scheduler.cap_batch(args.max_num_seqs)
            return {"max_num_seqs": args.max_num_seqs, "max_num_seqs_before": before}
        return self._after(self.service.worker.tp.reshape(args))

    def _after(self, report: dict) -> dict:
        """A leader that serves alone again after its reshape (its last newcomer left) serves the plan it reports."""
        if self.service.engine.member is None and "plan" in report:
            self.service.alone_plan = InstancePlan.model_validate(report["plan"])
        return report
