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

from array import array
from collections.abc import Container, Iterable
from dataclasses import dataclass
from itertools import compress

from shared.core.errors import LedgerError

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


def _ascending(pages: range) -> range:
    """`pages` in ascending order, whose start and stop slice the per-page arrays as one span."""
    return pages if pages.step > 0 else pages[::-1]


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
        # Which pages are free KV pages, a byte each: the highest is found by a backward scan of contiguous bytes
        # (bytearray.rfind), where a heap of page ids and a set of them cost a cache miss a level across the
        # thousand arenas of a simulated fleet.
        self._is_free = bytearray(b"\x01") * num_pages
        self._num_free = num_pages
        self._top = num_pages  # no page at or above it is free
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
        if not self._all_free(pages):
            for p in pages:
                self._check_page(p)
                if not self._is_free[p]:
                    owner = f"layer {self._slot_of[p]}'s slot" if self._slot_of[p] != KV else "live KV"
                    raise LedgerError(f"page {p} cannot join layer {layer}'s slot: it is {owner}")
        # Whole slices, not page by page: a simulated fleet lays out a thousand arenas of ten thousand pages.
        span = slice(pages.start, pages.stop, pages.step)
        self._take_free(pages)
        self._extension -= sum(self._was_slot[span])
        self._slot_of[span] = array("i", [layer]) * len(pages)
        self._was_slot[span] = b"\x01" * len(pages)
        self._slot_pages += len(pages)

    def release_slot_pages(self, layer: int, pages: range) -> None:
        """Turn pages of `layer`'s slot (its tail, after quantization) into free KV pages."""
        pages = _ascending(pages)
        inside = not pages or (pages.start >= 0 and pages[-1] < self.num_pages)
        span = slice(pages.start, pages.stop, pages.step)  # whole slices, as assign_slot
        if not inside or self._slot_of[span].count(layer) != len(pages):
            for p in pages:
                self._check_page(p)
                if self._slot_of[p] != layer:
                    raise LedgerError(f"page {p} is not in layer {layer}'s slot (owner: {self.slot_of(p)})")
        self._slot_of[span] = array("i", [KV]) * len(pages)
        self._extension += len(pages)
        self._give_free(pages)
        self._slot_pages -= len(pages)

    def slot_of(self, page: int) -> int | None:
        """The layer whose weight slot holds `page`; None for a KV page."""
        layer = self._slot_of[page]
        return None if layer == KV else layer

    # --- absent pages -------------------------------------------------------------------------
    def withdraw(self, pages: range) -> None:
        """Take free KV pages out of use altogether (an instance's block ids no member can back now)."""
        if not self._all_free(pages):
            for p in pages:
                self._check_page(p)
                if not self._is_free[p]:
                    raise LedgerError(f"page {p} cannot be withdrawn: it is not a free KV page")
        self._take_free(pages)
        self._absent.update(pages)

    def reinstate(self, pages: range) -> None:
        """Bring withdrawn pages back as free KV pages."""
        for p in pages:
            self._check_page(p)
            if p not in self._absent:
                raise LedgerError(f"page {p} cannot be reinstated: it was not withdrawn")
        self._absent.difference_update(pages)
        self._give_free(pages)

    @property
    def num_present(self) -> int:
        return self.num_pages - len(self._absent)

    # --- KV pages -----------------------------------------------------------------------------
    def allocate(self) -> int:
        """Take one free KV page (refcount 1), the highest. Raises LedgerError when none is free."""
        page = self._is_free.rfind(1, 0, self._top)
        if page < 0:
            raise LedgerError("no free KV page")
        self._is_free[page] = 0
        self._num_free -= 1
        self._top = page
        self._refcount[page] = 1
        return page

    def allocate_many(self, count: int) -> list[int]:
        """Take `count` free KV pages (refcount 1), the ones `count` calls of allocate would take, in their order;
        LedgerError, and none taken, when fewer are free. A prompt takes tens of pages at once, and an instance's
        members back thousands of blocks: a run of free pages is taken as one."""
        if count > self._num_free:
            raise LedgerError(f"{count} free KV pages wanted, {self._num_free} free")
        is_free, pages, top = self._is_free, [], self._top
        while len(pages) < count:
            top = is_free.rfind(1, 0, top) + 1  # one past the highest free page left
            low = max(is_free.rfind(0, 0, top) + 1, top - (count - len(pages)))  # down its run, as far as wanted
            pages += range(top - 1, low - 1, -1)
            is_free[low:top] = bytes(top - low)
            self._refcount[low:top] = [1] * (top - low)
            top = low
        self._num_free -= count
        self._top = top
        return pages

    def claim(self, page: int) -> None:
        """Take the free KV page `page` (refcount 1): a transformation that chose where its KV goes."""
        self._check_page(page)
        if not self._is_free[page]:
            raise LedgerError(f"page {page} is not a free KV page")
        self._take_free(range(page, page + 1))
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
                self._is_free[page] = page not in used
        self._num_free = self._is_free.count(1)
        self._top = self.num_pages

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
        return sum(1 for p in self.free_pages() if p not in avoid)

    def relocate(self, page: int, avoid: Container[int]) -> int:
        """Hand every reference of the used KV page `page` to a free page outside `avoid`, and free `page`.
        Returns the new page; copying the data and repointing the holders is the caller's part."""
        self._check_used(page)
        new = self.allocate_outside(avoid)
        self._refcount[new], self._refcount[page] = self._refcount[page], 0
        self._give_free(range(page, page + 1))
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
        refcount, is_free, num_pages, freed, top = self._refcount, self._is_free, self.num_pages, 0, self._top
        try:
            for page in pages:
                if not 0 <= page < num_pages or refcount[page] <= 0:
                    self._check_used(page)  # raises, saying which
                left = refcount[page] - 1
                refcount[page] = left
                if not left:
                    is_free[page] = 1
                    freed += 1
                    if page >= top:
                        top = page + 1
        finally:
            self._num_free += freed
            self._top = top

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    @property
    def num_free(self) -> int:
        return self._num_free

    def free_pages(self) -> list[int]:
        """The free KV pages, ascending."""
        return list(compress(range(self.num_pages), self._is_free))

    def snapshot(self) -> LedgerSnapshot:
        free = self._num_free
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
            free = bool(self._is_free[p])
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
        if self._num_free != self._is_free.count(1) or self._is_free.find(1, self._top) >= 0:
            raise LedgerError(f"{self._num_free} free pages counted below {self._top}, "
                              f"{self._is_free.count(1)} found, the highest {self._is_free.rfind(1)}")

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

    def _all_free(self, pages: range) -> bool:
        """Whether every page of `pages` is a free KV page inside the arena."""
        pages = _ascending(pages)
        if not pages:
            return True
        if pages.start < 0 or pages[-1] >= self.num_pages:
            return False
        return self._is_free[pages.start:pages.stop:pages.step].count(1) == len(pages)

    def _take_free(self, pages: range) -> None:
        """`pages`, every one free, are free no more."""
        pages = _ascending(pages)
        self._is_free[pages.start:pages.stop:pages.step] = bytes(len(pages))
        self._num_free -= len(pages)

    def _give_free(self, pages: range) -> None:
        """`pages`, none of them free, are free KV pages now."""
        pages = _ascending(pages)
        self._is_free[pages.start:pages.stop:pages.step] = b"\x01" * len(pages)
        self._num_free += len(pages)
        if pages:
            self._top = max(self._top, pages[-1] + 1)
