"""AMOEBAs' runtime merge of executors that serve alone into one TP instance, between two steps, with the
running requests keeping their tokens and their KV (§3.1-3.3).

Every member, at a step boundary, in the members' group:
1. cuts its FFN in place (merge.become_member: FFN first);
2. tells the others its live blocks, its free pages and (the followers) its sequences;
3. computes the same KV head plan (kv_heads.plan_merge) and sends the heads it keeps no more to their owners,
   reading every source before it writes;
4. numbers the instance's blocks the same way everywhere (live ones first, in name order), maps each to a
   head unit per local KV head, and backs as many more as the member with the fewest free units can;
5. the first member leads: its engine takes every sequence, with block tables in instance block ids, and
   steps the instance from then on; the others follow its steps.
"""

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from services.executor.fabric.kv_heads import HeadMove, UnitPool, plan_merge
from services.executor.fabric.member import InstanceMember
from services.executor.fabric.merge import become_member
from services.executor.fabric.shards import head_shards
from services.executor.fabric.world import World, checked
from shared.messages import InstancePlan, LayerPlan

if TYPE_CHECKING:
    from services.executor.engine.engine import LLMEngine

log = logging.getLogger(__name__)


def merge(engine: "LLMEngine", world: World, members: list[str], me: str, instance_id: str) -> InstanceMember:
    """Merge this executor's engine (serving alone) with the other `members`' into the TP instance
    `instance_id`; returns this executor's member (the first of `members` leads; its engine now steps the
    instance)."""
    rank, tp = members.index(me), len(members)
    group = world.group(members)
    model, arena = engine.model, engine.arena

    def all_reduce(partial: torch.Tensor) -> torch.Tensor:
        with checked(f"instance {instance_id}: all-reducing a TP shard's output"):
            dist.all_reduce(partial, group=group)
        return partial

    membership = become_member(model, arena, engine.variants, tp, rank, all_reduce)
    seqs = [*engine.scheduler.running, *engine.scheduler.waiting]
    ledger = arena.ledger
    mine = {"blocks": {p: ledger.refcount(p) for s in seqs for p in s.block_table},
            "free": ledger.free_pages(),
            "seqs": [] if rank == 0 else engine.export_sequences()}
    everyone: list[dict] = [None] * tp  # type: ignore[list-item]
    with checked(f"instance {instance_id}: sharing what each member holds"):
        dist.all_gather_object(everyone, mine, group=group)

    heads_per_page = arena.kv_cache.shape[1]
    member_heads = [s.kv for s in head_shards(model.cfg.num_heads, model.cfg.num_kv_heads, tp)]
    blocks = [{(r, p): p for p in e["blocks"]} for r, e in enumerate(everyone)]
    plan = plan_merge(heads_per_page, member_heads, blocks, [e["free"] for e in everyone], names=members)
    exchange_heads(arena, world, members, me, plan.moves)

    names = sorted((name for own in blocks for name in own), key=str)
    block_id = {name: i for i, name in enumerate(names)}
    spare = min(len(free) // len(heads) for free, heads in zip(plan.free_units, member_heads))
    capacity = len(names) + spare
    pool = UnitPool(heads_per_page, plan.free_units[rank])
    units = [plan.units[rank][name] for name in names] + [tuple(pool.take(len(member_heads[rank])))
                                                          for _ in range(spare)]
    instance = InstancePlan(id=instance_id, leader=members[0], members=list(members), tp=tp,
                            layers=[LayerPlan(placement=list(members), bits=16 if b == model.full_bits else b)
                                    for b in model.layer_bits])
    member = InstanceMember.merged(world, instance, me, engine, torch.tensor(units, dtype=torch.int64), capacity,
                                   membership)
    if rank == 0:
        refs = {block_id[(r, p)]: rc for r, e in enumerate(everyone) for p, rc in e["blocks"].items()}
        for block, rc in refs.items():
            member.blocks.claim(block)
            for _ in range(rc - 1):
                member.blocks.incref(block)
        engine.lead_instance(member, lambda r, table: [block_id[(r, p)] for p in table],
                             [(r, s) for r, e in enumerate(everyone) for s in e["seqs"]])
    else:
        engine.hand_over()
    log.info("executor %s: merged into %s (TP%d, rank %d): %d live blocks, %d in all; %d head moves", me,
             instance_id, tp, rank, len(names), capacity, len(plan.moves))
    return member


def exchange_heads(arena, world: World, members: list[str], me: str, moves: list[HeadMove]) -> None:
    """Send and receive the heads `moves` names: every source read before anything is written."""
    units = arena.kv_cache.view(-1, *arena.kv_cache.shape[2:])
    rank = members.index(me)
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
            dist.broadcast(buffer, world.rank_of(members[src]), group=world.group((members[src], members[dst])))
        if rank == dst:
            received.append((torch.tensor([m.dst_unit for m in ms]), buffer))
    for index, data in received:
        units[index] = data
