"""Which commands an executor takes in each of its roles, and the sentence it refuses the rest with.

The live executor (services/executor/service.py), an instance's follower (follower.py) and the simulator's executor
all ask `refusal`, so that a command refused live is refused in a simulation with the same words. A command's own
arguments (an instance id that is not this one, a layer that is not there) are checked where it applies.
`join_refusal` says, from the cluster state, whether an executor may join another's instance for replicas.
"""

from enum import Enum

from shared.messages import ExecutorState


class Role(Enum):
    ALONE = "alone"  # serves by itself
    LEADER = "leader"  # leads a planned instance of several executors
    MERGED = "merged"  # leads an instance a tp_merge formed
    MEMBER = "member"  # follows an instance's leader


EVERY_ROLE = frozenset({"ping", "drain"})


def role_of(in_instance: bool, leads: bool, merged: bool) -> Role:
    if not in_instance:
        return Role.ALONE
    if not leads:
        return Role.MEMBER
    return Role.MERGED if merged else Role.LEADER


def refusal(role: Role, kind: str, executor: str, instance: str | None = None, leader: str | None = None
            ) -> str | None:
    """Why `executor`, in `role` in `instance` (led by `leader`), refuses a command of `kind`; None when it takes it."""
    if kind in EVERY_ROLE:
        return None
    if role is Role.MEMBER:
        return f"{executor} is a member of instance {instance}, which morphs as a whole: send it to its leader {leader}"
    if kind == "tp_split":
        return None if role is Role.MERGED else \
            f"{executor} leads no instance formed by tp_merge: it has nothing to split back into"
    if kind == "tp_merge":
        return None
    if kind == "join":
        return None if role is Role.ALONE else \
            f"{executor} is in instance {instance} already: only an executor serving alone joins another's"
    if role is Role.MERGED:
        return (f"instance {instance} is a TP merge, which serves at the bits its layers had when it formed: {kind} it "
                f"after its split")
    return None


def join_refusal(candidate: ExecutorState, leader: ExecutorState) -> str | None:
    """Why `candidate` cannot join the TP1 instance `leader` leads, to hold replicas of its layers (the gateway and
    the controller ask before they send a replicate or migrate onto it); None when it can."""
    name, t = candidate.executor, candidate.telemetry
    if not candidate.alive:
        return f"executor {name} is not alive"
    if t.plan is not None and (len(t.plan.members) > 1 or t.plan.leader != name):
        return f"executor {name} is in instance {t.plan.id} already: only an executor serving alone joins another's"
    if t.draining:
        return f"executor {name} is draining"
    if t.model != leader.telemetry.model:
        return f"executor {name} serves {t.model}, not {leader.telemetry.model}"
    if name not in leader.telemetry.world:
        return (f"executors {name} and {leader.executor} are no peers of one world of executors (`morphling up` "
                f"makes every executor of a model one), so they cannot form an instance")
    return None
