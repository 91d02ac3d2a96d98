"""CoCoServe onto a simulated executor serving alone, as services/executor/fabric/enlist.py does it: the executor
joins a leader's TP1 instance to hold the replicas (or migrated layers) that the leader's replicate or migrate
brings it, and leaves once it holds none.

Joining happens where the leader's command and the newcomer's join meet (control.py's collective). They refuse
alike, with nothing changed, where the leader is no executor serving alone (the simulator models recruits of the
controller's, which only joins those, shared/core/policies/cocoserve_recruits.py), where the two are not one
world, or where the newcomer's arena holds fewer pages than the leader's KV blocks. The leader's sequences keep
their blocks, renumbered as the instance's. The newcomer drops every slot (they become KV pages), backs those
blocks, and hands its sequences to the leader, preempted after the tokens they have, so the leader computes
their KV again. The leader's command is then the instance's reshape; where the reshape is refused, the newcomer
leaves again at once.

Leaving (`part`, after every reshape): a member that joined and holds no layer takes its whole model back at full
precision and serves alone; a leader then alone serves alone again, and its blocks are its pages once more.
"""

from services.tools.simulator.instance import SimInstance, SimulatedRefusal
from shared.core.memory.block_manager import BlockManager
from shared.core.planner.memory import FULL_BITS
from shared.core.plans import alone, layers_on
from shared.core.scheduling.scheduler import Scheduler
from shared.core.scheduling.sequence import Sequence, Status
from shared.messages import JoinArgs, MigrateArgs, ReplicateArgs


def brings_in(executor, args) -> str | None:
    """The executor that `args`, taken by `executor`, brings into an instance (a join's collective): a join's own
    executor, or the executor outside its plan that a leader's replicate or migrate names."""
    if isinstance(args, JoinArgs):
        return executor.id
    if isinstance(args, (ReplicateArgs, MigrateArgs)) and executor.leads and executor.plan is not None \
            and args.to not in executor.plan.members:
        return args.to
    return None


def refusal(leader, newcomer, instance: str) -> str | None:
    """Why the two cannot meet in a join of `instance`; None where they can."""
    if leader.group is not None or leader.plan is None or leader.plan.id != instance:
        return (f"join refused: {leader.id} serves no instance {instance!r} alone (the simulator models joins onto "
                f"an executor serving alone, the controller's recruits)")
    if newcomer.group is not None:
        return f"join refused: {newcomer.id} is in instance {newcomer.group.plan.id} already"
    if newcomer.id not in leader.world:
        return f"join refused: {newcomer.id} is not a peer of {leader.id}'s world of executors"
    blocks = leader.outside_slots()
    if newcomer.ledger.num_pages < blocks:
        return (f"join refused: no memory: {newcomer.id} can back {newcomer.ledger.num_pages} KV blocks without its "
                f"layers, fewer than the {blocks} of instance {instance}")
    if blocks < leader.sequence_blocks():  # the reshape would be refused, and the newcomer leave at once
        return (f"join refused: no memory: instance {instance} would have {blocks} KV blocks, fewer than one "
                f"sequence of the longest length needs ({leader.sequence_blocks()})")
    return None


def join(leader, newcomer, op: ReplicateArgs | MigrateArgs) -> tuple[dict, float]:
    """The two meet: `newcomer` joins the instance `leader` serves alone and `op` is its reshape. (The leader's
    result state, the seconds.) SimulatedRefusal, nothing changed, where they refuse."""
    if (why := refusal(leader, newcomer, op.instance)) is not None:
        raise SimulatedRefusal(why)
    leader.release_batch()
    newcomer.release_batch()
    for seq in list(newcomer.scheduler.running):
        newcomer.scheduler.preempt(seq)
    own = leader.scheduler
    moving = [*_detach(own, leader.blocks), *_detach(newcomer.scheduler, newcomer.blocks)]
    plan = leader.plan.model_copy(update={"members": [*leader.plan.members, newcomer.id]})
    instance = SimInstance(plan, {leader.id: leader, newcomer.id: newcomer})
    instance.joined = {newcomer.id}
    _attach(instance.scheduler, instance.ledger, own, moving)
    for request in newcomer.requests.values():
        request.executor = leader.id
    leader.requests.update(newcomer.requests)
    newcomer.requests.clear()
    leader.longest = newcomer.longest = None
    try:
        state, seconds = instance.reshape(op)
    except SimulatedRefusal:
        part(instance)
        raise
    left = part(instance)
    return {**state, "joined": newcomer.id, **({"left": left} if left else {})}, seconds


def part(instance: SimInstance) -> list[str]:
    """After a reshape: the members that joined and hold no layer leave, each serving alone with its whole model
    at full precision again; a leader then alone serves alone again. Returns those that left."""
    plan = instance.plan
    idle = [m for m in plan.members if m in instance.joined and not layers_on(plan, m)]
    if not idle:
        return []
    every = list(range(len(plan.layers)))
    for name in idle:
        member = instance.members.pop(name)
        member.unmap_blocks(0)
        member.hold(every, [FULL_BITS] * len(every))
        member.group, member.plan = None, alone(name, len(every))
        instance.joined.discard(name)
    instance.adopt(plan.model_copy(update={"members": [m for m in plan.members if m not in idle]}))
    if len(instance.members) == 1:
        _serve_alone(instance)
    return idle


def _serve_alone(instance: SimInstance) -> None:
    """The leader's instance of one, formed by a join, ends: its blocks are its pages again."""
    leader = instance.leader
    leader.release_batch()
    moving = _detach(instance.scheduler, instance.blocks)
    leader.unmap_blocks(0)
    leader.take_arena(leader.ledger)
    _attach(leader.scheduler, leader.ledger, instance.scheduler, moving)
    leader.group, leader.plan, leader.longest = None, instance.plan, None


def _detach(scheduler: Scheduler, blocks: BlockManager) -> list[tuple[Sequence, int]]:
    """Every sequence of `scheduler`, running first, taken out with its pages freed: each with how many it held."""
    out = []
    for seq in [*scheduler.running, *scheduler.waiting]:
        count = len(seq.block_table)
        blocks.free(seq)
        out.append((seq, count))
    scheduler.running.clear()
    scheduler.waiting.clear()
    return out


def _attach(scheduler: Scheduler, ledger, before: Scheduler, moving: list[tuple[Sequence, int]]) -> None:
    """`moving` into `scheduler`, each with as many pages of `ledger` as it held, waiting ones by arrival; the batch
    cap and the pressure counts those of `before`, which they served in until now."""
    scheduler.max_num_seqs, scheduler.configured_max_num_seqs = before.max_num_seqs, before.configured_max_num_seqs
    scheduler.num_preemptions, scheduler.num_admission_blocked = before.num_preemptions, before.num_admission_blocked
    waiting = []
    for seq, count in moving:
        seq.block_table = ledger.allocate_many(count)
        (scheduler.running if seq.status is Status.RUNNING else waiting).append(seq)
    scheduler.waiting.extend(sorted(waiting, key=lambda s: s.arrival_time))
