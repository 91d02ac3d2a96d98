"""What the leader sends its members each step, as one int64 tensor (the process group moves tensors).

A step names KV by block id, the instance's own numbering: each member maps ids to pages of its arena.
It carries the pages to zero and copy first, the packed batch (ForwardBatch), and for every replicated
layer range the sub-batch and batch rows of each replica. KEEPALIVE steps say "still here" while the
leader is idle, so that a member's wait can time out only when the leader is really gone. A RESHAPE step
carries the instance's next plan (reshape.py says what follows it). A LEAVE step ends the instance: a leader
done with it says so, and its members stop following at once instead of when their wait times out. A SPLIT
step starts a TP split (transform.py): every member then serves alone again. A JOIN step carries the plan that
names a newcomer, a PART step the plan without the members that leave (enlist.py).
"""

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from services.executor.engine.model.decoder import DecodeGroup, ForwardBatch, PrefillChunk
from shared.messages import InstancePlan

RUN, KEEPALIVE, RESHAPE, LEAVE, SPLIT, JOIN, PART = 1, 2, 3, 4, 5, 6, 7


@dataclass
class ReplicaPart:
    segment: int  # index into the instance's segments
    member: int  # index into the instance's members
    rows: torch.Tensor  # int64 rows of the step's batch this replica computes
    batch: ForwardBatch  # those rows as a batch of their own


@dataclass
class StepPlan:
    kind: int
    kv_free: int = 0  # the instance's block counts after scheduling, for the members' telemetry
    kv_used: int = 0
    fresh: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    copies: torch.Tensor = field(default_factory=lambda: torch.empty(0, 2, dtype=torch.int64))
    batch: ForwardBatch | None = None
    parts: list[ReplicaPart] = field(default_factory=list)
    payload: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # a plan (plan_payload)


def encode(step: StepPlan) -> torch.Tensor:
    tensors = [torch.tensor([step.kind, step.kv_free, step.kv_used, len(step.parts)]), step.fresh,
               step.copies.reshape(-1, 2), step.payload]
    if step.batch is not None:
        tensors += _batch_tensors(step.batch)
        for part in step.parts:
            tensors += [torch.tensor([part.segment, part.member]), part.rows, *_batch_tensors(part.batch)]
    return pack(tensors)


def decode(flat: torch.Tensor) -> StepPlan:
    it = iter(unpack(flat))
    kind, kv_free, kv_used, num_parts = next(it).tolist()
    step = StepPlan(kind, kv_free, kv_used, next(it), next(it), payload=next(it))
    if kind == RUN:
        step.batch = _read_batch(it)
        for _ in range(num_parts):
            segment, member = next(it).tolist()
            step.parts.append(ReplicaPart(segment, member, next(it), _read_batch(it)))
    return step


def plan_payload(plan: InstancePlan) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(plan.model_dump_json().encode(), dtype=np.uint8).astype(np.int64))


def payload_plan(payload: torch.Tensor) -> InstancePlan:
    return InstancePlan.model_validate_json(payload.numpy().astype(np.uint8).tobytes())


def _batch_tensors(b: ForwardBatch) -> list[torch.Tensor]:
    out = [b.input_ids, b.positions, b.slot_mapping, b.logits_rows, torch.tensor([len(b.decodes), len(b.prefills)])]
    for g in b.decodes:
        out += [torch.tensor([g.row, g.length]), g.block_tables, g.context_lens]
    for p in b.prefills:
        out += [torch.tensor([p.row, p.length, p.context_start]), p.block_table]
    return out


def _read_batch(it: Iterator[torch.Tensor]) -> ForwardBatch:
    input_ids, positions, slot_mapping, logits_rows = next(it), next(it), next(it), next(it)
    num_decodes, num_prefills = next(it).tolist()
    decodes, prefills = [], []
    for _ in range(num_decodes):
        row, length = next(it).tolist()
        decodes.append(DecodeGroup(row, length, next(it).to(torch.int32), next(it).to(torch.int32)))
    for _ in range(num_prefills):
        row, length, context_start = next(it).tolist()
        prefills.append(PrefillChunk(row, length, next(it).to(torch.int32), context_start))
    return ForwardBatch(input_ids, positions, slot_mapping, decodes, prefills, logits_rows)


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[count, (ndim, d0, d1) per tensor, data...]: tensors of one or two dimensions, as int64."""
    header = [len(tensors)]
    for t in tensors:
        header += [t.dim(), t.shape[0], t.shape[1] if t.dim() == 2 else 0]
    return torch.cat([torch.tensor(header, dtype=torch.int64),
                      *(t.reshape(-1).to(device="cpu", dtype=torch.int64) for t in tensors)])


def unpack(flat: torch.Tensor) -> list[torch.Tensor]:
    count = int(flat[0])
    dims = flat[1:1 + 3 * count].view(count, 3).tolist()
    out, offset = [], 1 + 3 * count
    for ndim, d0, d1 in dims:
        size = d0 * d1 if ndim == 2 else d0
        t = flat[offset:offset + size]
        out.append(t.view(d0, d1) if ndim == 2 else t)
        offset += size
    return out
