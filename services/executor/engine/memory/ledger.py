"""The arena's ledger: for every page, whether it is a free KV page, a used KV page, or part of a layer slot.

It is the single source of truth for "how many KV blocks exist now". Pure Python (no torch) so that the
property tests can drive millions of operations, and so that the controller-side code can reason about
the same numbers without a model.

Free pages are handed out highest id first. Layer slots sit at the low end of the arena, so pages that
quantization later frees from slot tails ("extension" pages) are the last to be used and the cheapest
to take back.

An instance that spans several executors numbers its KV blocks with a ledger of its own, whose pages are
block ids: a block exists only while every member has a page for it, so the ids above what the members
can hold now are withdrawn (absent) and come back when they can again (services/executor/fabric/reshape.py).
"""

import heapq
from array import array
from collections.abc import Container, Iterable
from dataclasses import dataclass

from services.executor.engine.errors import LedgerError

KV = -1  # slot_of's value for a page that is not in a slot


@dataclass(frozen=True)
class LedgerSnapshot:
    pages_total: int
    pages_slot: int  # pages inside decoder-layer weight slots
    pages_kv_free: int
    pages_kv_used: int
    pages_base: int  # KV pages that were never part of a slot
    pages_extension: int  # KV pages released from slot tails

    @property
    def pages_kv(self) -> int:
        return self.pages_kv_free + self.pages_kv_used


class PageLedger:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise LedgerError(f"a ledger needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        # A simulated fleet copies a thousand arenas alike (copy): per-page state that serving seldom touches is
        # kept in arrays, which copy as one block of memory where a list increments a count on each of its items.
        # The refcounts stay a list, whose items Python reads and writes 2-4x faster, at every block.
        self._slot_of = array("i", [KV]) * num_pages  # the layer whose weight slot holds page p, or KV
        self._refcount = [0] * num_pages
        self._free_heap = list(range(1 - num_pages, 1))  # max-heap by page id (ascending: a heap as it is)
        self._free = set(range(num_pages))
        self._was_slot = bytearray(num_pages)  # has this page ever been part of a slot
        self._extension = 0  # pages once in a slot and now not: counted as they move, since telemetry asks often
        self._slot_pages = 0
        self._absent: set[int] = set()  # withdrawn: neither KV nor slot until reinstated

    def copy(self) -> "PageLedger":
        """An independent ledger in this one's state: a simulated fleet lays out a thousand arenas alike."""
        twin = object.__new__(PageLedger)
        twin.__dict__ = {name: value[:] if isinstance(value, (list, array, bytearray)) else
                         value.copy() if isinstance(value, (set, dict)) else value
                         for name, value in self.__dict__.items()}
        return twin

    # --- weight slots -------------------------------------------------------------------------
    def assign_slot(self, layer: int, pages: range) -> None:
        """Make `pages` (ascending) part of `layer`'s weight slot. Every page must be a free KV page."""
        if not self._free.issuperset(pages):
            for p in pages:
                self._check_page(p)
                if p not in self._free:
                    owner = f"layer {self._slot_of[p]}'s slot" if self._slot_of[p] != KV else "live KV"
                    raise LedgerError(f"page {p} cannot join layer {layer}'s slot: it is {owner}")
        # Whole slices, not page by page: a simulated fleet lays out a thousand arenas of ten thousand pages.
        span = slice(pages.start, pages.stop, pages.step)
        self._free.difference_update(pages)
        self._extension -= sum(self._was_slot[span])
        self._slot_of[span] = array("i", [layer]) * len(pages)
        self._was_slot[span] = b"\x01" * len(pages)
        self._slot_pages += len(pages)
        self._compact_heap()

    def release_slot_pages(self, layer: int, pages: range) -> None:
        """Turn pages of `layer`'s slot (its tail, after quantization) into free KV pages."""
        pages = pages if pages.step > 0 else pages[::-1]
        inside = not pages or (pages.start >= 0 and pages[-1] < self.num_pages)
        span = slice(pages.start, pages.stop, pages.step)  # whole slices, as assign_slot
        if not inside or self._slot_of[span].count(layer) != len(pages):
            for p in pages:
                self._check_page(p)
                if self._slot_of[p] != layer:
                    raise LedgerError(f"page {p} is not in layer {layer}'s slot (owner: {self.slot_of(p)})")
        self._slot_of[span] = array("i", [KV]) * len(pages)
        self._extension += len(pages)
        self._free.update(pages)
        for p in pages:
            heapq.heappush(self._free_heap, -p)
        self._slot_pages -= len(pages)

    def slot_of(self, page: int) -> int | None:
        """The layer whose weight slot holds `page`; None for a KV page."""
        layer = self._slot_of[page]
        return None if layer == KV else layer

    # --- absent pages -------------------------------------------------------------------------
    def withdraw(self, pages: range) -> None:
        """Take free KV pages out of use altogether (an instance's block ids no member can back now)."""
        if not self._free.issuperset(pages):
            for p in pages:
                self._check_page(p)
                if p not in self._free:
                    raise LedgerError(f"page {p} cannot be withdrawn: it is not a free KV page")
        self._free.difference_update(pages)
        self._absent.update(pages)
        # Their heap entries would be stale, and they are the highest ids, which the next allocate pops first:
        # an instance withdrawing half its ids paid a pop for each (26,000 per TP instance of a simulated fleet).
        self._rebuild_heap()

    def reinstate(self, pages: range) -> None:
        """Bring withdrawn pages back as free KV pages."""
        for p in pages:
            self._check_page(p)
            if p not in self._absent:
                raise LedgerError(f"page {p} cannot be reinstated: it was not withdrawn")
        for p in pages:
            self._absent.discard(p)
            self._free.add(p)
            heapq.heappush(self._free_heap, -p)

    @property
    def num_present(self) -> int:
        return self.num_pages - len(self._absent)

    # --- KV pages -----------------------------------------------------------------------------
    def allocate(self) -> int:
        """Take one free KV page (refcount 1). Raises LedgerError when none is free."""
        while self._free_heap:
            p = -heapq.heappop(self._free_heap)
            if p in self._free:  # the heap may hold stale ids of pages since taken into a slot
                self._free.discard(p)
                self._refcount[p] = 1
                return p
        raise LedgerError("no free KV page")

    def allocate_many(self, count: int) -> list[int]:
        """Take `count` free KV pages (refcount 1), the ones `count` calls of allocate would take, in their order;
        LedgerError, and none taken, when fewer are free. An instance's members back thousands of blocks at once."""
        if count > len(self._free):
            raise LedgerError(f"{count} free KV pages wanted, {len(self._free)} free")
        # allocate's order, since every free page has its heap entry; a sort beats nlargest past a few pages
        pages = heapq.nlargest(count, self._free) if count < 16 else sorted(self._free, reverse=True)[:count]
        if count == len(self._free):
            self._free.clear()
        else:
            self._free.difference_update(pages)
        if pages and pages[0] - pages[-1] == count - 1:  # one run of ids, as an arena's free pages start out
            self._refcount[pages[-1]:pages[0] + 1] = [1] * count
        else:
            for p in pages:
                self._refcount[p] = 1
        self._compact_heap()
        return pages

    def claim(self, page: int) -> None:
        """Take the free KV page `page` (refcount 1): a transformation that chose where its KV goes."""
        self._check_page(page)
        if page not in self._free:
            raise LedgerError(f"page {page} is not a free KV page")
        self._free.discard(page)  # its stale heap entry is skipped by allocate
        self._refcount[page] = 1

    def reset_kv(self, used: dict[int, int]) -> None:
        """Every KV page free but those in `used` (page -> refcount): the KV was rearranged wholesale (a TP
        split puts blocks back in pages the merged instance addressed by head unit)."""
        for page in used:
            self._check_page(page)
            if self._slot_of[page] != KV or page in self._absent:
                raise LedgerError(f"page {page} cannot hold KV: it is in a slot or withdrawn")
        for page in range(self.num_pages):
            if self._slot_of[page] == KV and page not in self._absent:
                self._refcount[page] = used.get(page, 0)
                if page in used:
                    self._free.discard(page)
                else:
                    self._free.add(page)
        self._rebuild_heap()

    def allocate_outside(self, avoid: Container[int]) -> int:
        """Take one free KV page that is not in `avoid` (where KV must move out of, not into)."""
        skipped = []
        try:
            while True:
                page = self.allocate()
                if page not in avoid:
                    return page
                skipped.append(page)
        finally:
            for page in skipped:
                self.decref(page)

    def free_outside(self, avoid: Container[int]) -> int:
        return sum(1 for p in self._free if p not in avoid)

    def relocate(self, page: int, avoid: Container[int]) -> int:
        """Hand every reference of the used KV page `page` to a free page outside `avoid`, and free `page`.
        Returns the new page; copying the data and repointing the holders is the caller's part."""
        self._check_used(page)
        new = self.allocate_outside(avoid)
        self._refcount[new], self._refcount[page] = self._refcount[page], 0
        self._free.add(page)
        heapq.heappush(self._free_heap, -page)
        return new

    def incref(self, page: int) -> None:
        self._refcount[page] = self._check_used(page) + 1

    def decref(self, page: int) -> None:
        """Drop one reference; the page becomes free when none is left."""
        self.decref_all((page,))

    def decref_all(self, pages: Iterable[int]) -> None:
        """decref each of `pages` in turn, as a sequence's whole block table is freed: one call, not one a page, for
        the tens of blocks a finished sequence holds. A page that is not allocated raises, saying which, when its
        turn comes."""
        refcount, free, heap, num_pages = self._refcount, self._free, self._free_heap, self.num_pages
        for page in pages:
            if not 0 <= page < num_pages or refcount[page] <= 0:
                self._check_used(page)  # raises, saying which
            left = refcount[page] - 1
            refcount[page] = left
            if not left:
                free.add(page)
                heapq.heappush(heap, -page)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_pages(self) -> list[int]:
        """The free KV pages, ascending."""
        return sorted(self._free)

    def snapshot(self) -> LedgerSnapshot:
        free = len(self._free)
        kv_pages = self.num_present - self._slot_pages
        extension = self._extension
        return LedgerSnapshot(
            pages_total=self.num_present,
            pages_slot=self._slot_pages,
            pages_kv_free=free,
            pages_kv_used=kv_pages - free,
            pages_base=kv_pages - extension,
            pages_extension=extension,
        )

    def check_consistency(self) -> None:
        """Raise LedgerError if the bookkeeping contradicts itself (used by tests and debug builds)."""
        for p in range(self.num_pages):
            in_slot = self._slot_of[p] != KV
            free = p in self._free
            rc = self._refcount[p]
            if p in self._absent:
                if in_slot or free or rc:
                    raise LedgerError(f"page {p} is withdrawn and also in a slot, free or referenced")
                continue
            if in_slot and (free or rc):
                raise LedgerError(f"page {p} is in a slot and also free or referenced (refcount {rc})")
            if not in_slot and free == (rc > 0):
                raise LedgerError(f"page {p}: free={free} but refcount={rc}")
        extension = sum(1 for p in range(self.num_pages) if self._was_slot[p] and self._slot_of[p] == KV)
        if extension != self._extension:
            raise LedgerError(f"{self._extension} extension pages counted, {extension} found")

    # --- helpers ------------------------------------------------------------------------------
    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise LedgerError(f"page {page} is outside the arena (0..{self.num_pages - 1})")

    def _check_used(self, page: int) -> int:
        """The refcount of `page`, which must be an allocated KV page."""
        self._check_page(page)
        count = self._refcount[page]
        if count <= 0:
            raise LedgerError(f"page {page} is not an allocated KV page")
        return count

    def _rebuild_heap(self) -> None:
        self._free_heap = [-p for p in self._free]
        heapq.heapify(self._free_heap)

    def _compact_heap(self) -> None:
        """Drop the heap's stale ids once they outnumber the free pages: allocate skips them anyway, and
        rebuilding after every slot would make laying out an arena quadratic in its pages."""
        if len(self._free_heap) > 2 * len(self._free) + 64:
            self._rebuild_heap()
