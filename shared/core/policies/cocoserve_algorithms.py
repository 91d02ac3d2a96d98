"""CoCoServe's two algorithms (§4) and what they read: the settings, an instance as the cluster state shows it,
Algorithm 1 (scale-up) and one step of Algorithm 2 (scale-down). Pure; policies/cocoserve.py runs them.

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
"""

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from shared.config import ControllerConfig
from shared.core.hysteresis import HysteresisParams
from shared.core.speedup import EQUATIONS, SpeedupProfile, Strategy, predict
from shared.messages import (BatchArgs, ClusterState, CommandArgs, EvictArgs, ExecutorState, InstancePlan, MigrateArgs,
                             SloWindow)

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

    @functools.cached_property  # asked for every instance at every state
    def hysteresis(self) -> HysteresisParams:
        return HysteresisParams(self.enter_windows, self.leave_windows, self.min_dwell_s)

    @functools.cached_property
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
    """The instances of several members whose leader is in the state, as their leaders report them (not TP
    merges: AMOEBAs splits those back, policies/amoebas.py; nor SplitQuant plans, whose members keep no slot
    for a layer to come)."""
    by_name = {es.executor: es for es in state.executors}
    views = []
    for es in state.executors:
        plan = es.telemetry.plan
        if (plan is not None and len(plan.members) > 1 and plan.leader == es.executor and not plan.merged
                and plan.slots == "all"):
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


def vacancy(es: ExecutorState, spare_pages: int | None = None) -> Vacancy:
    """Its vacancy; `spare_pages` in place of those it reports (an executor serving alone, once it joined)."""
    t = es.telemetry
    spare = t.spare_pages if spare_pages is None else spare_pages
    memory = spare / t.kv.pages_total if t.kv.pages_total > 0 else 0.0
    return Vacancy(memory=min(1.0, max(0.0, memory)), compute=min(1.0, max(0.0, 1.0 - t.busy)))


def violating(slo: SloWindow, settings: CocoSettings) -> bool:
    """Pressure: the SLO violation rate over T_down, over enough requests to be a rate."""
    return slo.requests >= settings.min_requests and slo.violation_rate > settings.t_down


def batch_tokens(leader: ExecutorState, settings: CocoSettings) -> int:
    """The tokens a step the speed-up is predicted at: the setting, else the leader's batch cap."""
    t = leader.telemetry
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


@functools.lru_cache(maxsize=4096)
def predicted_scale_up(strategy: Strategy, nodes: tuple[tuple[str, int], ...], profile: SpeedupProfile, tokens: int,
                       equation: str) -> ScaleUp:
    """Algorithm 1 on the speed-up `equation` predicts at `tokens` a step. An instance with an eligible node weighs
    it at every state and keeps its plan, its spare pages and its batch cap (the tokens) for long: the same answer.
    It was half of CoCoServe's decision at a thousand executors. The result is shared: read it, never change it."""
    return scale_up(strategy, nodes, lambda s: predict(s, profile, tokens, equation))


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
