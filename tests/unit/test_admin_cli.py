"""`morphling status` from a GET /v1/cluster body: the executors' table, and the instances below it (replicas per
layer, each leader's batch cap and SLO window) once some executors serve one model copy together; a cluster of
standalone executors prints as before instances existed. `morphling morph`: its flags become the API's body, and
the gateway's refusals its exit status and message."""

import httpx
import pytest

from services import admin_cli
from services.gateway import admin
from shared.core.plans import tp_plans
from shared.messages import ClusterState, InstancePlan, LayerPlan, SloWindow
from tests.unit.test_cluster_admin import BEFORE, admin_app, cluster, placed, with_load
from tests.unit.test_router import executor

OLD_HEADER = ["EXECUTOR", "ALIVE", "RESTARTS", "RUNNING", "WAITING", "KV_TOTAL", "KV_FREE", "KV_BASE", "KV_EXT",
              "LAYER_BITS"]


def at_bits(bits: int, *owners: str) -> list[LayerPlan]:
    return [layer.model_copy(update={"bits": bits}) for layer in placed(*owners)]


def status(monkeypatch, capsys, s: ClusterState) -> list[str]:
    monkeypatch.setattr(admin_cli, "_call", lambda *args, **kwargs: admin.cluster_body(s))
    assert admin_cli.status_main(["--url", "http://gateway"]) == 0
    return capsys.readouterr().out.splitlines()


def test_placement_runs_join_consecutive_layers_on_the_same_executors():
    layers = [layer.model_dump() for layer in placed(*["exec0"] * 10, *["exec1"] * 10, *["exec0"] * 10)]
    assert admin_cli.placement_runs(layers) == "0-9 exec0 | 10-19 exec1 | 20-29 exec0"
    layers = [layer.model_dump() for layer in placed("exec0", "exec0+exec1", "exec0+exec1", "exec1")]
    assert admin_cli.placement_runs(layers) == "0 exec0 | 1-2 exec0+exec1 | 3 exec1"
    assert admin_cli.placement_runs([]) == "-"


def test_standalone_executors_print_exactly_as_before(monkeypatch, capsys):
    solo = tp_plans(["exec0", "exec1"], 1, 4)
    for s in (ClusterState(time=0.0, executors=[executor("exec0"), executor("exec1")]),
              ClusterState(time=0.0, executors=[executor("exec0", plan=solo[0]), executor("exec1", plan=solo[1])],
                           instances=solo)):
        header, *rows = status(monkeypatch, capsys, s)
        assert header.split() == OLD_HEADER and len(rows) == 2
        assert rows[0].split()[:3] == ["exec0", "yes", "0"] and rows[0].endswith("16x4")


def test_replica_runs_join_consecutive_layers_with_as_many_copies():
    assert admin_cli.replica_runs([2] * 15 + [1] * 15) == "0-14×2 15-29×1"
    assert admin_cli.replica_runs([1, 3, 3, 1]) == "0×1 1-2×3 3×1"
    assert admin_cli.replica_runs([]) == "-"


def test_an_instance_of_several_executors_shows_roles_and_its_plan(monkeypatch, capsys):
    plan = InstancePlan(id="i0", leader="exec0", members=["exec0", "exec1"],
                        layers=at_bits(8, "exec0", "exec0", "exec1", "exec1", "exec0+exec1"))
    (tp2,) = tp_plans(["exec2", "exec3"], 2, 5)
    tp2 = tp2.model_copy(update={"id": "i1"})
    window = SloWindow(requests=50, violation_rate=0.125, ttft_p95_s=0.4321, tpot_p95_s=0.0512)
    s = ClusterState(time=0.0, executors=[with_load(executor("exec0", plan=plan), 32, window),
                                          executor("exec1", plan=plan), executor("exec2", plan=tp2),
                                          executor("exec3", plan=tp2), with_load(executor("solo"), 6),
                                          executor("gone", alive=False)], instances=[plan, tp2])
    lines = status(monkeypatch, capsys, s)
    header, *rows = lines[:lines.index("")]
    # The new columns come just before LAYER_BITS: the others keep their places, and the bits stay last.
    assert header.split() == [*OLD_HEADER[:-1], "INSTANCE", "ROLE", "LAYER_BITS"]
    assert [row.split()[9:11] for row in rows] == [["i0", "leader"], ["i0", "follower"], ["i1", "leader"],
                                                   ["i1", "follower"], ["-", "leader"], ["-", "leader"]]
    assert all(row.split()[2] == "0" and row.endswith("16x4") for row in rows)
    header, first, second, solo = lines[lines.index("") + 1:]
    assert header.split() == ["INSTANCE", "LEADER", "MEMBERS", "TP", "BATCH", "SLO_VIOL", "TTFT_P95", "TPOT_P95",
                              "PLAN_BITS", "REPLICAS", "LAYERS"]
    assert first.split(maxsplit=11) == ["i0", "exec0", "exec0,exec1", "1", "32", "12.5%", "0.432s", "0.051s", "8x5",
                                        "0-3×1", "4×2", "0-1 exec0 | 2-3 exec1 | 4 exec0+exec1"]
    assert second.split() == ["i1", "exec2", "exec2,exec3", "2", "-", "-", "-", "-", "16x5", "0-4×1", "0-4",
                              "exec2+exec3"]
    # A live standalone executor is the instance the morph API names i-<executor>; a dead one is no instance.
    assert solo.split() == ["i-solo", "solo", "solo", "1", "6", "-", "-", "-", "16x4", "0-3×1", "0-3", "solo"]


def test_standalone_executors_are_listed_as_instances_when_asked(monkeypatch, capsys):
    s = ClusterState(time=0.0, executors=[with_load(executor("exec0"), 8), executor("exec1")])
    monkeypatch.setattr(admin_cli, "_call", lambda *args, **kwargs: admin.cluster_body(s))
    assert admin_cli.status_main(["--instances"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == OLD_HEADER and lines[3] == ""
    assert [row.split()[:5] for row in lines[5:]] == [["i-exec0", "exec0", "exec0", "1", "8"],
                                                      ["i-exec1", "exec1", "exec1", "1", "-"]]


def test_a_gateway_without_instances_in_its_answer_still_prints(monkeypatch, capsys):
    body = admin.cluster_body(ClusterState(time=0.0, executors=[executor("exec0")]))
    del body["instances"]
    for e in body["executors"]:
        del e["instance"], e["role"]
    monkeypatch.setattr(admin_cli, "_call", lambda *args, **kwargs: body)
    assert admin_cli.status_main([]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == OLD_HEADER


# --- morphling morph ------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, body", [
    (["--action", "replicate", "--instance", "i0", "--layers", "0", "14", "--to", "exec1"],
     {"action": "replicate", "instance": "i0", "layers": [0, 14], "to": "exec1"}),
    (["--action", "migrate", "--instance", "i0", "--layers", "3", "3", "--from", "exec0", "--to", "exec1"],
     {"action": "migrate", "instance": "i0", "layers": [3, 3], "from": "exec0", "to": "exec1"}),
    (["--action", "evict", "--instance", "i0", "--layers", "0", "14", "--from", "exec1"],
     {"action": "evict", "instance": "i0", "layers": [0, 14], "from": "exec1"}),
    (["--action", "batch", "--instance", "i-exec0", "--max-num-seqs", "8"],
     {"action": "batch", "instance": "i-exec0", "max_num_seqs": 8}),
    # What the API would refuse is posted as given, for its 400 to name the field.
    (["--action", "replicate", "--instance", "i0", "--layers", "4"],
     {"action": "replicate", "instance": "i0", "layers": [4]}),
    (["--action", "batch", "--instance", "i0", "--max-num-seqs", "8", "--to", "exec1"],
     {"action": "batch", "instance": "i0", "max_num_seqs": 8, "to": "exec1"}),
    (["--action", "quantize", "--executor", "*", "--layers", "3", "--bits", "8"],
     {"action": "quantize", "executor": "*", "layers": 3, "bits": 8}),
    (["--action", "restore", "--executor", "exec0", "--layers", "2"],
     {"action": "restore", "executor": "exec0", "layers": 2}),
])
def test_morph_posts_its_flags_under_the_apis_names(monkeypatch, capsys, argv, body):
    posted = []

    def call(prog, method, url, key, sent=None):
        posted.append((method, url, key, sent))
        return None  # as after a refusal, which _call has printed

    monkeypatch.setattr(admin_cli, "_call", call)
    assert admin_cli.morph_main(["--url", "http://gw:1/", "--admin-key", "root", *argv]) == 1
    assert posted == [("POST", "http://gw:1/v1/cluster/morph", "root", body)]


@pytest.mark.parametrize("argv", [
    ["--action", "quantize", "--layers", "1", "--bits", "8"],
    ["--action", "quantize", "--executor", "exec0", "--layers", "1"],
    ["--action", "restore", "--executor", "exec0", "--layers", "1", "--bits", "4"],
    ["--action", "restore", "--executor", "exec0"],
    ["--action", "split", "--instance", "i0"],
])
def test_quantize_and_restore_keep_their_usage_errors(monkeypatch, argv):
    monkeypatch.setattr(admin_cli, "_call", lambda *args, **kwargs: pytest.fail("posted a body it should refuse"))
    with pytest.raises(SystemExit) as exited:
        admin_cli.morph_main(argv)
    assert exited.value.code == 2


@pytest.fixture
def through_gateway(monkeypatch):
    """The CLI's HTTP calls go to a gateway app without a bus (test_cluster_admin.admin_app): returns its
    `install`."""
    client, install = admin_app()

    def request(method, url, json=None, headers=None, timeout=None):
        return client.request(method, httpx.URL(url).path, json=json, headers=headers)

    monkeypatch.setattr(admin_cli.httpx, "request", request)
    return install


@pytest.mark.parametrize("argv, status, message", [
    (["--action", "replicate", "--instance", "i0", "--layers", "0", "1"], "400 invalid_request_error",
     "Missing required parameter: 'to'"),
    (["--action", "replicate", "--instance", "i0", "--layers", "2", "1", "--to", "exec1"], "400 invalid_request_error",
     "expected [a, b] with a <= b"),
    (["--action", "batch", "--instance", "i7", "--max-num-seqs", "4"], "404 instance_not_found", "`i7` does not exist"),
    (["--action", "replicate", "--instance", "i-solo", "--layers", "0", "1", "--to", "solo"], "409 morph_refused",
     "one member"),
])
def test_morph_exits_non_zero_with_the_apis_message(through_gateway, capsys, argv, status, message):
    sender = through_gateway(cluster())
    assert admin_cli.morph_main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"morphling morph: {status}: ") and message in err
    assert sender.sent == []


def test_morph_prints_the_leaders_answer_then_the_cluster_with_its_instances(through_gateway, capsys):
    applied = BEFORE.model_copy(update={"layers": placed("exec0+exec1", "exec0+exec1", "exec1", "exec1")})
    through_gateway(cluster(), answer={"plan": applied.model_dump(), "seconds": 0.5},
                    then=[(0.05, cluster(applied, at=1.0))])
    assert admin_cli.morph_main(["--action", "replicate", "--instance", "i0", "--layers", "0", "1", "--to",
                                 "exec1"]) == 0
    results, executors, instances = capsys.readouterr().out.split("\n\n")
    assert [line.split() for line in results.splitlines()] == [
        ["LEADER", "RESULT", "INSTANCE", "ACTION", "LAYERS", "FROM", "TO", "MAX_NUM_SEQS", "SECONDS", "ERROR"],
        ["exec0", "ok", "i0", "replicate", "0-1", "-", "exec1", "-", "0.500"]]
    assert executors.splitlines()[0].split()[-3:] == ["INSTANCE", "ROLE", "LAYER_BITS"]
    i0, solo = instances.splitlines()[1:]
    assert i0.split()[:5] == ["i0", "exec0", "exec0,exec1", "1", "16"] and "0-1×2 2-3×1" in i0
    assert solo.split()[:5] == ["i-solo", "solo", "solo", "1", "4"]
