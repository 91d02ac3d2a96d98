"""CoCoServe's scale-up (Algorithm 1) and scale-down (Algorithm 2) policies, driven with hand-made cluster states.

A fake instance applies the planned commands to its plan (shared.core.plans.reshaped, as the leader does) and
accounts for pages the way the fabric does: every member backs the instance's KV blocks outside its layer
slots, so the instance has as many blocks as the fullest member can back, and a member's spare pages are
what it has beyond that. The policy thus sees its own commands' effects in the next states.
"""

import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from services.controller.loop import Controller
from shared.commands import CommandSender
from shared.config import ControllerConfig
from shared.core.plans import layers_on, reshaped
from shared.core.policies import cocoserve
from shared.core.policies.cocoserve import CocoMemory, plan
from shared.core.policies.cocoserve_algorithms import (CocoSettings, consecutive_runs, scale_up,
                                                               settings_for_mode, sort_candidates_by_continuity)
from shared.core.speedup import DEFAULT_PROFILE, Line, SpeedupProfile, Strategy, predict
from shared.messages import (BatchArgs, ClusterState, CommandResult, EvictArgs, ExecutorState, ExecutorTelemetry,
                             InstancePlan, KvPages, LayerPlan, MigrateArgs, ReplicateArgs, SloWindow)

R, TOTAL, LAYERS = 10, 200, 8  # pages per layer slot, pages per member's arena, decoder layers
FAST = CocoSettings(enter_windows=2, leave_windows=3, min_dwell_s=1.0, up_windows=2, settle_s=0.5, step=4,
                    delta_bs=5)
VIOLATING, CALM = 0.5, 0.0


def instance_plan(members, placements, tp=1, iid="i0") -> InstancePlan:
    return InstancePlan(id=iid, leader=members[0], members=list(members), tp=tp,
                        layers=[LayerPlan(placement=list(p)) for p in placements])


@dataclass
class FakeInstance:
    plan: InstancePlan
    cap: int = 16  # the leader's batch cap
    used: int = 20  # KV pages the leader's blocks hold
    growth: int = 0
    waiting: int = 0
    running: int = 4
    busy: dict[str, float] = field(default_factory=dict)
    suspect: set[str] = field(default_factory=set)

    def outside(self, member: str) -> int:
        return TOTAL - R * len(layers_on(self.plan, member))

    def blocks(self) -> int:
        return min(self.outside(m) for m in self.plan.members)

    def spare(self, member: str) -> int:
        return self.outside(member) - self.blocks()

    def apply(self, commands):
        for c in commands:
            assert c.executor == self.plan.leader
            if isinstance(c.args, BatchArgs):
                assert c.args.max_num_seqs >= 1
                self.cap = c.args.max_num_seqs
                continue
            before = self.blocks()
            self.plan = reshaped(self.plan, c.args)  # refuses a layer not there, a member not in the instance
            if isinstance(c.args, ReplicateArgs):
                assert self.blocks() == before, "a replica must fit in spare pages, never shrink the KV"

    def state(self, now: float, rate: float, requests: int = 10) -> ClusterState:
        executors = []
        for m in self.plan.members:
            leader = m == self.plan.leader
            blocks = self.blocks()
            kv = KvPages(pages_total=TOTAL, pages_slot=TOTAL - self.outside(m),
                         pages_free=blocks - self.used if leader else blocks, pages_used=self.used if leader else 0,
                         pages_base=self.outside(m), pages_extension=0)
            t = ExecutorTelemetry(executor=m, instance="p", time=now, model="m", max_model_len=256, block_size=16,
                                  page_bytes=4096, kv=kv, layers=[16] * len(self.plan.layers),
                                  swap_order=list(range(len(self.plan.layers))), running=self.running if leader else 0,
                                  waiting=self.waiting if leader else 0, max_waiting=64, preemptions=0,
                                  prompt_tokens=0, generated_tokens=0, queue_delay_s=0.0, ttft_s=0.0, tpot_s=0.0,
                                  plan=self.plan, max_num_seqs=self.cap if leader else 0, layer_pages=R,
                                  spare_pages=self.spare(m), pages_growth=self.growth if leader else 0,
                                  busy=self.busy.get(m, 0.0))
            slo = SloWindow(requests=requests, violation_rate=rate) if leader else SloWindow()
            executors.append(ExecutorState(executor=m, alive=True, suspect=m in self.suspect, last_seen=now,
                                           kv_usage=self.used / blocks, queue_delay_s=0.0, waiting=0.0,
                                           telemetry=t, slo=slo))
        return ClusterState(time=now, executors=executors)


class Driver:
    def __init__(self, instance: FakeInstance, settings: CocoSettings = FAST, profile: SpeedupProfile = DEFAULT_PROFILE,
                 dt: float = 0.2):
        self.instance, self.settings, self.profile, self.dt = instance, settings, profile, dt
        self.memory, self.now, self.log = CocoMemory(), 0.0, []

    def window(self, rate: float = CALM, requests: int = 10):
        self.now += self.dt
        commands, self.memory = plan(self.instance.state(self.now, rate, requests), self.memory, self.settings,
                                     self.profile)
        self.instance.apply(commands)
        self.log.extend((self.now, c) for c in commands)
        return commands

    def run(self, windows: int, rate: float = CALM, **kw):
        return [c for _ in range(windows) for c in self.window(rate, **kw)]


def leader_and_spare() -> FakeInstance:
    """exec0 computes all layers; exec1 computes none: 80 spare pages, 40 % of its arena."""
    return FakeInstance(instance_plan(["exec0", "exec1"], [["exec0"]] * LAYERS))


def three_members() -> FakeInstance:
    """exec0 computes all layers, exec1 holds replicas of 0-3, exec2 nothing."""
    return FakeInstance(instance_plan(["exec0", "exec1", "exec2"],
                                      [["exec0", "exec1"]] * 4 + [["exec0"]] * 4))


def kinds(commands) -> list[str]:
    return [c.args.kind for c in commands]


# --- scale-up ----------------------------------------------------------------------------------------
def test_an_idle_member_takes_one_contiguous_range_of_replicas_after_the_up_windows():
    d = Driver(leader_and_spare())
    assert d.window() == []
    commands = d.window()
    assert [c.args for c in commands] == [ReplicateArgs(instance="i0", layers=[0, 7], to="exec1")]
    inputs = commands[0].inputs
    assert inputs["vacancy"]["exec1"] == {"memory": 0.4, "compute": 1.0, "rate": 0.4}
    assert inputs["max_replicas"] == {"exec1": 8} and inputs["speedup_after"] > inputs["speedup_before"] == 1.0
    assert "exec1 40%" in commands[0].reason and "layers 0-7 on exec1" in commands[0].reason
    assert d.run(50) == []  # the member is full now: its spare pages went into the slots


def test_replicas_are_capped_by_the_members_spare_pages():
    instance = leader_and_spare()
    instance.plan = instance_plan(["exec0", "exec1"], [["exec0"]] * 5 + [["exec1"]] * 3)
    # exec0 backs 150 pages outside its slots, exec1 170: 20 spare pages on exec1 (10 % of its arena), two
    # layers' worth, and the longest run it lacks is 0-4: it takes the start of that run.
    assert Driver(instance).run(10) == []  # at the default T_up of 20 %, 10 % vacant is not enough
    lax = replace(FAST, t_up=0.05)
    assert [c.args.layers for c in Driver(instance, lax).run(10)] == [[0, 1]]


def test_a_busy_member_or_a_member_without_room_takes_no_replica():
    busy = leader_and_spare()
    busy.busy["exec1"] = 0.9  # compute vacancy 0.1 < T_up
    assert Driver(busy).run(20) == []
    full = FakeInstance(instance_plan(["exec0", "exec1"], [["exec0"]] * 4 + [["exec1"]] * 4))
    assert full.spare("exec1") == 0 and full.spare("exec0") == 0
    assert Driver(full).run(20) == []


def test_no_replica_where_the_model_predicts_no_gain():
    # A hop that costs more than a layer: no run, however long, pays for its scatter and gather here.
    slow_hop = SpeedupProfile(model="m", device="cpu", threads=1, num_layers=8, hidden_size=64, dtype_bytes=4,
                              layer=Line(1e-3, 0.0), hop=Line(1.0, 0.0), step_overhead=Line(0.0, 0.0))
    for equation in ("eq4", "eq3"):
        d = Driver(leader_and_spare(), replace(FAST, equation=equation), slow_hop)
        assert d.run(20) == []


def test_sort_candidates_by_continuity_takes_the_longest_run_first_then_by_index():
    strategy = Strategy.sequential(8).with_replicas([2, 6], "b")
    assert sort_candidates_by_continuity(strategy, "b", 4) == [3, 4, 5, 0]
    assert sort_candidates_by_continuity(strategy, "b", 10) == [3, 4, 5, 0, 1, 7]
    assert sort_candidates_by_continuity(strategy, "c", 3) == [0, 1, 2]


def test_a_run_whose_first_layer_alone_does_not_pay_is_still_taken_once_enough_of_it_does():
    # δ charges a new run's two transfers to its layers: one layer alone loses, two gain (2·hop vs layer).
    profile = SpeedupProfile(model="m", device="cpu", threads=1, num_layers=8, hidden_size=1, dtype_bytes=1,
                             layer=Line(0.0, 1.0), hop=Line(0.0, 0.6), step_overhead=Line(0.0, 0.0))
    result = scale_up(Strategy.sequential(8), [("b", 8)], lambda s: predict(s, profile, 4, "eq4"))
    assert result.added == {"b": list(range(8))} and result.after > result.before


# --- scale-down --------------------------------------------------------------------------------------
def test_scale_down_migrates_then_evicts_then_cuts_the_batch_one_step_per_enter():
    d = Driver(three_members())
    steps = []
    for _ in range(200):
        for c in d.window(VIOLATING):
            steps.append(c.args)
    assert steps[:4] == [
        # phase 1: the leader's last run of solo layers goes to exec2, the member with the most spare pages
        MigrateArgs(instance="i0", layers=[4, 7], source="exec0", to="exec2"),
        # the leader keeps half the model: phase 2 evicts exec1's replicas, the removal the model minds least
        EvictArgs(instance="i0", layers=[0, 3], source="exec1"),
        # nothing left to migrate or evict: phase 3
        BatchArgs(instance="i0", max_num_seqs=11),
        BatchArgs(instance="i0", max_num_seqs=6),
    ]
    assert steps[4:] == [BatchArgs(instance="i0", max_num_seqs=1)]  # not below 1
    # The KV the leader backs grew from 120 blocks to every page outside a slot of a member holding 4 layers.
    assert d.instance.blocks() == 160


def test_scale_down_leaves_the_instance_alone_while_a_step_settles():
    d = Driver(three_members(), replace(FAST, settle_s=3.0))
    d.run(100, VIOLATING)
    times = [now for now, _ in d.log]
    assert len(times) >= 3 and all(b - a >= 3.0 - 1e-9 for a, b in zip(times, times[1:]))


def test_few_requests_are_neither_pressure_nor_calm_enough_to_replicate():
    assert Driver(three_members()).run(50, VIOLATING, requests=2) == []


def test_when_pressure_ends_the_batch_comes_back_then_the_migrations_in_reverse():
    instance = FakeInstance(instance_plan(["exec0", "exec1"], [["exec0"]] * LAYERS))
    d = Driver(instance, replace(FAST, mode="scale-down", step=2))
    d.run(200, VIOLATING)
    down = [c.args for _, c in d.log]
    assert down == [MigrateArgs(instance="i0", layers=[6, 7], source="exec0", to="exec1"),
                    MigrateArgs(instance="i0", layers=[4, 5], source="exec0", to="exec1"),
                    BatchArgs(instance="i0", max_num_seqs=11), BatchArgs(instance="i0", max_num_seqs=6),
                    BatchArgs(instance="i0", max_num_seqs=1)]
    d.log.clear()
    d.run(300, CALM)
    up = [c.args for _, c in d.log]
    assert up == [BatchArgs(instance="i0", max_num_seqs=6), BatchArgs(instance="i0", max_num_seqs=11),
                  BatchArgs(instance="i0", max_num_seqs=16),
                  MigrateArgs(instance="i0", layers=[4, 5], source="exec1", to="exec0"),
                  MigrateArgs(instance="i0", layers=[6, 7], source="exec1", to="exec0")]
    assert instance.plan.layers == [LayerPlan(placement=["exec0"])] * LAYERS and instance.cap == 16


def test_a_step_back_waits_while_the_running_sequences_will_still_grow_past_the_kv():
    instance = FakeInstance(instance_plan(["exec0", "exec1"], [["exec0"]] * LAYERS))
    d = Driver(instance, replace(FAST, mode="scale-down"))
    d.run(200, VIOLATING)
    d.log.clear()
    # 160 blocks, 20 in use: 130 more still to be taken is more than the 10 % margin allows.
    instance.growth = 130
    assert d.run(100, CALM) == []
    instance.growth = 100  # (20 + 100) * 1.1 <= 160: room to raise the batch back
    assert kinds(d.run(20, CALM))[:1] == ["batch"]


def test_a_migration_back_needs_nothing_waiting_and_counts_the_kv_it_takes_back():
    instance = FakeInstance(instance_plan(["exec0", "exec1"], [["exec0"]] * LAYERS), cap=1)
    d = Driver(instance, replace(FAST, mode="scale-down", step=4))
    d.run(50, VIOLATING)
    assert instance.blocks() == 160 and [c.args.kind for _, c in d.log] == ["migrate"]
    instance.waiting = 1
    assert d.run(100, CALM) == []
    instance.waiting = 0
    instance.used = 110  # taking the 4 layers back leaves 120 blocks: 110 * 1.1 > 120
    assert d.run(100, CALM) == []
    instance.used = 100  # 100 * 1.1 <= 120
    assert kinds(d.run(20, CALM)) == ["migrate"] and instance.blocks() == 120


def test_no_replicas_come_back_while_the_batch_is_cut_or_within_the_dwell():
    instance = FakeInstance(instance_plan(["exec0", "exec1"], [["exec0"]] * 4 + [["exec1"]] * 4), cap=16)
    d = Driver(instance, replace(FAST, min_dwell_s=4.0))
    d.run(10, VIOLATING)  # nothing to migrate or evict here: the batch is cut
    cuts = kinds(c for _, c in d.log)
    assert cuts and set(cuts) == {"batch"}
    cut_at = d.log[-1][0]
    # exec0 gets 60 spare pages: replicas would now fit, but the batch comes back first
    instance.plan = instance_plan(["exec0", "exec1"], [["exec0"]] + [["exec1"]] * 7)
    d.run(100, CALM)
    kinds_seen = [c.args.kind for _, c in d.log]
    assert kinds_seen[:2 * len(cuts)] == ["batch"] * 2 * len(cuts) and "replicate" in kinds_seen
    first_back = next(now for now, c in d.log if now > cut_at)
    assert first_back - cut_at >= 4.0 - 1e-9
    batch_back = max(now for now, c in d.log if c.args.kind == "batch")
    assert all(now > batch_back for now, c in d.log if c.args.kind == "replicate")


def test_a_tp_instance_only_cuts_its_batch():
    instance = FakeInstance(instance_plan(["exec0", "exec1"], [["exec0", "exec1"]] * LAYERS, tp=2))
    d = Driver(instance)
    assert set(kinds(d.run(100, VIOLATING))) == {"batch"}
    assert set(kinds(d.run(300, CALM))) == {"batch"} and instance.cap == 16


def test_an_instance_with_a_member_suspect_or_missing_gets_nothing():
    instance = three_members()
    instance.suspect.add("exec2")
    assert Driver(instance).run(50, VIOLATING) == []
    d = Driver(three_members())
    state = d.instance.state(1.0, VIOLATING)
    state = state.model_copy(update={"executors": state.executors[:2]})
    memory = CocoMemory()
    for i in range(20):
        commands, memory = plan(state.model_copy(update={"time": i * 0.2}), memory, FAST)
        assert commands == []


def test_modes_off_and_scale_down():
    assert Driver(leader_and_spare(), replace(FAST, mode="off")).run(50, VIOLATING) == []
    assert Driver(leader_and_spare(), replace(FAST, mode="scale-down")).run(50) == []
    assert settings_for_mode("default", t_up=0.3).t_up == 0.3


@pytest.mark.parametrize("bad", [dict(mode="fast"), dict(t_up=1.0), dict(t_down_low=0.2), dict(t_down=1.5),
                                 dict(delta_bs=0), dict(step=0), dict(enter_windows=0), dict(up_windows=0),
                                 dict(settle_s=-1), dict(equation="eq5")])
def test_nonsense_settings_are_refused(bad):
    with pytest.raises(ValueError):
        CocoSettings(**bad)
    with pytest.raises(ValueError, match="unknown CoCoServe setting"):
        settings_for_mode("default", nonsense=1)


@pytest.mark.parametrize("args, complaint", [
    (["--speedup", "{bad}"], "layer.per_token_s: expected a finite number"),
    (["--speedup", "/no/such/speedup.json"], "cannot read the speed-up profile"),
    (["--t-down", "2"], "t_down <= 1"),
    (["--cocoserve-set", "no_such_setting=1"], "unknown CoCoServe setting"),
    (["--cocoserve", "sometimes"], "invalid choice"),
])
def test_the_controller_refuses_bad_cocoserve_flags_before_connecting(tmp_path, args, complaint):
    bad = tmp_path / "speedup.json"
    bad.write_text(json.dumps({"kind": "speedup-profile", "model": "m", "device": "cpu", "threads": 1,
                               "num_layers": 2, "hidden_size": 4, "dtype_bytes": 4,
                               "layer": {"intercept_s": 0.1, "per_token_s": -1}}))
    argv = [a.replace("{bad}", str(bad)) for a in args]
    result = subprocess.run([sys.executable, "-m", "services.cli", "controller", "--nats", "nats://127.0.0.1:1",
                             *argv], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and complaint in result.stderr, result.stderr


# --- the audit trail ---------------------------------------------------------------------------------
class FakeBus:
    def __init__(self):
        self.events = []

    async def request(self, subject, command, reply_type, timeout):
        return CommandResult(seq=command.seq, issuer=command.issuer, executor=subject.rsplit(".", 1)[-1],
                             kind=command.kind, ok=True)

    async def publish(self, subject, message):
        self.events.append(message)


def test_every_decision_reaches_the_audit_event_with_the_inputs_it_saw():
    async def scenario():
        instance = three_members()
        config = ControllerConfig(cocoserve_mode="default",
                                  cocoserve_overrides=(("enter_windows", 2), ("settle_s", 0.5)))
        controller = Controller(config, [cocoserve.make_policy()])
        bus = FakeBus()
        controller.sender = CommandSender(bus, "ctl-test", 1.0, 0)
        for i in range(1, 4):
            controller.dispatch(controller.plan(instance.state(i * 0.2, VIOLATING)))
            await controller.wait_idle()
        return bus.events

    events = asyncio.run(scenario())
    assert len(events) == 1
    data = events[0].data
    assert data["kind"] == "migrate" and data["args"] == {"instance": "i0", "layers": [4, 7], "from": "exec0",
                                                          "to": "exec2"}
    assert data["reason"].startswith("SLO violation rate 50% of 10 requests over T_down 10% for 2 windows")
    assert data["inputs"]["violation_rate"] == VIOLATING and data["inputs"]["phase"] == "migrate"
    assert data["inputs"]["spare_pages"] == 80 and data["inputs"]["layer_pages"] == R
    assert data["inputs"]["vacancy"]["exec2"] == {"memory": 0.4, "compute": 1.0, "rate": 0.4}
    assert data["inputs"]["speedup"] > 1.0  # exec1's replicas of layers 0-3, as the model predicts them


# --- properties --------------------------------------------------------------------------------------
MEMBERS = ["exec0", "exec1", "exec2"]


@st.composite
def replication_strategies(draw, n_max=12):
    n = draw(st.integers(1, n_max))
    placements = []
    for _ in range(n):
        first = draw(st.sampled_from(MEMBERS))
        others = draw(st.lists(st.sampled_from([m for m in MEMBERS if m != first]), unique=True, max_size=2))
        placements.append((first, *others))
    return Strategy(tuple(placements))


profiles = st.builds(lambda a, b, h0, h1: SpeedupProfile(model="m", device="cpu", threads=1, num_layers=8,
                                                         hidden_size=64, dtype_bytes=2, layer=Line(a, b + 1e-7),
                                                         hop=Line(h0, h1), step_overhead=Line(0.0, 0.0)),
                     st.floats(0, 1e-2), st.floats(0, 1e-3), st.floats(0, 1e-2), st.floats(0, 1e-7))


@hsettings(max_examples=300, deadline=None)
@given(replication_strategies(), st.lists(st.tuples(st.sampled_from(MEMBERS), st.integers(0, 12)), max_size=3),
       profiles, st.sampled_from(["eq3", "eq4"]), st.integers(1, 64))
def test_algorithm_1_never_lowers_the_predicted_speedup(strategy, nodes, profile, equation, tokens):
    def speedup_of(s):
        return predict(s, profile, tokens, equation)

    result = scale_up(strategy, nodes, speedup_of)
    assert result.after >= result.before == pytest.approx(speedup_of(strategy))
    assert result.after == pytest.approx(speedup_of(result.strategy))
    if result.added:
        assert result.after > result.before
    for dst, layers in result.added.items():
        assert all(dst not in strategy.placements[i] for i in layers)
        assert len(layers) <= sum(k for name, k in nodes if name == dst)


@hsettings(max_examples=300, deadline=None)
@given(replication_strategies(n_max=16), st.sampled_from(MEMBERS), st.integers(0, 16))
def test_candidates_come_in_whole_runs_longest_first(strategy, dst, max_replicas):
    chosen = sort_candidates_by_continuity(strategy, dst, max_replicas)
    free = [i for i, p in enumerate(strategy.placements) if dst not in p]
    assert len(chosen) == min(max_replicas, len(free)) and len(set(chosen)) == len(chosen)
    runs = consecutive_runs(free)
    taken = [run for run in runs if set(run) & set(chosen)]
    whole = [run for run in taken if set(run) <= set(chosen)]
    assert len(taken) - len(whole) <= 1  # at most one run is cut short: the last one taken
    # No run is left out for a shorter one
    assert all(len(run) <= min(len(t) for t in whole) for run in runs if run not in taken) if whole else True


@hsettings(max_examples=200, deadline=None)
@given(replication_strategies(), st.sampled_from(MEMBERS), st.integers(0, 12))
def test_with_free_transfers_every_candidate_is_taken_in_continuity_order(strategy, dst, max_replicas):
    free_hops = SpeedupProfile(model="m", device="cpu", threads=1, num_layers=8, hidden_size=64, dtype_bytes=2,
                               layer=Line(1e-3, 1e-4), hop=Line(0.0, 0.0), step_overhead=Line(0.0, 0.0))
    result = scale_up(strategy, [(dst, max_replicas)], lambda s: predict(s, free_hops, 16, "eq4"))
    assert result.added.get(dst, []) == sort_candidates_by_continuity(strategy, dst, max_replicas)


def can_migrate(instance: FakeInstance, step: int) -> bool:
    """The leader holds layers beyond the first half of the model, and the last `step` of them can go to a
    member that replicates them all, or to one with room for a layer."""
    plan, leader = instance.plan, instance.plan.leader
    beyond = [i for i, layer in enumerate(plan.layers) if leader in layer.placement][(len(plan.layers) + 1) // 2:]
    if not beyond:
        return False
    tail = [beyond[-1]]
    while len(tail) < step and tail[0] - 1 in beyond:
        tail.insert(0, tail[0] - 1)
    others = [m for m in plan.members if m != leader]
    return (any(all(m in plan.layers[i].placement for i in tail) for m in others)
            or any(instance.spare(m) >= R for m in others))


def can_evict(instance: FakeInstance) -> bool:
    return any(len(layer.placement) > 1 for layer in instance.plan.layers)


@hsettings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(MEMBERS), st.lists(st.sampled_from(MEMBERS), unique=True, max_size=2)),
                min_size=1, max_size=LAYERS),
       st.integers(1, 40), st.lists(st.sampled_from([VIOLATING, CALM, 0.08]), min_size=1, max_size=120),
       st.integers(1, 4), st.integers(1, 8))
def test_algorithm_2_never_takes_a_later_phase_while_an_earlier_one_can_act(layers, cap, load, step, delta_bs):
    placements = [[first, *[m for m in others if m != first]] for first, others in layers]
    fake = FakeInstance(instance_plan(MEMBERS, placements), cap=cap)
    s = replace(FAST, step=step, delta_bs=delta_bs, mode="scale-down")
    d = Driver(fake, s)
    original = cap
    for rate in load:
        migrate_ok, evict_ok = can_migrate(fake, step), can_evict(fake)
        for c in d.window(rate):
            kind = c.args.kind
            if rate == VIOLATING:
                assert kind == ("migrate" if migrate_ok else "evict" if evict_ok else "batch"), (kind, c.reason)
            else:
                assert rate == CALM and kind in ("batch", "migrate")
        assert 1 <= fake.cap <= original
    times = [now for now, _ in d.log]
    assert all(b - a >= s.settle_s - 1e-9 for a, b in zip(times, times[1:]))
