"""Which planned commands go out now: the controller's delivery rules, pure so that the simulator runs them too.

An executor gets one command at a time: while one is in flight, plans for that executor are dropped, because
they were made from a state the running command is about to change. And a state whose telemetry from an
executor predates the answer to its last command does not show that command's effect yet (a swap changes
layers one by one): acting on it would repeat what was just done, so its plans for that executor are dropped
too. The next state plans afresh.

A join goes with its leader's commands, both or neither: the newcomer's join and the leader's replicate that
brings it in meet in their collectives, so one without the other would only wait out its timeout.
"""

from collections.abc import Collection, Mapping

from shared.core.policies.interface import PlannedCommand
from shared.messages import JoinArgs


def sendable(planned: list[PlannedCommand], busy: Collection[str], reported: Mapping[str, float],
             settled: Mapping[str, float]) -> dict[str, list[PlannedCommand]]:
    """`planned` grouped by executor in order, less those for an executor in `busy` (a command in flight) or
    whose telemetry in the state (`reported`: its time) is no newer than its last answer (`settled`), and less a
    join and its leader's commands where either of the two is left out."""
    by_executor: dict[str, list[PlannedCommand]] = {}
    partner: dict[str, str] = {}
    for p in planned:
        by_executor.setdefault(p.executor, []).append(p)
        if isinstance(p.args, JoinArgs):
            partner[p.executor], partner[p.args.leader] = p.args.leader, p.executor
    ready = {executor for executor in by_executor
             if executor not in busy and reported.get(executor, float("inf")) > settled.get(executor, float("-inf"))}
    return {executor: commands for executor, commands in by_executor.items()
            if executor in ready and partner.get(executor, executor) in ready}
