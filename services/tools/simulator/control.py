"""Commands reaching their executors in a simulation (mixed into Simulation, cluster.py): delivered after the bus's
latency, applied at the executor's step boundary while it steps nothing, a TP merge once every member has come to
its collective, a join once the newcomer and its leader have (joins.py), and answered after the bus's latency
again, each an event in the audit's shape.
"""

from services.tools.simulator import joins, tp
from services.tools.simulator.instance import SimulatedRefusal
from shared.core.policies.interface import PlannedCommand
from shared.messages import Event, JoinArgs, TpMergeArgs


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
        for k, (decided, planned) in enumerate(batch):
            if isinstance(planned.args, TpMergeArgs):
                self._at_merge(name, decided, planned, elapsed)
                return
            if (newcomer := joins.brings_in(executor, planned.args)) is not None:
                self._at_join(name, newcomer, decided, planned, elapsed, batch[k + 1:])
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
                for _, dropped in batch[k + 1:]:  # a join waiting on a command that never comes is refused
                    if (newcomer := joins.brings_in(executor, dropped.args)) is not None:
                        self._abandon_join(newcomer, f"join refused: {name}'s earlier command failed: {error}")
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

    def _at_join(self, name: str, newcomer: str, decided: float, planned: PlannedCommand, elapsed: float,
                 rest: list) -> None:
        """The newcomer's join or the leader's command that brings it in, at their collective (joins.py): it waits
        there (steps nothing) until the other has come; then the newcomer joins, or both refuse alike. `rest`: the
        commands delivered with it, taken after it unless it is refused."""
        self._blocked.add(name)
        side = "join" if isinstance(planned.args, JoinArgs) else "lead"
        if side == "join" and (refused := self._refused_joins.pop(newcomer, None)):
            self._answer_join(newcomer, {side: (name, decided, planned, rest)}, self.now + elapsed, {}, 0.0, refused)
            return
        meeting = self._joining.setdefault(newcomer, {})
        meeting[side] = (name, decided, planned, rest)
        if len(meeting) < 2:
            return
        del self._joining[newcomer]
        (leader, _, lead, _), (_, _, join, _) = meeting["lead"], meeting["join"]
        start = self.now + elapsed
        try:
            if join.args.leader != leader or join.args.instance != lead.args.instance:
                raise SimulatedRefusal(f"join refused: {newcomer} joins {join.args.leader}'s instance "
                                       f"{join.args.instance}, not {leader}'s {lead.args.instance}")
            state, seconds = joins.join(self.executors[leader], self.executors[newcomer], lead.args)
            error = None
        except SimulatedRefusal as exc:
            state, seconds, error = {}, 0.0, str(exc)
        self._answer_join(newcomer, meeting, start, state, seconds, error)

    def _answer_join(self, newcomer: str, meeting: dict, start: float, state: dict, seconds: float,
                     error: str | None) -> None:
        answered = start + seconds + self.settings.bus_latency_s
        for side, (name, decided, planned, rest) in meeting.items():
            mine = state if side == "lead" else {"plan": state["plan"]} if "plan" in state else {}
            self.events.append(Event(kind="command", source="controller", time=answered, data={
                "executor": name, "kind": planned.args.kind, "args": planned.args.model_dump(by_alias=True),
                "ok": error is None, "error": error, "latency_s": answered - decided,
                "state": mine | {"seconds": seconds}, "reason": planned.reason}))
            if error is None:  # else they build on one refused: the next plan starts afresh
                self._inbox[name] = rest + self._inbox.get(name, [])
            self.at(start + seconds, self._applied, name, answered)

    def _abandon_join(self, newcomer: str, why: str) -> None:
        """The leader's side of `newcomer`'s join will not come: a join waiting is refused now, one to come then."""
        meeting = self._joining.get(newcomer)
        if meeting is not None and "join" in meeting:
            del self._joining[newcomer]
            self._answer_join(newcomer, {"join": meeting["join"]}, self.now, {}, 0.0, why)
        else:
            self._refused_joins[newcomer] = why

    def _applied(self, name: str, answered: float) -> None:
        self._blocked.discard(name)
        self._busy.discard(name)
        self._settled[name] = answered
        self._take_next(name)
