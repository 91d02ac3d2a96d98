"""CoCoServe's scale-up (Algorithm 1) and scale-down (Algorithm 2) on instances of several executors (§4).

Where it sits on the controller's ladder (DESIGN.md; ladder.py orders the rungs): quantizing
(policies/morph.py) is the cheapest rung; then, cheapest first under pressure, this module's: migrate
layers off the leader (phase 1), evict replicas (phase 2), cut the batch cap (phase 3); and the reverse
order when pressure ends: the batch cap back up, replicas back (scale-up), migrated layers back, then the
restores. Replicating on idle capacity (scale-up) is the last rung.

Signals, all from the leader's and the members' telemetry in the cluster state:
- pressure: the leader's SLO violation rate (ExecutorState.slo, the monitor's window) above `t_down`, over
  at least `min_requests` requests;
- calm: the rate at or below `t_down_low`, and the release test: the KV the running sequences hold now
  *and will still take* (`pages_growth`) fits, with `release_margin` to spare, in what the leader's KV has
  left after the step, so that a restore never comes back mid-burst (a burst's sequences are short at first);
- vacancy of a member: min(memory vacancy, compute vacancy), memory = spare_pages / kv.pages_total (pages
  a replica may take without shrinking the instance's KV, as a share of its arena) and compute = 1 − busy
  (the share of the last second it did not compute). The minimum, because a replica needs both: pages for
  its slot and time to compute its share of the rows.

Algorithm 1 (scale-up), as written: sp_best = the predicted speed-up of the plan now; for every eligible
node (vacancy > `t_up`, room for one layer; most vacant first), max_replicas = spare_pages // layer_pages
(the paper's available/r), SortCandidatesByContinuity (the layers not on it yet, grouped into runs of
consecutive indices, longest run first, then by index; the first max_replicas), and each candidate is added
only if the predicted speed-up is strictly higher (Eq. 3 by default, or Eq. 4 with `equation="eq4"`; speedup.py). One
deviation: δ charges a new run's scatter and gather to its replicated layers, so a run's first layer alone
may not pay for them while the run would; a rejected candidate is therefore kept pending and judged again
with the next candidate of the same run (as written, the algorithm would never start such a run). With a
constant δ this changes nothing: a single candidate then gains exactly when any does. The chosen layers
become one `replicate` per contiguous range and destination, sent to the leader.

Algorithm 2 (scale-down), one step per hysteresis "enter" (a command's effect shows only in later states, so
IsViolating is the violation rate of the windows after the step), each phase only when the one before it
cannot act any more:
1. migrate (TP1): FilterModules = whole layers of the leader's (§3.3), those beyond the first half of the
   model it keeps, so migration balances the members rather than moving the bottleneck;
   FindOptimalDestination = a member that replicates all of them (its replicas then take the rows: nothing
   is copied), else the other member with the most spare pages (then the least busy) that has room for a
   layer; the leader's last run of such layers moves from its end, up to `step` layers and the
   destination's room, so that later steps extend the same tail on the destination instead of adding hops;
2. evict (TP1): SortEvicteesBy = the replicas (every copy of a layer but its first) whose removal lowers
   the predicted speed-up least, taken `step` layers from the end of a member's run of replicas (the
   reverse of scale-up, which fills runs from their start; a cut in the middle would split a run);
3. batch: the leader's batch cap minus `delta_bs`, not below 1 (every multi-member instance, TP ones too:
   their layers are sharded, so this is the one phase they have). The paper's offloading is not done.
After each command the instance is left alone for `settle_s` (both hysteresis runs restart) so that the
violation rate, a trailing window, shows the step before the next one is judged.
The reverse, one step per "leave": the batch cap up by `delta_bs` to where it was before the first cut (the
projected KV of as many waiting requests as the raise admits counts against the release test); then, once
scale-up has nothing more to add, the most recent migration back to its source (nothing may wait: it can
shrink the leader's KV). A migrated layer that scale-up has meanwhile replicated back onto its source stays
as it is: both members then compute it. Replicating (scale-up) waits while the batch cap is cut and for
`min_dwell_s` after a scale-down step, as a restore does.

What telemetry cannot tell is kept in InstanceMemory (the hysteresis runs, the batch cap before the first
cut, the migrations done), passed in and returned by the pure `plan`. A restarted controller forgets them:
a cut cap then stays where it is and migrated layers where they are until an operator moves them.

Modes: off (nothing), scale-down (Algorithm 2 and its reverse, never a new replica: for measuring
robustness alone), default (both algorithms).
"""

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, fields, replace

from services.controller.hysteresis import HysteresisParams, HysteresisState, advance
from services.controller.policies.interface import PlannedCommand, Policy
from shared.config import ControllerConfig
from shared.messages import (BatchArgs, ClusterState, CommandArgs, EvictArgs, ExecutorState, InstancePlan, MigrateArgs,
                             ReplicateArgs)
from shared.speedup import DEFAULT_PROFILE, EQUATIONS, SpeedupProfile, Strategy, gamma, predict

MODES = ("off", "scale-down", "default")


@dataclass(frozen=True)
class CocoSettings:
    mode: str = "default"
    # A member takes replicas while at least a fifth of its compute and of its arena is idle: below that its
    # share of the rows would slow what it already computes, and the slot would take most of what is left.
    t_up: float = 0.2
    # Scale down once more than one request in ten misses its SLOs: the usual 90 % attainment target.
    t_down: float = 0.10
    # Pressure is over at half T_down: a rate hovering at T_down must not step down and up in turn.
    t_down_low: float = 0.05
    # One or two slow requests in the window are noise (a long prompt's TTFT); three make a rate.
    min_requests: int = 3
    delta_bs: int = 5  # the paper's example step of Δbs
    # Layers per migrate / evict command: about an eighth of a 30-layer model, so a step frees a noticeable
    # share of the leader's slots while a tail moves in few hops.
    step: int = 4
    # The violation rate already averages the monitor's 10 s window; five states (a second at 5 Hz) more only
    # guard against one state's jitter.
    enter_windows: int = 5
    leave_windows: int = 25  # five seconds of calm before each step back: a lull between bursts is shorter
    # No step back sooner than a whole SLO window (10 s) after a step down: by then the rate describes
    # requests served after that step.
    min_dwell_s: float = 10.0
    # Windows a member must stay vacant with a predicted gain before replicas are copied onto it: a copy
    # moves weights, not worth it for a momentary lull, and members' telemetry catches up with the last one.
    up_windows: int = 10
    # After a command the instance is left alone this long: half the SLO window has then finished under the
    # new configuration, enough to tell whether the step helped.
    settle_s: float = 5.0
    release_margin: float = 0.10  # headroom the projected KV must keep after a step back (as morph.py's)
    # Which speed-up Algorithm 1 and the evictions compare. The paper takes Eq. 4 on a homogeneous cluster;
    # Eq. 3 also sees the profile's intercepts (half a batch does not take half the time) and predicted the
    # measured speed-ups far better (docs/benchmarks.md, "The speed-up model": full replication measured
    # 1.33x, Eq. 3 said 1.23x, Eq. 4 1.99x), so it is the default.
    equation: str = "eq3"
    batch_tokens: int = 0  # tokens per step the speed-up is predicted at; 0: the leader's batch cap

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0 <= self.t_up < 1:
            problems.append(f"need 0 <= t_up < 1, got {self.t_up}")
        if not 0 <= self.t_down_low < self.t_down <= 1:
            problems.append(f"need 0 <= t_down_low < t_down <= 1, got {self.t_down_low} and {self.t_down}")
        if self.min_requests < 1 or self.delta_bs < 1 or self.step < 1:
            problems.append(f"min_requests, delta_bs and step must be at least 1, got {self.min_requests}, "
                            f"{self.delta_bs} and {self.step}")
        if self.settle_s < 0 or self.release_margin < 0 or self.batch_tokens < 0:
            problems.append(f"settle_s, release_margin and batch_tokens must not be negative, got {self.settle_s}, "
                            f"{self.release_margin} and {self.batch_tokens}")
        if self.equation not in EQUATIONS:
            problems.append(f"equation must be one of {', '.join(EQUATIONS)}, got {self.equation!r}")
        if problems:
            raise ValueError("; ".join(problems))
        HysteresisParams(self.enter_windows, self.leave_windows, self.min_dwell_s)  # validates
        HysteresisParams(self.up_windows, 1, 0.0)

    @property
    def hysteresis(self) -> HysteresisParams:
        return HysteresisParams(self.enter_windows, self.leave_windows, self.min_dwell_s)

    @property
    def up_hysteresis(self) -> HysteresisParams:
        return HysteresisParams(self.up_windows, 1, 0.0)  # scale-up only ever enters; eviction is scale-down's


def settings_for_mode(mode: str, **overrides) -> CocoSettings:
    unknown = set(overrides) - {f.name for f in fields(CocoSettings) if f.name != "mode"}
    if unknown:
        raise ValueError(f"unknown CoCoServe setting(s): {', '.join(sorted(unknown))}")
    return CocoSettings(mode=mode, **overrides)


def settings_for_config(config: ControllerConfig) -> CocoSettings:
    return settings_for_mode(config.cocoserve_mode, **dict(config.cocoserve_overrides))


# --- an instance, read from the state ------------------------------------------------------------------
@dataclass(frozen=True)
class InstanceView:
    plan: InstancePlan
    members: dict[str, ExecutorState]  # the members the state reports, the leader among them

    @property
    def leader(self) -> ExecutorState:
        return self.members[self.plan.leader]

    @property
    def whole(self) -> bool:
        """Every member reports and serves: a reshape runs on all of them in lock-step."""
        return all(m in self.members and self.members[m].alive and not self.members[m].suspect
                   and not self.members[m].telemetry.draining for m in self.plan.members)

    @property
    def layer_pages(self) -> int:
        """r: the pages of one full-precision layer slot (one model: the same on every member)."""
        return max(es.telemetry.layer_pages for es in self.members.values())


def instances(state: ClusterState) -> list[InstanceView]:
    """The instances of several members whose leader is in the state, as their leaders report them."""
    by_name = {es.executor: es for es in state.executors}
    views = []
    for es in state.executors:
        plan = es.telemetry.plan
        if plan is not None and len(plan.members) > 1 and plan.leader == es.executor:
            views.append(InstanceView(plan, {m: by_name[m] for m in plan.members if m in by_name}))
    return views


@dataclass(frozen=True)
class Vacancy:
    memory: float  # spare_pages / kv.pages_total
    compute: float  # 1 - busy

    @property
    def rate(self) -> float:
        return min(self.memory, self.compute)

    def as_dict(self) -> dict[str, float]:
        return {"memory": self.memory, "compute": self.compute, "rate": self.rate}


def vacancy(es: ExecutorState) -> Vacancy:
    t = es.telemetry
    memory = t.spare_pages / t.kv.pages_total if t.kv.pages_total > 0 else 0.0
    return Vacancy(memory=min(1.0, max(0.0, memory)), compute=min(1.0, max(0.0, 1.0 - t.busy)))


def batch_tokens(view: InstanceView, settings: CocoSettings) -> int:
    t = view.leader.telemetry
    return settings.batch_tokens or t.max_num_seqs or max(1, t.running)


def consecutive_runs(indices: Sequence[int]) -> list[list[int]]:
    """[0, 1, 2, 5, 6, 9] -> [[0, 1, 2], [5, 6], [9]] (indices ascending)."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] + 1 == i:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def ranges(layers: Sequence[int]) -> list[list[int]]:
    """Consecutive layers as inclusive [a, b] ranges, the shape commands take."""
    return [[run[0], run[-1]] for run in consecutive_runs(sorted(layers))]


# --- Algorithm 1: scale-up -----------------------------------------------------------------------------
def sort_candidates_by_continuity(strategy: Strategy, dst: str, max_replicas: int) -> list[int]:
    """The layers `dst` could take a replica of, longest run of consecutive indices first, then by index."""
    free = [i for i, placement in enumerate(strategy.placements) if dst not in placement]
    ordered = sorted(consecutive_runs(free), key=lambda run: (-len(run), run[0]))
    return [i for run in ordered for i in run][:max(0, max_replicas)]


@dataclass(frozen=True)
class ScaleUp:
    strategy: Strategy  # P*
    added: dict[str, list[int]]  # destination -> the layers it takes replicas of, in the order they were taken
    before: float  # predicted speed-up of P
    after: float  # of P*


def scale_up(strategy: Strategy, nodes: Sequence[tuple[str, int]],
             speedup_of: Callable[[Strategy], float]) -> ScaleUp:
    """Algorithm 1 over `nodes`, the eligible nodes with their max_replicas, in the order they are tried."""
    best = before = speedup_of(strategy)
    added: dict[str, list[int]] = {}
    for dst, max_replicas in nodes:
        pending: list[int] = []
        for layer in sort_candidates_by_continuity(strategy, dst, max_replicas):
            if pending and layer != pending[-1] + 1:
                pending = []  # a new run: the old one's rejected start never paid off
            trial = strategy.with_replicas([*pending, layer], dst)
            predicted = speedup_of(trial)
            if predicted > best:
                strategy, best = trial, predicted
                added.setdefault(dst, []).extend([*pending, layer])
                pending = []
            else:
                pending.append(layer)
    return ScaleUp(strategy, added, before, best)


def eligible_nodes(view: InstanceView, settings: CocoSettings) -> list[tuple[str, int, Vacancy]]:
    """GetEligibleNodes: (member, max_replicas, vacancy) of the members over T_up with room for a layer,
    most vacant first."""
    r = view.layer_pages
    if r <= 0:
        return []
    nodes = [(name, es.telemetry.spare_pages // r, vacancy(es)) for name, es in view.members.items()]
    nodes = [n for n in nodes if n[1] >= 1 and n[2].rate > settings.t_up]
    return sorted(nodes, key=lambda n: (-n[2].rate, n[0]))


# --- Algorithm 2: scale-down ---------------------------------------------------------------------------
def migratable(plan: InstancePlan) -> list[int]:
    """FilterModules: whole layers (§3.3: they move with the least traffic) of the leader's, not the whole
    model: those beyond the first half of the model it keeps, so that migration balances the members
    instead of moving the bottleneck. A layer another member replicates moves there without a copy."""
    mine = [i for i, layer in enumerate(plan.layers) if plan.leader in layer.placement]
    keep = (len(plan.layers) + 1) // 2
    return mine[keep:]


def find_destination(view: InstanceView) -> str | None:
    """FindOptimalDestination: the other member with the most spare pages (then the least busy) that can
    take a layer without shrinking the instance's KV."""
    r = view.layer_pages
    fits = [(name, es) for name, es in view.members.items()
            if name != view.plan.leader and r > 0 and es.telemetry.spare_pages >= r]
    if not fits:
        return None
    return min(fits, key=lambda f: (-f[1].telemetry.spare_pages, f[1].telemetry.busy, f[0]))[0]


def next_migration(view: InstanceView, settings: CocoSettings) -> MigrateArgs | None:
    runs = consecutive_runs(migratable(view.plan))
    if not runs:
        return None
    tail = runs[-1][-settings.step:]
    leader, layers = view.plan.leader, view.plan.layers
    holders = sorted((m for m in view.members if m != leader and all(m in layers[i].placement for i in tail)),
                     key=lambda m: (-view.members[m].telemetry.spare_pages, m))
    if holders:  # its replicas take the rows: nothing to copy, no memory needed
        return MigrateArgs(instance=view.plan.id, layers=[tail[0], tail[-1]], source=leader, to=holders[0])
    dst = find_destination(view)
    if dst is None:
        return None
    tail = tail[-view.members[dst].telemetry.spare_pages // view.layer_pages:]
    return MigrateArgs(instance=view.plan.id, layers=[tail[0], tail[-1]], source=leader, to=dst)


@dataclass(frozen=True)
class Evictee:
    member: str
    layers: tuple[int, int]  # inclusive
    run_length: int  # of the member's run of replicas the range ends
    speedup_after: float


def sort_evictees(strategy: Strategy, step: int, speedup_of: Callable[[Strategy], float]) -> list[Evictee]:
    """SortEvicteesBy: the tail (up to `step` layers) of every member's run of replicas, the removal that
    lowers the predicted speed-up least first; then shorter runs, later layers, member name."""
    members = sorted({e for placement in strategy.placements for e in placement[1:]})
    out = []
    for member in members:
        held = [i for i, placement in enumerate(strategy.placements) if member in placement[1:]]
        for run in consecutive_runs(held):
            tail = run[-min(step, len(run)):]
            after = speedup_of(strategy.without_replicas(tail, member))
            out.append(Evictee(member, (tail[0], tail[-1]), len(run), after))
    return sorted(out, key=lambda e: (-e.speedup_after, e.run_length, -e.layers[1], e.member))


def next_batch_cut(view: InstanceView, settings: CocoSettings) -> BatchArgs | None:
    cap = view.leader.telemetry.max_num_seqs
    if cap <= 1:
        return None
    return BatchArgs(instance=view.plan.id, max_num_seqs=max(1, cap - settings.delta_bs))


PHASE_NAMES = {"migrate": "phase 1, migrate", "evict": "phase 2, evict", "batch": "phase 3, cut the batch",
               "batch-back": "step back, raise the batch", "migrate-back": "step back, migrate back"}


@dataclass(frozen=True)
class Step:
    phase: str  # migrate | evict | batch | batch-back | migrate-back | replicate
    commands: list[CommandArgs]
    inputs: dict
    cost_pages: int = 0  # a step back: KV pages it takes from the leader's capacity


def scale_down_step(view: InstanceView, settings: CocoSettings,
                    speedup_of: Callable[[Strategy], float]) -> Step | None:
    """The first phase of Algorithm 2 that can still act, one step of it."""
    if view.plan.tp == 1:
        migration = next_migration(view, settings)
        if migration is not None:
            dst = view.members[migration.to].telemetry
            return Step("migrate", [migration], {"spare_pages": dst.spare_pages, "layer_pages": view.layer_pages})
        strategy = Strategy.of_plan(view.plan)
        evictees = sort_evictees(strategy, settings.step, speedup_of)
        if evictees:
            e = evictees[0]
            evict = EvictArgs(instance=view.plan.id, layers=list(e.layers), source=e.member)
            return Step("evict", [evict], {"speedup_before": speedup_of(strategy),
                                           "speedup_after": e.speedup_after})
    cut = next_batch_cut(view, settings)
    if cut is not None:
        return Step("batch", [cut], {"max_num_seqs_before": view.leader.telemetry.max_num_seqs,
                                     "max_num_seqs_after": cut.max_num_seqs})
    return None


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


@dataclass(frozen=True)
class CocoMemory:
    """Everything `plan` needs beyond the current state. Never mutated: `plan` returns a new one."""
    instances: dict[str, InstanceMemory] = field(default_factory=dict)


def _quiet(state: HysteresisState) -> HysteresisState:
    # A skipped window breaks both runs; the time of the last step still counts for the dwell.
    return replace(state, pressure_windows=0, calm_windows=0)


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
    return replace(memory, original_batch=original, migrations=migrations)


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
    tokens = batch_tokens(view, settings)
    nodes = eligible_nodes(view, settings)
    strategy = Strategy.of_plan(view.plan)
    result = scale_up(strategy, [(name, k) for name, k, _ in nodes],
                      lambda s: predict(s, profile, tokens, settings.equation))
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
    settling = memory.last_command is not None and now - memory.last_command < settings.settle_s
    if not view.whole or settling:
        return [], replace(memory, pressure=_quiet(memory.pressure), idle=_quiet(memory.idle))
    memory = _forget_done(memory, view, settings, now)
    leader, slo = view.leader, view.leader.slo
    tokens = batch_tokens(view, settings)

    def speedup_of(strategy: Strategy) -> float:
        return predict(strategy, profile, tokens, settings.equation)

    violating = slo.requests >= settings.min_requests and slo.violation_rate > settings.t_down and not hold_down
    down = scale_down_step(view, settings, speedup_of) if violating else None
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
    memory = replace(memory, pressure=pressure)
    step = down if event == "enter" else back if event == "leave" else None
    if step is None:
        up_event, idle = advance(settings.up_hysteresis, memory.idle, grow is not None, False, now)
        memory = replace(memory, idle=idle)
        step = grow if up_event == "enter" else None
    else:
        memory = replace(memory, idle=_quiet(memory.idle))
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
    # An instance missing from this state (its leader silent) keeps what it recorded: a leader that comes
    # back still has its cut cap and its migrated layers, or its telemetry shows they are gone.
    for instance, kept in memory.instances.items():
        out.setdefault(instance, replace(kept, pressure=_quiet(kept.pressure), idle=_quiet(kept.idle)))
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
