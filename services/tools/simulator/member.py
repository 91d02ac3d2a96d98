"""What a simulated executor's arena does as a member of an instance of several executors, as the fabric's
member keeps it (services/executor/fabric/member.py): the slots of the layers placed on it, the pages backing
the instance's blocks, the KV head units it reports for AMOEBAs' merges, and its KV pages as telemetry shows
them. Mixed into SimExecutor (executor.py), whose arena (`ledger`, `slot_pages`, `_slot`) it works on.
"""

from array import array

from services.tools.simulator.tp import ffn_pages_freed
from shared.core.kv_report import instance_pages, kv_fields
from shared.core.memory.ledger import LedgerSnapshot
from shared.core.scheduling.growth import blocks_at_end
from shared.core.slots import slot_moves
from shared.core.tp_scheduler import MAX_TP
from shared.messages import KvUnits


class MemberArena:
    def _head(self, layer: int, bits: int) -> range:
        """The pages of `layer`'s slot its weights at `bits` fill."""
        slot = self._slot(layer)
        return range(slot.start, slot.start + self.slot_pages[bits])

    def outside_slots(self, layers: list[int] | None = None, bits: list[int] | None = None) -> int:
        """Pages outside slots, now or once the slots hold `layers` at `bits` (each layer's bits now, by default)."""
        held = self.held if layers is None else layers
        bits = self.layer_bits if bits is None else bits
        return self.ledger.num_pages - sum(self.slot_pages[bits[i]] for i in held)

    def hold(self, layers: list[int], bits: list[int]) -> None:
        """Fill exactly the slots of `layers`, at `bits`: those it gives up are released, and so are the tails of
        those it keeps at fewer bits; those it gains, or keeps at more, are taken back, the blocks backed by their
        pages moved out first (the fabric member's vacate)."""
        keep = set(layers)
        for i in sorted(self.held - keep):
            self.ledger.release_slot_pages(i, self._head(i, self.layer_bits[i]))
        resized = {i: slot_moves(self._slot(i), self.slot_pages[self.layer_bits[i]], self.slot_pages[bits[i]])
                   for i in sorted(keep & self.held) if bits[i] != self.layer_bits[i]}
        for i, (_, release) in resized.items():
            if release:
                self.ledger.release_slot_pages(i, release)
        gained = {i: self._head(i, bits[i]) for i in sorted(keep - self.held)}
        gained.update((i, reclaim) for i, (reclaim, _) in resized.items() if reclaim)
        taking = {p for pages in gained.values() for p in pages}
        moved = {p: self.ledger.relocate(p, taking) for p in sorted(taking) if self.ledger.refcount(p) > 0}
        self.mapped = array("i", (moved.get(p, p) for p in self.mapped))
        for i, pages in gained.items():
            self.ledger.assign_slot(i, pages)
        self.held, self.layer_bits = keep, list(bits)

    def back_first_blocks(self, count: int, laid_out: dict) -> None:
        """Its own arena, as laid out, with an instance's first `count` blocks backed (map_blocks): a copy of the
        first member's laid out alike, where they shared the one laid out (SimExecutor's `starts_in_instance`).
        Backing a thousand members' pages one by one was most of an INT4 fleet's set-up."""
        key = ("backing", self.laid_out_as, count)
        if key not in laid_out:
            arena = laid_out[self.laid_out_as].copy()
            laid_out[key] = arena, array("i", arena.allocate_many(count))
        arena, mapped = laid_out[key]
        self.take_arena(arena.copy())
        self.mapped = mapped[:]

    def map_blocks(self, count: int) -> None:
        self.mapped.extend(self.ledger.allocate_many(max(0, count - len(self.mapped))))

    def unmap_blocks(self, count: int) -> None:
        self.ledger.decref_all(self.mapped[count:])
        del self.mapped[count:]

    def join(self, group) -> None:
        """Serve in `group`; its leader's scheduler becomes the instance's."""
        self.group, self.plan = group, group.plan
        if group.plan.leader == self.id:
            self.scheduler, self.blocks = group.scheduler, group.blocks

    @property
    def leads(self) -> bool:
        """Whether it takes requests: alone, or its instance's leader."""
        return self.group is None or self.group.leader is self

    def sequence_blocks(self) -> int:
        """KV blocks one sequence of the longest length takes: what an executor alone, and an instance of several,
        must hold at the least."""
        return -(-self.max_model_len // self.limits.block_size)

    def blocks_at_end(self, prompt_tokens: int, max_tokens: int) -> int:
        """KV blocks a sequence holds once it ends (its last token is sampled, never written)."""
        return blocks_at_end(prompt_tokens, max_tokens, self.max_model_len, self.limits.block_size)

    def kv_capacity(self) -> int:
        """KV blocks the instance holds empty: the most one sequence can take."""
        return self.group.num_blocks if self.group is not None else self.ledger.snapshot().pages_kv

    def kv_units(self, pages_kv: int | None = None) -> list[KvUnits]:
        """merge.kv_units: its KV head units as a member of each TP instance its world can form, as the worker
        caches them: recomputed while it serves alone, the last ones standing while merged (what it holds once
        it splits), none in an instance it started in (its cache starts empty). `pages_kv`: the ledger's, when
        the caller has its snapshot."""
        if self.group is not None:
            return self.units if self.group.plan.merged else []
        if len(self.world) < 2:
            return []
        pages = self.ledger.snapshot().pages_kv if pages_kv is None else pages_kv
        # Every report asks; weighing the layers' FFN cuts each time was a third of a thousand-executor run.
        key = (pages, tuple(self.layer_bits), frozenset(self.held), len(self.world))
        if key != self.units_key:
            heads = self.shape.num_kv_heads
            self.units = [KvUnits(tp=k, units=heads * (pages + ffn_pages_freed(self, k)))
                          for k in (1, 2, MAX_TP) if k <= len(self.world)]
            self.units_key = key
        return self.units

    def kv_pages(self, snap: LedgerSnapshot) -> dict[str, int]:
        """Telemetry's KvPages, as fields (the bench's poll reads them as a dict)."""
        return kv_fields(self.reported_pages(snap))

    def reported_pages(self, snap: LedgerSnapshot) -> LedgerSnapshot:
        """The pages its telemetry reports of its ledger's `snap`: in an instance, the instance's blocks, as
        fabric/member.py's snapshot counts them on every member."""
        if self.group is not None:
            blocks, free = self.group.num_blocks, self.group.ledger.num_free
            return instance_pages(snap, blocks, free, blocks - free, self.group.freed_pages(self.id))
        return snap
