"""CoCoServe onto an executor serving alone (shared/core/policies/cocoserve_recruits.py), driven with hand-made
cluster states of one world of executors each serving alone.

A fake world applies the planned commands as the executors do: a leader's replicate onto an executor outside its
instance, with that executor's join beside it, makes the two one instance (the newcomer backs the leader's KV
blocks; what its arena has beyond them is its spare pages); evicting the newcomer's last replica makes it serve
alone again. The policy thus sees its own commands' effects in the next states.
"""

from dataclasses import dataclass, field, replace

from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from shared.core.delivery import sendable
from shared.core.plans import layers_on, reshaped
from shared.core.policies.cocoserve import CocoMemory, plan
from shared.core.policies.cocoserve_algorithms import CocoSettings
from shared.core.policies.interface import PlannedCommand
from shared.messages import (ClusterState, EvictArgs, ExecutorState, ExecutorTelemetry, InstancePlan, JoinArgs,
                             KvPages, LayerPlan, ReplicateArgs, RestoreArgs, SloWindow)

R, TOTAL, LAYERS = 10, 200, 8  # pages per layer slot, pages per arena, decoder layers
KV = TOTAL - R * LAYERS  # the KV pages of an executor serving alone: its KV blocks
FAST = CocoSettings(enter_windows=2, leave_windows=3, min_dwell_s=1.0, up_windows=2, settle_s=0.5)


def alone(name: str) -> InstancePlan:
    return InstancePlan(id=f"i-{name}", leader=name, members=[name], layers=[LayerPlan(placement=[name])] * LAYERS)


@dataclass
class Executor:
    running: int = 0
    waiting: int = 0
    busy: float = 0.0
    violation: float = 0.0
    draining: bool = False
    model: str = "m"
    pages: int = TOTAL


@dataclass
class FakeWorld:
    executors: dict[str, Executor]
    plans: dict[str, InstancePlan] = field(default_factory=dict)  # by leader
    world: list[str] | None = None

    def __post_init__(self):
        self.plans = {name: alone(name) for name in self.executors}
        self.world = self.world if self.world is not None else sorted(self.executors)

    def plan_of(self, name: str) -> InstancePlan:
        return next(p for p in self.plans.values() if name in p.members)

    def apply(self, commands: list[PlannedCommand]) -> None:
        joins = {c.executor: c.args for c in commands if isinstance(c.args, JoinArgs)}
        for c in commands:
            if isinstance(c.args, JoinArgs):
                assert any(isinstance(o.args, ReplicateArgs) and o.args.to == c.executor and o.executor == c.args.leader
                           for o in commands), "a join goes with its leader's replicate"
                continue
            p = self.plans[c.executor]
            if isinstance(c.args, ReplicateArgs) and c.args.to not in p.members:
                assert joins.get(c.args.to) == JoinArgs(instance=p.id, leader=c.executor)
                del self.plans[c.args.to]
                p = p.model_copy(update={"members": [*p.members, c.args.to]})
            p = reshaped(p, c.args)
            for gone in [m for m in p.members if m != p.leader and not layers_on(p, m)]:
                p = p.model_copy(update={"members": [m for m in p.members if m != gone]})
                self.plans[gone] = alone(gone)
            self.plans[c.executor] = p

    def state(self, now: float) -> ClusterState:
        out = []
        for name, e in self.executors.items():
            p = self.plan_of(name)
            leads = p.leader == name
            blocks = KV
            slots = R * len(layers_on(p, name))
            kv = KvPages(pages_total=e.pages, pages_slot=slots, pages_free=blocks - 4 * e.running,
                         pages_used=4 * e.running, pages_base=blocks, pages_extension=0)
            t = ExecutorTelemetry(
                executor=name, instance="p", time=now, model=e.model, max_model_len=256, block_size=16,
                page_bytes=4096, kv=kv, layers=[16] * LAYERS, swap_order=list(range(LAYERS)),
                running=e.running if leads else 0, waiting=e.waiting if leads else 0, max_waiting=64, preemptions=0,
                prompt_tokens=0, generated_tokens=0, queue_delay_s=0.0, ttft_s=0.0, tpot_s=0.0, plan=p,
                max_num_seqs=16 if leads else 0, layer_pages=R, draining=e.draining, busy=e.busy, world=self.world,
                spare_pages=max(0, e.pages - slots - blocks) if len(p.members) > 1 else 0)
            out.append(ExecutorState(executor=name, alive=True, last_seen=now, kv_usage=0.1, queue_delay_s=0.0,
                                     waiting=0.0, telemetry=t, slo=SloWindow(requests=10, violation_rate=e.violation)))
        return ClusterState(time=now, executors=out)


class Driver:
    def __init__(self, world: FakeWorld, settings: CocoSettings = FAST, dt: float = 0.2):
        self.world, self.settings, self.dt = world, settings, dt
        self.memory, self.now = CocoMemory(), 0.0

    def window(self) -> list[PlannedCommand]:
        self.now += self.dt
        commands, self.memory = plan(self.world.state(self.now), self.memory, self.settings)
        self.world.apply(commands)
        return commands

    def run(self, windows: int) -> list[PlannedCommand]:
        return [c for _ in range(windows) for c in self.window()]


def busy_and_idle(**idle) -> FakeWorld:
    return FakeWorld({"exec0": Executor(running=4, busy=0.9), "exec1": Executor(**idle)})


def test_an_idle_peer_is_recruited_after_the_up_windows_with_the_leaders_replicate_and_its_join():
    d = Driver(busy_and_idle())
    assert d.window() == []
    commands = d.window()
    assert [(c.executor, c.args) for c in commands] == [
        ("exec0", ReplicateArgs(instance="i-exec0", layers=[0, LAYERS - 1], to="exec1")),
        ("exec1", JoinArgs(instance="i-exec0", leader="exec0"))]
    inputs = commands[0].inputs
    # exec1 backs exec0's 120 KV blocks; the 80 pages beyond them hold 8 layers, 40 % of its arena.
    assert inputs["leader_blocks"] == KV and inputs["max_replicas"] == LAYERS
    assert inputs["vacancy"]["exec1"] == {"memory": 0.4, "compute": 1.0, "rate": 0.4}
    assert inputs["speedup_after"] > inputs["speedup_before"]
    assert "exec1 serving alone has run nothing" in commands[0].reason
    assert "joins exec0's instance" in commands[0].reason
    assert d.world.plan_of("exec1").members == ["exec0", "exec1"]
    assert d.run(10) == []  # no arrival: it stays


def test_replicas_are_capped_by_the_pages_beyond_the_leaders_blocks():
    d = Driver(busy_and_idle(pages=KV + 3 * R + 5), replace(FAST, t_up=0.05))
    assert [c.args for c in d.run(3) if c.executor == "exec0"] == [
        ReplicateArgs(instance="i-exec0", layers=[0, 2], to="exec1")]


def test_no_recruit_from_a_peer_with_work_or_without_room_nor_for_a_leader_that_queues_or_fails_its_slo():
    for world in [busy_and_idle(running=1), busy_and_idle(waiting=1), busy_and_idle(busy=0.9),
                  busy_and_idle(draining=True), busy_and_idle(model="other"), busy_and_idle(pages=KV + R - 1)]:
        assert Driver(world).run(20) == [], world
    queued = busy_and_idle()
    queued.executors["exec0"].waiting = 2
    violating = busy_and_idle()
    violating.executors["exec0"].violation = 0.5
    idle_leader = busy_and_idle()
    idle_leader.executors["exec0"].running = 0
    outside = FakeWorld({"exec0": Executor(running=4), "exec1": Executor()}, world=["exec0", "exec2"])
    for world in [queued, violating, idle_leader, outside]:
        assert Driver(world).run(20) == []


def test_a_recruit_goes_back_the_moment_work_arrives_or_the_leader_runs_nothing():
    for arrival in [dict(running=5), dict(waiting=1), dict(running=0), dict(violation=0.5)]:
        d = Driver(busy_and_idle())
        d.run(2)
        d.world.executors["exec0"].running = 3  # a sequence finished: less work, no arrival
        assert d.run(3) == []
        for name, value in arrival.items():
            setattr(d.world.executors["exec0"], name, value)
        commands = d.window()
        assert [(c.executor, c.args) for c in commands] == [
            ("exec0", EvictArgs(instance="i-exec0", layers=[0, LAYERS - 1], source="exec1"))], arrival
        assert commands[0].inputs["phase"] == "release" and "go back to serving alone" in commands[0].reason
        assert d.world.plan_of("exec1").members == ["exec1"]
        d.world.executors["exec0"].running, d.world.executors["exec0"].waiting = 4, 0
        d.world.executors["exec0"].violation = 0.0
        assert d.run(4) == []  # within the dwell after a release: not recruited again at once
        assert [c.executor for c in d.run(10)] == ["exec0", "exec1"]  # and again after it


def test_a_join_and_its_leaders_replicate_go_out_both_or_neither():
    join = [PlannedCommand("exec0", ReplicateArgs(instance="i-exec0", layers=[0, 7], to="exec1")),
            PlannedCommand("exec1", JoinArgs(instance="i-exec0", leader="exec0")),
            PlannedCommand("exec2", RestoreArgs(layers=1))]
    fresh = {"exec0": 10.0, "exec1": 10.0, "exec2": 10.0}
    assert list(sendable(join, busy=set(), reported=fresh, settled={})) == ["exec0", "exec1", "exec2"]
    assert list(sendable(join, busy={"exec0"}, reported=fresh, settled={})) == ["exec2"]
    assert list(sendable(join, busy=set(), reported=fresh, settled={"exec1": 10.0})) == ["exec2"]


@hsettings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 2)), min_size=1, max_size=60))
def test_recruits_take_idle_peers_only_and_never_stay_through_an_arrival(loads):
    """Three executors; each window sets exec0's and exec1's running sequences and exec2's waiting ones."""
    world = FakeWorld({"exec0": Executor(), "exec1": Executor(), "exec2": Executor()})
    d = Driver(world)
    floors: dict[str, int] = {}  # the least a leader ran and queued since its recruit came
    for running0, running1, waiting2 in loads:
        world.executors["exec0"].running, world.executors["exec1"].running = running0, running1
        world.executors["exec2"].waiting = waiting2
        alone_before = {name for name in world.executors if len(world.plan_of(name).members) == 1}
        load = {name: e.running + e.waiting for name, e in world.executors.items()}
        for c in d.window():
            if isinstance(c.args, JoinArgs):
                assert c.executor in alone_before and load[c.executor] == 0
                assert c.args.leader in alone_before and world.executors[c.args.leader].waiting == 0
                assert world.executors[c.args.leader].running > 0
                floors[c.args.leader] = load[c.args.leader]
        for leader, p in world.plans.items():
            assert len(p.members) <= 2 and all(layers_on(p, m) for m in p.members)
            if len(p.members) == 2:  # still recruited after this window: no work came, and some is left
                assert load[leader] <= floors[leader] and world.executors[leader].running > 0
                floors[leader] = min(floors[leader], load[leader])
