"""KV addressed by head unit (a merged TP member's layout, fabric/kv_heads.py) computes exactly what KV addressed
by page does: the same step of a real engine, once over its pages and once over a copy of its KV scattered
head by head over other pages' units, gives the same logits and writes the same K and V."""

import random

import torch

from services.executor.engine.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3


def test_a_step_over_scattered_head_units_equals_the_step_over_pages(tmp_path):
    engine = LLMEngine(EngineConfig(model=str(write_tiny_llama3(tmp_path / "tiny")), memory_budget=4 << 20,
                                    block_size=8, max_model_len=128, max_num_batched_tokens=24,
                                    prepare_variants=False), progress=False)
    params = SamplingOptions(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("short", "The quick brown fox jumps", params)
    engine.add_request("mid", "Once upon a time in a land far away there lived", params)
    for _ in range(6):
        engine.step()
    engine.add_request("long", " ".join(["numbers one two three four five six seven"] * 3), params)
    engine.step()  # "long" is prefilled in chunks: the step below attends to its context in cache as well

    out = engine.scheduler.schedule()
    assert any(c.length == 1 for c in out.chunks) and any(c.length > 1 and c.start > 0 for c in out.chunks)
    model, arena, bs = engine.model, engine.arena, engine.config.block_size
    kv, heads = arena.kv_cache, arena.kv_cache.shape[1]
    if out.fresh_pages:
        kv[torch.tensor(out.fresh_pages)] = 0
    batch, _ = engine.runner.build(out.chunks)
    live = sorted({p for c in out.chunks for p in c.seq.block_table})

    # Every head of every live page to its own unit of pages nobody uses, in a shuffled order.
    spare = [arena.ledger.allocate() for _ in range(len(live))]
    units = [page * heads + h for page in spare for h in range(heads)]
    random.Random(0).shuffle(units)
    unit_of = {page: units[i * heads:(i + 1) * heads] for i, page in enumerate(live)}
    flat = kv.view(-1, 1, *kv.shape[2:])
    for page, us in unit_of.items():
        for h, u in enumerate(us):
            flat[u] = kv[page, h]

    def by_unit(pages: torch.Tensor) -> torch.Tensor:
        return torch.tensor([[unit_of[int(p)][h] for h in range(heads)] for p in pages.flatten()],
                            dtype=pages.dtype).reshape(*pages.shape, heads)

    slots = batch.slot_mapping
    unit_batch = type(batch)(
        input_ids=batch.input_ids, positions=batch.positions,
        slot_mapping=by_unit(slots // bs) * bs + (slots % bs).unsqueeze(-1),
        decodes=[type(g)(g.row, g.length, by_unit(g.block_tables), g.context_lens) for g in batch.decodes],
        prefills=[type(p)(p.row, p.length, by_unit(p.block_table), p.context_start) for p in batch.prefills],
        logits_rows=batch.logits_rows)

    by_page = model.forward(batch)
    model.use_head_units(True)
    try:
        by_head = model.forward(unit_batch)
    finally:
        model.use_head_units(False)
    torch.testing.assert_close(by_head, by_page, rtol=0, atol=1e-6)
    for slot, per_head in zip(slots.tolist(), unit_batch.slot_mapping.tolist()):  # this step's K and V, bit for bit
        for h, unit_slot in enumerate(per_head):
            page, offset = divmod(slot, bs)
            assert torch.equal(flat[unit_slot // bs, 0, :, :, unit_slot % bs], kv[page, h, :, :, offset])
