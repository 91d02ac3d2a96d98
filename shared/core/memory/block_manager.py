"""Block tables: which pages hold a sequence's KV, shared by reference count, copied on write.

The ledger owns the pages; this class only decides which of them each sequence uses.
"""

from collections.abc import Iterable

from shared.core.errors import OutOfPagesError
from shared.core.memory.ledger import PageLedger
from shared.core.scheduling.sequence import Sequence


class BlockManager:
    def __init__(self, ledger: PageLedger, block_size: int):
        self.ledger = ledger
        self.block_size = block_size

    def pages_needed(self, seq: Sequence, upto: int) -> int:
        """Free pages `seq` needs so that positions [num_computed, upto) can be written."""
        blocks = -(-upto // self.block_size)
        new = max(0, blocks - len(seq.block_table))
        return new + (1 if self._shared_write_block(seq) is not None else 0)

    def tokens_that_fit(self, seq: Sequence) -> int:
        """How many more tokens of `seq` the free pages can hold right now."""
        free = self.ledger.num_free - (1 if self._shared_write_block(seq) is not None else 0)
        capacity = (len(seq.block_table) + max(free, 0)) * self.block_size
        return max(0, capacity - seq.num_computed)

    def reserve(self, seq: Sequence, upto: int) -> tuple[list[tuple[int, int]], list[int]]:
        """Give `seq` pages for positions up to `upto`.

        Returns the (src, dst) page copies to run first, and the fresh pages, which must be zeroed before
        use: attention reads past a context inside the last block and relies on finding finite values.
        """
        copies, fresh = [], []
        shared = self._shared_write_block(seq)
        if shared is not None:
            src = seq.block_table[shared]
            dst = self.ledger.allocate()
            self.ledger.decref(src)
            seq.block_table[shared] = dst
            copies.append((src, dst))
        if (count := -(-upto // self.block_size) - len(seq.block_table)) > 0:
            fresh = self.ledger.allocate_many(count) if count > 1 else [self.ledger.allocate()]
            seq.block_table += fresh
        return copies, fresh

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        for page in child.block_table:
            self.ledger.incref(page)

    def evacuate(self, pages: set[int], holders: Iterable[Sequence]) -> dict[int, int]:
        """Move the live KV blocks in `pages` to free pages elsewhere and repoint the block tables of
        `holders` (every sequence that holds pages). Returns {old page: new page}: the caller copies
        the data. Raises OutOfPagesError, changing nothing, when too few pages are free elsewhere."""
        live = [p for p in sorted(pages) if self.ledger.refcount(p) > 0]
        room = self.ledger.free_outside(pages)
        if len(live) > room:
            raise OutOfPagesError(len(live), room, f"moving {len(live)} live KV blocks")
        moved = {page: self.ledger.relocate(page, pages) for page in live}
        if moved:
            for seq in holders:
                seq.block_table = [moved.get(p, p) for p in seq.block_table]
        return moved

    def free(self, seq: Sequence) -> None:
        self.ledger.decref_all(seq.block_table[::-1])
        seq.block_table = []

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index of the partly filled block the next token goes into, if other sequences share it."""
        idx = seq.num_computed // self.block_size
        if seq.num_computed % self.block_size == 0 or idx >= len(seq.block_table):
            return None
        return idx if self.ledger.refcount(seq.block_table[idx]) > 1 else None
