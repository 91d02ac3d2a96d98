"""One executor's part of an instance that spans several: its layers, its KV pages, the step protocol.

Every member holds a DecoderModel with the layers it computes (and of each, its TP shard: shards.py) in
its own arena; a layer keeps its index everywhere, and its slot its place in every member's arena, so that
a layer can come to a member later (reshape.py) the way a restore takes back a slot. KV is named by the
instance's block ids: the members agree on how many blocks the instance has (the fewest any member can back
outside its slots) and each maps block b to a page of its own arena (`page_of`, taken from its ledger), so
the leader's scheduler allocates for all of them and no page is ever asked of a member that lacks it.

A step, leader and followers in lock-step (the leader sends the StepPlan first, step.py):
  embed (the leader; in a TP instance every member, so that no hidden state needs sending)
  for each segment (a run of layers computed by the same members, shared/core/plans.py):
    TP shards:  every member runs its shard; o_proj and down_proj outputs are all-reduced
    one member: it runs the layers (the leader sends it the hidden states and gets them back: a hop)
    replicas:   the leader scatters each replica's rows, runs its own, gathers the rest
  logits (the leader)
Point-to-point traffic is a broadcast in the pair's own group: gloo's group timeout then covers it,
which plain send/recv does not honour.
"""

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from services.executor.engine.memory.arena import Arena, ArenaGeometry
from services.executor.engine.model.checkpoint import Checkpoint
from services.executor.engine.model.decoder import DecodeGroup, DecoderModel, ForwardBatch, PrefillChunk, layer_layout
from services.executor.engine.morphing.swapper import LayerSwapper
from services.executor.fabric import join_step, reshape
from services.executor.fabric import step as wire
from services.executor.fabric.shards import MemberCheckpoint, Shard
from services.executor.fabric.world import FabricError, LeaderLeft, World, checked
from shared.config import EngineConfig
from shared.core.kv_report import instance_pages
from shared.core.latency import BusyWindow
from shared.core.memory.ledger import LedgerSnapshot, PageLedger
from shared.core.plans import Segment, layers_on, quantized_layers, segments
from shared.messages import InstancePlan

log = logging.getLogger(__name__)

KEEPALIVE_S = 1.0  # an idle leader says it is alive this often; far below any sane --dist-timeout


@dataclass(frozen=True)
class Seat:
    """An executor's place in an instance that spans several executors."""
    world: World
    plan: InstancePlan
    me: str


class InstanceMember:
    def __init__(self, seat: Seat, config: EngineConfig, checkpoint: Checkpoint, dtype: torch.dtype,
                 max_model_len: int, progress: bool = True):
        world, plan, me = seat.world, seat.plan, seat.me
        self.world, self.me = world, me
        self.leader = plan.leader
        self.is_leader = me == plan.leader
        self.device = torch.device(config.device)
        self.adopt(plan)
        self.shard = Shard(plan.tp, plan.members.index(me) if plan.tp > 1 else 0)
        self.checkpoint = view = MemberCheckpoint(checkpoint, self.shard)
        cfg = view.config
        held = layers_on(plan, me)
        geometry = ArenaGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size, dtype)
        self.arena = Arena(geometry, config.memory_budget, layer_layout(cfg, dtype)[1], max_model_len, config.device,
                           held, held if plan.slots == "placed" else None)
        reduce = self._all_reduce if plan.tp > 1 else None
        self.model = DecoderModel(cfg, self.arena, view, dtype, config.device, max_model_len, progress, reduce, held)
        self.hidden_size, self.dtype = cfg.hidden_size, dtype
        # Full-precision copies of the layers this member quantized while the instance ran, for their restore.
        self.full_copies: dict[int, dict[str, torch.Tensor]] = {}
        self.busy = BusyWindow()  # a follower's share of the last second spent in its part of the leader's steps
        self.min_blocks = geometry.pages_for_tokens(max_model_len)  # an instance holds one longest sequence
        _quantize_as_planned(self.model, self.arena, plan, held)
        self.capacity, blocks = _agree_on_blocks(self.arena.ledger, plan.id, self.group)
        self.page_of: list[int] = []  # block id -> our page
        self.map_blocks(blocks)
        self.blocks = PageLedger(self.capacity)  # the instance's block ids (the leader allocates them)
        self.blocks.withdraw(range(blocks, self.capacity))
        self.kv_free, self.kv_used = self.blocks.num_free, 0  # a follower's copy of the leader's counts
        self.broken = False
        self.last_sent = time.monotonic()
        self.merged_state = None  # an instance merged at run time keeps what its split needs here
        self.joined: set[str] = set()  # the leader's: members that joined at run time (enlist.py), which leave again
        log.info("executor %s: member of instance %s (%s, layers %s), %d KV blocks of %d tokens", me, plan.id,
                 self.shard.describe(), held, blocks, config.block_size)

    @classmethod
    def from_engine(cls, world: World, plan: InstancePlan, me: str, engine, pages: torch.Tensor, capacity: int,
                    merged=None) -> "InstanceMember":
        """This executor's member of an instance formed at run time out of the engine that served alone: its model
        and arena as they are, instance block b backed by `pages[b]` (a page; in a TP merge, cut by
        merge.become_member, a row of head units), up to `capacity` blocks ever. `merged` (transform.MergedState)
        is what a TP merge's split needs to know (fabric/transform.py); a TP1 instance formed by a join has none
        (enlist.py)."""
        self = cls.__new__(cls)
        self.world, self.me, self.leader, self.is_leader = world, me, plan.leader, me == plan.leader
        self.device = torch.device(engine.config.device)
        self.adopt(plan)
        self.shard = Shard(plan.tp, plan.members.index(me) if plan.tp > 1 else 0)
        self.checkpoint = engine.checkpoint  # a layer back to full precision reads it (a TP instance never does)
        self.arena, self.model = engine.arena, engine.model
        if plan.tp > 1:
            self.model.reduce = self._all_reduce
        self.hidden_size, self.dtype = self.model.cfg.hidden_size, self.model.dtype
        self.full_copies = {}
        self.busy = BusyWindow()
        self.min_blocks = self.arena.geometry.pages_for_tokens(engine.max_model_len)
        self.capacity = capacity
        self.page_of = [tuple(row) if pages.dim() == 2 else row for row in pages.tolist()]
        self.pages = pages.to(self.device)
        self.blocks = PageLedger(capacity)
        self.blocks.withdraw(range(len(self.page_of), capacity))
        self.kv_free, self.kv_used = self.blocks.num_free, 0
        self.broken = False
        self.last_sent = time.monotonic()
        self.merged_state = merged
        self.joined = set()
        return self

    @property
    def group(self):
        """The instance's process group (formed at its first collective; held by the world alone, so that
        closing it closes its connections)."""
        return self.world.group(self.plan.members)

    def adopt(self, plan: InstancePlan) -> None:
        """Serve `plan` from the next step on."""
        self.plan = plan
        self.segments: list[Segment] = segments(plan)

    # --- block ids to our pages -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.page_of)

    def map_blocks(self, count: int) -> None:
        """Back blocks up to `count` with pages of ours (fresh blocks are zeroed when first used)."""
        self.page_of.extend(self.arena.ledger.allocate_many(max(0, count - len(self.page_of))))
        self.pages = torch.tensor(self.page_of, dtype=torch.int64, device=self.device)

    def unmap_blocks(self, count: int) -> None:
        """Give back the pages of the blocks from `count` on (the instance no longer has them)."""
        self.arena.ledger.decref_all(self.page_of[count:])
        del self.page_of[count:]
        self.pages = torch.tensor(self.page_of, dtype=torch.int64, device=self.device)

    def vacate(self, pages: set[int]) -> int:
        """Move the blocks whose pages are in `pages` to free pages elsewhere (a slot is about to take them)."""
        ledger, kv = self.arena.ledger, self.arena.kv_cache
        block_at = {page: block for block, page in enumerate(self.page_of)}
        moved = 0
        for page in sorted(pages):
            if page in block_at:
                new = ledger.relocate(page, pages)
                kv[new] = kv[page]
                self.page_of[block_at[page]] = new
                moved += 1
        self.pages = torch.tensor(self.page_of, dtype=torch.int64, device=self.device)
        return moved

    # --- the leader's side ------------------------------------------------------------------------
    def lead(self, step: wire.StepPlan) -> torch.Tensor:
        """Send `step` to the members and run our part; the logits of the step's sampled rows."""
        self.send_step(step)
        return self.execute(step)

    def leave(self) -> None:
        """End the instance for every member (the leader, done with it); a member already gone is no matter."""
        try:
            self.send_step(wire.StepPlan(wire.LEAVE))
        except FabricError:
            pass

    def keepalive(self) -> None:
        if time.monotonic() - self.last_sent >= KEEPALIVE_S:
            self.send_step(wire.StepPlan(wire.KEEPALIVE))

    def send_step(self, step: wire.StepPlan) -> None:
        step.kv_free, step.kv_used = self.blocks.num_free, self.blocks.num_present - self.blocks.num_free
        self.share(wire.encode(step), "sending a step")
        self.last_sent = time.monotonic()

    def share(self, flat: torch.Tensor | None, what: str) -> torch.Tensor:
        """The leader's int64 tensor `flat`, on every member (the others pass None)."""
        leader = self.world.group_rank(self.plan.members, self.leader)
        with self.collective(what):
            size = torch.tensor([flat.numel() if flat is not None else 0], dtype=torch.int64)
            dist.broadcast(size, group=self.group, group_src=leader)
            if flat is None:
                flat = torch.empty(int(size), dtype=torch.int64)
            dist.broadcast(flat, group=self.group, group_src=leader)
        return flat

    # --- a follower's side ------------------------------------------------------------------------
    def follow_one(self) -> int:
        """Wait for the leader's next step (KEEPALIVE_S at most while it lives) and run our part of it, timed into
        `busy`; returns the step's kind (a SPLIT, and a PART whose plan leaves us out, are the caller's to carry
        out: they need the engine). Every follower loops on this, so a failure is handled alike: FabricError, and a
        bug in our part breaks the instance too (it cannot step without us)."""
        step = wire.decode(self.share(None, "waiting for the leader's step"))
        self.kv_free, self.kv_used = step.kv_free, step.kv_used
        try:
            if step.kind == wire.RUN:
                with self.busy.measuring():
                    self.execute(step)
            elif step.kind == wire.RESHAPE:
                reshape.follow(self, step)
            elif step.kind == wire.JOIN:
                join_step.follow_join(self, step)
            elif step.kind == wire.PART:
                self.adopt(wire.payload_plan(step.payload))  # one that is left out leaves (the caller's part)
        except FabricError:
            raise
        except Exception as exc:
            log.exception("executor %s: running the leader's step failed", self.me)
            self.broken = True
            self.world.drop(self.plan.members)
            raise FabricError(f"{self.me}'s part of the leader's step failed: {exc!r}") from exc
        if step.kind == wire.LEAVE:
            raise LeaderLeft(f"the leader of instance {self.plan.id} ended it")
        return step.kind

    # --- both -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: wire.StepPlan) -> torch.Tensor | None:
        kv = self.arena.kv_cache if self.model.kv_units is None else self.model.kv_units
        if step.fresh.numel():
            kv[self._pages(step.fresh)] = 0
        if step.copies.numel():
            kv[self._pages(step.copies[:, 1])] = kv[self._pages(step.copies[:, 0])]
        batch = self._local(step.batch)
        x = self.model.embed(batch.input_ids) if self.is_leader or self.plan.tp > 1 else None
        for index, segment in enumerate(self.segments):
            x = self._segment(index, segment, x, batch, step.parts)
        return self.model.logits(x, batch.logits_rows) if self.is_leader else None

    def _segment(self, index: int, segment: Segment, x: torch.Tensor | None, batch: ForwardBatch,
                 parts: list[wire.ReplicaPart]) -> torch.Tensor | None:
        if self.plan.tp > 1:
            return self.model.run_layers(x, batch, self._local_layers(segment))
        if len(segment.placement) == 1:
            owner = segment.placement[0]
            if owner == self.leader:
                return self.model.run_layers(x, batch, self._local_layers(segment)) if self.is_leader else x
            if self.is_leader:
                self.hop(x, self.leader, owner)
                return self.hop(x, owner, self.leader)
            if self.me == owner:
                rows = batch.input_ids.shape[0]
                x = self.hop(self._buffer(rows), self.leader, owner)
                self.hop(self.model.run_layers(x, batch, self._local_layers(segment)), owner, self.leader)
            return None
        return self._replicas(index, segment, x, batch, parts)

    def _replicas(self, index: int, segment: Segment, x: torch.Tensor | None, batch: ForwardBatch,
                  parts: list[wire.ReplicaPart]) -> torch.Tensor | None:
        mine = {self.plan.members[p.member]: p for p in parts if p.segment == index}
        layers = self._local_layers(segment) if self.me in segment.placement else None
        if not self.is_leader:
            if self.me in mine:
                part = mine[self.me]
                rows = self.hop(self._buffer(part.rows.numel()), self.leader, self.me)
                self.hop(self.model.run_layers(rows, self._local(part.batch), layers), self.me, self.leader)
            return x
        rows = {m: part.rows.to(self.device) for m, part in mine.items()}
        others = [m for m in segment.placement if m != self.leader and m in mine]
        for m in others:
            self.hop(x[rows[m]], self.leader, m)  # indexing copies: x itself is free to take the results
        if self.leader in mine:
            x[rows[self.leader]] = self.model.run_layers(x[rows[self.leader]], self._local(mine[self.leader].batch),
                                                         layers)
        for m in others:
            x[rows[m]] = self.hop(self._buffer(len(rows[m])), m, self.leader)
        return x

    def hop(self, tensor: torch.Tensor, src: str, dst: str, what: str = "hidden states") -> torch.Tensor:
        """Move `tensor` from `src` to `dst` (the receiver passes a buffer of the right shape)."""
        with self.collective(f"moving {what} {src} -> {dst}"):
            dist.broadcast(tensor, group=self.world.group((src, dst)), group_src=self.world.group_rank((src, dst), src))
        return tensor

    def barrier(self, what: str) -> None:
        with self.collective(what):
            dist.all_reduce(torch.zeros(1), group=self.group)

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        with self.collective("all-reducing a TP shard's output"):
            dist.all_reduce(partial, group=self.group)
        return partial

    def _buffer(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, self.hidden_size, dtype=self.dtype, device=self.device)

    @staticmethod
    def _local_layers(segment: Segment) -> range:
        return range(segment.start, segment.stop)

    # --- a step's block ids as our pages ----------------------------------------------------------
    def _pages(self, blocks: torch.Tensor) -> torch.Tensor:
        return self.pages[blocks.to(self.device)]

    def _local(self, b: ForwardBatch) -> ForwardBatch:
        bs = self.arena.geometry.block_size
        slots = b.slot_mapping.to(self.device)
        return ForwardBatch(
            input_ids=b.input_ids.to(self.device), positions=b.positions.to(self.device),
            slot_mapping=self.pages[slots // bs] * bs + (slots % bs if self.pages.dim() == 1 else
                                                         (slots % bs).unsqueeze(-1)),
            decodes=[DecodeGroup(g.row, g.length, self._pages(g.block_tables).to(torch.int32),
                                 g.context_lens.to(self.device)) for g in b.decodes],
            prefills=[PrefillChunk(p.row, p.length, self._pages(p.block_table).to(torch.int32), p.context_start)
                      for p in b.prefills],
            logits_rows=b.logits_rows.to(self.device))

    # --- failure ----------------------------------------------------------------------------------
    def _check_whole(self) -> None:
        if self.broken:
            raise FabricError(f"instance {self.plan.id} is broken")

    @contextlib.contextmanager
    def collective(self, what: str):
        """checked(), and a failure marks the member broken and closes the instance's groups, so that every peer
        still waiting on us fails at once too instead of after its timeout."""
        self._check_whole()
        try:
            with checked(f"instance {self.plan.id}: {what}"):
                yield
        except FabricError:
            self.broken = True
            self.world.drop(self.plan.members)
            raise

    def snapshot(self) -> LedgerSnapshot:
        """The arena's pages, with the KV counts of the instance's blocks (the leader's, or its last word)."""
        free, used = (self.blocks.num_free, self.num_blocks - self.blocks.num_free) if self.is_leader \
            else (self.kv_free, self.kv_used)
        return instance_pages(self.arena.ledger.snapshot(), self.num_blocks, free, used)


# --- a member's start ---------------------------------------------------------------------------------
def _quantize_as_planned(model: DecoderModel, arena: Arena, plan: InstancePlan, held: list[int]) -> None:
    by_bits = quantized_layers(plan, set(held))
    if by_bits:
        swapper = LayerSwapper(model, arena, scheduler=None)
        for bits, layers in by_bits.items():
            swapper.set_bits(layers, bits)


def _agree_on_blocks(ledger: PageLedger, instance: str, group) -> tuple[int, int]:
    """(the most blocks the instance could ever have, the blocks it has now: as many as the member with the
    fewest free pages can back)."""
    counts = torch.tensor([ledger.num_pages, ledger.num_free], dtype=torch.int64)
    with checked(f"instance {instance}: agreeing on the KV block count"):
        dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=group)
    capacity, blocks = counts.tolist()
    return capacity, blocks
