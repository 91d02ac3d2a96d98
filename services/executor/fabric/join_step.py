"""The part of a join (enlist.py) that every member of the growing instance takes alike: the leader's plan sent to
the newcomer, what each member gathers, and the refusal each derives from it; and a member's whole part, the JOIN
step. Apart from enlist.py because members follow JOIN steps (member.py), and enlist.py builds members."""

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from services.executor.fabric import step as wire
from services.executor.fabric.world import World, checked
from shared.core.errors import ReshapeRefused
from shared.messages import InstancePlan

if TYPE_CHECKING:
    from services.executor.fabric.member import InstanceMember

log = logging.getLogger(__name__)


def follow_join(member: "InstanceMember", step: wire.StepPlan) -> None:
    """A member's part in a newcomer joining its instance (the JOIN step): the gather, then the plan that names
    the newcomer, unless every one refused."""
    grown = wire.payload_plan(step.payload)
    newcomer = grown.members[-1]
    everyone = gather(member.world, grown, {"capacity": member.arena.ledger.num_pages}, member)
    try:
        capacity_or_refuse(grown, newcomer, everyone)
    except ReshapeRefused as exc:
        log.warning("executor %s: %s", member.me, exc)
        return
    member.adopt(grown)
    member.barrier("finishing a join")


def broadcast_plan(world: World, pair: tuple[str, str], leader: str, payload: torch.Tensor | None) -> torch.Tensor:
    """The leader's plan payload on both ends of `pair` (the other passes None)."""
    group, src = world.group(pair), world.group_rank(pair, leader)
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    dist.broadcast(size, group=group, group_src=src)
    if payload is None:
        payload = torch.empty(int(size), dtype=torch.int64)
    dist.broadcast(payload, group=group, group_src=src)
    return payload


def gather(world: World, plan: InstancePlan, mine: dict, member: "InstanceMember | None" = None) -> list[dict]:
    """Every member's `mine` of `plan` (the grown instance), in member order."""
    everyone: list[dict] = [None] * len(plan.members)  # type: ignore[list-item]
    what = f"instance {plan.id}: sharing what each member holds for a join"
    with member.collective(what) if member is not None else checked(what):
        dist.all_gather_object(everyone, mine, group=world.group(plan.members))
    return world.in_member_order(plan.members, everyone)


def capacity_or_refuse(plan: InstancePlan, newcomer: str, everyone: list[dict]) -> int:
    """What every member decides alike from the gather: ReshapeRefused where the newcomer cannot back the
    instance's blocks, else the most blocks the grown instance could ever have."""
    blocks = everyone[plan.members.index(plan.leader)]["blocks"]
    pages = everyone[plan.members.index(newcomer)]["pages"]
    if pages < blocks:
        raise ReshapeRefused(f"no memory: {newcomer} can back {pages} KV blocks without its layers, fewer than "
                             f"the {blocks} of instance {plan.id}")
    return min(e["capacity"] for e in everyone)
