"""`morphling status` from a GET /v1/cluster body: the executors' table, and the instances below it once some
executors serve one model copy together; a cluster of standalone executors prints as before instances existed."""

from services import admin_cli
from services.gateway import admin
from shared.messages import ClusterState, InstancePlan, LayerPlan
from shared.plans import tp_plans
from tests.unit.test_router import executor

OLD_HEADER = ["EXECUTOR", "ALIVE", "RESTARTS", "RUNNING", "WAITING", "KV_TOTAL", "KV_FREE", "KV_BASE", "KV_EXT",
              "LAYER_BITS"]


def placed(*owners: str, bits: int = 16) -> list[LayerPlan]:
    return [LayerPlan(placement=owner.split("+"), bits=bits) for owner in owners]


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


def test_an_instance_of_several_executors_shows_roles_and_its_plan(monkeypatch, capsys):
    plan = InstancePlan(id="i0", leader="exec0", members=["exec0", "exec1"],
                        layers=placed("exec0", "exec0", "exec1", "exec1", "exec0+exec1", bits=8))
    (tp2,) = tp_plans(["exec2", "exec3"], 2, 5)
    tp2 = tp2.model_copy(update={"id": "i1"})
    s = ClusterState(time=0.0, executors=[executor("exec0", plan=plan), executor("exec1", plan=plan),
                                          executor("exec2", plan=tp2), executor("exec3", plan=tp2),
                                          executor("solo")], instances=[plan, tp2])
    lines = status(monkeypatch, capsys, s)
    header, *rows = lines[:lines.index("")]
    # The new columns come just before LAYER_BITS: the others keep their places, and the bits stay last.
    assert header.split() == [*OLD_HEADER[:-1], "INSTANCE", "ROLE", "LAYER_BITS"]
    assert [row.split()[9:11] for row in rows] == [["i0", "leader"], ["i0", "follower"], ["i1", "leader"],
                                                   ["i1", "follower"], ["-", "leader"]]
    assert all(row.split()[1:3] == ["yes", "0"] and row.endswith("16x4") for row in rows)
    header, first, second = lines[lines.index("") + 1:]
    assert header.split() == ["INSTANCE", "LEADER", "MEMBERS", "TP", "PLAN_BITS", "LAYERS"]
    assert first.split(maxsplit=5) == ["i0", "exec0", "exec0,exec1", "1", "8x5",
                                       "0-1 exec0 | 2-3 exec1 | 4 exec0+exec1"]
    assert second.split(maxsplit=5) == ["i1", "exec2", "exec2,exec3", "2", "16x5", "0-4 exec2+exec3"]


def test_a_gateway_without_instances_in_its_answer_still_prints(monkeypatch, capsys):
    body = admin.cluster_body(ClusterState(time=0.0, executors=[executor("exec0")]))
    del body["instances"]
    for e in body["executors"]:
        del e["instance"], e["role"]
    monkeypatch.setattr(admin_cli, "_call", lambda *args, **kwargs: body)
    assert admin_cli.status_main([]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == OLD_HEADER
