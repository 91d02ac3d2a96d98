"""What an executor's telemetry says of its pages (`KvPages`), counted once for an executor alone, an instance's
members and the simulator's executors.

Alone, the pages are its arena's. In an instance of several executors the KV is the instance's blocks, which every
member counts alike (each block has a page on every member): a member reports its own arena's slots and the
instance's blocks, as many of them base pages as its own arena had before slots gave pages up.
"""

from dataclasses import replace

from shared.core.memory.ledger import LedgerSnapshot


def kv_fields(snap: LedgerSnapshot) -> dict[str, int]:
    """Telemetry's KvPages as fields (the bench's poll reads them as a dict, a report makes them one)."""
    return dict(pages_total=snap.pages_total, pages_slot=snap.pages_slot, pages_free=snap.pages_kv_free,
                pages_used=snap.pages_kv_used, pages_base=snap.pages_base, pages_extension=snap.pages_extension)


def instance_pages(own: LedgerSnapshot, blocks: int, free: int, used: int, slot_pages_freed: int = 0
                   ) -> LedgerSnapshot:
    """A member's pages in an instance of `blocks` KV blocks, `free` and `used` of them: its arena's slots (less
    `slot_pages_freed`, where a simulated TP merge's FFN cut freed slot pages its ledger does not count), and the
    instance's blocks as its KV."""
    if slot_pages_freed:
        own = replace(own, pages_slot=own.pages_slot - slot_pages_freed, pages_base=own.pages_base + slot_pages_freed)
    extension = max(0, blocks - own.pages_base)
    return LedgerSnapshot(pages_total=own.pages_total, pages_slot=own.pages_slot, pages_kv_free=free,
                          pages_kv_used=used, pages_base=blocks - extension, pages_extension=extension)
