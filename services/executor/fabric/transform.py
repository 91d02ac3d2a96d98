"""AMOEBAs' runtime merge of executors that serve alone into one TP instance, and its split back, between two
steps, with the running requests keeping their tokens and their KV (§3.1-3.3).

Every member, at a step boundary, in the members' group:
1. tells the others its live blocks, its free pages (with those its FFN cut will free) and (the followers)
   its sequences, and computes the same KV head plan (kv_heads.plan_merge): where it does not fit, every
   member refuses alike (KvPlanError) with nothing changed;
2. cuts its FFN in place (merge.become_member: FFN first), then sends the heads it keeps no more to their
   owners, reading every source before it writes;
4. numbers the instance's blocks the same way everywhere (live ones first, in name order), maps each to a
   head unit per local KV head, and backs as many more as the member with the fewest free units can;
5. the first member leads: its engine takes every sequence, with block tables in instance block ids, and
   steps the instance from then on; the others follow its steps.

Splitting (the leader sends a SPLIT step, then every member): the leader says which member serves each
sequence from then on (the one it came from; a request that arrived merged goes to the member with the
fewest blocks so far) and hands the others' over; every member tells the others its free units and the
pages its FFN refill needs; all compute the same plan (kv_heads.plan_split, KV first), move heads, refill
the FFN from the host variants (merge.become_whole) and serve alone again.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from services.executor.fabric import step as wire
from services.executor.fabric.kv_heads import HeadMove, UnitPool, plan_merge, plan_split
from services.executor.fabric.leader import InstanceRunner
from services.executor.fabric.member import InstanceMember
from services.executor.fabric.merge import Membership, become_member, become_whole, cut_pages
from services.executor.fabric.shards import head_shards
from services.executor.fabric.world import World, checked
from shared.messages import InstancePlan, LayerPlan

if TYPE_CHECKING:
    from services.executor.engine.engine import LLMEngine

log = logging.getLogger(__name__)


@dataclass
class MergedState:
    """What a member of a merged instance keeps for its split."""
    membership: Membership  # its FFN cut
    member_heads: list[range]  # the KV heads each member holds
    home: dict[int, tuple[int, int]]  # instance block id -> (member, page) it had before the merge
    spare_units: set[int]  # this member's units that no block id maps to
    origin: dict[str, int]  # request id -> the member it came from (the leader's record)
    report: dict  # what the merge did and how long each part took, here
    carried: list  # what each member's caller sent along with its sequences (merge's `carry`), by rank


def merge(engine: "LLMEngine", world: World, members: list[str], me: str, instance_id: str,
          carry: object = None) -> InstanceMember:
    """Merge this executor's engine (serving alone) with the other `members`' into the TP instance
    `instance_id`; returns this executor's member (the first of `members` leads; its engine now steps the
    instance). `carry` (picklable) travels with this member's sequences: the service's record of its
    requests; every member's is in `merged_state.carried`."""
    rank, tp = members.index(me), len(members)
    model, arena = engine.model, engine.arena
    clock = Clock()

    def all_reduce(partial: torch.Tensor) -> torch.Tensor:
        with checked(f"instance {instance_id}: all-reducing a TP shard's output"):
            dist.all_reduce(partial, group=world.group(members))
        return partial

    seqs = [*engine.scheduler.running, *engine.scheduler.waiting]
    ledger = arena.ledger
    mine = {"blocks": {p: ledger.refcount(p) for s in seqs for p in s.block_table},
            "free": ledger.free_pages() + cut_pages(model, arena, tp, rank),
            "seqs": [] if rank == 0 else engine.export_sequences(), "carry": carry}
    everyone: list[dict] = [None] * tp  # type: ignore[list-item]
    with checked(f"instance {instance_id}: sharing what each member holds"):
        dist.all_gather_object(everyone, mine, group=world.group(members))
    everyone = world.in_member_order(members, everyone)
    clock.lap("share_s")

    heads_per_page = arena.kv_cache.shape[1]
    member_heads = [s.kv for s in head_shards(model.cfg.num_heads, model.cfg.num_kv_heads, tp)]
    blocks = [{(r, p): p for p in e["blocks"]} for r, e in enumerate(everyone)]
    plan = plan_merge(heads_per_page, member_heads, blocks, [e["free"] for e in everyone], names=members)
    clock.lap("plan_s")
    membership = become_member(model, arena, engine.variants, tp, rank, all_reduce)
    clock.lap("ffn_s")
    moved = exchange_heads(arena, world, members, me, plan.moves)
    clock.lap("kv_s")

    names = sorted((name for own in blocks for name in own), key=str)
    block_id = {name: i for i, name in enumerate(names)}
    spare = min(len(free) // len(heads) for free, heads in zip(plan.free_units, member_heads))
    capacity = len(names) + spare
    pool = UnitPool(heads_per_page, plan.free_units[rank])
    units = [plan.units[rank][name] for name in names] + [tuple(pool.take(len(member_heads[rank])))
                                                          for _ in range(spare)]
    instance = InstancePlan(id=instance_id, leader=members[0], members=list(members), tp=tp,
                            layers=[LayerPlan(placement=list(members), bits=16 if b == model.full_bits else b)
                                    for b in model.layer_bits], merged=True)
    report = dict(live_blocks=len(names), blocks=capacity, head_moves=len(plan.moves), **moved,
                  ffn_pages_freed=sum(map(len, membership.freed.values())), boundary_pages=membership.boundary_pages,
                  **clock.laps)
    state = MergedState(membership, member_heads, {block_id[name]: name for name in names}, set(pool.free),
                        {} if rank else {s.request_id: 0 for s in seqs} | {
                            p["request_id"]: r for r, e in enumerate(everyone) for p in e["seqs"]}, report,
                        [e["carry"] for e in everyone])
    member = InstanceMember.from_engine(world, instance, me, engine, torch.tensor(units, dtype=torch.int64), capacity,
                                        state)
    if rank == 0:
        refs = {block_id[(r, p)]: rc for r, e in enumerate(everyone) for p, rc in e["blocks"].items()}
        for block, rc in refs.items():
            member.blocks.claim(block)
            for _ in range(rc - 1):
                member.blocks.incref(block)
        engine.lead_instance(InstanceRunner(member, engine.config.block_size),
                             lambda r, table: [block_id[(r, p)] for p in table],
                             [(r, s) for r, e in enumerate(everyone) for s in e["seqs"]])
    else:
        engine.hand_over()
    report.update(clock.laps, total_s=clock.total())
    log.info("executor %s: merged into %s (TP%d, rank %d): %s", me, instance_id, tp, rank, report)
    return member


def split(engine: "LLMEngine", member: InstanceMember,
          carry: Callable[[list[str]], object] = lambda request_ids: None) -> dict:
    """Split the merged instance `member` belongs to back into executors that serve alone (every member
    calls this; the leader first, which starts it with a SPLIT step). Returns what it did and how long each
    part took, here; under "carried" what the leader's `carry(request ids)` (which must change nothing) gave
    for the requests this member takes over, and under "moved" the member each request left for. Where the
    KV does not fit, every member raises KvPlanError alike before anything moved, and the instance stays
    merged."""
    members, me, world, state = member.plan.members, member.me, member.world, member.merged_state
    rank, arena = members.index(me), engine.arena
    clock = Clock()
    decision = [None]
    if member.is_leader:
        member.send_step(wire.StepPlan(wire.SPLIT))
        decision = [_split_decision(engine, member, carry)]
    with checked(f"instance {member.plan.id}: sharing the split's decision"):
        dist.broadcast_object_list(decision, group=member.group, group_src=world.group_rank(members, member.leader))
    targets, refs, handed, where = (decision[0][k] for k in ("targets", "refs", "handed", "where"))
    live = set(targets)
    mine = {"units": {b: member.page_of[b] for b in live},
            "free": state.spare_units | {u for b, us in enumerate(member.page_of) if b not in live for u in us},
            "reserved": {p for pages in state.membership.freed.values() for p in pages}}
    everyone: list[dict] = [None] * len(members)  # type: ignore[list-item]
    with checked(f"instance {member.plan.id}: sharing the split's free units"):
        dist.all_gather_object(everyone, mine, group=member.group)
    everyone = world.in_member_order(members, everyone)
    clock.lap("share_s")
    plan = plan_split(arena.kv_cache.shape[1], state.member_heads, [e["units"] for e in everyone],
                      [e["free"] for e in everyone], targets, state.home, [e["reserved"] for e in everyone],
                      names=members)
    clock.lap("plan_s")
    moved = exchange_heads(arena, world, members, me, plan.moves, plan.copies)
    clock.lap("kv_s")
    written = become_whole(engine.model, arena, engine.variants, state.membership)
    clock.lap("ffn_s")
    pages = plan.pages[rank]
    arena.ledger.reset_kv({pages[b]: refs[b] for b in pages})
    engine.serve_alone(lambda table: [pages[b] for b in table],
                       lambda seq: where[seq.request_id] == rank, handed.get(rank, []))
    report = dict(blocks_kept=len(pages), head_moves=len(plan.moves), head_copies=len(plan.copies), **moved,
                  ffn_bytes_refilled=written, **clock.laps, total_s=clock.total())
    log.info("executor %s: split from %s: %s", me, member.plan.id, report)
    return {**report, "carried": decision[0]["carried"].get(rank),
            "moved": {rid: members[r] for rid, r in where.items() if r != rank}}


def _split_decision(engine: "LLMEngine", member: InstanceMember, carry: Callable[[list[str]], object]) -> dict:
    """The leader's: which member serves each live block's sequence from now on, the blocks' reference counts,
    the sequences each other member takes (packed, block tables in instance block ids) and what `carry` sends
    along with their requests."""
    origin = member.merged_state.origin
    load = [0] * len(member.plan.members)
    where: dict[str, int] = {}
    seqs = [*engine.scheduler.running, *engine.scheduler.waiting]
    for seq in seqs:
        if seq.request_id not in where:
            where[seq.request_id] = origin.get(seq.request_id, min(range(len(load)), key=load.__getitem__))
        load[where[seq.request_id]] += len(seq.block_table)
    targets = {b: where[s.request_id] for s in seqs for b in s.block_table}
    handed: dict[int, list[dict]] = {}
    for seq in seqs:
        if where[seq.request_id] != 0:
            handed.setdefault(where[seq.request_id], []).append(engine.pack_sequence(seq))
    carried = {r: carry(list(dict.fromkeys(p["request_id"] for p in packed))) for r, packed in handed.items()}
    return {"targets": targets, "refs": {b: member.blocks.refcount(b) for b in targets}, "handed": handed,
            "where": where, "carried": carried}


def exchange_heads(arena, world: World, members: list[str], me: str, moves: list[HeadMove],
                   copies: list[HeadMove] = ()) -> dict:
    """Send and receive the heads `moves` names and copy those `copies` names inside this member: every
    source read before anything is written. Returns the bytes sent and received, and those the buffers took."""
    units = arena.kv_cache.view(-1, *arena.kv_cache.shape[2:])
    rank = members.index(me)
    own = [m for m in copies if m.src == rank]
    local = (torch.tensor([m.dst_unit for m in own]), units[torch.tensor([m.src_unit for m in own])].clone()) \
        if own else None
    by_pair: dict[tuple[int, int], list] = {}
    for m in moves:
        by_pair.setdefault((m.src, m.dst), []).append(m)
    outgoing = {pair: units[torch.tensor([m.src_unit for m in ms])].clone()
                for pair, ms in by_pair.items() if pair[0] == rank}
    received = []
    for (src, dst), ms in sorted(by_pair.items()):
        if rank not in (src, dst):
            continue
        buffer = outgoing[(src, dst)] if rank == src else units.new_empty((len(ms), *units.shape[1:]))
        with checked(f"moving {len(ms)} KV heads {members[src]} -> {members[dst]}"):
            pair = (members[src], members[dst])
            dist.broadcast(buffer, group=world.group(pair), group_src=world.group_rank(pair, members[src]))
        if rank == dst:
            received.append((torch.tensor([m.dst_unit for m in ms]), buffer))
    if local is not None:
        received.append(local)
    for index, data in received:
        units[index] = data
    unit_bytes = units[0].numel() * units.element_size()
    return {"kv_bytes_sent": unit_bytes * sum(len(b) for b in outgoing.values()),
            "kv_bytes_received": unit_bytes * sum(len(i) for i, _ in received),
            "buffer_bytes": unit_bytes * (sum(len(b) for b in outgoing.values()) + sum(len(i) for i, _ in received))}


class Clock:
    """Seconds per named part of a transformation, in order."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self.last
        self.last = now

    def total(self) -> float:
        return time.perf_counter() - self.start
