"""A member's pages in an instance (shared/core/kv_report.py): the instance's blocks as its KV, its own slots."""

from hypothesis import given, strategies as st

from shared.core.kv_report import instance_pages, kv_fields
from shared.core.memory.ledger import PageLedger


@st.composite
def member(draw):
    """A member's ledger (some slot pages given up as KV) and an instance's blocks, free and used."""
    slots = draw(st.integers(1, 6))
    slot_size = draw(st.integers(1, 8))
    kv = draw(st.integers(1, 40))
    ledger = PageLedger(slots * slot_size + kv)
    for layer in range(slots):
        ledger.assign_slot(layer, range(layer * slot_size, (layer + 1) * slot_size))
    given_up = draw(st.integers(0, slot_size - 1))
    if given_up:
        ledger.release_slot_pages(0, range(slot_size - given_up, slot_size))
    blocks = draw(st.integers(0, 60))
    free = draw(st.integers(0, blocks))
    return ledger.snapshot(), blocks, free, given_up


@given(member(), st.integers(0, 3))
def test_a_member_reports_the_instances_blocks_as_its_kv_and_its_own_slots(case, freed):
    own, blocks, free, _ = case
    freed = min(freed, own.pages_slot)
    snap = instance_pages(own, blocks, free, blocks - free, freed)
    fields = kv_fields(snap)
    assert fields["pages_free"] + fields["pages_used"] == blocks
    assert fields["pages_base"] + fields["pages_extension"] == blocks and fields["pages_extension"] >= 0
    assert fields["pages_total"] == own.pages_total and fields["pages_slot"] == own.pages_slot - freed
    # Blocks beyond what the arena had as base pages (those freed from slots counting as base) are extension.
    assert fields["pages_extension"] == max(0, blocks - (own.pages_base + freed))
