"""Where every KV head of every block goes when TP1 instances merge into one TP-k instance and when it splits
back (AMOEBAs §3.1), on plain data: pure, so that the property tests drive it directly.

A page is one KV block of every layer laid out head-major (`[kv_head, layer, k|v, token, head_dim]`), so
each head's share of a page is a contiguous `unit`: unit `page·H + h` holds head h of the block in that page
(H KV heads). A TP1 member names a block by its page; a member of a merged instance names each of its local
heads of a block by a unit. Merging, each member keeps its own heads of its own blocks where they are, sends
the others' heads to their owners, and the units those leave become KV units at once: the bubbles are
reused, no page is defragmented (the paper's "in-place migration with header-centric layout"). Receiving, a
member fills units of pages already in part used before it breaks into a whole free page, so whole pages
stay whole for a later split.

Splitting, each block goes back to one member (the one that serves its sequence from then on), which needs
all H heads in one page again. A block that member held before the merge, whose other units are still free,
returns to its old page and only the sent heads come back; any other block takes a whole free page, into
which the member copies its own heads and receives the rest. `reserved` pages (the FFN pages the split
refills with weights) take no block, and blocks there move out. The plan checks that everything fits
before anything moves, and says what does not.
"""

from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass

Block = Hashable  # a block's name across the instance (e.g. its instance block id)


class KvPlanError(ValueError):
    """The KV of the transformation does not fit: nothing was moved."""


@dataclass(frozen=True)
class HeadMove:
    block: Block
    head: int  # global KV head
    src: int  # member
    src_unit: int
    dst: int  # member
    dst_unit: int


@dataclass
class MergePlan:
    units: list[dict[Block, tuple[int, ...]]]  # per member: block -> a unit for each of its heads, in order
    moves: list[HeadMove]  # between members (src != dst)
    free_units: list[set[int]]  # per member, after the merge


@dataclass
class SplitPlan:
    pages: list[dict[Block, int]]  # per member: block -> its page
    moves: list[HeadMove]  # between members
    copies: list[HeadMove]  # inside one member (src == dst): a head into its block's new page
    free_pages: list[set[int]]  # per member, after the split


class UnitPool:
    """A member's free units, handed out to fill pages already in part used first (in page order)."""

    def __init__(self, heads_per_page: int, free: Iterable[int] = ()):
        self.heads_per_page = heads_per_page
        self.free: set[int] = set(free)
        self._order: list[int] | None = None  # the hand-out order, rebuilt after units come back

    def give(self, units: Iterable[int]) -> None:
        self.free.update(units)
        self._order = None

    def remove(self, units: Iterable[int]) -> None:
        self.free.difference_update(units)
        self._order = None

    def take(self, count: int) -> list[int]:
        # Taking units of a whole page leaves it in part used and its next units next in line, so one order
        # serves every take until units come back.
        if self._order is None:
            h = self.heads_per_page
            by_page: dict[int, list[int]] = {}
            for unit in self.free:
                by_page.setdefault(unit // h, []).append(unit)
            ordered = sorted(by_page.items(), key=lambda item: (len(item[1]) == h, item[0]))
            self._order = [u for _, us in reversed(ordered) for u in sorted(us, reverse=True)]
        if len(self._order) < count:
            raise KvPlanError(f"needs {count} free head units, has {len(self._order)}")
        units = [self._order.pop() for _ in range(count)]
        self.free.difference_update(units)
        return units

    def whole_pages(self, avoid: Collection[int] = ()) -> list[int]:
        h = self.heads_per_page
        return sorted(p for p in {u // h for u in self.free}
                      if p not in avoid and all(p * h + i in self.free for i in range(h)))


def plan_merge(heads_per_page: int, member_heads: list[range], blocks: list[dict[Block, int]],
               free_pages: list[Iterable[int]], names: list[str] | None = None) -> MergePlan:
    """Merge TP1 members into one instance in which member r holds the global KV heads `member_heads[r]`.
    `blocks[r]`: member r's live blocks (block -> page); `free_pages[r]`: its free KV pages (the FFN cut's
    included). Every member ends up with its heads of every block."""
    h = heads_per_page
    names = names or [f"member {r}" for r in range(len(blocks))]
    owner = {block: r for r, own in enumerate(blocks) for block in own}
    if len(owner) != sum(len(own) for own in blocks):
        raise KvPlanError("a block is live on two members")
    pools = [UnitPool(h, {p * h + i for p in pages for i in range(h)}) for pages in free_pages]
    units: list[dict[Block, tuple[int, ...]]] = [{} for _ in blocks]
    for r, heads in enumerate(member_heads):
        for block, page in blocks[r].items():
            units[r][block] = tuple(page * h + head for head in heads)
            pools[r].give(page * h + i for i in range(h) if i not in heads)
    moves = []
    for r, heads in enumerate(member_heads):
        foreign = [b for b in owner if owner[b] != r]
        need = len(foreign) * len(heads)
        if need > len(pools[r].free):
            raise KvPlanError(f"tp_merge: {names[r]} needs {need} free head units for the other members' KV, "
                              f"has {len(pools[r].free)}")
        for block in sorted(foreign, key=str):
            src, page = owner[block], blocks[owner[block]][block]
            dst_units = tuple(pools[r].take(len(heads)))
            units[r][block] = dst_units
            moves += [HeadMove(block, head, src, page * h + head, r, unit) for head, unit in zip(heads, dst_units)]
    return MergePlan(units, moves, [pool.free for pool in pools])


def plan_split(heads_per_page: int, member_heads: list[range], units: list[dict[Block, tuple[int, ...]]],
               free_units: list[Iterable[int]], target: dict[Block, int], home: dict[Block, tuple[int, int]],
               reserved: list[Collection[int]], names: list[str] | None = None) -> SplitPlan:
    """Split a merged instance back into TP1 members: block b goes to member `target[b]`. `units` and
    `free_units` are the merged state (MergePlan's, or later); `home[b]` = (member, page) where b lived
    before the merge, if it did; `reserved[r]`: pages of member r that must end with no KV (slots to refill)."""
    h = heads_per_page
    names = names or [f"member {r}" for r in range(len(units))]
    pools = [UnitPool(h, set(free)) for free in free_units]
    # Units of blocks leaving a member are free once their heads are sent (the plan's sends go first).
    for r, mine in enumerate(units):
        for block, us in mine.items():
            if target[block] != r:
                pools[r].give(us)
    pages: list[dict[Block, int]] = [{} for _ in units]
    moves, copies = [], []
    for r in range(len(units)):
        own = {block: dict(zip(member_heads[r], units[r][block])) for block in units[r] if target[block] == r}
        arriving = sorted((b for b in target if target[b] == r), key=str)
        homeless = [b for b in arriving if home.get(b, (None,))[0] != r or home[b][1] in reserved[r]]
        fresh = list(homeless)
        # The runtime reads every source before it writes anything, so the units of blocks that take a fresh
        # page may be reused at once, by a block going back home among them.
        for block in homeless:
            pools[r].give(own[block].values())
        for block in arriving:
            if block in homeless:
                continue
            page = home[block][1]
            if (all(own[block].get(i, page * h + i) == page * h + i for i in range(h))
                    and all(page * h + i in pools[r].free for i in range(h) if i not in own[block])):
                pools[r].remove(page * h + i for i in range(h))
                pages[r][block] = page
            else:
                fresh.append(block)
                pools[r].give(own[block].values())
        whole = pools[r].whole_pages(avoid=reserved[r])
        if len(fresh) > len(whole):
            raise KvPlanError(f"tp_split: {names[r]} needs {len(fresh)} whole free KV pages for the sequences it "
                              f"takes back, has {len(whole)}")
        for block, page in zip(fresh, whole):
            pools[r].remove(page * h + i for i in range(h))
            pages[r][block] = page
            copies += [HeadMove(block, head, r, unit, r, page * h + head) for head, unit in own[block].items()
                       if unit != page * h + head]
        for block in arriving:
            for head in range(h):
                if head in own[block]:
                    continue
                src = next(s for s, heads in enumerate(member_heads) if head in heads and block in units[s])
                src_unit = dict(zip(member_heads[src], units[src][block]))[head]
                moves.append(HeadMove(block, head, src, src_unit, r, pages[r][block] * h + head))
    return SplitPlan(pages, moves, copies, [set(pool.whole_pages()) for pool in pools])
