"""The step the leader sends its members survives the trip as one int64 tensor."""

import torch

from services.executor.engine.model.decoder import DecodeGroup, ForwardBatch, PrefillChunk
from services.executor.fabric import step as wire


def batch(rows: int) -> ForwardBatch:
    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(
        input_ids=torch.arange(rows), positions=torch.arange(rows) + 3, slot_mapping=torch.arange(rows) * 2,
        decodes=[DecodeGroup(0, 2, torch.tensor([[4, 5], [6, 4]], dtype=torch.int32),
                             torch.tensor([9, 7], dtype=torch.int32))],
        prefills=[PrefillChunk(2, rows - 2, torch.tensor([1, 2, 3], dtype=torch.int32), 5)],
        logits_rows=i64(1, rows - 1))


def same(a: ForwardBatch, b: ForwardBatch) -> bool:
    tensors = lambda x: [x.input_ids, x.positions, x.slot_mapping, x.logits_rows,  # noqa: E731
                         *(t for g in x.decodes for t in (g.block_tables, g.context_lens)),
                         *(p.block_table for p in x.prefills)]
    return (all(torch.equal(s, t) and s.dtype == t.dtype for s, t in zip(tensors(a), tensors(b)))
            and [(g.row, g.length) for g in a.decodes] == [(g.row, g.length) for g in b.decodes]
            and [(p.row, p.length, p.context_start) for p in a.prefills]
            == [(p.row, p.length, p.context_start) for p in b.prefills])


def test_a_step_with_replica_parts_round_trips():
    step = wire.StepPlan(wire.RUN, kv_free=10, kv_used=4, fresh=torch.tensor([7, 8]),
                         copies=torch.tensor([[1, 2], [3, 4]]), batch=batch(6),
                         parts=[wire.ReplicaPart(1, 0, torch.tensor([0, 2, 3]), batch(4)),
                                wire.ReplicaPart(1, 1, torch.tensor([1, 4, 5]), batch(5))])
    back = wire.decode(wire.encode(step))
    assert (back.kind, back.kv_free, back.kv_used) == (wire.RUN, 10, 4)
    assert torch.equal(back.fresh, step.fresh) and torch.equal(back.copies, step.copies)
    assert same(back.batch, step.batch)
    assert [(p.segment, p.member, p.rows.tolist()) for p in back.parts] == [(1, 0, [0, 2, 3]), (1, 1, [1, 4, 5])]
    assert all(same(p.batch, q.batch) for p, q in zip(back.parts, step.parts))


def test_a_keepalive_carries_only_the_counts():
    back = wire.decode(wire.encode(wire.StepPlan(wire.KEEPALIVE, kv_free=3, kv_used=1)))
    assert (back.kind, back.kv_free, back.kv_used, back.batch, back.parts) == (wire.KEEPALIVE, 3, 1, None, [])
