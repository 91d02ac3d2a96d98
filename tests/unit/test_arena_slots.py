"""An arena that keeps slots only for the layers placed on it (a SplitQuant plan's member)."""

import pytest
import torch

from services.executor.engine.memory.arena import Arena, ArenaGeometry
from shared.core.errors import MemoryBudgetError

GEOMETRY = ArenaGeometry(num_layers=6, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
SLOT = 3 * GEOMETRY.page_bytes  # three pages a layer


def test_placed_slots_pack_from_the_first_page_and_leave_the_rest_kv():
    arena = Arena(GEOMETRY, 10 * GEOMETRY.page_bytes, SLOT, min_kv_tokens=4, held=[2, 5], slotted=[2, 5])
    assert arena.slot_range(2) == range(0, 3) and arena.slot_range(5) == range(3, 6)
    assert arena.ledger.snapshot().pages_kv == 4
    assert not arena.has_slot(0)
    with pytest.raises(ValueError, match="layer 0 has no slot"):
        arena.slot_range(0)


def test_a_budget_that_holds_the_placed_layers_but_not_the_whole_model_starts_only_with_placed_slots():
    budget = 8 * GEOMETRY.page_bytes  # 2 layers (6 pages) and a sequence, not 6 layers (18 pages)
    Arena(GEOMETRY, budget, SLOT, min_kv_tokens=8, held=[0, 1], slotted=[0, 1])
    with pytest.raises(MemoryBudgetError, match="raise the budget to at least"):
        Arena(GEOMETRY, budget, SLOT, min_kv_tokens=8, held=[0, 1])
    with pytest.raises(ValueError, match="held but have no slot"):
        Arena(GEOMETRY, budget, SLOT, min_kv_tokens=8, held=[0, 1], slotted=[0])
