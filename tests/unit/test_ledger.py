"""The ledger never hands a page out twice, never frees what is not in use, and always adds up."""

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shared.core.errors import LedgerError
from shared.core.memory.ledger import PageLedger


def test_slots_are_carved_from_free_pages_and_refuse_double_use():
    ledger = PageLedger(10)
    ledger.assign_slot(0, range(0, 3))
    with pytest.raises(LedgerError, match="layer 0's slot"):
        ledger.assign_slot(1, range(2, 4))
    page = ledger.allocate()
    assert page == 9  # highest first: slot tails freed later are the last to be used
    with pytest.raises(LedgerError, match="live KV"):
        ledger.assign_slot(1, range(9, 10))
    snap = ledger.snapshot()
    assert (snap.pages_total, snap.pages_slot, snap.pages_kv_used, snap.pages_kv_free) == (10, 3, 1, 6)


def test_released_slot_pages_become_extension_kv_pages():
    ledger = PageLedger(8)
    ledger.assign_slot(0, range(0, 4))
    ledger.release_slot_pages(0, range(2, 4))
    snap = ledger.snapshot()
    assert (snap.pages_slot, snap.pages_base, snap.pages_extension, snap.pages_kv_free) == (2, 4, 2, 6)
    with pytest.raises(LedgerError, match="not in layer 1's slot"):
        ledger.release_slot_pages(1, range(0, 1))
    taken = [ledger.allocate() for _ in range(6)]
    assert taken[-2:] == [3, 2]  # extension pages go last
    with pytest.raises(LedgerError, match="no free KV page"):
        ledger.allocate()


def test_freeing_a_free_page_is_refused():
    ledger = PageLedger(4)
    with pytest.raises(LedgerError, match="not an allocated KV page"):
        ledger.decref(0)
    with pytest.raises(LedgerError, match="outside the arena"):
        ledger.incref(7)


class LedgerMachine(RuleBasedStateMachine):
    """Random allocate / share / free / relocate / slot changes against a model of who holds what."""

    def __init__(self):
        super().__init__()
        self.ledger = PageLedger(24)
        self.ledger.assign_slot(0, range(0, 6))
        self.slot = set(range(0, 6))
        self.refs: dict[int, int] = {}
        self.absent: set[int] = set()
        self.copied = None  # (the ledger copied, its snapshot and free pages then)

    @rule()
    def allocate(self):
        if self.ledger.num_free == 0:
            with pytest.raises(LedgerError):
                self.ledger.allocate()
            return
        page = self.ledger.allocate()
        assert page == max(self._free())  # highest first
        self.refs[page] = 1

    @rule(count=st.integers(0, 20))
    def allocate_many(self, count):
        free = self._free()
        if count > len(free):
            with pytest.raises(LedgerError):
                self.ledger.allocate_many(count)
            return
        pages = self.ledger.allocate_many(count)
        assert pages == sorted(free, reverse=True)[:count]  # what `count` allocate calls take
        self.refs.update(dict.fromkeys(pages, 1))

    def _free(self) -> set[int]:
        return set(range(24)) - self.slot - self.absent - set(self.refs)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def share(self, data):
        page = data.draw(st.sampled_from(sorted(self.refs)))
        self.ledger.incref(page)
        self.refs[page] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data):
        page = data.draw(st.sampled_from(sorted(self.refs)))
        self.ledger.decref(page)
        self.refs[page] -= 1
        if not self.refs[page]:
            del self.refs[page]

    @rule(data=st.data())
    def free_all(self, data):
        """A block table freed at once: each page once, and maybe one it does not hold, which raises there."""
        pages = data.draw(st.lists(st.sampled_from(sorted(self.refs)), unique=True) if self.refs else st.just([]))
        stray = data.draw(st.one_of(st.none(), st.integers(-2, 25)))
        if stray is not None and stray not in self.refs:
            cut = data.draw(st.integers(0, len(pages)))
            with pytest.raises(LedgerError):
                self.ledger.decref_all(pages[:cut] + [stray] + pages[cut:])
            pages = pages[:cut]  # freed before its turn came, as decref one by one would have
        else:
            self.ledger.decref_all(pages)
        for page in pages:
            self.refs[page] -= 1
            if not self.refs[page]:
                del self.refs[page]

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def relocate(self, data):
        page = data.draw(st.sampled_from(sorted(self.refs)))
        avoid = set(data.draw(st.lists(st.integers(0, 23), max_size=8)))
        room = [p for p in range(24) if p not in self.refs and p not in self.slot and p not in self.absent
                and p not in avoid]
        if not room:
            with pytest.raises(LedgerError):
                self.ledger.relocate(page, avoid)
            return
        new = self.ledger.relocate(page, avoid)
        assert new in room  # a free page, outside what must be vacated
        self.refs[new] = self.refs.pop(page)  # every reference moved with it; the old page is free

    @rule(page=st.integers(0, 23))
    def free_unowned_is_refused(self, page):
        if page not in self.refs:
            with pytest.raises(LedgerError):
                self.ledger.decref(page)

    @rule(start=st.integers(-2, 25), length=st.integers(0, 4), descending=st.booleans())
    def release_slot_pages(self, start, length, descending):
        pages = range(start, start + length)
        pages = pages[::-1] if descending else pages
        if not self.slot.issuperset(pages):
            with pytest.raises(LedgerError):
                self.ledger.release_slot_pages(0, pages)
        else:
            self.ledger.release_slot_pages(0, pages)
            self.slot.difference_update(pages)

    @rule(start=st.integers(-2, 25), length=st.integers(0, 4))
    def withdraw(self, start, length):
        pages = range(start, start + length)
        if not self._free().issuperset(pages):
            with pytest.raises(LedgerError):
                self.ledger.withdraw(pages)
        else:
            self.ledger.withdraw(pages)
            self.absent.update(pages)

    @rule(page=st.integers(0, 23))
    def reinstate(self, page):
        if page not in self.absent:
            with pytest.raises(LedgerError):
                self.ledger.reinstate(range(page, page + 1))
        else:
            self.ledger.reinstate(range(page, page + 1))
            self.absent.discard(page)

    @rule(page=st.integers(0, 23))
    def grow_slot(self, page):
        if page in self.refs or page in self.slot or page in self.absent:
            with pytest.raises(LedgerError):
                self.ledger.assign_slot(0, range(page, page + 1))
        else:
            self.ledger.assign_slot(0, range(page, page + 1))
            self.slot.add(page)

    @rule(page=st.integers(0, 23))
    def claim(self, page):
        if page in self.refs or page in self.slot or page in self.absent:
            with pytest.raises(LedgerError):
                self.ledger.claim(page)
        else:
            self.ledger.claim(page)
            self.refs[page] = 1

    @rule(data=st.data())
    def reset_kv(self, data):
        used = data.draw(st.dictionaries(st.integers(0, 23), st.integers(1, 3), max_size=6))
        if any(p in self.slot or p in self.absent for p in used):
            with pytest.raises(LedgerError):
                self.ledger.reset_kv(used)
        else:
            self.ledger.reset_kv(used)
            self.refs = dict(used)
        assert self.ledger.free_pages() == sorted(set(range(24)) - self.slot - self.absent - set(self.refs))

    @rule()
    def copy(self):
        """Go on with a copy: it behaves as the ledger would have, and the ledger stays as it was."""
        self.copied = (self.ledger, self.ledger.snapshot(), self.ledger.free_pages())
        self.ledger = self.ledger.copy()

    @invariant()
    def the_copied_ledger_is_untouched(self):
        if self.copied is not None:
            ledger, snapshot, free = self.copied
            assert ledger.snapshot() == snapshot and ledger.free_pages() == free
            ledger.check_consistency()  # its pages' owners and refcounts, which the copy must not share

    @invariant()
    def adds_up(self):
        self.ledger.check_consistency()
        snap = self.ledger.snapshot()
        assert snap.pages_slot == len(self.slot)
        assert snap.pages_kv_used == len(self.refs)
        assert snap.pages_kv_free == 24 - len(self.slot) - len(self.refs) - len(self.absent)
        assert snap.pages_total == 24 - len(self.absent)
        assert all(self.ledger.refcount(p) == n for p, n in self.refs.items())


TestLedgerMachine = LedgerMachine.TestCase
