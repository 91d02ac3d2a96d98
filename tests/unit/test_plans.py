"""shared/core/plans.py: the instance shapes of `--tp` and `--executors`, and what a `--plan` file may say."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.core.plans import (OperationRefused, PlanError, alone, check_plans, instance_plans, layers_on, parse_plans,
                          plan_of, plans_json, quantized_layers, read_plan_file, reshaped, segments, tp_plans)
from shared.messages import EvictArgs, InstancePlan, LayerPlan, MigrateArgs, ReplicateArgs

EXECS = ["exec0", "exec1", "exec2", "exec3"]


def instance(members: list[str], placements: list[list[str]], tp: int = 1, bits: list[int] | None = None,
             **extra) -> dict:
    """One instance of a plan file, as JSON, with `id` and `leader` left out unless given."""
    bits = bits or [16] * len(placements)
    return {"members": members, "tp": tp, "layers": [{"placement": p, "bits": b} for p, b in zip(placements, bits)],
            **extra}


def all_on(members: list[str], layers: int) -> list[list[str]]:
    return [list(members) for _ in range(layers)]


def write(tmp_path, data) -> str:
    path = tmp_path / "plan.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


# --- the shapes of --tp and --executors -------------------------------------------------------------

def test_tp_plans_group_consecutive_executors_led_by_the_first():
    plans = tp_plans(EXECS, 2, 3)
    assert [(p.id, p.leader, p.members, p.tp) for p in plans] == [("i0", "exec0", ["exec0", "exec1"], 2),
                                                                   ("i1", "exec2", ["exec2", "exec3"], 2)]
    for p in plans:
        assert [layer.placement for layer in p.layers] == [p.members] * 3
        assert {layer.bits for layer in p.layers} == {16}
    assert plan_of(plans, "exec3") is plans[1]
    (whole,) = tp_plans(EXECS, 4, 2)
    assert whole.members == EXECS and whole.tp == 4 and whole.leader == "exec0"


def test_tp1_plans_make_every_executor_an_instance_of_its_own_at_the_given_bits():
    plans = tp_plans(EXECS[:3], 1, 2, bits=8)
    assert [(p.id, p.leader, p.members, p.tp) for p in plans] == [
        (f"i{i}", e, [e], 1) for i, e in enumerate(EXECS[:3])]
    assert all(layers_on(p, p.leader) == [0, 1] for p in plans)
    assert {layer.bits for p in plans for layer in p.layers} == {8}


def test_an_executor_alone_is_a_tp1_instance_named_after_it():
    lone = alone("exec2", 3, bits=4)
    assert (lone.id, lone.leader, lone.members, lone.tp) == ("i-exec2", "exec2", ["exec2"], 1)
    assert [(layer.placement, layer.bits) for layer in lone.layers] == [(["exec2"], 4)] * 3
    check_plans([lone], ["exec2"], 3)


@pytest.mark.parametrize("tp", [0, 3, 5])
def test_tp_must_divide_the_executors(tp):
    with pytest.raises(PlanError, match=f"--tp {tp} must divide the 4 executors"):
        tp_plans(EXECS, tp, 2)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.sampled_from([1, 2, 4]), st.integers(0, 6))
def test_tp_plans_pass_their_own_checks_and_survive_a_round_trip_through_json(instances, tp, layers):
    executors = [f"exec{i}" for i in range(instances * tp)]
    plans = tp_plans(executors, tp, layers)
    check_plans(plans, executors, layers)
    assert sorted(m for p in plans for m in p.members) == sorted(executors)
    assert parse_plans(json.loads(json.dumps(plans_json(plans))), executors, layers) == plans


def test_a_tp_degree_that_does_not_divide_the_ffn_pieces_is_refused():
    with pytest.raises(PlanError, match="--tp 3 must divide the FFN's 4 pieces"):
        tp_plans(EXECS[:3], 3, 2)
    bad = {"instances": [{"members": EXECS[:3], "tp": 3, "layers": [{"placement": EXECS[:3]}] * 2}]}
    with pytest.raises(PlanError, match=r"instances\[0\]\.tp: 3 must divide the FFN's 4 pieces"):
        parse_plans(bad, EXECS, 2)


# --- plan files: what is filled in ------------------------------------------------------------------

def test_a_plan_file_without_id_and_leader_gets_i_n_and_its_first_member(tmp_path):
    path = write(tmp_path, {"instances": [
        instance(["exec1", "exec0"], all_on(["exec1", "exec0"], 2), tp=2),
        instance(["exec2", "exec3"], [["exec2"], ["exec3"], ["exec2", "exec3"]], bits=[8, 4, 16]),
    ]})
    first, second = read_plan_file(path, EXECS, None)
    assert (first.id, first.leader, first.tp) == ("i0", "exec1", 2)
    assert (second.id, second.leader, second.tp) == ("i1", "exec2", 1)
    assert [layer.bits for layer in second.layers] == [8, 4, 16]
    # Given ones are kept.
    path = write(tmp_path, {"instances": [instance(EXECS, all_on(EXECS, 1), tp=4, id="big", leader="exec3")]})
    (only,) = read_plan_file(path, EXECS, 1)
    assert (only.id, only.leader) == ("big", "exec3")


def test_the_layer_count_is_checked_only_when_known(tmp_path):
    path = write(tmp_path, {"instances": [instance(["exec0"], all_on(["exec0"], 3))]})
    assert len(read_plan_file(path, ["exec0"], None)[0].layers) == 3
    assert len(read_plan_file(path, ["exec0"], 3)[0].layers) == 3
    with pytest.raises(PlanError, match=r"^instances\[0\]\.layers: the model has 4 decoder layers, the plan lists 3"):
        read_plan_file(path, ["exec0"], 4)


# --- plan files: every rejection names its field ----------------------------------------------------

TWO = ["exec0", "exec1"]

REJECTED = [
    # (the executors, the instances, the start of the message: the field, then why)
    (TWO, [instance(["exec0", "exec9"], all_on(["exec0", "exec9"], 2), tp=2),
           instance(["exec1"], all_on(["exec1"], 2))],
     r"instances\[0\]\.members: 'exec9' is not an executor"),
    (TWO, [instance(TWO, all_on(TWO, 2), tp=2), instance(["exec1"], all_on(["exec1"], 2))],
     r"instances\[1\]\.members: 'exec1' is already a member of instance 'i0'"),
    (EXECS, [instance(TWO, all_on(TWO, 2), tp=2, leader="exec2")],
     r"instances\[0\]\.leader: 'exec2' is not one of its members"),
    (EXECS, [instance(EXECS[:3], all_on(EXECS[:3], 2), tp=2), instance(["exec3"], all_on(["exec3"], 2))],
     r"instances\[0\]\.tp: 2 must be 1 or the number of members \(3\)"),
    (EXECS, [instance(TWO, all_on(TWO, 2), tp=2, id="x"), instance(EXECS[2:], all_on(EXECS[2:], 2), tp=2, id="x")],
     r"instances\[1\]\.id: 'x' names two instances"),
    (TWO, [instance(["exec0"], [["exec0"], ["exec0", "exec1"]]), instance(["exec1"], all_on(["exec1"], 2))],
     r"instances\[0\]\.layers\[1\]\.placement: 'exec1' is not a member of the instance"),
    (TWO, [instance(TWO, [TWO, ["exec0"]], tp=2)],
     r"instances\[0\]\.layers\[1\]\.placement: a TP2 instance shards every layer over all its members"),
    (TWO, [instance(TWO, [["exec0", "exec0"], ["exec1"]])],
     r"instances\[0\]\.layers\[0\]\.placement: an executor is named twice"),
    (TWO, [instance(["exec0"], all_on(["exec0"], 3), bits=[16, 2, 16]),
           instance(["exec1"], all_on(["exec1"], 3))],
     r"instances\[0\]\.layers\[1\]\.bits: "),
    (TWO, [instance(["exec0"], [[]]), instance(["exec1"], all_on(["exec1"], 1))],
     r"instances\[0\]\.layers\[0\]\.placement: "),
    (TWO, [instance(TWO, all_on(TWO, 1), tp=0)], r"instances\[0\]\.tp: "),
    (TWO, [{"members": TWO, "tp": 2}], r"instances\[0\]\.layers: Field required"),
    (TWO, [{"tp": 2, "layers": [{"placement": TWO}]}], r"instances\[0\]\.members: expected a list of executor ids"),
    (TWO, [instance(["exec0", "exec0", "exec1"], all_on(TWO, 1))], r"instances\[0\]\.members: an executor is named twice"),
    (TWO, [instance(TWO, all_on(TWO, 1), tp=2, shards=2)], r"instances\[0\]\.shards: "),
    (TWO, [instance(["exec0"], all_on(["exec0"], 2))], r"instances: executor 'exec1' is in no instance"),
    (TWO, ["exec0"], r"instances\[0\]: expected an object"),
    (TWO, [], r"instances: expected"),
]


@pytest.mark.parametrize("executors, instances, message", REJECTED)
def test_a_plan_that_cannot_be_served_is_refused_naming_the_field(tmp_path, executors, instances, message):
    with pytest.raises(PlanError, match=f"^{message}"):
        read_plan_file(write(tmp_path, {"instances": instances}), executors, None)


def test_a_placement_outside_the_members_is_refused_in_a_tp1_instance_of_several(tmp_path):
    path = write(tmp_path, {"instances": [instance(TWO, [["exec0"], ["exec1"], ["exec2"]]),
                                          instance(EXECS[2:], all_on(EXECS[2:], 3), tp=2)]})
    with pytest.raises(PlanError, match=r"^instances\[0\]\.layers\[2\]\.placement: 'exec2' is not a member"):
        read_plan_file(path, EXECS, None)


@pytest.mark.parametrize("text", ["not json", "{\"instances\": ", "[1, 2]", "{\"plans\": []}", "{\"instances\": {}}"])
def test_a_file_that_is_not_a_plan_is_refused(tmp_path, text):
    with pytest.raises(PlanError, match=r"cannot read the plan file|^instances: expected"):
        read_plan_file(write(tmp_path, text), TWO, None)


def test_a_missing_plan_file_is_refused_with_its_path(tmp_path):
    with pytest.raises(PlanError, match=f"cannot read the plan file {tmp_path / 'nope.json'}"):
        read_plan_file(tmp_path / "nope.json", TWO, None)


# --- segments and layers_on -------------------------------------------------------------------------

def plan(placements: list[list[str]], members: list[str] | None = None, tp: int = 1) -> InstancePlan:
    members = members or sorted({m for p in placements for m in p})
    return InstancePlan(id="i0", leader=members[0], members=members, tp=tp,
                        layers=[LayerPlan(placement=p) for p in placements])


def test_segments_are_runs_of_layers_on_the_same_executors():
    p = plan([["exec0"], ["exec0"], ["exec1"], ["exec0", "exec1"], ["exec0", "exec1"], ["exec0"]])
    assert [(s.start, s.stop, s.placement) for s in segments(p)] == [
        (0, 2, ("exec0",)), (2, 3, ("exec1",)), (3, 5, ("exec0", "exec1")), (5, 6, ("exec0",))]
    assert layers_on(p, "exec0") == [0, 1, 3, 4, 5]
    assert layers_on(p, "exec1") == [2, 3, 4]
    assert layers_on(p, "exec7") == []
    (whole,) = segments(tp_plans(TWO, 2, 4)[0])
    assert (whole.start, whole.stop, whole.placement) == (0, 4, tuple(TWO))
    assert segments(plan([], members=["exec0"])) == []


placements = st.lists(st.lists(st.sampled_from(EXECS), min_size=1, max_size=4, unique=True), max_size=24)


@settings(max_examples=300, deadline=None)
@given(placements.filter(bool))
def test_segments_cover_every_layer_once_in_order_and_neighbours_differ(layers):
    p = plan(layers)
    found = segments(p)
    assert found[0].start == 0 and found[-1].stop == len(layers)
    for before, after in zip(found, found[1:]):
        assert before.stop == after.start and before.placement != after.placement
    for s in found:
        assert s.start < s.stop
        assert all(tuple(layers[i]) == s.placement for i in range(s.start, s.stop))
    for member in EXECS:
        held = [i for s in found if member in s.placement for i in range(s.start, s.stop)]
        assert layers_on(p, member) == held


@settings(max_examples=200, deadline=None)
@given(placements.filter(bool), st.lists(st.sampled_from([16, 8, 4]), min_size=24, max_size=24))
def test_a_tp1_plan_is_accepted_with_spare_members_that_compute_nothing_yet(layers, bits):
    members = sorted({m for p in layers for m in p})
    spares = [e for e in EXECS if e not in members][:1]  # a spare takes replicas at run time
    others = [e for e in EXECS if e not in members and e not in spares]
    data = {"instances": [{"members": [*members, *spares],
                           "layers": [{"placement": p, "bits": b} for p, b in zip(layers, bits)]},
                          *({"members": [e], "layers": [{"placement": [e]}] * len(layers)} for e in others)]}
    plans = parse_plans(data, EXECS, len(layers))
    assert plans[0].leader == members[0] and [layer.bits for layer in plans[0].layers] == bits[:len(layers)]
    assert plans[0].members == [*members, *spares]


def test_quantized_layers_groups_what_the_plan_does_not_keep_at_full_precision():
    [plan] = parse_plans({"instances": [{"members": ["exec0"], "layers": [
        {"placement": ["exec0"], "bits": 8}, {"placement": ["exec0"]}, {"placement": ["exec0"], "bits": 4},
        {"placement": ["exec0"], "bits": 8}]}]}, ["exec0"], 4)
    assert quantized_layers(plan) == {8: [0, 3], 4: [2]}
    assert quantized_layers(plan, {2, 3}) == {4: [2], 8: [3]}  # of the layers a member holds


def test_instance_plans_take_the_file_else_tp_at_the_static_bits(tmp_path):
    assert instance_plans(["exec0", "exec1"], 2, bits=8) == tp_plans(["exec0", "exec1"], 1, 2, 8)
    assert instance_plans(["exec0", "exec1"], 2, tp=2) == tp_plans(["exec0", "exec1"], 2, 2)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"instances": [{"members": ["exec1", "exec0"], "tp": 2, "layers": [
        {"placement": ["exec0", "exec1"]}]}]}))
    [plan] = instance_plans(["exec0", "exec1"], 1, tp=2, plan_file=path)
    assert plan.leader == "exec1"


def test_a_worlds_prefix_names_its_instances_where_the_plan_names_none(tmp_path):
    assert [p.id for p in instance_plans(EXECS, 2, tp=2, prefix="b")] == ["b0", "b1"]
    path = write(tmp_path, {"instances": [instance(["exec0"], all_on(["exec0"], 2)),
                                          instance(["exec1"], all_on(["exec1"], 2), id="own")]})
    assert [p.id for p in instance_plans(["exec0", "exec1"], 2, plan_file=path, prefix="b")] == ["b0", "own"]


# --- CoCoServe's operations on a running instance's plan ---------------------------------------------

def _two_member_plan(num_layers: int = 6) -> InstancePlan:
    layers = [{"placement": ["exec0"], "bits": 8}] * num_layers
    [plan] = parse_plans({"instances": [{"members": TWO, "layers": layers}]}, TWO, num_layers)
    return plan


def test_replicate_migrate_and_evict_change_only_the_layers_named():
    plan = _two_member_plan()
    replicated = reshaped(plan, ReplicateArgs(instance="i0", layers=[1, 3], to="exec1"))
    both = ["exec0", "exec1"]
    assert [layer.placement for layer in replicated.layers] == [["exec0"], both, both, both, ["exec0"], ["exec0"]]
    assert [layer.bits for layer in replicated.layers] == [8] * 6  # a replica keeps the layer's bits
    migrated = reshaped(replicated, MigrateArgs(instance="i0", layers=[3, 4], source="exec0", to="exec1"))
    assert [layer.placement for layer in migrated.layers][2:5] == [["exec0", "exec1"], ["exec1"], ["exec1"]]
    evicted = reshaped(migrated, EvictArgs(instance="i0", layers=[1, 2], source="exec1"))
    assert [layer.placement for layer in evicted.layers] == [["exec0"]] * 3 + [["exec1"]] * 2 + [["exec0"]]
    assert [layer.placement for layer in plan.layers] == [["exec0"]] * 6  # the input is never changed


@pytest.mark.parametrize("op, why", [
    (ReplicateArgs(instance="i9", layers=[0, 1], to="exec1"), "not 'i9'"),
    (ReplicateArgs(instance="i0", layers=[4, 6], to="exec1"), "the model has 6 decoder layers"),
    (ReplicateArgs(instance="i0", layers=[0, 1], to="exec7"), "'exec7' is not a member"),
    (ReplicateArgs(instance="i0", layers=[0, 1], to="exec0"), "layer 0 is already on exec0"),
    (MigrateArgs(instance="i0", layers=[0, 1], source="exec1", to="exec0"), "layer 0 is not on exec1"),
    (MigrateArgs(instance="i0", layers=[0, 1], source="exec0", to="exec0"), "two different members"),
    (EvictArgs(instance="i0", layers=[2, 2], source="exec0"), "evicting its last copy"),
    (EvictArgs(instance="i0", layers=[2, 2], source="exec1"), "no replica on exec1"),
])
def test_an_operation_the_plan_does_not_allow_is_refused_with_the_reason(op, why):
    with pytest.raises(OperationRefused, match=why):
        reshaped(_two_member_plan(), op)


def test_a_tp_instance_refuses_layer_operations():
    [plan] = tp_plans(TWO, 2, 4)
    with pytest.raises(OperationRefused, match="TP2"):
        reshaped(plan, ReplicateArgs(instance=plan.id, layers=[0, 0], to="exec1"))


def test_a_planned_instance_refuses_to_move_layers_its_members_keep_no_slot_for():
    plan = InstancePlan(id="i0", leader="exec0", members=["exec0", "exec1"], slots="placed",
                        layers=[LayerPlan(placement=["exec0"]), LayerPlan(placement=["exec1"], bits=4)])
    for op in (ReplicateArgs(instance="i0", layers=[0, 0], to="exec1"),
               MigrateArgs(instance="i0", layers=[1, 1], source="exec1", to="exec0")):
        with pytest.raises(OperationRefused, match="slots for its placed layers only"):
            reshaped(plan, op)
