"""The leader's runner for an instance that spans several executors: the scheduler's step as a StepPlan.

It builds the packed batch exactly as the one-executor runner does (in block ids, the instance's KV
numbering), adds for every replicated layer range each replica's rows and sub-batch, and hands the step to
its InstanceMember, which sends it to the members and runs the leader's part. Which replica holds a
request's KV for a range is remembered here (`sticky`, per segment), and reshaped with the plan.
"""

import torch

from services.executor.engine.runner import ModelRunner, batch_order
from services.executor.fabric import reshape
from services.executor.fabric import step as wire
from services.executor.fabric.member import InstanceMember, Seat
from shared.config import EngineConfig
from shared.core.memory.ledger import LedgerSnapshot
from shared.core.replicas import assign_replicas, rows_by_replica
from shared.core.scheduling.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from shared.messages import EvictArgs, MigrateArgs, QuantizeArgs, ReplicateArgs, RestoreArgs


class InstanceRunner(ModelRunner):
    def __init__(self, member: InstanceMember, block_size: int):
        # Batches stay on the CPU: the step goes to the members as one int64 tensor and each member moves
        # its part to its own device.
        super().__init__(member.model, block_size, "cpu")
        self.member = member
        self.sticky: dict[int, dict[str, str]] = {}  # replicated segment -> request id -> replica

    @property
    def kv_pages(self):
        return self.member.blocks

    def kv_capacity_blocks(self) -> int:
        return self.member.num_blocks

    def ledger(self) -> LedgerSnapshot:
        return self.member.snapshot()

    @property
    def replicated(self) -> list[int]:
        if self.member.plan.tp > 1:
            return []
        return [i for i, s in enumerate(self.member.segments) if len(s.placement) > 1]

    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        chunks = batch_order(out.chunks)
        batch, sampled = self.build(chunks)
        step = wire.StepPlan(wire.RUN, fresh=torch.tensor(out.fresh_pages, dtype=torch.int64),
                             copies=torch.tensor(out.copies, dtype=torch.int64).reshape(-1, 2), batch=batch,
                             parts=self._replica_parts(chunks))
        return self.member.lead(step), sampled

    def keepalive(self) -> None:
        self.member.keepalive()

    def reshape(self, op: ReplicateArgs | MigrateArgs | EvictArgs | QuantizeArgs | RestoreArgs,
                scheduler: Scheduler) -> dict:
        """Change the instance's plan between two steps as `op` asks; ReshapeRefused (nothing changed) or a
        report."""
        plan = reshape.next_plan(self.member.plan, op)
        report, self.sticky = reshape.lead(self.member, scheduler, self.sticky, plan)
        return report

    def _replica_parts(self, chunks: list[ScheduledChunk]) -> list[wire.ReplicaPart]:
        replicated = self.replicated
        if not replicated:
            return []
        spans, row = [], 0
        for c in chunks:
            spans.append(range(row, row + c.length))
            row += c.length
        members = self.member.plan.members
        parts = []
        for index in replicated:
            placement = self.member.segments[index].placement
            sticky = self.sticky.setdefault(index, {})
            owners = assign_replicas([(c.seq.request_id, c.length) for c in chunks], placement, sticky)
            sticky.update(owners)
            rows = rows_by_replica(spans, [owners[c.seq.request_id] for c in chunks], placement)
            for replica, replica_rows in rows.items():
                if replica_rows:
                    mine = [c for c in chunks if owners[c.seq.request_id] == replica]
                    parts.append(wire.ReplicaPart(index, members.index(replica),
                                                  torch.tensor(replica_rows, dtype=torch.int64), self.build(mine)[0]))
        return parts

    def forget(self, request_id: str) -> None:
        """A request that ended: its KV is gone from every replica, so it needs no replica any more."""
        for sticky in self.sticky.values():
            sticky.pop(request_id, None)


def seated(seat: Seat, config: EngineConfig):
    """The placement of an engine that leads the instance `seat` names (LLMEngine's `place`): its member of the
    instance, holding its part of the model, and the runner that steps the instance."""

    def place(checkpoint, dtype, max_model_len: int, progress: bool) -> InstanceRunner:
        return InstanceRunner(InstanceMember(seat, config, checkpoint, dtype, max_model_len, progress),
                              config.block_size)

    return place
