"""AMOEBAs in the gateway: a request longer than every instance holds waits for a TP merge that holds it
(§3.3), and the admin's `tp_merge` and `tp_split` go out from here too.

The executors answer such a request's admission with KV_CAPACITY and its prompt length; the gateway then
asks shared/tp_scheduler.decide where it goes given the cluster state: an instance that holds it (one that
was draining towards its split takes it back), a merge first, or a refusal (400: no instance this cluster
can form holds it). Choice: where decide steps TP1 -> TP2 and a TP2 instance would not hold the request
either, four executors serving alone merge into TP4 at once (the runtime merges only executors that serve
alone, so decide's next step, two TP2 instances into one, is not taken). A merge goes to every member at
once (each takes its part at a step boundary) and is awaited until the monitor shows the merged instance;
the request is then admitted on its leader. One merge runs at a time per gateway: requests arriving
meanwhile see its result before they ask for another.
"""

import asyncio
import itertools
import logging
import time

from services.gateway.openai_api import ApiError
from shared.commands import CommandSender
from shared.core.tp_scheduler import (MAX_TP, Merge, Refuse, Route, SchedulerState, capacity, decide, instances_from,
                                 world_allows)
from shared.messages import ClusterState, CommandResult, TpMergeArgs

log = logging.getLogger(__name__)

SHOWN_WAIT_S = 5.0  # for the monitor's view to show a merge the executors answered
_POLL_S = 0.05


def merged_id(executors: list[str] | tuple[str, ...]) -> str:
    """The id of the instance `executors` merge into: the same whoever asks, so that all members agree."""
    return "tp-" + "-".join(executors)


def allowed_in(state: ClusterState | None):
    """decide()'s `allowed`: whether executors can form one instance, by the world their telemetry reports."""
    worlds = {e.executor: e.telemetry.world for e in (state.executors if state else [])}

    def allowed(members: tuple[str, ...]) -> bool:
        world = worlds.get(members[0]) or []
        return all(worlds.get(m) == world for m in members) and world_allows(world, members)
    return allowed


def merge_refusal(state: ClusterState | None, executors: list[str]) -> str | None:
    """Why `executors` cannot merge now, by the cluster state (each executor checks the same again)."""
    live = {e.executor: e for e in (state.executors if state else []) if e.alive}
    for name in executors:
        e = live.get(name)
        if e is None:
            return f"executor {name} is not alive"
        if e.telemetry.plan is not None and len(e.telemetry.plan.members) > 1:
            return f"executor {name} is already in instance {e.telemetry.plan.id}: only executors serving alone merge"
    if not allowed_in(state)(tuple(executors)):
        return (f"executors {executors} cannot form one instance: they must share a world, two of them, or four "
                f"consecutive ranks from a multiple of four")
    return None


async def send_merge(sender: CommandSender, executors: list[str], reason: str,
                     hold_s: float = TpMergeArgs.model_fields["hold_s"].default) -> list[CommandResult]:
    args = TpMergeArgs(executors=list(executors), instance=merged_id(executors), hold_s=hold_s)
    return list(await asyncio.gather(*(sender.send(e, args, reason) for e in executors)))


async def wait_shown(get_state, shows, timeout_s: float = SHOWN_WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (state := get_state()) is not None and shows(state):
            return True
        await asyncio.sleep(_POLL_S)
    return False


def shown(instance: str, executors: list[str]):
    """A view shows `executors` serving as `instance`: each of them reports it."""
    return lambda state: all(any(e.executor == name and e.telemetry.plan is not None and e.telemetry.plan.id ==
                                 instance for e in state.executors) for name in executors)


class MergeScheduler:
    """Makes room for a request no instance holds, by the strategy the gateway runs (amoebas, rr or llf)."""

    def __init__(self, sender: CommandSender, get_state, strategy: str = "amoebas", free_fraction: float = 0.5):
        self.sender, self.get_state, self.strategy, self.free_fraction = sender, get_state, strategy, free_fraction
        self._lock = asyncio.Lock()
        self._rr = SchedulerState()

    async def make_room(self, tokens: int, model: str, chosen: str) -> str | None:
        """The leader to admit a request of `tokens` on: that of the instance merged for it, once the monitor
        shows it, or of one that was draining towards its split and holds it; None when the cluster view is
        behind (ask again); ApiError when no merge can make room. `chosen`: the leader the baselines (rr, llf)
        picked for it, which merges with its least-loaded peer."""
        async with self._lock:
            state = self.get_state()
            instances = instances_from(state, model, self.free_fraction)
            need = -(-tokens // instances[0].block_size) if instances else 0
            for closed in (i for i in instances if not i.accepting and i.blocks_free >= need):
                return closed.members[0].executor
            decision = decide(tokens, instances, self.strategy, allowed_in(state), self._rr)
            if self.strategy != "amoebas" and (with_peer := self._with_peer(chosen, instances, state)):
                decision = with_peer
            elif isinstance(decision, Merge) and (four := self.four_for(need, decision, instances, state)):
                decision = four
            if isinstance(decision, Refuse):
                if decision.never:
                    raise ApiError(400, f"This model's context cannot hold the request here: {decision.reason}",
                                   "invalid_request_error", "max_tokens", "context_length_exceeded")
                raise ApiError(503, decision.reason, "server_error", None, "no_capacity")
            if isinstance(decision, Route):  # the view is behind what the executors said: ask again
                await asyncio.sleep(_POLL_S * 4)
                return None
            return await self._merge(decision, instances, state, tokens)

    @staticmethod
    def _with_peer(chosen: str, instances, state: ClusterState) -> Merge | None:
        """The baselines' merge: the instance `chosen` leads with its least-loaded peer of the same degree."""
        mine = next((i for i in instances if i.members[0].executor == chosen), None)
        if mine is None or not mine.accepting:
            return None
        allowed = allowed_in(state)
        peers = sorted((i for i in instances if i.tp == mine.tp and i.id != mine.id and i.accepting
                        and allowed(tuple(m.executor for m in (*mine.members, *i.members)))),
                       key=lambda i: (i.load, i.id))
        return Merge((mine.id, peers[0].id), mine.tp * 2) if peers and mine.tp < MAX_TP else None

    @staticmethod
    def four_for(need: int, decision: Merge, instances, state: ClusterState) -> Merge | None:
        """decide's step from TP1 to TP2 when the TP2 instance would not hold `need` blocks either: the runtime
        merges only executors serving alone, so the two steps are taken at once, on the least-loaded aligned
        four that hold it (None: keep the step)."""
        by_id = {i.id: i for i in instances}
        pair = tuple(m for i in decision.instances for m in by_id[i].members)
        if decision.tp != 2 or capacity(pair, instances[0].kv_heads) - sum(
                by_id[i].blocks_used for i in decision.instances) >= need:
            return None
        allowed = allowed_in(state)
        alone = sorted((i for i in instances if i.tp == 1 and i.accepting), key=lambda i: (i.load, i.id))
        for four in itertools.combinations(alone, MAX_TP):
            members = tuple(i.members[0] for i in four)
            if allowed(tuple(m.executor for m in members)) and \
                    capacity(members, four[0].kv_heads) - sum(i.blocks_used for i in four) >= need:
                return Merge(tuple(i.id for i in four), MAX_TP)
        return None

    async def _merge(self, decision: Merge, instances, state: ClusterState, tokens: int) -> str:
        by_id = {i.id: i for i in instances}
        executors = [m.executor for i in decision.instances for m in by_id[i].members]
        if any(by_id[i].tp > 1 for i in decision.instances):
            raise ApiError(503, f"the request of {tokens} tokens needs instances {list(decision.instances)} merged "
                                f"further, and only executors serving alone merge", "server_error", None,
                           "no_capacity")
        if (why := merge_refusal(state, executors)) is not None:
            raise ApiError(503, f"no merge can make room now: {why}", "server_error", None, "no_capacity")
        log.info("a request of %d tokens fits no instance: merging %s into TP%d", tokens, executors, decision.tp)
        results = await send_merge(self.sender, executors,
                                   f"AMOEBAs ({self.strategy}): a request of {tokens} tokens fits no instance")
        refused = [r for r in results if not r.ok]
        if refused:
            raise ApiError(503, "the merge that would hold the request was refused: " +
                           "; ".join(f"{r.executor}: {r.error}" for r in refused), "server_error", None,
                           "no_capacity")
        await wait_shown(self.get_state, shown(merged_id(executors), executors))
        return executors[0]
