"""The leader's runner for an instance that spans several executors: the scheduler's step as a StepPlan.

It builds the packed batch exactly as the one-executor runner does (in block ids, the instance's KV
numbering), adds for every replicated layer range each replica's rows and sub-batch, and hands the step to
its InstanceMember, which sends it to the members and runs the leader's part.
"""

import torch

from services.executor.engine.runner import ModelRunner, batch_order
from services.executor.engine.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from services.executor.fabric import step as wire
from services.executor.fabric.member import InstanceMember
from services.executor.fabric.replicas import assign_replicas, rows_by_replica


class InstanceRunner(ModelRunner):
    def __init__(self, member: InstanceMember, block_size: int):
        # Batches stay on the CPU: the step goes to the members as one int64 tensor and each member moves
        # its part to its own device.
        super().__init__(member.model, block_size, "cpu")
        self.member = member
        self.replicated = [(i, s) for i, s in enumerate(member.segments)
                           if len(s.placement) > 1 and member.plan.tp == 1]
        self._sticky: list[dict[str, str]] = [{} for _ in self.replicated]  # request id -> replica, per range

    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        chunks = batch_order(out.chunks)
        batch, sampled = self.build(chunks)
        step = wire.StepPlan(wire.RUN, fresh=torch.tensor(out.fresh_pages, dtype=torch.int64),
                             copies=torch.tensor(out.copies, dtype=torch.int64).reshape(-1, 2), batch=batch,
                             parts=self._replica_parts(chunks))
        return self.member.lead(step), sampled

    def keepalive(self) -> None:
        self.member.keepalive()

    def _replica_parts(self, chunks: list[ScheduledChunk]) -> list[wire.ReplicaPart]:
        if not self.replicated:
            return []
        spans, row = [], 0
        for c in chunks:
            spans.append(range(row, row + c.length))
            row += c.length
        members = self.member.plan.members
        parts = []
        for (index, segment), sticky in zip(self.replicated, self._sticky):
            owners = assign_replicas([(c.seq.request_id, c.length) for c in chunks], segment.placement, sticky)
            sticky.update(owners)
            rows = rows_by_replica(spans, [owners[c.seq.request_id] for c in chunks], segment.placement)
            for replica, replica_rows in rows.items():
                if replica_rows:
                    mine = [c for c in chunks if owners[c.seq.request_id] == replica]
                    parts.append(wire.ReplicaPart(index, members.index(replica),
                                                  torch.tensor(replica_rows, dtype=torch.int64), self.build(mine)[0]))
        return parts

    def forget(self, request_id: str) -> None:
        """A request that ended: its KV is gone from every replica, so it needs no replica any more."""
        for sticky in self._sticky:
            sticky.pop(request_id, None)
