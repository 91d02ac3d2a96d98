"""CoCoServe's scale-up (Algorithm 1) and scale-down (Algorithm 2) on instances of several executors (§4): the
policy, its memory and its steps back; the algorithms themselves are in cocoserve_algorithms.py.

Where it sits on the controller's ladder (DESIGN.md; ladder.py orders the rungs): quantizing
(policies/morph.py) is the cheapest rung; then, cheapest first under pressure, this module's: migrate
layers off the leader (phase 1), evict replicas (phase 2), cut the batch cap (phase 3); and the reverse
order when pressure ends: the batch cap back up, replicas back (scale-up), migrated layers back, then the
restores. Replicating on idle capacity (scale-up) is the last rung: onto idle members, and onto an idle executor
serving alone that a busy one serving alone recruits, and releases at once when work arrives
(cocoserve_recruits.py).

What telemetry cannot tell is kept in InstanceMemory (the hysteresis runs, the batch cap before the first
cut, the migrations done, the recruits), passed in and returned by the pure `plan`. A restarted controller
forgets them: a cut cap then stays where it is and migrated layers where they are until an operator moves them.

Modes: off (nothing), scale-down (Algorithm 2 and its reverse, never a new replica: for measuring
robustness alone), default (both algorithms).
"""

from collections.abc import Collection
from dataclasses import dataclass, field, replace

from shared.config import ControllerConfig
from shared.core.hysteresis import HysteresisState, advance, interrupted
from shared.core.policies.cocoserve_algorithms import (PHASE_NAMES, CocoSettings, InstanceView, Step, batch_tokens,
                                                       consecutive_runs, eligible_nodes, instances, predicted_scale_up,
                                                       ranges, scale_down_step, settings_for_config, vacancy,
                                                       violating)
from shared.core.policies.cocoserve_recruits import Recruit, recruits, return_step
from shared.core.policies.interface import PlannedCommand, Policy, updated
from shared.core.speedup import DEFAULT_PROFILE, SpeedupProfile, Strategy, gamma, predict
from shared.messages import (BatchArgs, ClusterState, CommandArgs, EvictArgs, ExecutorState, InstancePlan, JoinArgs,
                             MigrateArgs, ReplicateArgs)


# --- memory --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Migration:
    layers: tuple[int, int]  # inclusive
    source: str  # the member they came from (the leader)
    to: str


@dataclass(frozen=True)
class InstanceMemory:
    pressure: HysteresisState = HysteresisState()  # scale-down steps ("enter") and steps back ("leave")
    idle: HysteresisState = HysteresisState()  # scale-up ("enter")
    original_batch: int | None = None  # the leader's batch cap before the first cut
    # The cap the last batch command set: telemetry lags a command under load, so a cap still reported at
    # its original value right after a cut is not yet a sign that it came back.
    batch_target: int | None = None
    migrations: tuple[Migration, ...] = ()  # phase 1's, oldest first
    last_command: float | None = None
    recruited: tuple[str, ...] = ()  # executors it recruited while serving alone (cocoserve_recruits.py)
    load_floor: int = 0  # the least running + waiting on the leader since it recruited them


@dataclass(frozen=True)
class CocoMemory:
    """Everything `plan` needs beyond the current state. Never mutated: `plan` returns a new one."""
    instances: dict[str, InstanceMemory] = field(default_factory=dict)


def _quiet(memory: InstanceMemory) -> InstanceMemory:
    """A skipped window: both ladders' runs broken."""
    return updated(memory, pressure=interrupted(memory.pressure), idle=interrupted(memory.idle))


def _still_away(plan: InstancePlan, migration: Migration) -> list[int]:
    """The migrated layers that are still on the destination alone (later steps may have moved them)."""
    a, b = migration.layers
    if migration.source not in plan.members:
        return []
    return [i for i in range(a, min(b, len(plan.layers) - 1) + 1) if plan.layers[i].placement == [migration.to]]


def _forget_done(memory: InstanceMemory, view: InstanceView, settings: CocoSettings, now: float) -> InstanceMemory:
    original = memory.original_batch
    # Back where it was: by our own raise, or long enough after a cut (one refused) that telemetry must tell.
    stale = memory.last_command is not None and now - memory.last_command > 4 * settings.settle_s
    if (original is not None and view.leader.telemetry.max_num_seqs >= original
            and (memory.batch_target == original or stale)):
        original = None
    migrations = tuple(m for m in memory.migrations if _still_away(view.plan, m))
    return updated(memory, original_batch=original, migrations=migrations)


# --- stepping back -------------------------------------------------------------------------------------
def release_step(view: InstanceView, memory: InstanceMemory, settings: CocoSettings,
                 replicas_pending: bool) -> Step | None:
    """The next step back, most recent scale-down phase first: the batch cap; then (once scale-up has
    nothing to add) the latest migration."""
    t = view.leader.telemetry
    if memory.original_batch is not None and t.max_num_seqs < memory.original_batch:
        raised = min(memory.original_batch, t.max_num_seqs + settings.delta_bs)
        # The raise admits up to raised - cap waiting requests, each projected to take the KV a running
        # sequence holds and will hold.
        admitted = min(raised - t.max_num_seqs, t.waiting)
        per_sequence = (t.kv.pages_used + t.pages_growth) / max(1, t.running)
        return Step("batch-back", [BatchArgs(instance=view.plan.id, max_num_seqs=raised)],
                    {"max_num_seqs_before": t.max_num_seqs, "max_num_seqs_after": raised,
                     "original_max_num_seqs": memory.original_batch}, cost_pages=round(admitted * per_sequence))
    if replicas_pending or t.waiting > 0:
        return None
    for migration in reversed(memory.migrations):
        away = consecutive_runs(_still_away(view.plan, migration))
        if away:
            back = away[-1]
            cost = max(0, len(back) * view.layer_pages - t.spare_pages)
            args = MigrateArgs(instance=view.plan.id, layers=[back[0], back[-1]], source=migration.to,
                               to=migration.source)
            return Step("migrate-back", [args], {"spare_pages": t.spare_pages, "layer_pages": view.layer_pages},
                        cost_pages=cost)
    return None


def release_ok(leader: ExecutorState, settings: CocoSettings, cost_pages: int) -> bool:
    """The KV the running sequences hold and will still take fits after the step, with the margin."""
    t = leader.telemetry
    capacity = t.kv.pages_free + t.kv.pages_used
    return (t.kv.pages_used + t.pages_growth) * (1 + settings.release_margin) <= capacity - cost_pages


# --- the policy ----------------------------------------------------------------------------------------
def _inputs(view: InstanceView, settings: CocoSettings, speedup_now: float, tokens: int) -> dict:
    """What every decision on the instance saw: the leader's SLO window and KV, each member's vacancy and
    the predicted speed-up of the plan as it stands."""
    slo, t = view.leader.slo, view.leader.telemetry
    return {"instance": view.plan.id, "violation_rate": slo.violation_rate, "requests": slo.requests,
            "t_down": settings.t_down, "t_down_low": settings.t_down_low, "t_up": settings.t_up,
            "ttft_p95_s": slo.ttft_p95_s, "tpot_p95_s": slo.tpot_p95_s, "max_num_seqs": t.max_num_seqs,
            "waiting": t.waiting, "running": t.running, "pages_used": t.kv.pages_used,
            "pages_free": t.kv.pages_free, "pages_growth": t.pages_growth,
            "vacancy": {name: vacancy(es).as_dict() for name, es in sorted(view.members.items())},
            "speedup": speedup_now, "equation": settings.equation, "tokens": tokens}


def _reason(step: Step, view: InstanceView, settings: CocoSettings, inputs: dict) -> str:
    slo = view.leader.slo
    rate = f"SLO violation rate {slo.violation_rate:.0%} of {slo.requests} requests"
    if step.phase in ("migrate", "evict", "batch"):
        head = f"{rate} over T_down {settings.t_down:.0%} for {settings.enter_windows} windows"
    elif step.phase == "replicate":
        i = inputs
        vacant = ", ".join(f"{name} {i['vacancy'][name]['rate']:.0%}" for name in i["max_replicas"])
        placed = ", ".join(f"layers {a.layers[0]}-{a.layers[1]} on {a.to}" for a in step.commands)
        return (f"idle capacity for {settings.up_windows} windows (vacancy {vacant}; T_up {settings.t_up:.0%}): "
                f"replicas of {placed} raise the predicted speed-up {i['speedup_before']:.3f} -> "
                f"{i['speedup_after']:.3f} ({settings.equation} at {i['tokens']} tokens)")
    else:
        t = view.leader.telemetry
        head = (f"{rate} at most {settings.t_down_low:.0%} for {settings.leave_windows} windows, and the running "
                f"sequences' {t.kv.pages_used}+{t.pages_growth} KV pages fit after the step")
    args = step.commands[0]
    if isinstance(args, MigrateArgs):
        what = f"layers {args.layers[0]}-{args.layers[1]} {args.source} -> {args.to}"
    elif isinstance(args, EvictArgs):
        what = (f"{args.source}'s replicas of layers {args.layers[0]}-{args.layers[1]} (predicted speed-up "
                f"{inputs['speedup_before']:.3f} -> {inputs['speedup_after']:.3f})")
    else:
        what = f"batch cap {view.leader.telemetry.max_num_seqs} -> {args.max_num_seqs}"
    return f"{head}: {PHASE_NAMES[step.phase]}: {what}"


def _scale_up_step(view: InstanceView, settings: CocoSettings, profile: SpeedupProfile) -> Step | None:
    nodes = eligible_nodes(view, settings)
    if not nodes:  # Algorithm 1 adds nothing, and weighing the plan it keeps was most of a fleet's decision
        return None
    tokens = batch_tokens(view.leader, settings)
    strategy = Strategy.of_plan(view.plan)
    result = predicted_scale_up(strategy, tuple((name, k) for name, k, _ in nodes), profile, tokens,
                                settings.equation)
    if not result.added:
        return None
    commands: list[CommandArgs] = [ReplicateArgs(instance=view.plan.id, layers=span, to=dst)
                                   for dst, layers in result.added.items() for span in ranges(layers)]
    inputs = {"max_replicas": {name: k for name, k, _ in nodes}, "layer_pages": view.layer_pages,
              "speedup_before": result.before, "speedup_after": result.after,
              "gamma_before": gamma(strategy, profile, tokens), "gamma_after": gamma(result.strategy, profile, tokens)}
    return Step("replicate", commands, inputs)


def _plan_instance(view: InstanceView, memory: InstanceMemory, settings: CocoSettings, profile: SpeedupProfile,
                   now: float, hold_down: bool = False) -> tuple[list[PlannedCommand], InstanceMemory]:
    t = view.leader.telemetry
    if memory.recruited:
        memory = updated(memory, recruited=tuple(m for m in memory.recruited if m in view.plan.members),
                         load_floor=min(memory.load_floor, t.running + t.waiting))
    if memory.recruited and view.whole:  # before settling: a recruit goes back the moment work arrives
        release = return_step(view, memory.recruited, settings, memory.load_floor)
        if release is not None:
            memory = replace(_quiet(memory), last_command=now)
            why = (f"recruits {', '.join(memory.recruited)} go back to serving alone "
                   f"({release.inputs['released_for']}: the leader runs {t.running} and queues {t.waiting}, "
                   f"{memory.load_floor} together at the least since they came): their replicas evicted")
            inputs = {"instance": view.plan.id, "phase": "release", **release.inputs}
            return [PlannedCommand(view.plan.leader, args, why, inputs) for args in release.commands], memory
    settling = memory.last_command is not None and now - memory.last_command < settings.settle_s
    if not view.whole or settling:
        return [], _quiet(memory)
    memory = _forget_done(memory, view, settings, now)
    leader, slo = view.leader, view.leader.slo
    tokens = batch_tokens(view.leader, settings)

    def speedup_of(strategy: Strategy) -> float:
        return predict(strategy, profile, tokens, settings.equation)

    pressed = violating(slo, settings) and not hold_down
    down = scale_down_step(view, settings, speedup_of) if pressed else None
    cut = memory.original_batch is not None
    dwelling = (memory.pressure.last_direction == "enter" and memory.pressure.last_change is not None
                and now - memory.pressure.last_change < settings.min_dwell_s)
    # Replicas only where no violation shows at all: a high rate over too few requests is no reason to
    # scale down, but no invitation to scale up either.
    quiet = slo.violation_rate <= settings.t_down
    grow = (_scale_up_step(view, settings, profile)
            if settings.mode == "default" and view.plan.tp == 1 and quiet and not cut and not dwelling else None)
    back = release_step(view, memory, settings, replicas_pending=grow is not None)
    # Only windows in which a step is possible count, so a step the hysteresis grants is one the policy takes.
    # A window with too few finished requests says nothing while requests run (the start of a burst has
    # finished none yet); only an idle leader is calm without them.
    idle_leader = leader.telemetry.running == 0 and leader.telemetry.waiting == 0
    calm = (back is not None and slo.violation_rate <= settings.t_down_low
            and (slo.requests >= settings.min_requests or idle_leader)
            and release_ok(leader, settings, back.cost_pages))
    event, pressure = advance(settings.hysteresis, memory.pressure, down is not None, calm, now)
    memory = updated(memory, pressure=pressure)
    step = down if event == "enter" else back if event == "leave" else None
    if step is None:
        up_event, idle = advance(settings.up_hysteresis, memory.idle, grow is not None, False, now)
        memory = updated(memory, idle=idle)
        step = grow if up_event == "enter" else None
    else:
        memory = updated(memory, idle=interrupted(memory.idle))
    if step is None:
        return [], memory
    if step.phase == "batch" and memory.original_batch is None:
        memory = replace(memory, original_batch=leader.telemetry.max_num_seqs)
    if step.phase in ("batch", "batch-back"):
        memory = replace(memory, batch_target=step.commands[0].max_num_seqs)
    if step.phase == "migrate":
        moved = step.commands[0]
        memory = replace(memory, migrations=(*memory.migrations,
                                             Migration((moved.layers[0], moved.layers[1]), moved.source, moved.to)))
    memory = replace(memory, last_command=now)
    inputs = {**_inputs(view, settings, speedup_of(Strategy.of_plan(view.plan)), tokens), "phase": step.phase,
              **step.inputs, "cost_pages": step.cost_pages}
    why = _reason(step, view, settings, inputs)
    return [PlannedCommand(view.plan.leader, args, why, inputs) for args in step.commands], memory


def _plan_recruit(recruit: Recruit, memory: InstanceMemory, settings: CocoSettings, profile: SpeedupProfile,
                  now: float) -> tuple[list[PlannedCommand], InstanceMemory]:
    """Algorithm 1 for a leader serving alone with `recruit`'s newcomer as its node, through the scale-up
    hysteresis: the leader's replicates and the newcomer's join, or nothing."""
    if memory.last_command is not None and now - memory.last_command < settings.min_dwell_s:
        return [], _quiet(memory)  # a recruit released moments ago: the lull that brought it was short
    leader, newcomer, t = recruit.leader.executor, recruit.newcomer.executor, recruit.leader.telemetry
    plan = t.plan
    tokens = batch_tokens(recruit.leader, settings)
    strategy = Strategy.of_plan(plan)
    result = predicted_scale_up(strategy, ((newcomer, recruit.max_replicas),), profile, tokens, settings.equation)
    event, idle = advance(settings.up_hysteresis, memory.idle, bool(result.added), False, now)
    memory = updated(memory, idle=idle, recruited=())
    if event != "enter":
        return [], memory
    memory = replace(memory, recruited=(newcomer,), load_floor=t.running + t.waiting, last_command=now)
    spans = ranges(result.added[newcomer])
    inputs = {"instance": plan.id, "phase": "recruit", "newcomer": newcomer, "max_replicas": recruit.max_replicas,
              "vacancy": {newcomer: recruit.vacancy.as_dict()}, "leader_blocks": recruit.blocks,
              "layer_pages": max(t.layer_pages, recruit.newcomer.telemetry.layer_pages), "running": t.running,
              "speedup_before": result.before, "speedup_after": result.after, "equation": settings.equation,
              "tokens": tokens}
    placed = ", ".join(f"layers {a}-{b}" for a, b in spans)
    why = (f"{newcomer} serving alone has run nothing for {settings.up_windows} windows (vacancy "
           f"{recruit.vacancy.rate:.0%}; T_up {settings.t_up:.0%}) while {leader} runs {t.running} sequences: "
           f"replicas of {placed} on {newcomer} raise the predicted speed-up {result.before:.3f} -> "
           f"{result.after:.3f} ({settings.equation} at {tokens} tokens); it joins {leader}'s instance {plan.id}")
    commands = [PlannedCommand(leader, ReplicateArgs(instance=plan.id, layers=span, to=newcomer), why, inputs)
                for span in spans]
    return [*commands, PlannedCommand(newcomer, JoinArgs(instance=plan.id, leader=leader), why, inputs)], memory


def plan(state: ClusterState, memory: CocoMemory, settings: CocoSettings, profile: SpeedupProfile = DEFAULT_PROFILE,
         hold_down: Collection[str] = ()) -> tuple[list[PlannedCommand], CocoMemory]:
    """Pure: the commands for `state` and the memory for the next one. Instances whose leader is in
    `hold_down` take no scale-down step now (a cheaper rung takes the pressure)."""
    if settings.mode == "off":
        return [], memory
    commands: list[PlannedCommand] = []
    out: dict[str, InstanceMemory] = {}
    for view in instances(state):
        previous = memory.instances.get(view.plan.id, InstanceMemory())
        planned, out[view.plan.id] = _plan_instance(view, previous, settings, profile, state.time,
                                                    view.plan.leader in hold_down)
        commands.extend(planned)
    if settings.mode == "default":
        for recruit in recruits(state, settings):
            leader = recruit.leader.executor
            if leader in hold_down:
                continue
            instance = recruit.leader.telemetry.plan.id
            previous = memory.instances.get(instance, InstanceMemory())
            planned, out[instance] = _plan_recruit(recruit, previous, settings, profile, state.time)
            commands.extend(planned)
    # An instance missing from this state (its leader silent) keeps what it recorded: a leader that comes
    # back still has its cut cap and its migrated layers, or its telemetry shows they are gone.
    for instance, kept in memory.instances.items():
        out.setdefault(instance, _quiet(kept))
    return commands, CocoMemory(out)


def stepping_back(state: ClusterState, memory: CocoMemory) -> set[str]:
    """The leaders of instances with steps back still to take (a cut batch cap, migrated layers)."""
    return {view.plan.leader for view in instances(state)
            if (kept := memory.instances.get(view.plan.id)) is not None
            and (kept.original_batch is not None or kept.migrations)}


def make_policy(profile: SpeedupProfile | None = None, settings: CocoSettings | None = None) -> Policy:
    """The controller-facing policy; settings None reads the mode and overrides from ControllerConfig."""
    memory = CocoMemory()
    costs = profile or DEFAULT_PROFILE

    def cocoserve_policy(state: ClusterState, history: list[ClusterState],
                         config: ControllerConfig) -> list[PlannedCommand]:
        nonlocal memory
        commands, memory = plan(state, memory, settings if settings is not None else settings_for_config(config),
                                costs)
        return commands

    return cocoserve_policy
