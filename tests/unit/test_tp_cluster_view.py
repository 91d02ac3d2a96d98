"""AMOEBAs over the cluster state: which executors can form one instance, the instances decide() reads from the
executors' telemetry, the controller's split of a merge nothing needs, and the admin bodies of tp_merge and
tp_split."""

import pytest

from services.gateway import admin, tp_merges
from services.gateway.openai_api import ApiError
from shared.config import ControllerConfig
from shared.core.policies.amoebas import splits
from shared.core.tp_scheduler import Merge, decide, instances_from, world_allows
from shared.messages import InstancePlan, KvUnits, LayerPlan, TpSplitArgs
from tests.unit.test_router import executor, state

WORLD = ["exec0", "exec1", "exec2", "exec3"]
UNITS = [KvUnits(tp=1, units=300), KvUnits(tp=2, units=900), KvUnits(tp=4, units=1200)]  # 3 KV heads


def solo(name: str, free: int = 100, used: int = 0, running: int = 0):
    e = executor(name, free=free)
    e.telemetry.kv.pages_used = used
    e.telemetry.running = running
    return e.model_copy(update={"telemetry": e.telemetry.model_copy(update={
        "world": WORLD, "kv_units": UNITS, "kv_heads": 3, "plan": None})})


def merged(leader: str, follower: str, free: int, used: int, longest: int, hold: float = 0.0):
    plan = InstancePlan(id=tp_merges.merged_id([leader, follower]), leader=leader, members=[leader, follower], tp=2,
                        layers=[LayerPlan(placement=[leader, follower])] * 4, merged=True)
    out = []
    for name in (leader, follower):
        e = solo(name, free, used)
        out.append(e.model_copy(update={"telemetry": e.telemetry.model_copy(update={
            "plan": plan, "longest_blocks": longest if name == leader else 0,
            "merge_hold_s": hold if name == leader else 0.0})}))
    return out


def test_any_two_executors_of_a_world_form_an_instance_four_only_when_aligned():
    assert world_allows(WORLD, ["exec3", "exec0"]) and world_allows(WORLD, WORLD)
    assert not world_allows(WORLD, ["exec0", "exec0"]) and not world_allows(WORLD, ["exec0", "exec9"])
    assert not world_allows(WORLD + ["exec4"], ["exec1", "exec2", "exec3", "exec4"])
    assert not world_allows(WORLD, ["exec0", "exec1", "exec2"])


def test_instances_are_read_from_the_telemetry_of_executors_in_a_world():
    s = state(solo("exec0", free=80, used=20, running=2), solo("exec1"), executor("lone"))  # lone: in no world
    a, b = instances_from(s, "m")
    assert (a.id, a.tp, a.blocks_free, a.blocks_used, a.load) == ("exec0", 1, 80, 20, 2)
    assert a.members[0].kv_units == {1: 300, 2: 900, 4: 1200} and a.kv_heads == 3 and b.id == "exec1"
    # 100 blocks alone, 450 merged (900 units, 2 heads on the first member): a request of 200 blocks merges them.
    assert decide(200 * 16, [a, b], "amoebas", tp_merges.allowed_in(s)) == Merge(("exec1", "exec0"), 2)


def test_a_merge_nothing_needs_stops_taking_requests_and_the_controller_splits_it_once_half_free():
    config = ControllerConfig()
    busy = state(*merged("exec0", "exec1", free=200, used=250, longest=300))  # the long request still runs
    [i] = instances_from(busy, "m")
    assert i.merged and i.accepting and splits(busy, config.split_free_fraction) == []
    held = state(*merged("exec0", "exec1", free=450, used=0, longest=0, hold=5.0))  # just merged, request on its way
    assert instances_from(held, "m")[0].accepting and splits(held, config.split_free_fraction) == []
    draining = state(*merged("exec0", "exec1", free=200, used=250, longest=50))
    assert not instances_from(draining, "m")[0].accepting and splits(draining, config.split_free_fraction) == []
    free = state(*merged("exec0", "exec1", free=300, used=150, longest=50))
    [command] = splits(free, config.split_free_fraction)
    assert command.executor == "exec0" and command.args == TpSplitArgs(instance="tp-exec0-exec1")
    assert command.inputs == {"longest_blocks": 50, "alone_blocks": 100, "blocks_free": 300, "blocks": 450}
    assert splits(free, 0.9) == []


def test_merge_refusals_are_read_from_the_cluster_state():
    s = state(solo("exec0"), solo("exec1"), *merged("exec2", "exec3", 10, 0, 0))
    assert tp_merges.merge_refusal(s, ["exec0", "exec1"]) is None
    assert "exec2 is already in instance tp-exec2-exec3" in tp_merges.merge_refusal(s, ["exec0", "exec2"])
    assert "exec7 is not alive" in tp_merges.merge_refusal(s, ["exec0", "exec7"])


@pytest.mark.parametrize("body, param", [({"action": "tp_merge"}, "executors"),
                                         ({"action": "tp_merge", "executors": ["exec0"]}, "executors"),
                                         ({"action": "tp_merge", "executors": ["a", "b", "c"]}, "executors"),
                                         ({"action": "tp_merge", "executors": ["a", "a"]}, "executors"),
                                         ({"action": "tp_merge", "executors": ["a", "b"], "instance": "x"}, "instance"),
                                         ({"action": "tp_split"}, "instance"),
                                         ({"action": "tp_split", "instance": "x", "layers": [0, 1]}, "layers")])
def test_bad_tp_bodies_are_400s_naming_the_field(body, param):
    with pytest.raises(ApiError) as err:
        admin.parse_morph(body)
    assert err.value.status == 400 and err.value.param == param


def test_good_tp_bodies_parse():
    assert admin.parse_morph({"action": "tp_merge", "executors": ["exec0", "exec1"]}).executors == ["exec0", "exec1"]
    assert admin.parse_morph({"action": "tp_split", "instance": "tp-exec0-exec1"}).instance == "tp-exec0-exec1"


def test_a_request_only_four_hold_merges_four_executors_serving_alone_at_once():
    s = state(*(solo(f"exec{i}") for i in range(4)))
    instances = instances_from(s, "m")
    # TP2 holds 450 blocks, TP4 1200 // 1: a request of 600 blocks needs all four.
    step = decide(600 * 16, instances, "amoebas", tp_merges.allowed_in(s))
    assert isinstance(step, Merge) and step.tp == 2
    four = tp_merges.MergeScheduler.four_for(600, step, instances, s)
    assert four is not None and four.tp == 4 and sorted(four.instances) == WORLD
    assert tp_merges.MergeScheduler.four_for(400, decide(400 * 16, instances, "amoebas", tp_merges.allowed_in(s)),
                                              instances, s) is None  # a pair holds it


def test_a_request_no_instance_the_cluster_can_form_holds_is_a_400_and_a_draining_cluster_a_503():
    import asyncio

    s = state(solo("exec0"), solo("exec1"))
    scheduler = tp_merges.MergeScheduler(sender=None, get_state=lambda: s)
    with pytest.raises(ApiError) as err:  # TP2 holds 450 blocks
        asyncio.run(scheduler.make_room(500 * 16, "m", "exec0"))
    assert err.value.status == 400 and "needs 500 KV blocks" in err.value.message
    merged_pair = state(*merged("exec0", "exec1", free=100, used=350, longest=50))  # draining, too full for it
    scheduler = tp_merges.MergeScheduler(sender=None, get_state=lambda: merged_pair)
    with pytest.raises(ApiError) as err:
        asyncio.run(scheduler.make_room(200 * 16, "m", "exec0"))
    assert err.value.status == 503 and err.value.code == "no_capacity"
    reopen = state(*merged("exec0", "exec1", free=300, used=150, longest=50))  # draining, and it holds it
    scheduler = tp_merges.MergeScheduler(sender=None, get_state=lambda: reopen)
    assert asyncio.run(scheduler.make_room(200 * 16, "m", "exec0")) == "exec0"
