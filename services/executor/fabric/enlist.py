"""CoCoServe onto any executor with the memory (§3.1): an executor serving alone joins a TP1 instance to hold
replicas of its layers, or layers migrated to it, and leaves it once it holds none.

Joining, between two steps (the leader then carries out the replicate or migrate that asked for the newcomer):
1. the leader sends the newcomer the plan that names it, in their pair's group; then, when it leads members
   already, them too (a JOIN step), so that a newcomer that never comes costs them nothing;
2. everyone in the new instance's group gathers the leader's KV block count and the newcomer's pages and
   sequences; where the newcomer cannot back the instance's blocks, all refuse alike and nothing changed;
3. a leader that served alone becomes an instance of one first: its model, arena and KV stay as they are, its
   pages become block ids (the live ones first). The newcomer drops every layer (its slots become KV pages),
   backs the instance's blocks and hands its sequences to the leader, which computes their KV again (to its
   scheduler they are sequences preempted after the tokens they have). It holds no layer until the reshape
   brings some.

Leaving (the leader, after a reshape that left a newcomer without layers; a planned spare member stays): a PART
step with the plan without it. That member takes its whole model back from its checkpoint at full precision and
serves alone; a leader left alone in an instance a join formed serves alone again, its block ids its pages once
more.
"""

import logging
import time
from typing import TYPE_CHECKING

import torch

from services.executor.engine.scheduling import handover
from services.executor.fabric import join_step
from services.executor.fabric import step as wire
from services.executor.fabric.leader import InstanceRunner
from services.executor.fabric.member import InstanceMember
from services.executor.fabric.world import FabricError, World, checked
from shared.core.errors import ReshapeRefused
from shared.core.plans import layers_on
from shared.messages import InstancePlan

if TYPE_CHECKING:
    from services.executor.engine.engine import LLMEngine

log = logging.getLogger(__name__)


def lead_join(engine: "LLMEngine", world: World, plan: InstancePlan, newcomer: str) -> tuple[list, dict]:
    """The leader's part in `newcomer` joining the TP1 instance it leads (`plan`: the plan it serves now; alone,
    its one-member plan). Returns (what the newcomer sent along with its sequences, a report); ReshapeRefused,
    with nothing changed, when the newcomer does not come or cannot back the instance's blocks."""
    if plan.tp > 1 or plan.merged:
        raise ReshapeRefused(f"instance {plan.id} is TP{plan.tp}: its layers are sharded over every member, so no "
                             f"executor joins it for replicas")
    if newcomer in plan.members:
        raise ReshapeRefused(f"{newcomer} is a member of instance {plan.id} already")
    start = time.perf_counter()
    grown = plan.model_copy(update={"members": [*plan.members, newcomer]})
    pair = (plan.leader, newcomer)
    try:
        with checked(f"sending {newcomer} the plan of instance {plan.id}"):
            join_step.broadcast_plan(world, pair, plan.leader, wire.plan_payload(grown))
    except FabricError as exc:
        world.drop(pair)
        raise ReshapeRefused(f"{newcomer} did not join instance {plan.id}: {exc}") from None
    member = engine.member
    if member is not None:
        member.send_step(wire.StepPlan(wire.JOIN, payload=wire.plan_payload(grown)))
    ledger = engine.arena.ledger
    blocks = member.num_blocks if member is not None else ledger.num_free + len(_held(engine))
    try:
        everyone = join_step.gather(world, grown, {"blocks": blocks, "capacity": ledger.num_pages}, member)
    except FabricError as exc:
        if member is not None:  # its members already wait on the newcomer: the instance cannot go on
            raise
        world.drop(pair)
        raise ReshapeRefused(f"{newcomer} did not join instance {plan.id}: {exc}") from None
    shared_s = time.perf_counter() - start
    capacity = join_step.capacity_or_refuse(grown, newcomer, everyone)
    if member is None:
        member = _instance_of_one(engine, world, grown, capacity)
    else:
        member.adopt(grown)
        member.capacity = min(member.capacity, capacity)
    member.joined.add(newcomer)
    carried = everyone[grown.members.index(newcomer)]
    for packed in carried["seqs"]:  # to the scheduler, sequences preempted after the tokens they have
        engine.adopt(handover.preempted(packed), [])
    member.barrier("finishing a join")
    report = {"joined": newcomer, "blocks": member.num_blocks, "sequences_recomputed": len(carried["seqs"]),
              "share_s": shared_s, "join_s": time.perf_counter() - start}
    log.info("executor %s: %s joined instance %s: %s", plan.leader, newcomer, plan.id, report)
    return carried["carry"], report


def join(engine: "LLMEngine", world: World, me: str, leader: str, instance_id: str, carry: object = None
         ) -> InstanceMember:
    """The newcomer's part: join the instance `leader` leads and follow it, holding no layer yet, its sequences
    (and `carry`, picklable: the service's record of its requests) handed to the leader. ReshapeRefused, with
    nothing changed, when the leader does not send a plan or the instance's blocks do not fit here."""
    pair = (leader, me)
    try:
        with checked(f"waiting for instance {instance_id}'s plan from {leader}"):
            payload = join_step.broadcast_plan(world, pair, leader, None)
        plan = wire.payload_plan(payload)
        ledger = engine.arena.ledger
        everyone = join_step.gather(world, plan, {"pages": ledger.num_present, "capacity": ledger.num_pages,
                                                  "seqs": engine.export_sequences(), "carry": carry})
    except FabricError as exc:
        world.drop(pair)
        raise ReshapeRefused(f"{me} could not join instance {instance_id} led by {leader}: {exc}") from None
    capacity = join_step.capacity_or_refuse(plan, me, everyone)
    blocks = everyone[plan.members.index(plan.leader)]["blocks"]
    engine.hand_over()
    released = engine.swapper.release_all()
    ledger.reset_kv({})
    pages = torch.tensor(ledger.allocate_many(blocks), dtype=torch.int64)
    member = InstanceMember.from_engine(world, plan, me, engine, pages, capacity)
    member.barrier("finishing a join")
    log.info("executor %s: joined instance %s led by %s, holding no layer yet (%d slot pages now KV), %d KV "
             "blocks", me, plan.id, leader, released, blocks)
    return member


def lead_part(engine: "LLMEngine", member: InstanceMember) -> tuple[list[str], InstancePlan]:
    """After a reshape, the leader's: the members that joined at run time and hold no layer leave the instance (a
    PART step); a leader then alone in an instance a join formed serves alone again. Returns (those that left,
    the plan it serves afterwards)."""
    plan = member.plan
    idle = [m for m in plan.members if m in member.joined and not layers_on(plan, m)]  # a planned spare stays
    if not idle:
        return [], plan
    rest = plan.model_copy(update={"members": [m for m in plan.members if m not in idle]})
    member.send_step(wire.StepPlan(wire.PART, payload=wire.plan_payload(rest)))
    member.adopt(rest)
    member.joined -= set(idle)
    if rest.members == [rest.leader]:  # an instance of one that joins formed (a planned one has planned members)
        _serve_alone(engine, member)
    log.info("executor %s: %s left instance %s", plan.leader, idle, plan.id)
    return idle, rest


def leave(engine: "LLMEngine", member: InstanceMember) -> int:
    """The newcomer's, once a PART step left it out (it holds no layer): its whole model back from its checkpoint
    at full precision, every KV page free; it serves alone again. Returns the slot pages it took back."""
    engine.arena.ledger.reset_kv({})  # the pages that backed the instance's blocks too
    taken = engine.swapper.reload_all(engine.checkpoint)
    log.info("executor %s: left instance %s; serving alone with the whole model again", member.me, member.plan.id)
    return taken


def _held(engine: "LLMEngine") -> list[int]:
    """What the engine's sequences hold: pages while it serves alone, block ids while it leads an instance."""
    return sorted({p for s in [*engine.scheduler.running, *engine.scheduler.waiting] for p in s.block_table})


def _instance_of_one(engine: "LLMEngine", world: World, plan: InstancePlan, capacity: int) -> InstanceMember:
    """The leader that served alone leads `plan` from now on: its KV pages are the instance's blocks, the live
    ones first, each with its reference count; its sequences' block tables become block ids."""
    ledger = engine.arena.ledger
    live = _held(engine)
    refs = {p: ledger.refcount(p) for p in live}
    page_of = live + ledger.free_pages()
    ledger.reset_kv({p: 1 for p in page_of})  # each backs one block; the instance's ledger counts references
    member = InstanceMember.from_engine(world, plan, plan.leader, engine, torch.tensor(page_of, dtype=torch.int64),
                                        capacity)
    block_of = {p: b for b, p in enumerate(page_of)}
    for page, rc in refs.items():
        member.blocks.claim(block_of[page])
        for _ in range(rc - 1):
            member.blocks.incref(block_of[page])
    engine.lead_instance(InstanceRunner(member, engine.config.block_size),
                         lambda _, table: [block_of[p] for p in table], [])
    return member


def _serve_alone(engine: "LLMEngine", member: InstanceMember) -> None:
    """The leader's instance of one, formed by a join, ends: its blocks are its pages again."""
    engine.arena.ledger.reset_kv({member.page_of[b]: member.blocks.refcount(b) for b in _held(engine)})
    engine.serve_alone(lambda table: [member.page_of[b] for b in table], lambda _: True, [])
