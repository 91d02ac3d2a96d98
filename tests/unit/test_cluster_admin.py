"""GET /v1/cluster's body without a gateway: the executors with their instance and role, and the instances in the
plan shape shared/plans.py reads."""

from services.gateway import admin
from shared.messages import ClusterState, InstancePlan, LayerPlan
from shared.plans import parse_plans
from tests.unit.test_router import executor, state


def split_plan() -> InstancePlan:
    layers = [LayerPlan(placement=["exec0"]), LayerPlan(placement=["exec1"], bits=8),
              LayerPlan(placement=["exec0", "exec1"], bits=4)]
    return InstancePlan(id="i0", leader="exec0", members=["exec0", "exec1"], layers=layers)


def test_instances_are_listed_in_the_plan_shape():
    plan = split_plan()
    s = ClusterState(time=0.0, executors=[executor("exec0", plan=plan), executor("exec1", plan=plan)],
                     instances=[plan])
    body = admin.cluster_body(s)
    assert body["instances"] == [{"id": "i0", "leader": "exec0", "members": ["exec0", "exec1"], "tp": 1,
                                  "layers": [{"placement": ["exec0"], "bits": 16}, {"placement": ["exec1"], "bits": 8},
                                             {"placement": ["exec0", "exec1"], "bits": 4}]}]
    # What a running cluster shows can be written to a --plan file as it is.
    assert parse_plans({"instances": body["instances"]}, ["exec0", "exec1"], 3) == [plan]


def test_each_executor_shows_its_instance_and_role_beside_what_it_showed_before():
    plan = split_plan()
    s = ClusterState(time=0.0, executors=[executor("exec0", plan=plan), executor("exec1", plan=plan),
                                          executor("solo")], instances=[plan])
    view = admin.cluster_body(s)["executors"]
    assert [(e["id"], e["instance"], e["role"]) for e in view] == [("exec0", "i0", "leader"),
                                                                   ("exec1", "i0", "follower"),
                                                                   ("solo", None, "leader")]
    assert set(view[0]) == {"id", "alive", "suspect", "restarts", "model", "draining", "layers", "swap_order",
                            "block_size", "kv", "running", "waiting", "preemptions", "instance", "role"}


def test_no_state_yet_is_an_empty_cluster():
    assert admin.cluster_body(None) == {"executors": [], "instances": []}
    assert admin.cluster_body(state(executor("a")))["instances"] == []
