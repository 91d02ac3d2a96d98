"""What every policy is: a pure function from the cluster state to the commands it wants sent."""

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from shared.config import ControllerConfig
from shared.messages import ClusterState, CommandArgs


@dataclass(frozen=True)
class PlannedCommand:
    executor: str
    args: CommandArgs
    reason: str = ""  # why, in a sentence with the numbers that decided it: kept in the audit event
    # The signals the decision saw (violation rate, vacancy, predicted speed-up, ...), by name: kept in the
    # audit event beside the reason, so that a decision can be checked against its inputs afterwards.
    inputs: dict[str, Any] = field(default_factory=dict)


# (current state, earlier states oldest first, config) -> commands to send.
Policy = Callable[[ClusterState, list[ClusterState], ControllerConfig], list[PlannedCommand]]

Memory = TypeVar("Memory")


def updated(memory: Memory, **changes) -> Memory:
    """A policy's frozen memory with `changes`: the same one where nothing changes, as at most executors and
    instances at most states, where making new ones was a fifth of a decision at a thousand executors."""
    if all(getattr(memory, name) == value for name, value in changes.items()):
        return memory
    return replace(memory, **changes)
