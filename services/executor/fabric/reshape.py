"""Changing a running instance's plan: CoCoServe's replicate, migrate and evict of a range of layers (§3.1),
and MorphServe's quantize and restore taken by the instance as a whole (every member holding a layer swaps it).

A change is applied between two steps by every member in lock-step, in two rounds:
  1. The leader sends the next plan (a RESHAPE step). Each member works out how many of its pages would
     be outside slots afterwards, and all gather those counts: the instance then has K' blocks, the
     fewest any member can back (a member that takes a layer may leave fewer; one that gives a layer up,
     more).
  2. The leader, which alone knows the block tables, moves live blocks out of the ids the instance loses
     (whole-block copies, as a restore moves KV out of a slot), decides where each request's KV lives
     afterwards (replicas.reassign) and which holder sends each new copy of a layer its weights, and
     sends that verdict, or a refusal, after which nothing has changed anywhere. Every member then, in
     this order: copies the moved blocks; drops the blocks the instance loses; takes back the slot pages
     of the layers it gains, moving its blocks out of them; receives those layers' weights from a holder
     (the slot's bytes at the layer's current bits, so a replica computes exactly what its source does);
     sends or receives the KV rows of the requests that change member for a layer; releases the slots of
     the layers it gives up; backs the blocks the instance gains; and serves the new plan. A last
     all-reduce says that every member is done.
Every transfer is a broadcast in its pair's group, taken in the verdict's order by both ends, so no two
members ever wait on each other.
"""

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from services.executor.engine.model.decoder import load_layer, slot_views
from services.executor.engine.morphing.variants import quantize_layer
from services.executor.fabric import step as wire
from shared.core.errors import OutOfPagesError, ReshapeRefused
from shared.core.plans import FULL_BITS, OperationRefused, layers_on, reshaped, segments, with_bits
from shared.core.replicas import KvMove, reassign
from shared.core.scheduling.scheduler import Scheduler
from shared.core.slots import slot_moves
from shared.messages import EvictArgs, InstancePlan, MigrateArgs, QuantizeArgs, ReplicateArgs, RestoreArgs

if TYPE_CHECKING:
    from services.executor.fabric.member import InstanceMember

log = logging.getLogger(__name__)

Operation = ReplicateArgs | MigrateArgs | EvictArgs


@dataclass
class Verdict:
    ok: bool
    blocks: int = 0  # K': the instance's block count afterwards
    copies: torch.Tensor = field(default_factory=lambda: torch.empty(0, 2, dtype=torch.int64))  # [old, new] block ids
    weights: list[tuple[int, str, str]] = field(default_factory=list)  # (layer, from, to)
    moves: list[KvMove] = field(default_factory=list)

    def encode(self, members: list[str]) -> torch.Tensor:
        index = members.index
        tensors = [torch.tensor([int(self.ok), self.blocks, len(self.moves)]), self.copies.reshape(-1, 2),
                   torch.tensor([[layer, index(a), index(b)] for layer, a, b in self.weights],
                                dtype=torch.int64).reshape(-1, 3)]
        for m in self.moves:
            tensors += [torch.tensor([index(m.src), index(m.dst)]), torch.tensor(m.layers, dtype=torch.int64),
                        torch.tensor(m.blocks, dtype=torch.int64)]
        return wire.pack(tensors)

    @classmethod
    def decode(cls, flat: torch.Tensor, members: list[str]) -> "Verdict":
        it = iter(wire.unpack(flat))
        ok, blocks, num_moves = next(it).tolist()
        copies = next(it)
        weights = [(layer, members[a], members[b]) for layer, a, b in next(it).tolist()]
        moves = []
        for _ in range(num_moves):
            src, dst = next(it).tolist()
            moves.append(KvMove(members[src], members[dst], tuple(next(it).tolist()), tuple(next(it).tolist())))
        return cls(bool(ok), blocks, copies, weights, moves)


# --- the leader ---------------------------------------------------------------------------------------
def next_plan(plan: InstancePlan, op: Operation | QuantizeArgs | RestoreArgs) -> InstancePlan:
    """The plan `op` asks for; ReshapeRefused says why it cannot apply."""
    try:
        if isinstance(op, QuantizeArgs):
            return with_bits(plan, op.layers, op.bits)
        if isinstance(op, RestoreArgs):
            return with_bits(plan, op.layers, FULL_BITS)
        return reshaped(plan, op)
    except OperationRefused as exc:
        raise ReshapeRefused(str(exc)) from None


def lead(member: "InstanceMember", scheduler: Scheduler, sticky: dict[int, dict[str, str]],
         plan: InstancePlan) -> tuple[dict, dict[int, dict[str, str]]]:
    """Serve `plan` from now on in the instance `member` leads: (a report, the replicas' sticky requests
    afterwards). Raises ReshapeRefused, with nothing changed, when it cannot apply."""
    start = time.perf_counter()
    if plan == member.plan:
        raise ReshapeRefused("the instance already serves that plan")
    member.send_step(wire.StepPlan(wire.RESHAPE, payload=wire.plan_payload(plan)))
    outside = _gather_outside_slots(member, plan)
    before, after = member.num_blocks, min(min(outside.values()), member.capacity)
    members = plan.members
    try:
        copies = _shrink(member, scheduler, before, after, outside)
    except ReshapeRefused:
        member.share(Verdict(False).encode(members), "refusing a reshape")
        raise
    if after > before:
        member.blocks.reinstate(range(before, after))
    held: dict[str, set[int]] = {}  # request -> the blocks its sequences hold
    for seq in [*scheduler.running, *scheduler.waiting]:
        if seq.block_table:
            held.setdefault(seq.request_id, set()).update(seq.block_table)
    new_sticky, moves = reassign(member.segments, segments(plan), sticky, held)
    verdict = Verdict(True, after, torch.tensor(copies, dtype=torch.int64).reshape(-1, 2),
                      _weight_sources(member.plan, plan), moves)
    member.share(verdict.encode(members), "sending a reshape's verdict")
    moved_bytes = _apply(member, plan, verdict)
    report = {"plan": plan.model_dump(), "blocks_before": before, "blocks_after": after,
              "blocks_relocated": len(copies), "layers_copied": len(verdict.weights),
              "layers": [layer.bits for layer in plan.layers],
              "kv_rows_moved": sum(len(m.layers) * len(m.blocks) for m in moves), "bytes_moved": moved_bytes,
              "seconds": time.perf_counter() - start}
    log.info("instance %s reshaped: %s", plan.id, {k: v for k, v in report.items() if k != "plan"})
    return report, new_sticky


def _shrink(member: "InstanceMember", scheduler: Scheduler, before: int, after: int,
            outside: dict[str, int]) -> list[tuple[int, int]]:
    """Withdraw the block ids from `after` on, moving the live ones below it: the whole-block copies."""
    if after < member.min_blocks:
        short = min(outside, key=outside.get)
        raise ReshapeRefused(f"no memory: {short} would back only {after} KV blocks, fewer than one sequence of "
                             f"the longest length needs ({member.min_blocks})")
    if after >= before:
        return []
    try:
        moved = scheduler.evacuate(set(range(after, before)))
    except OutOfPagesError as exc:
        raise ReshapeRefused(f"no memory: the instance would keep {after} of its {before} KV blocks, but "
                             f"{exc.needed} live blocks would have to move into {exc.free} free ones") from None
    member.blocks.withdraw(range(after, before))
    return sorted(moved.items())


def _weight_sources(old: InstancePlan, new: InstancePlan) -> list[tuple[int, str, str]]:
    """(layer, holder, newcomer) for every member that gains a layer; the leader sends what it holds."""
    out = []
    for i, (was, now) in enumerate(zip(old.layers, new.layers)):
        holders = sorted(was.placement, key=lambda m: m != old.leader)
        out += [(i, holders[0], m) for m in now.placement if m not in was.placement]
    return out


# --- a follower ---------------------------------------------------------------------------------------
def follow(member: "InstanceMember", step: wire.StepPlan) -> None:
    plan = wire.payload_plan(step.payload)
    _gather_outside_slots(member, plan)
    verdict = Verdict.decode(member.share(None, "waiting for a reshape's verdict"), plan.members)
    if verdict.ok:
        _apply(member, plan, verdict)


# --- every member ---------------------------------------------------------------------------------------
def _slot_head(member: "InstanceMember", layer: int, bits: int) -> range:
    """The pages of `layer`'s slot that its weights at `bits` take (a quantized layer leaves the rest KV)."""
    _, nbytes = member.model.slot_layout(_model_bits(member, bits))
    slot = member.arena.slot_range(layer)
    return range(slot.start, slot.start + member.arena.geometry.pages_for_bytes(nbytes))


def _slot_moves(member: "InstanceMember", layer: int, now: int, then: int) -> tuple[range, range]:
    """(pages to take back into `layer`'s slot, pages it releases) when it goes from `now` bits to `then`: the
    swapper's rule (slots.slot_moves)."""
    return slot_moves(member.arena.slot_range(layer), len(_slot_head(member, layer, now)),
                      len(_slot_head(member, layer, then)))


@dataclass(frozen=True)
class Change:
    """What `plan` changes on one member: the layers it gains, loses, and keeps at other bits."""
    gained: list[int]
    lost: list[int]
    rebits: dict[int, int]  # layer -> its bits afterwards


def _change(member: "InstanceMember", plan: InstancePlan) -> Change:
    held = set(layers_on(member.plan, member.me))
    will = set(layers_on(plan, member.me))
    rebits = {i: plan.layers[i].bits for i in sorted(held & will) if plan.layers[i].bits != member.plan.layers[i].bits}
    return Change(sorted(will - held), sorted(held - will), rebits)


def _gather_outside_slots(member: "InstanceMember", plan: InstancePlan) -> dict[str, int]:
    """Every member's pages outside slots once `plan` applies (all gathered, in member order)."""
    change = _change(member, plan)
    slot = member.arena.ledger.snapshot().pages_slot
    slot += sum(len(_slot_head(member, i, plan.layers[i].bits)) for i in change.gained)
    slot -= sum(len(_slot_head(member, i, member.model.layer_bits[i])) for i in change.lost)
    slot += sum(len(_slot_head(member, i, bits)) - len(_slot_head(member, i, member.model.layer_bits[i]))
                for i, bits in change.rebits.items())
    mine = torch.tensor([member.arena.ledger.num_pages - slot], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in plan.members]
    with member.collective("gathering the members' free pages for a reshape"):
        dist.all_gather(counts, mine, group=member.group)
    return {m: int(c) for m, c in zip(plan.members, member.world.in_member_order(plan.members, counts))}


def _apply(member: "InstanceMember", plan: InstancePlan, verdict: Verdict) -> int:
    """Carry out `verdict` on this member (module docstring, round 2); returns the bytes it sent or received."""
    arena, model, me = member.arena, member.model, member.me
    kv = arena.kv_cache
    change = _change(member, plan)
    if verdict.copies.numel():
        kv[member.pages[verdict.copies[:, 1]]] = kv[member.pages[verdict.copies[:, 0]]]
    member.unmap_blocks(min(verdict.blocks, member.num_blocks))
    # Slot pages to take back: the heads of layers gained, the tails of layers going back to more bits.
    taken = {i: _slot_head(member, i, plan.layers[i].bits) for i in change.gained}
    for i, bits in change.rebits.items():
        if reclaim := _slot_moves(member, i, model.layer_bits[i], bits)[0]:
            taken[i] = reclaim
    member.vacate({p for pages in taken.values() for p in pages})
    for i, pages in taken.items():
        arena.ledger.assign_slot(i, pages)
    moved = 0
    for layer, src, dst in verdict.weights:
        if me in (src, dst):
            head = _slot_head(member, layer, plan.layers[layer].bits)
            data = arena.buffer[head.start * arena.page_bytes:head.stop * arena.page_bytes]
            member.hop(data, src, dst, f"layer {layer}'s weights")
            moved += data.numel()
            if me == dst:
                _adopt_layer(member, layer, plan.layers[layer].bits)
    for move in verdict.moves:
        if me in (move.src, move.dst):
            moved += _move_rows(member, move)
    for i, bits in change.rebits.items():
        _write_bits(member, i, bits)
    for i in change.lost:
        arena.ledger.release_slot_pages(i, _slot_head(member, i, model.layer_bits[i]))
        model.layers[i] = None
        member.full_copies.pop(i, None)
    member.map_blocks(verdict.blocks)
    member.adopt(plan)
    member.barrier("finishing a reshape")
    return moved


def _model_bits(member: "InstanceMember", bits: int) -> int:
    """A plan's bits as the model counts them: a plan says 16 for "as loaded", float32 included."""
    return member.model.full_bits if bits == FULL_BITS else bits


def layer_views(member: "InstanceMember", layer: int, bits: int) -> dict[str, torch.Tensor]:
    """`layer`'s tensors at `bits`, as views into its slot."""
    layout, _ = member.model.slot_layout(_model_bits(member, bits))
    return slot_views(member.arena, layer, layout)


def _adopt_layer(member: "InstanceMember", layer: int, bits: int) -> None:
    """Point the model at `layer`'s slot, holding the layer at `bits`."""
    member.model.layers[layer] = layer_views(member, layer, bits)
    member.model.layer_bits[layer] = _model_bits(member, bits)


def _write_bits(member: "InstanceMember", layer: int, bits: int) -> None:
    """Bring a held layer to `bits` in place, releasing the slot pages it no longer fills (its slot's head was
    taken back before, when it grows). Full precision comes from the copy kept when it was quantized here,
    else (a replica that arrived quantized) from the checkpoint, read again."""
    model, arena = member.model, member.arena
    bits = _model_bits(member, bits)
    _, release = _slot_moves(member, layer, model.layer_bits[layer], bits)
    full = member.full_copies.pop(layer, None)
    if full is None and model.layer_bits[layer] == model.full_bits:
        full = {name: t.clone() for name, t in model.layers[layer].items()}
    if full is None:
        full = {name: torch.empty_like(t) for name, t in layer_views(member, layer, model.full_bits).items()}
        load_layer(full, member.checkpoint, layer)
    if bits != model.full_bits:
        member.full_copies[layer] = full
    _adopt_layer(member, layer, bits)
    written = full if bits == model.full_bits else quantize_layer(full, bits, model.cfg, model.int4_packing)
    for name, tensor in written.items():
        model.layers[layer][name].copy_(tensor)
    if release:
        arena.ledger.release_slot_pages(layer, release)


def _move_rows(member: "InstanceMember", move: KvMove) -> int:
    """Send (or receive) the KV rows of `move.layers` in `move.blocks`."""
    kv = member.arena.kv_cache
    pages = member.pages[torch.tensor(move.blocks, dtype=torch.int64, device=member.device)]
    layers = torch.tensor(move.layers, dtype=torch.int64, device=member.device)
    if member.me == move.src:
        rows = kv[pages][:, :, layers].contiguous()
    else:
        rows = torch.empty((len(move.blocks), kv.shape[1], len(move.layers), *kv.shape[3:]), dtype=kv.dtype,
                           device=kv.device)
    member.hop(rows, move.src, move.dst, f"KV of layers {list(move.layers)}")
    if member.me == move.dst:
        for j, layer in enumerate(move.layers):
            kv[pages, :, layer] = rows[:, :, j]
    return rows.numel() * rows.element_size()
