"""Which layers a swap takes and which slot pages it moves: the arithmetic of a swap without its weights, shared
by the swapper (swapper.py) and the simulator, which swaps no weights but must free and take back the same
pages in the same order."""


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
