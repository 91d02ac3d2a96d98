"""Which commands an executor takes in each of its roles, and the sentence it refuses the rest with.

The live executor (services/executor/service.py), an instance's follower (follower.py) and the simulator's executor
all ask `refusal`, so that a command refused live is refused in a simulation with the same words. A command's own
arguments (an instance id that is not this one, a layer that is not there) are checked where it applies.
"""

from enum import Enum


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
    if role is Role.MERGED:
        return (f"instance {instance} is a TP merge, which serves at the bits its layers had when it formed: {kind} it "
                f"after its split")
    return None
