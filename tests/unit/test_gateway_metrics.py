"""/metrics from a cluster state: the instance gauges follow the latest state, and followers (running and waiting
always 0) leave the request gauges as they were."""

from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import GatewayMetrics
from shared.core.plans import tp_plans
from shared.messages import ClusterState
from tests.unit.test_router import executor


def samples(metrics: GatewayMetrics) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def test_each_instance_has_its_members_and_tp_and_each_executor_its_role():
    (tp2,) = tp_plans(["exec0", "exec1"], 2, 4)
    solo = tp_plans(["exec2"], 1, 4)[0].model_copy(update={"id": "i1"})
    m = GatewayMetrics()
    m.observe_state(ClusterState(time=0.0, executors=[executor("exec0", plan=tp2), executor("exec1", plan=tp2),
                                                      executor("exec2", plan=solo), executor("old")],
                                 instances=[tp2, solo]))
    got = samples(m)
    assert got[("morphling_instance_members", (("instance", "i0"), ("leader", "exec0")))] == 2
    assert got[("morphling_instance_members", (("instance", "i1"), ("leader", "exec2")))] == 1
    assert got[("morphling_instance_tp", (("instance", "i0"),))] == 2
    assert got[("morphling_instance_tp", (("instance", "i1"),))] == 1
    roles = {labels: v for (name, labels), v in got.items() if name == "morphling_executor_instance"}
    assert roles == {(("executor", "exec0"), ("instance", "i0"), ("role", "leader")): 1,
                     (("executor", "exec1"), ("instance", "i0"), ("role", "follower")): 1,
                     (("executor", "exec2"), ("instance", "i1"), ("role", "leader")): 1}


def test_a_dissolved_instance_leaves_metrics_and_followers_add_no_requests():
    (tp2,) = tp_plans(["exec0", "exec1"], 2, 4)
    m = GatewayMetrics()
    m.observe_state(ClusterState(time=0.0, executors=[executor("exec0", waiting=3, plan=tp2),
                                                      executor("exec1", plan=tp2)], instances=[tp2]))
    got = samples(m)
    assert got[("morphling_requests_waiting", ())] == 3
    assert got[("morphling_kv_cache_usage_ratio", ())] == 0.5
    assert {name for name, _ in got} >= {"morphling_executor_restarts_total", "morphling_requests_running"}
    m.observe_state(ClusterState(time=1.0, executors=[executor("exec0", alive=False, plan=tp2),
                                                      executor("exec1", plan=tp2)]))
    got = samples(m)
    assert not any(name.startswith("morphling_instance") for name, _ in got)
    roles = [labels for (name, labels), _ in got.items() if name == "morphling_executor_instance"]
    assert roles == [(("executor", "exec1"), ("instance", "i0"), ("role", "follower"))]
