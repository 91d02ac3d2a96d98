"""CoCoServe onto a simulated executor serving alone (services/tools/simulator/joins.py): the controller's recruit
joins and leaves as the executors' enlist.py has it, through the simulation's own collective, and a join either
side refuses changes nothing."""

import json

import pytest

from services.tools.bench.trace import TraceRequest
from services.tools.simulator import joins
from services.tools.simulator.cluster import SimSettings, Simulation
from services.tools.simulator.executor import SimRequest, SimulatedRefusal
from services.tools.simulator.fleet import read_fleet
from shared.config import ControllerConfig
from shared.core.policies.interface import PlannedCommand
from shared.messages import BatchArgs, JoinArgs, ReplicateArgs
from tests.unit.test_simulator import PAGE, write_fleet

RECRUITING = SimSettings(controller=ControllerConfig(levers=("replicate",), cocoserve_mode="default"))


def pair(tmp_path, leader_pages: int = 800, settings: SimSettings = RECRUITING) -> Simulation:
    """exec0 of `leader_pages` and exec1 of 800 (30 layer slots of 20 pages: 200 KV pages), one world."""
    path = write_fleet(tmp_path, pages=800, count=2)
    fleet = json.loads(path.read_text())
    newcomer = dict(fleet["executors"][0], count=1)
    fleet["executors"] = [dict(newcomer, memory=leader_pages * PAGE), newcomer]
    path.write_text(json.dumps(fleet))
    return Simulation(read_fleet(path), settings)


def arena(executor) -> tuple:
    snap = executor.ledger.snapshot()
    return snap, sorted(executor.held), list(executor.layer_bits), executor.group, executor.plan


def test_a_lone_stream_recruits_the_idle_executor_which_goes_back_when_a_second_request_arrives(tmp_path):
    sim = pair(tmp_path)
    before = arena(sim.executors["exec1"])
    run = sim.run([TraceRequest(0.5, 100, 300), TraceRequest(8.0, 50, 20)])
    commands = [e.data for e in run.events if e.kind == "command"]
    assert [(d["executor"], d["kind"], d["ok"]) for d in commands] == [
        ("exec0", "replicate", True), ("exec1", "join", True), ("exec0", "evict", True)]
    replicate, join, evict = commands
    assert replicate["state"]["joined"] == "exec1" and replicate["state"]["layers_copied"] == 30
    assert join["state"]["plan"]["members"] == ["exec0", "exec1"]
    assert evict["state"]["left"] == ["exec1"] and evict["state"]["plan"]["members"] == ["exec0"]
    [decided] = [e.time - e.data["latency_s"] for e in run.events if e.kind == "command" and e.data["kind"] == "evict"]
    assert 8.0 < decided < 9.0  # at the second request's arrival
    assert [(r.tokens, r.error) for r in run.requests] == [(300, None), (20, None)]
    # exec1 serves alone with its whole model at full precision and every KV page free, as it started.
    assert arena(sim.executors["exec1"]) == before
    leader = sim.executors["exec0"]
    assert leader.group is None and leader.plan.members == ["exec0"] and leader.ledger.snapshot().pages_kv_used == 0


def test_the_leaders_sequences_keep_their_tokens_and_the_newcomers_are_handed_over_to_recompute(tmp_path):
    sim = pair(tmp_path)
    leader, newcomer = sim.executors["exec0"], sim.executors["exec1"]
    leader.admit(SimRequest(0, 0.0, 100, 50), 0.0)
    newcomer.admit(SimRequest(1, 0.0, 60, 10), 0.0)
    seq = leader.scheduler.waiting[0]
    leader.scheduler.schedule()  # its prefill scheduled: it holds blocks
    held = len(seq.block_table)
    assert held > 0
    state, _ = joins.join(leader, newcomer, ReplicateArgs(instance=leader.plan.id, layers=[0, 9], to="exec1"))
    group = leader.group
    assert group is newcomer.group and state["joined"] == "exec1" and group.plan.members == ["exec0", "exec1"]
    assert seq in group.scheduler.running and len(seq.block_table) == held
    assert [s.request_id for s in group.scheduler.waiting] == ["1"] and not newcomer.requests
    assert leader.requests["1"].executor == "exec0"
    assert sorted(newcomer.held) == list(range(10)) and group.ledger.num_present - group.ledger.num_free == held


@pytest.mark.parametrize("why", ["not a peer", "too few pages", "in an instance already", "its reshape refused"])
def test_a_join_either_side_refuses_changes_nothing(tmp_path, why):
    sim = pair(tmp_path, leader_pages=1500 if why == "too few pages" else 800)  # 900 KV pages: more than exec1 has
    leader, newcomer = sim.executors["exec0"], sim.executors["exec1"]
    op = ReplicateArgs(instance=leader.plan.id, layers=[0, 29], to="exec1")
    if why == "not a peer":
        leader.world = ["exec0"]
    elif why == "in an instance already":
        joins.join(leader, newcomer, ReplicateArgs(instance=leader.plan.id, layers=[0, 1], to="exec1"))
    else:  # the two meet, the replicate of a layer the model lacks is refused, and the newcomer leaves at once
        op = ReplicateArgs(instance=leader.plan.id, layers=[0, 30], to="exec1")
        leader.admit(SimRequest(0, 0.0, 100, 50), 0.0)
        leader.scheduler.schedule()
    before = [arena(leader), arena(newcomer)]
    with pytest.raises(SimulatedRefusal, match="join refused" if why != "its reshape refused" else "replicate"):
        joins.join(leader, newcomer, op)
    assert [arena(leader), arena(newcomer)] == before


@pytest.mark.parametrize("join_first", [True, False], ids=["the join first", "the leader's commands first"])
def test_a_join_whose_leaders_command_never_comes_is_refused_not_left_waiting(tmp_path, join_first):
    sim = pair(tmp_path)
    instance = sim.executors["exec0"].plan.id
    leader = [PlannedCommand("exec0", BatchArgs(instance="nope", max_num_seqs=1)),  # refused, and what follows
              PlannedCommand("exec0", ReplicateArgs(instance=instance, layers=[0, 29], to="exec1"))]
    join = [PlannedCommand("exec1", JoinArgs(instance=instance, leader="exec0"))]
    deliveries = [("exec1", join), ("exec0", leader)]
    for name, commands in deliveries if join_first else deliveries[::-1]:
        sim._deliver(name, commands, 0.0)
    answered = [(e.data["executor"], e.data["kind"], e.data["ok"], e.data["error"] or "") for e in sim.events
                if e.kind == "command"]
    assert sorted(a[:3] for a in answered) == [("exec0", "batch", False), ("exec1", "join", False)]
    assert "exec0's earlier command failed" in next(a[3] for a in answered if a[1] == "join")
    assert sim.executors["exec1"].group is None and not sim._joining and not sim._refused_joins
