"""Which layers a swap takes and which slot pages it moves: a swap without its weights, shared by the swapper
(swapper.py) and the simulator, which swaps no weights but must free and take back the same pages in the same
order."""

from collections.abc import Callable
from dataclasses import dataclass

from shared.core.memory.ledger import PageLedger


class SwapRefused(ValueError):
    """A count of layers the swap order cannot give."""


def next_layers(order: list[int], current: list[int], full_bits: int, count: int, bits: int) -> list[int]:
    """The `count` layers that going to `bits` takes next: quantizing walks the swap `order` over layers wider
    than `bits`; restoring (`full_bits`) walks it backwards over quantized layers, so the most recently
    quantized come back first."""
    if bits == full_bits:
        candidates = [i for i in reversed(order) if current[i] < full_bits]
    else:
        candidates = [i for i in order if current[i] > bits]
    if not 1 <= count <= len(candidates):
        raise SwapRefused(f"layers must be between 1 and {len(candidates)} here, got {count}")
    return candidates[:count]


def slot_moves(slot: range, held: int, need: int) -> tuple[range, range]:
    """(pages to take back into the slot, pages to release from it) when a layer whose slot starts at
    `slot.start` goes from filling `held` pages to `need`: a slot fills from its start, so the tail moves."""
    return range(slot.start + held, slot.start + need), range(slot.start + need, slot.start + held)


@dataclass(frozen=True)
class SlotResize:
    """What resizing layers' slots did to the pages."""
    moved: dict[int, int]  # live KV pages moved out of the pages the slots took back: old page -> new
    released: int  # slot pages that became KV pages
    reclaimed: int  # KV pages taken back into slots


def resize_slots(ledger: PageLedger, changes: dict[int, tuple[range, int, int]],
                 evacuate: Callable[[set[int]], dict[int, int]], write: Callable[[int], None]) -> SlotResize:
    """Bring each layer of `changes` (layer -> (its slot, pages it fills now, pages it fills after)) to its new
    size: first the live KV moves out of every page the slots take back (`evacuate`, which refuses with
    OutOfPagesError, changing nothing), then layer by layer the slot takes its pages back, `write` fills it and
    its tail is released, so that no page is KV and slot at once."""
    moves = {i: slot_moves(slot, held, need) for i, (slot, held, need) in changes.items()}
    taking = {p for reclaim, _ in moves.values() for p in reclaim}
    moved = evacuate(taking) if taking else {}
    released = 0
    for i, (reclaim, release) in moves.items():
        if reclaim:
            ledger.assign_slot(i, reclaim)
        write(i)
        if release:
            ledger.release_slot_pages(i, release)
            released += len(release)
    return SlotResize(moved, released, len(taking))
