"""slots.resize_slots, the page rule of every swap (the swapper alone, the fabric's member, the simulator): live KV
moves out of the pages slots take back first, then each slot takes its pages back and releases its tail, and a
refusal (too few free pages elsewhere) changes nothing."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.core.errors import OutOfPagesError
from shared.core.memory.ledger import PageLedger
from shared.core.slots import resize_slots

LAYERS, SLOT = 4, 6  # pages of a full-precision slot
PAGES_AT = {16: SLOT, 8: 3, 4: 2}
TOTAL = LAYERS * SLOT + 4  # four base KV pages


def slot(layer: int) -> range:
    return range(layer * SLOT, (layer + 1) * SLOT)


def evacuate_from(ledger: PageLedger, live: set[int]):
    """The scheduler's evacuate, for sequences holding `live` pages: each live page in `pages` moves to a free
    page outside them, or OutOfPagesError before anything moves."""
    def evacuate(pages: set[int]) -> dict[int, int]:
        moving = sorted(live & pages)
        if len(moving) > ledger.free_outside(pages):
            raise OutOfPagesError(len(moving), ledger.free_outside(pages), "evacuating")
        moved = {p: ledger.relocate(p, pages) for p in moving}
        live.difference_update(moved)
        live.update(moved.values())
        return moved
    return evacuate


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, LAYERS - 1), min_size=1, max_size=LAYERS, unique=True),
                          st.sampled_from(sorted(PAGES_AT)), st.integers(0, 12)), max_size=8))
def test_any_run_of_swaps_keeps_every_live_page_and_each_slot_at_its_bits(swaps):
    ledger = PageLedger(TOTAL)
    for layer in range(LAYERS):
        ledger.assign_slot(layer, slot(layer))
    bits, live = [16] * LAYERS, set()
    for layers, to, allocate in swaps:
        live.update(ledger.allocate_many(min(allocate, ledger.num_free)))
        before = (ledger.snapshot(), list(bits), set(live))
        written = []
        changes = {i: (slot(i), PAGES_AT[bits[i]], PAGES_AT[to]) for i in layers}
        try:
            done = resize_slots(ledger, changes, evacuate_from(ledger, live), written.append)
        except OutOfPagesError:
            assert (ledger.snapshot(), bits, live) == before  # refused: nothing changed
            continue
        assert written == layers
        for i in layers:
            bits[i] = to
        ledger.check_consistency()
        snap = ledger.snapshot()
        assert snap.pages_slot == sum(PAGES_AT[b] for b in bits)
        assert len(live) == len(before[2]) and all(ledger.refcount(p) == 1 for p in live)
        assert not any(ledger.slot_of(p) is not None for p in live)  # no page is KV and slot at once
        assert done.released - done.reclaimed == before[0].pages_slot - snap.pages_slot


def test_a_restore_with_no_room_for_the_live_kv_is_refused_and_changes_nothing():
    ledger = PageLedger(LAYERS * SLOT)  # no base KV pages: only the slot tails
    for layer in range(LAYERS):
        ledger.assign_slot(layer, slot(layer))
    quantize = {i: (slot(i), SLOT, PAGES_AT[4]) for i in range(LAYERS)}
    resize_slots(ledger, quantize, evacuate_from(ledger, set()), lambda i: None)
    live = set(ledger.allocate_many(ledger.num_free))  # every KV page in use
    before = ledger.snapshot()
    with pytest.raises(OutOfPagesError):
        resize_slots(ledger, {0: (slot(0), PAGES_AT[4], SLOT)}, evacuate_from(ledger, live), lambda i: None)
    assert ledger.snapshot() == before
