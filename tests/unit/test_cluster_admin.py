"""The gateway's admin endpoints without a bus: GET /v1/cluster's body (the executors with their instance, role,
batch cap and SLO window; the instances in the plan shape shared/core/plans.py reads, with their replicas per layer),
and POST /v1/cluster/morph over HTTP against a monitor view and a command sender that stand in for the cluster."""

import asyncio

import pytest
from starlette.testclient import TestClient

from services.gateway import admin
from services.gateway.app import create_app
from shared.config import GatewayConfig
from shared.core.plans import parse_plans, tp_plans
from shared.messages import (BatchArgs, ClusterState, Command, CommandResult, EvictArgs, InstancePlan, JoinArgs,
                             LayerPlan, MigrateArgs, QuantizeArgs, ReplicateArgs, SloWindow)
from tests.unit.test_router import executor, state


def split_plan() -> InstancePlan:
    layers = [LayerPlan(placement=["exec0"]), LayerPlan(placement=["exec1"], bits=8),
              LayerPlan(placement=["exec0", "exec1"], bits=4)]
    return InstancePlan(id="i0", leader="exec0", members=["exec0", "exec1"], layers=layers)


def placed(*owners: str) -> list[LayerPlan]:
    return [LayerPlan(placement=owner.split("+")) for owner in owners]


def with_load(e, max_num_seqs: int = 0, slo: SloWindow | None = None, at: float = 0.0):
    """An executor entry whose latest report (taken at `at`) carries a batch cap, with an SLO window."""
    telemetry = e.telemetry.model_copy(update={"max_num_seqs": max_num_seqs, "time": at})
    return e.model_copy(update={"telemetry": telemetry, "slo": slo or SloWindow()})


def test_instances_are_listed_in_the_plan_shape_with_replicas_per_layer():
    plan = split_plan()
    s = ClusterState(time=0.0, executors=[executor("exec0", plan=plan), executor("exec1", plan=plan)],
                     instances=[plan])
    body = admin.cluster_body(s)
    assert body["instances"] == [{"id": "i0", "leader": "exec0", "members": ["exec0", "exec1"], "tp": 1,
                                  "layers": [{"placement": ["exec0"], "bits": 16}, {"placement": ["exec1"], "bits": 8},
                                             {"placement": ["exec0", "exec1"], "bits": 4}],
                                  "merged": False, "slots": "all", "replicas": [1, 1, 2]}]
    # What a running cluster shows can be written to a --plan file once the derived `replicas` is dropped.
    shown = [{k: v for k, v in i.items() if k != "replicas"} for i in body["instances"]]
    assert parse_plans({"instances": shown}, ["exec0", "exec1"], 3) == [plan]


def test_a_tp_instance_shards_every_layer_so_each_has_one_copy():
    (tp2,) = tp_plans(["exec0", "exec1"], 2, 3)
    s = ClusterState(time=0.0, executors=[executor("exec0", plan=tp2), executor("exec1", plan=tp2)], instances=[tp2])
    assert admin.cluster_body(s)["instances"][0]["replicas"] == [1, 1, 1]


def test_each_executor_shows_its_instance_role_batch_cap_and_slo_window():
    plan = split_plan()
    window = SloWindow(requests=40, violation_rate=0.05, ttft_p95_s=0.4, tpot_p95_s=0.05)
    s = ClusterState(time=0.0, executors=[with_load(executor("exec0", plan=plan), 32, window),
                                          executor("exec1", plan=plan), with_load(executor("solo"), 8)],
                     instances=[plan])
    view = admin.cluster_body(s)["executors"]
    assert [(e["id"], e["instance"], e["role"], e["max_num_seqs"]) for e in view] == [
        ("exec0", "i0", "leader", 32), ("exec1", "i0", "follower", 0), ("solo", None, "leader", 8)]
    assert view[0]["slo"] == window.model_dump() and view[2]["slo"]["requests"] == 0
    assert set(view[0]) == {"id", "alive", "suspect", "restarts", "model", "draining", "layers", "swap_order",
                            "block_size", "kv", "running", "waiting", "preemptions", "instance", "role",
                            "max_num_seqs", "slo"}


def test_no_state_yet_is_an_empty_cluster():
    assert admin.cluster_body(None) == {"executors": [], "instances": []}
    assert admin.cluster_body(state(executor("a")))["instances"] == []


# --- POST /v1/cluster/morph ---------------------------------------------------------------------------
BEFORE = InstancePlan(id="i0", leader="exec0", members=["exec0", "exec1"], layers=placed("exec0", "exec0", "exec1",
                                                                                          "exec1"))


def cluster(plan: InstancePlan = BEFORE, leader_cap: int = 16, solo_cap: int = 4, at: float = 0.0,
            solo_alive: bool = True) -> ClusterState:
    """Instance i0 of exec0 (leader) and exec1, and the standalone executor `solo` (instance i-solo)."""
    return ClusterState(time=at, executors=[with_load(executor("exec0", plan=plan), leader_cap, at=at),
                                            with_load(executor("exec1", plan=plan), at=at),
                                            with_load(executor("solo", alive=solo_alive), solo_cap, at=at)],
                        instances=[plan])


class Monitor:
    """The gateway's view of the cluster (Dispatcher.state), which the monitor replaces a few times a second."""

    def __init__(self, s: ClusterState):
        self.state = s

    def publish_later(self, views: list[tuple[float, ClusterState]]) -> None:
        loop = asyncio.get_running_loop()
        for delay, view in views:
            loop.call_later(delay, setattr, self, "state", view)


class Sender:
    """CommandSender's part the endpoint uses: records each command and answers it as the leader would, the
    monitor's view following after the given delays."""

    def __init__(self, monitor: Monitor, ok: bool = True, error: str | None = None, answer: dict | None = None,
                 then: list[tuple[float, ClusterState]] = ()):
        self.monitor, self.ok, self.error, self.answer, self.then = monitor, ok, error, answer or {}, list(then)
        self.sent: list[tuple[str, object]] = []

    async def send(self, executor: str, args, reason: str = "") -> CommandResult:
        self.sent.append((executor, args))
        if self.ok:
            self.monitor.publish_later(self.then)
        return CommandResult(seq=len(self.sent), issuer="gateway-gw0", executor=executor, kind=args.kind, ok=self.ok,
                             error=self.error, state=self.answer if self.ok else {})


def admin_app():
    """(client, install) of a gateway app without a bus: `install(view, **answers)` sets the monitor's view and
    how the leader answers (Sender's arguments), and returns the Sender."""
    app = create_app(GatewayConfig())
    gw = app.state.gateway
    client = TestClient(app)  # no lifespan: nothing connects to a bus

    def install(view: ClusterState, **answers) -> Sender:
        gw.dispatcher = Monitor(view)
        gw.commands = Sender(gw.dispatcher, **answers)
        return gw.commands

    return client, install


@pytest.fixture
def gateway():
    return admin_app()


def post(client, body) -> tuple[int, dict]:
    r = client.post("/v1/cluster/morph", json=body)
    return r.status_code, r.json()


REPLICATE = {"action": "replicate", "instance": "i0", "layers": [0, 1], "to": "exec1"}
MIGRATE = {"action": "migrate", "instance": "i0", "layers": [2, 3], "from": "exec1", "to": "exec0"}
EVICT = {"action": "evict", "instance": "i0", "layers": [0, 1], "from": "exec1"}
BATCH = {"action": "batch", "instance": "i0", "max_num_seqs": 8}


def without(body: dict, name: str) -> dict:
    return {k: v for k, v in body.items() if k != name}


@pytest.mark.parametrize("body, param", [
    ([1, 2], None),
    ({"instance": "i0", "max_num_seqs": 8}, "action"),
    ({**BATCH, "action": "explode"}, "action"),
    ({**BATCH, "action": ["batch"]}, "action"),
    (without(REPLICATE, "instance"), "instance"),
    ({**BATCH, "instance": ""}, "instance"),
    ({**BATCH, "instance": 0}, "instance"),
    (without(REPLICATE, "layers"), "layers"),
    ({**REPLICATE, "layers": [1]}, "layers"),
    ({**REPLICATE, "layers": [0, 1, 2]}, "layers"),
    ({**REPLICATE, "layers": [2, 1]}, "layers"),
    ({**REPLICATE, "layers": [-1, 1]}, "layers"),
    ({**REPLICATE, "layers": [0, 1.0]}, "layers"),
    ({**REPLICATE, "layers": [True, 1]}, "layers"),
    ({**REPLICATE, "layers": [0, 10**30]}, "layers"),
    ({**REPLICATE, "layers": "0-1"}, "layers"),
    ({**EVICT, "layers": 2}, "layers"),
    (without(REPLICATE, "to"), "to"),
    ({**REPLICATE, "to": ""}, "to"),
    ({**REPLICATE, "to": 1}, "to"),
    ({**REPLICATE, "from": "exec0"}, "from"),
    ({**REPLICATE, "max_num_seqs": 8}, "max_num_seqs"),
    (without(MIGRATE, "from"), "from"),
    (without(MIGRATE, "to"), "to"),
    ({**MIGRATE, "to": "exec1"}, "to"),
    (without(EVICT, "from"), "from"),
    ({**EVICT, "to": "exec0"}, "to"),
    (without(BATCH, "max_num_seqs"), "max_num_seqs"),
    ({**BATCH, "max_num_seqs": 0}, "max_num_seqs"),
    ({**BATCH, "max_num_seqs": True}, "max_num_seqs"),
    ({**BATCH, "max_num_seqs": 8.0}, "max_num_seqs"),
    ({**BATCH, "max_num_seqs": "8"}, "max_num_seqs"),
    ({**BATCH, "max_num_seqs": 10**30}, "max_num_seqs"),
    ({**BATCH, "layers": [0, 1]}, "layers"),
    ({**BATCH, "to": "exec1"}, "to"),
    ({**BATCH, "from": "exec1"}, "from"),
    ({**BATCH, "executor": "exec0"}, "executor"),
    ({**REPLICATE, "bits": 8}, "bits"),
    ({**REPLICATE, "force": True}, "force"),
])
def test_a_bad_body_is_a_400_naming_the_field_and_sends_nothing(gateway, body, param):
    client, install = gateway
    sender = install(cluster())
    status, reply = post(client, body)
    assert status == 400, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert sender.sent == []


@pytest.mark.parametrize("body, param", [
    ({"executor": "exec0", "action": "quantize", "layers": 2, "bits": 3}, "bits"),
    ({"executor": "exec0", "action": "quantize", "layers": 2, "bits": 8.0}, "bits"),
    ({"executor": "exec0", "action": "quantize", "layers": 2}, "bits"),
    ({"executor": "exec0", "action": "restore", "layers": 2, "bits": 8}, "bits"),
    ({"executor": "exec0", "action": "quantize", "layers": 0, "bits": 8}, "layers"),
    ({"executor": "exec0", "action": "quantize", "layers": [0, 1], "bits": 8}, "layers"),
    ({"executor": "exec0", "action": "quantize", "layers": True, "bits": 8}, "layers"),
    ({"action": "quantize", "layers": 2, "bits": 8}, "executor"),
    ({"executor": "exec0", "action": "restore", "layers": 2, "instance": "i0"}, "instance"),
])
def test_quantize_and_restore_bodies_are_judged_as_before(gateway, body, param):
    client, install = gateway
    sender = install(cluster())
    status, reply = post(client, body)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert sender.sent == []


def test_quantize_still_reaches_the_executor_and_answers_with_the_instances_too(gateway, monkeypatch):
    monkeypatch.setattr(admin, "FRESH_VIEW_WAIT_S", 0.1)
    client, install = gateway
    sender = install(cluster(), answer={"layers": [8, 16, 16, 16]})
    status, reply = post(client, {"executor": "solo", "action": "quantize", "layers": 1, "bits": 8})
    assert status == 200, reply
    assert sender.sent == [("solo", QuantizeArgs(layers=1, bits=8))]
    assert reply["results"] == [{"executor": "solo", "ok": True, "error": None, "state": {"layers": [8, 16, 16, 16]}}]
    assert set(reply) == {"results", "executors", "instances"} and reply["instances"][0]["id"] == "i0"


@pytest.mark.parametrize("body, args, after", [
    (REPLICATE, ReplicateArgs(instance="i0", layers=[0, 1], to="exec1"),
     placed("exec0+exec1", "exec0+exec1", "exec1", "exec1")),
    (MIGRATE, MigrateArgs(instance="i0", layers=[2, 3], source="exec1", to="exec0"),
     placed("exec0", "exec0", "exec0", "exec0")),
])
def test_a_layer_operation_goes_to_the_leader_and_answers_once_the_monitor_shows_the_new_plan(gateway, body, args,
                                                                                             after):
    client, install = gateway
    applied = BEFORE.model_copy(update={"layers": after})
    stray = BEFORE.model_copy(update={"layers": placed("exec1", "exec0", "exec1", "exec1")})
    # A view with some other plan comes first: the answer waits for the plan the leader answered with.
    sender = install(cluster(), answer={"plan": applied.model_dump(), "seconds": 0.25},
                     then=[(0.05, cluster(stray, at=1.0)), (0.3, cluster(applied, at=2.0))])
    status, reply = post(client, body)
    assert status == 200, reply
    assert sender.sent == [("exec0", args)]
    assert reply["results"] == [{"executor": "exec0", "ok": True, "error": None,
                                 "state": {"plan": applied.model_dump(), "seconds": 0.25}}]
    (shown,) = reply["instances"]
    assert [layer["placement"] for layer in shown["layers"]] == [layer.placement for layer in after]
    assert shown["replicas"] == [len(layer.placement) for layer in after]


def test_migrate_and_evict_say_from_on_the_bus(gateway, monkeypatch):
    monkeypatch.setattr(admin, "FRESH_VIEW_WAIT_S", 0.1)  # the view never changes here
    client, install = gateway
    sender = install(cluster(BEFORE.model_copy(update={"layers": placed("exec0+exec1", "exec0+exec1", "exec1",
                                                                        "exec1")})))
    assert post(client, EVICT)[0] == 200
    assert sender.sent == [("exec0", EvictArgs(instance="i0", layers=[0, 1], source="exec1"))]
    assert Command.of(1, "gateway-gw0", sender.sent[0][1]).args == {"instance": "i0", "layers": [0, 1],
                                                                     "from": "exec1"}


def test_batch_caps_an_instance_or_a_standalone_executor_and_answers_once_the_leader_reports_it(gateway):
    client, install = gateway
    sender = install(cluster(), then=[(0.2, cluster(solo_cap=2, at=1.0))])
    status, reply = post(client, {"action": "batch", "instance": "i-solo", "max_num_seqs": 2})
    assert status == 200, reply
    assert sender.sent == [("solo", BatchArgs(instance="i-solo", max_num_seqs=2))]
    assert [e["max_num_seqs"] for e in reply["executors"] if e["id"] == "solo"] == [2]
    sender = install(cluster(), then=[(0.2, cluster(leader_cap=8, at=1.0))])
    status, reply = post(client, BATCH)
    assert status == 200, reply
    assert sender.sent == [("exec0", BatchArgs(instance="i0", max_num_seqs=8))]
    assert [(e["id"], e["max_num_seqs"]) for e in reply["executors"]] == [("exec0", 8), ("exec1", 0), ("solo", 4)]


def test_when_the_monitor_never_shows_the_change_the_answer_comes_after_a_bounded_wait(gateway, monkeypatch):
    monkeypatch.setattr(admin, "FRESH_VIEW_WAIT_S", 0.2)
    client, install = gateway
    install(cluster(), answer={"plan": BEFORE.model_copy(update={"layers": placed(*["exec0"] * 4)}).model_dump()})
    status, reply = post(client, MIGRATE)
    assert status == 200 and reply["results"][0]["ok"]
    assert reply["instances"][0]["replicas"] == [1, 1, 1, 1]  # as the monitor still shows it


@pytest.mark.parametrize("body, param, code", [
    ({**BATCH, "instance": "i9"}, "instance", "instance_not_found"),
    ({**BATCH, "instance": "i-exec0"}, "instance", "instance_not_found"),  # exec0 serves in i0, not alone
    ({**REPLICATE, "to": "exec9"}, "to", "executor_not_found"),
    ({**MIGRATE, "from": "exec9"}, "from", "executor_not_found"),
    ({**EVICT, "from": "solo"}, "from", "executor_not_found"),
])
def test_an_id_that_names_nothing_is_a_404_and_sends_nothing(gateway, body, param, code):
    client, install = gateway
    sender = install(cluster())
    status, reply = post(client, body)
    assert status == 404, reply
    assert reply["error"]["param"] == param and reply["error"]["code"] == code
    assert sender.sent == []


def test_an_instance_without_a_live_leader_is_a_404():
    dead_leader = ClusterState(time=0.0, executors=[executor("exec0", plan=BEFORE, alive=False),
                                                    executor("exec1", plan=BEFORE)])
    dead_solo = cluster(solo_alive=False)
    for view, instance, why in [(dead_leader, "i0", "has no live leader"), (dead_solo, "i-solo", "is not alive")]:
        with pytest.raises(admin.ApiError) as raised:
            asyncio.run(admin.morph(Monitor(view), None, {**BATCH, "instance": instance}))
        assert raised.value.status == 404 and why in raised.value.message


@pytest.mark.parametrize("body, why", [
    ({**REPLICATE, "to": "solo"}, "no peers of one world"),  # solo serves alone, outside exec0's world
    ({**REPLICATE, "instance": "i-solo", "to": "exec1"}, "in instance i0 already")])
def test_an_executor_that_cannot_join_is_a_409_and_sends_nothing(gateway, body, why):
    client, install = gateway
    sender = install(cluster())
    status, reply = post(client, body)
    assert status == 409 and reply["error"]["code"] == "morph_refused" and reply["error"]["param"] == "to"
    assert why in reply["error"]["message"] and sender.sent == []


def test_a_replicate_onto_an_executor_serving_alone_sends_the_leader_its_command_and_the_newcomer_a_join(gateway):
    client, install = gateway
    world = ["exec0", "exec1", "solo"]
    view = cluster()
    view = view.model_copy(update={"executors": [e.model_copy(update={"telemetry": e.telemetry.model_copy(
        update={"world": world})}) for e in view.executors]})
    sender = install(view)
    status, reply = post(client, {**REPLICATE, "instance": "i-solo", "to": "exec0"})
    assert status == 409 and "in instance i0 already" in reply["error"]["message"]
    status, reply = post(client, {**REPLICATE, "to": "solo"})
    assert status == 200, reply
    assert sender.sent == [("exec0", ReplicateArgs(instance="i0", layers=[0, 1], to="solo")),
                           ("solo", JoinArgs(instance="i0", leader="exec0"))]
    assert [r["executor"] for r in reply["results"]] == ["exec0", "solo"]


@pytest.mark.parametrize("body", [{**REPLICATE, "instance": "i-solo", "to": "solo"},
                                  {**EVICT, "instance": "i-solo", "from": "solo"}])
def test_a_one_member_instance_takes_batch_and_no_operation_among_its_own(gateway, body):
    client, install = gateway
    sender = install(cluster())
    status, reply = post(client, body)
    assert status == 409 and reply["error"]["code"] == "morph_refused"
    assert "one member" in reply["error"]["message"] and "batch" in reply["error"]["message"]
    assert sender.sent == []


def test_the_leaders_refusal_is_a_409_with_its_reason(gateway):
    client, install = gateway
    install(cluster(), ok=False, error="layer 2 is not on exec0 (it is on ['exec1'])")
    status, reply = post(client, EVICT | {"from": "exec0", "layers": [2, 2]})
    assert status == 409, reply
    assert reply["error"] == {"message": "exec0: layer 2 is not on exec0 (it is on ['exec1'])",
                              "type": "invalid_request_error", "param": None, "code": "morph_refused"}


def test_a_leader_that_never_answers_is_a_503(gateway):
    client, install = gateway
    install(cluster(), ok=False, error="no answer after 2 attempt(s): no responders")
    status, reply = post(client, BATCH)
    assert status == 503 and reply["error"]["code"] == "executor_unreachable"
