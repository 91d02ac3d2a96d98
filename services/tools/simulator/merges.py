"""The gateway's AMOEBAs merges in a simulation: a request longer than its instance holds even empty waits
for a TP merge that holds it (services/gateway/tp_merges.py's MergeScheduler.make_room, step by step on
simulated time, with its decisions imported: shared/tp_scheduler.decide, the four-at-once step, the refusals).

As the gateway: one merge at a time (requests that need one meanwhile see its result first); an instance
draining towards its split that holds the request takes it back; a view behind the executors asks again a
little later; a merge goes to every member, and once they answer, the request waits for the monitor's state
to show the merged instance (at most SHOWN_WAIT_S) and is admitted on its leader.
"""

from services.gateway.tp_merges import SHOWN_WAIT_S, MergeScheduler, allowed_in, merge_refusal, merged_id, shown
from services.tools.simulator.executor import SimRequest
from shared.core.policies.interface import PlannedCommand
from shared.core.tp_scheduler import Merge, Refuse, Route, SchedulerState, decide, instances_from
from shared.messages import TpMergeArgs

POLL_S = 0.05  # the gateway's, between looks at the state
STRATEGY = "amoebas"


class MergeRoom:
    def __init__(self, sim, free_fraction: float):
        self.sim, self.free_fraction = sim, free_fraction
        self.turns = SchedulerState()
        self.pending: tuple[TpMergeArgs, SimRequest] | None = None
        self.waiters: list[SimRequest] = []

    def make_room(self, request: SimRequest) -> None:
        if self.pending is not None:
            self.waiters.append(request)
            return
        sim, state = self.sim, self.sim.state
        tokens = request.prompt_tokens + request.output_tokens
        instances = instances_from(state, request.model, self.free_fraction)
        need = -(-tokens // instances[0].block_size) if instances else 0
        for closed in (i for i in instances if not i.accepting and i.blocks_free >= need):
            sim.admit_on(closed.members[0].executor, request)
            return
        decision = decide(tokens, instances, STRATEGY, allowed_in(state), self.turns)
        if isinstance(decision, Merge) and (four := MergeScheduler.four_for(need, decision, instances, state)):
            decision = four
        if isinstance(decision, Refuse):
            sim.fail(request, f"{'400' if decision.never else '503'}: {decision.reason}")
            return
        if isinstance(decision, Route):  # the view is behind what the executors said: ask again
            sim.at(sim.now + 4 * POLL_S, sim.arrive, request)
            return
        by_id = {i.id: i for i in instances}
        executors = [m.executor for i in decision.instances for m in by_id[i].members]
        if any(by_id[i].tp > 1 for i in decision.instances):
            sim.fail(request, f"503: the request of {tokens} tokens needs instances {list(decision.instances)} "
                              f"merged further, and only executors serving alone merge")
            return
        if (why := merge_refusal(state, executors)) is not None:
            sim.fail(request, f"503: no merge can make room now: {why}")
            return
        args = TpMergeArgs(executors=executors, instance=merged_id(executors))
        self.pending = (args, request)
        reason = f"AMOEBAs ({STRATEGY}): a request of {tokens} tokens fits no instance"
        for name in executors:
            sim.send(name, [PlannedCommand(name, args, reason)])

    def answered(self, instance: str, ok: bool, error: str | None) -> None:
        """Every member answered the pending merge."""
        args, request = self.pending
        if not ok:
            self.sim.fail(request, f"503: the merge that would hold the request was refused: {error}")
            self._next()
            return
        self._wait_shown(self.sim.now + SHOWN_WAIT_S)

    def _wait_shown(self, deadline: float) -> None:
        args, request = self.pending
        if self.sim.now < deadline and not (self.sim.state and shown(args.instance, args.executors)(self.sim.state)):
            self.sim.at(self.sim.now + POLL_S, self._wait_shown, deadline)
            return
        self.sim.admit_on(args.executors[0], request)
        self._next()

    def _next(self) -> None:
        self.pending = None
        waiting, self.waiters = self.waiters, []
        for request in waiting:
            self.sim.arrive(request)
