"""Which planned commands go out now: the controller's delivery rules, pure so that the simulator runs them too.

An executor gets one command at a time: while one is in flight, plans for that executor are dropped, because
they were made from a state the running command is about to change. And a state whose telemetry from an
executor predates the answer to its last command does not show that command's effect yet (a swap changes
layers one by one): acting on it would repeat what was just done, so its plans for that executor are dropped
too. The next state plans afresh.
"""

from collections.abc import Collection, Mapping

from shared.core.policies.interface import PlannedCommand


def sendable(planned: list[PlannedCommand], busy: Collection[str], reported: Mapping[str, float],
             settled: Mapping[str, float]) -> dict[str, list[PlannedCommand]]:
    """`planned` grouped by executor in order, less those for an executor in `busy` (a command in flight) or
    whose telemetry in the state (`reported`: its time) is no newer than its last answer (`settled`)."""
    by_executor: dict[str, list[PlannedCommand]] = {}
    for p in planned:
        by_executor.setdefault(p.executor, []).append(p)
    return {executor: commands for executor, commands in by_executor.items()
            if executor not in busy
            and reported.get(executor, float("inf")) > settled.get(executor, float("-inf"))}
