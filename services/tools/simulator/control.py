"""Commands reaching their executors in a simulation (mixed into Simulation, cluster.py): delivered after the bus's
latency, applied at the executor's step boundary while it steps nothing, a TP merge once every member has come to
its collective, and answered after the bus's latency again, each an event in the audit's shape.
"""

from services.tools.simulator import tp
from services.tools.simulator.instance import SimulatedRefusal
from shared.core.policies.interface import PlannedCommand
from shared.messages import Event, TpMergeArgs


class SimControl:
    def _deliver(self, name: str, commands: list[PlannedCommand], decided: float) -> None:
        self._inbox.setdefault(name, []).extend((decided, c) for c in commands)
        if name in self._stepping:
            self._cut(name)
        elif name not in self._blocked:  # else applying earlier ones or at a merge's collective: they wait their turn
            self._apply(name)

    def _apply(self, name: str) -> None:
        """At a step boundary: every delivered command in order, the executor blocked while they take."""
        executor, elapsed = self.executors[name], 0.0
        batch, self._inbox[name] = self._inbox.get(name, []), []
        for decided, planned in batch:
            if isinstance(planned.args, TpMergeArgs):
                self._at_merge(name, decided, planned, elapsed)
                return
            try:
                state, seconds = executor.apply(planned.args)
                ok, error = True, None
            except SimulatedRefusal as exc:
                state, seconds, ok, error = {}, 0.0, False, str(exc)
            elapsed += seconds
            answered = self.now + elapsed + self.settings.bus_latency_s
            self.events.append(Event(kind="command", source="controller", time=answered, data={
                "executor": name, "kind": planned.args.kind, "args": planned.args.model_dump(by_alias=True),
                "ok": ok, "error": error, "latency_s": answered - decided, "state": state | {"seconds": seconds},
                "reason": planned.reason}))
            if not ok:
                break
        self._blocked.add(name)
        self.at(self.now + elapsed, self._applied, name, self.now + elapsed + self.settings.bus_latency_s)

    def _at_merge(self, name: str, decided: float, planned: PlannedCommand, elapsed: float) -> None:
        """A member at a merge's collective: it waits there (steps nothing) until every member has come; then
        they merge, or all refuse alike."""
        args = planned.args
        self._blocked.add(name)
        arrived = self._merging.setdefault(args.instance, set())
        arrived.add(name)
        if arrived != set(args.executors):
            return
        del self._merging[args.instance]
        start = self.now + elapsed
        try:
            _, state, seconds = tp.merge({n: self.executors[n] for n in args.executors}, args, start)
            ok, error = True, None
        except SimulatedRefusal as exc:
            state, seconds, ok, error = {}, 0.0, False, str(exc)
        for member in args.executors:
            answered = start + seconds + self.settings.bus_latency_s
            self.events.append(Event(kind="command", source="gateway", time=answered, data={
                "executor": member, "kind": args.kind, "args": args.model_dump(by_alias=True), "ok": ok,
                "error": error, "latency_s": answered - decided, "state": state | {"seconds": seconds},
                "reason": planned.reason}))
            self.at(start + seconds, self._applied, member, answered)
        self.merges.answered(args.instance, ok, error)

    def _applied(self, name: str, answered: float) -> None:
        self._blocked.discard(name)
        self._busy.discard(name)
        self._settled[name] = answered
        self._take_next(name)
