"""CoCoServe's scale-up onto an executor serving alone (§3.1: idle capacity wherever it is): an idle executor is
recruited into a busy one's instance for replicas, and released as soon as work arrives. Pure; cocoserve.py runs it.

Recruiting pairs a leader serving alone (a TP1 plan of one, every slot kept) that runs sequences with none
waiting and no SLO violation over T_down, with a peer of its world serving alone that runs and queues nothing:
taking that one from the router then delays no request now, and it hands the leader no sequence. It is
Algorithm 1 with the newcomer as its one eligible node: its max_replicas are the pages its arena has beyond the
leader's KV blocks, which it must back once it joins (services/executor/fabric/enlist.py), over one layer's
pages; its vacancy is that share of its arena and its idle compute, over T_up. The step is the leader's
replicates and the newcomer's join, which go out side by side, both or neither (shared/core/delivery.py), as
the gateway sends an operator's.

Releasing: two executors serving alone serve arrivals at about twice one's rate, an instance of the two at its
replicas' speed-up (1.33x measured for full replication on this CPU, docs/benchmarks.md), so a recruit goes
back as soon as the leader's running and waiting rise above the least they were since it came (work arrived),
the leader runs nothing (nothing left to speed up), or violations show over T_down: its replicas are evicted,
and an executor that joined and holds no layer leaves the instance (enlist.lead_part). At once, not through the
scale-down hysteresis: an arrival is an event, not a noisy rate, and every window the recruit stays costs the
arrivals an executor. A restarted controller forgets its recruits; they then go back only under violations.
"""

from dataclasses import dataclass

from shared.core.policies.cocoserve_algorithms import (CocoSettings, InstanceView, Step, Vacancy, consecutive_runs,
                                                       vacancy, violating)
from shared.core.roles import join_refusal
from shared.messages import ClusterState, EvictArgs, ExecutorState


@dataclass(frozen=True)
class Recruit:
    leader: ExecutorState
    newcomer: ExecutorState
    max_replicas: int
    vacancy: Vacancy
    blocks: int  # the leader's KV blocks, which the newcomer backs


def serves_alone(es: ExecutorState) -> bool:
    """A live executor of a world serving a one-member TP1 plan that can take replicas in (every slot kept)."""
    plan, t = es.telemetry.plan, es.telemetry
    return (es.alive and not es.suspect and not t.draining and plan is not None and plan.leader == es.executor
            and len(plan.members) == 1 and plan.tp == 1 and not plan.merged and plan.slots == "all"
            and len(t.world) > 1)


def recruit_for(leader: ExecutorState, newcomer: ExecutorState, settings: CocoSettings) -> Recruit | None:
    """`newcomer` as Algorithm 1's node for `leader`'s instance, or None where it may not join or has no room."""
    if join_refusal(newcomer, leader) is not None:
        return None
    lt, nt = leader.telemetry, newcomer.telemetry
    r = max(lt.layer_pages, nt.layer_pages)
    blocks = lt.kv.pages_free + lt.kv.pages_used
    spare = nt.kv.pages_total - blocks
    if r <= 0 or spare < r or nt.kv.pages_total <= 0:
        return None
    vacant = vacancy(newcomer, spare)
    if vacant.rate <= settings.t_up:
        return None
    return Recruit(leader, newcomer, min(len(lt.layers), spare // r), vacant, blocks)


def recruits(state: ClusterState, settings: CocoSettings) -> list[Recruit]:
    """At most one idle newcomer for each busy, quiet leader serving alone; the most vacant first, by name."""
    leaders: list[ExecutorState] = []
    idle: dict[tuple, list[ExecutorState]] = {}
    for es in state.executors:
        if not serves_alone(es):
            continue
        t = es.telemetry
        if t.running == 0 and t.waiting == 0:
            # Peers of one world report one list of names: its first and its length tell worlds apart cheaply.
            idle.setdefault((t.model, t.world[0], len(t.world)), []).append(es)
        elif t.waiting == 0 and es.slo.violation_rate <= settings.t_down:
            leaders.append(es)
    if not idle or not leaders:
        return []
    for group in idle.values():
        group.sort(key=lambda es: (es.telemetry.busy, es.executor), reverse=True)  # popped from the end
    out = []
    for leader in sorted(leaders, key=lambda es: es.executor):
        t = leader.telemetry
        group = idle.get((t.model, t.world[0], len(t.world)), [])
        while group:
            found = recruit_for(leader, group.pop(), settings)
            if found is not None:
                out.append(found)
                break
    return out


def return_step(view: InstanceView, recruited: tuple[str, ...], settings: CocoSettings, floor: int) -> Step | None:
    """Every replica the recruits hold, evicted (one command per run), when work arrived (the leader's running and
    waiting above `floor`, the least they were since the recruit came), the leader runs nothing or violations
    show; None otherwise, or when a recruit holds a layer alone (a migration put it there)."""
    t = view.leader.telemetry
    load = t.running + t.waiting
    why = ("work arrived" if load > floor else "the leader runs nothing" if t.running == 0
           else "violations" if violating(view.leader.slo, settings) else None)
    if why is None:
        return None
    commands = []
    for member in recruited:
        held = [i for i, layer in enumerate(view.plan.layers) if member in layer.placement]
        if any(view.plan.layers[i].placement == [member] for i in held):
            return None
        commands += [EvictArgs(instance=view.plan.id, layers=[run[0], run[-1]], source=member)
                     for run in consecutive_runs(held)]
    if not commands:
        return None
    return Step("release", commands, {"recruits": list(recruited), "load": load, "load_floor": floor,
                                      "released_for": why})
