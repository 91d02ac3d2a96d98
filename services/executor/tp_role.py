"""What instances formed at run time make of one executor, as its engine thread takes part in them between two
steps: AMOEBAs' merges and splits (fabric/transform.py), and CoCoServe's joins and parts of a TP1 instance for
replicas (fabric/enlist.py). It keeps the instance it follows, if any, how long the one it leads is held merged,
and its KV head units at each TP degree its world can form (what the controller weighs a merge by).

The leader keeps its requests' records and takes those of the executors that come in; theirs go with their
sequences to the leader. A follower of a merge follows until the SPLIT step, whose sequences come back to their
executors; a newcomer of a join until the PART step that leaves it out, and then serves alone again.
"""

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from opentelemetry.context import Context

from services.executor.fabric import enlist, transform
from services.executor.fabric import step as wire
from services.executor.fabric.kv_heads import KvPlanError
from services.executor.fabric.member import InstanceMember
from services.executor.fabric.merge import kv_units
from services.executor.fabric.world import World
from services.executor.records import RequestRecords
from shared.core.errors import ReshapeRefused
from shared.errors import InvalidCommandError
from shared.messages import InstancePlan, MigrateArgs, ReplicateArgs

if TYPE_CHECKING:  # annotations only
    from services.executor.engine.engine import LLMEngine

log = logging.getLogger(__name__)


class TpRole:
    def __init__(self, engine: "LLMEngine", records: RequestRecords, executor: str):
        self.engine, self.records, self.executor = engine, records, executor
        self.following: InstanceMember | None = None  # the merged instance it follows (its engine runs no requests)
        self.degrees: list[int] = []  # those its world can merge it into (set by the service)
        self.hold_until = 0.0  # time.monotonic() until which the merged instance it leads is held merged
        self._kv_units: tuple[tuple, dict[int, int]] = ((), {})  # for the layer bits and degrees they were for

    def merge(self, world: World, members: list[str], instance_id: str, hold_s: float = 0.0) -> dict:
        """Take this executor's part in merging `members` into `instance_id`, held merged `hold_s`
        (merge_hold_s)."""
        if self.engine.member is not None or self.following is not None:  # merged since the service checked
            raise InvalidCommandError(f"{self.executor} is in an instance already: only executors serving alone "
                                      f"merge", "kind")
        carry = [] if members[0] == self.executor else self._carry()
        member = transform.merge(self.engine, world, members, self.executor, instance_id, carry)
        if member.is_leader:
            self.hold_until = time.monotonic() + hold_s
            for carried in member.merged_state.carried[1:]:
                self.records.tracked.update((t.request_id, t) for t in carried)
        else:
            self.records.hand_over(list(self.records.tracked), member.leader)
            self.following = member
        return member.merged_state.report

    def split(self) -> dict:
        """The leader's part in splitting its merged instance (the followers' starts with the SPLIT step)."""
        result = transform.split(self.engine, self.engine.member,
                                 lambda ids: [replace(self.records.tracked[i], trace_context=Context()) for i in ids])
        return self._after_split(result)

    def join(self, world: World, leader: str, instance_id: str) -> dict:
        """Join the TP1 instance `leader` leads, for the replicas its replicate or migrate brings here."""
        if self.engine.member is not None or self.following is not None:
            raise InvalidCommandError(f"{self.executor} is in an instance already: only an executor serving alone "
                                      f"joins another's", "kind")
        member = enlist.join(self.engine, world, self.executor, leader, instance_id, self._carry())
        self.records.hand_over(list(self.records.tracked), leader)
        self.following = member
        return {"plan": member.plan.model_dump(), "blocks": member.num_blocks}

    def recruit(self, world: World, newcomer: str, op: ReplicateArgs | MigrateArgs, plan: InstancePlan) -> dict:
        """The leader's: `newcomer` joins the TP1 instance it leads (`plan`), and `op` brings it layers; one that
        holds none afterwards (a refused `op`) leaves again at once."""
        carried, joined = enlist.lead_join(self.engine, world, plan, newcomer)
        self.records.tracked.update((t.request_id, t) for t in carried)
        try:
            return {**self.reshape(op), **joined}
        except ReshapeRefused:
            enlist.lead_part(self.engine, self.engine.member)
            raise

    def reshape(self, op) -> dict:
        """The engine's reshape of the instance it leads; members left with no layer leave it (enlist.lead_part),
        and "plan" is what it serves afterwards."""
        report = self.engine.reshape(op)
        if self.engine.member is None:
            return report
        left, plan = enlist.lead_part(self.engine, self.engine.member)
        return {**report, "left": left, "plan": plan.model_dump()} if left else report

    def follow(self) -> None:
        """One turn of following the instance's leader (InstanceMember.follow_one), a SPLIT or a PART that leaves
        us out carried out."""
        member = self.following
        kind = member.follow_one()
        if kind == wire.PART and self.executor not in member.plan.members:
            enlist.leave(self.engine, member)
            self.following = None
            return
        if kind != wire.SPLIT:
            return
        try:
            result = transform.split(self.engine, member)
        except KvPlanError as exc:  # refused alike by every member: the instance stays merged, and we follow
            log.warning("executor %s: %s", self.executor, exc)
            return
        self.following = None
        self._after_split(result)

    def _carry(self) -> list:
        """Our requests' records, to go with our sequences to a leader: trace contexts do not pickle, so without
        theirs."""
        return [replace(t, trace_context=Context()) for t in self.records.tracked.values()]

    def _after_split(self, result: dict) -> dict:
        self.records.tracked.update((t.request_id, t) for t in result.pop("carried") or [])
        for request_id, executor in result.pop("moved").items():
            self.records.hand_over([request_id], executor)
        return result

    def units(self) -> dict[int, int]:
        """merge.kv_units, recomputed only when the layers' bits change. In a merged instance (whose bits do
        not change) the last ones stand: what it holds once it splits."""
        if not self.degrees or self.engine.member is not None or self.following is not None:
            return self._kv_units[1]
        key = (tuple(self.engine.model.layer_bits), tuple(self.degrees))
        if self._kv_units[0] != key:
            self._kv_units = (key, kv_units(self.engine.model, self.engine.arena, self.degrees))
        return self._kv_units[1]
