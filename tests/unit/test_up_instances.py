"""`morphling up --executors N --tp K / --plan FILE`: what it refuses before anything starts, the world and
instance arguments each executor gets, and the arguments an executor's restarts run with (no world)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services import up
from services.supervisor import WORLD_ENV, Cluster
from services.up import executor_args, parse_args, refused, world_args

ROOT = Path(__file__).resolve().parents[2]
NATS = "nats://127.0.0.1:1"
WORLD_FLAGS = {"--rank", "--world-size", "--tp", "--plan", "--dist-timeout"}


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def plan_file(tmp_path: Path, instances: list[dict], name: str = "plan.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"instances": instances}))
    return path


def tp2_pair(members: list[str], layers: int = 2) -> dict:
    return {"members": members, "tp": 2, "layers": [{"placement": members}] * layers}


def spawned(monkeypatch, argv: list[str]) -> dict[str, dict]:
    """What `morphling up ARGV` would spawn, by child name: its command and environment."""
    children: dict[str, dict] = {}

    def spawn(self, name, role, cmd, env=None):
        children[name] = {"role": role, "cmd": cmd, "env": env}

    monkeypatch.setattr(Cluster, "spawn", spawn)
    monkeypatch.setattr(up, "_wait_and_serve", lambda *a: 0)
    assert up.main(["--nats", NATS, *argv]) == 0
    return children


def service_args(cmd: list[str]) -> list[str]:
    """The arguments after `python -m services.cli ROLE`."""
    return cmd[4:]


# --- refused before anything starts -------------------------------------------------------------------

def test_tp_and_plan_exclude_each_other(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--executors", "2", "--tp", "2", "--plan", str(tmp_path / "p.json")])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_tp_must_be_at_least_1(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--tp", "0"])
    assert "--tp must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("executors, tp", [(1, 2), (3, 2), (2, 4)])
def test_tp_must_divide_the_executors(executors, tp):
    assert refused(parse_args(["--executors", str(executors), "--tp", str(tp)])) == (
        f"--tp {tp} must divide --executors {executors}: each instance is {tp} consecutive executors")


@pytest.mark.parametrize("tp", [3, 8])
def test_tp_must_divide_the_ffn_pieces(tp):
    assert refused(parse_args(["--executors", str(tp), "--tp", str(tp)])) == (
        f"--tp {tp} must be 1, 2 or 4: every layer's FFN is stored in 4 pieces that TP splits")


@pytest.mark.parametrize("argv", [["--executors", "4", "--tp", "2"], ["--executors", "4", "--tp", "4"],
                                  ["--executors", "3", "--tp", "1"], ["--tp", "1"],
                                  # Morphing commands to multi-executor instances are the executors' to refuse.
                                  ["--executors", "2", "--tp", "2", "--mode", "performance"]])
def test_tp_that_divides_the_executors_is_accepted(argv):
    assert refused(parse_args(argv)) is None


def test_a_plan_that_fits_the_executors_is_accepted(tmp_path):
    path = plan_file(tmp_path, [tp2_pair(["exec0", "exec1"]),
                                {"members": ["exec2"], "layers": [{"placement": ["exec2"], "bits": 8}]}])
    assert refused(parse_args(["--executors", "3", "--plan", str(path), "--mode", "default"])) is None


@pytest.mark.parametrize("instances, executors, field", [
    ([tp2_pair(["exec0", "exec1"])], 4, "instances: executor 'exec2' is in no instance"),
    ([tp2_pair(["exec0", "exec5"])], 2, "instances[0].members: 'exec5' is not an executor"),
    ([{"members": ["exec0"], "layers": [{"placement": ["exec0"], "bits": 3}]}, tp2_pair(["exec1", "exec2"])], 3,
     "instances[0].layers[0].bits:"),
    ([{"members": ["exec0", "exec1"], "tp": 2, "layers": [{"placement": ["exec0"]}]}], 2,
     "instances[0].layers[0].placement: a TP2 instance shards every layer over all its members"),
])
def test_a_plan_that_does_not_fit_is_refused_naming_the_field(tmp_path, instances, executors, field):
    path = plan_file(tmp_path, instances)
    reason = refused(parse_args(["--executors", str(executors), "--plan", str(path)]))
    assert reason.startswith(f"--plan {path} does not fit --executors {executors}: {field}")


def test_an_unreadable_plan_is_refused(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    for name in ("bad.json", "missing.json"):
        assert "cannot read the plan file" in refused(parse_args(["--executors", "2", "--plan", str(tmp_path / name)]))


def test_a_refused_plan_starts_nothing(tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(Cluster, "spawn", lambda self, *a, **k: started.append(a))
    path = plan_file(tmp_path, [tp2_pair(["exec0", "exec1"])])
    assert up.main(["--nats", NATS, "--executors", "3", "--plan", str(path), "--log-dir", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err
    assert "morphling up: --plan" in err and "'exec2' is in no instance" in err
    assert started == [] and not (tmp_path / "logs").exists()


def test_the_command_line_refuses_a_bad_plan_at_once(tmp_path):
    path = plan_file(tmp_path, [tp2_pair(["exec0", "exec1"], 1), tp2_pair(["exec1", "exec2"], 1)])
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "services.cli", "up", "--executors", "3", "--plan", str(path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "instances[1].members: 'exec1' is already a member of instance 'i0'" in result.stderr
    assert "logs in" not in result.stderr and time.monotonic() - started < 60


# --- the arguments each executor gets -----------------------------------------------------------------

def test_one_executor_is_only_a_peer(monkeypatch):
    monkeypatch.setattr(up, "cpu_cores", lambda: 16)
    args = parse_args(["--tp", "1", "--dist-timeout", "5"])
    assert world_args(args, 0) == ["--join", "--rank", "0", "--dist-timeout", "5"]
    assert executor_args(args, NATS, 0) == ["--nats", NATS, "--id", "exec0", "--model", "default", "--device", "cpu",
                                            "--static-bits", "16", "--swap-order", "auto"]


@pytest.mark.parametrize("cores, executors, threads", [(16, 2, "8"), (16, 3, "5"), (2, 4, "1"), (1, 2, "1")])
def test_on_cpu_each_executor_takes_its_share_of_the_cores(monkeypatch, cores, executors, threads):
    monkeypatch.setattr(up, "cpu_cores", lambda: cores)
    args = parse_args(["--executors", str(executors)])
    assert {flag(executor_args(args, NATS, i), "--threads") for i in range(executors)} == {threads}


def test_on_gpus_the_threads_are_left_to_torch(monkeypatch):
    args = parse_args(["--executors", "2", "--device", "cuda"])
    assert [flag(executor_args(args, NATS, i), "--device") for i in range(2)] == ["cuda:0", "cuda:1"]
    assert all("--threads" not in executor_args(args, NATS, i) for i in range(2))


def test_the_latency_profile_goes_to_every_executor_as_an_absolute_path_and_a_bad_one_is_refused(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.chdir(ROOT)
    args = parse_args(["--executors", "2", "--latency-profile", "docs/results/latency_profile.json"])
    assert refused(args) is None
    assert {flag(executor_args(args, NATS, i), "--latency-profile") for i in range(2)} == {
        str(ROOT / "docs/results/latency_profile.json")}
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "speedup-profile"}))
    bad = parse_args(["--latency-profile", str(tmp_path / "bad.json")])
    assert "--latency-profile" in refused(bad) and "not a latency-profile record" in refused(bad)


def test_the_executors_default_to_the_shipped_latency_profile_where_it_fits_and_none_turns_it_off():
    from services.executor.service import SHIPPED_LATENCY_PROFILES, latency_profile_path, shipped_latency_profile
    from shared.core.planner.shapes import SHAPES
    from shared.provenance import cpu_model

    assert all("--latency-profile" not in executor_args(parse_args(["--executors", "2"]), NATS, i) for i in range(2))
    assert flag(executor_args(parse_args(["--latency-profile", "none"]), NATS, 0), "--latency-profile") == "none"
    xeon, epyc = SHIPPED_LATENCY_PROFILES["cpu"]
    smol = SHAPES["smollm2-135m"]
    # each CPU its own profile; one the shipped profiles do not name takes the one that names none (the EPYC's)
    assert shipped_latency_profile("cpu", smol, "Intel(R) Xeon(R) Processor (amx_bf16, amx_int8, amx_tile)") == xeon
    assert shipped_latency_profile("cpu", smol, "AMD EPYC 9B14") == epyc
    assert latency_profile_path("auto", "cpu", smol) == str(shipped_latency_profile("cpu", smol, cpu_model()))
    # measured on the default model's layers: it claims nothing for another model's, nor for a GPU
    assert latency_profile_path("auto", "cpu", SHAPES["llama-3.2-1b"]) is None
    assert latency_profile_path("auto", "cuda:0", SHAPES["smollm2-135m"]) is None
    assert latency_profile_path("none", "cpu", SHAPES["smollm2-135m"]) is None
    assert latency_profile_path(None, "cpu", SHAPES["smollm2-135m"]) is None
    assert latency_profile_path("some.json", "cpu", SHAPES["smollm2-135m"]) == "some.json"


def test_several_executors_join_one_world_by_rank():
    args = parse_args(["--executors", "3"])
    assert [world_args(args, i) for i in range(3)] == [["--rank", str(i), "--world-size", "3"] for i in range(3)]


def test_tp_and_the_collective_timeout_go_to_every_member_when_given():
    args = parse_args(["--executors", "4", "--tp", "2", "--dist-timeout", "12.5"])
    for i in range(4):
        world = world_args(args, i)
        assert (flag(world, "--tp"), flag(world, "--dist-timeout"), flag(world, "--rank")) == ("2", "12.5", str(i))
        assert "--plan" not in world


def test_the_plan_goes_as_an_absolute_path(tmp_path, monkeypatch):
    plan_file(tmp_path, [tp2_pair(["exec0", "exec1"])])
    monkeypatch.chdir(tmp_path)
    args = parse_args(["--executors", "2", "--plan", "plan.json"])
    assert refused(args) is None
    assert [flag(world_args(args, i), "--plan") for i in range(2)] == [str(tmp_path / "plan.json")] * 2
    assert all(WORLD_FLAGS.isdisjoint(executor_args(args, NATS, i)) for i in range(2))


def test_a_plan_needs_a_world(tmp_path):
    path = plan_file(tmp_path, [{"members": ["exec0"], "layers": [{"placement": ["exec0"], "bits": 4}]}])
    assert refused(parse_args(["--plan", str(path)])) == (
        f"--plan {path} needs --executors 2 or more: a lone executor serves the whole model itself")


# --- what up starts, and what it restarts ---------------------------------------------------------------

def test_up_starts_the_world_with_each_members_flags(tmp_path, monkeypatch):
    monkeypatch.setattr(up, "cpu_cores", lambda: 8)
    children = spawned(monkeypatch, ["--log-dir", str(tmp_path), "--executors", "2", "--tp", "2",
                                     "--dist-timeout", "7"])
    first = [service_args(children[f"exec{i}"]["cmd"]) for i in range(2)]
    assert [(flag(a, "--rank"), flag(a, "--world-size"), flag(a, "--tp"), flag(a, "--dist-timeout"))
            for a in first] == [("0", "2", "2", "7"), ("1", "2", "2", "7")]
    for i in range(2):
        child = children[f"exec{i}"]
        assert (flag(child["cmd"], "--id"), flag(child["cmd"], "--threads")) == (f"exec{i}", "4")
        assert service_args(child["cmd"]) == executor_args(parse_args(["--executors", "2"]), NATS, i) + world_args(
            parse_args(["--executors", "2", "--tp", "2", "--dist-timeout", "7"]), i)


def test_a_lone_executor_is_a_peer_of_the_world_that_scale_grows(tmp_path, monkeypatch):
    cmd = spawned(monkeypatch, ["--log-dir", str(tmp_path)])["exec0"]["cmd"]
    assert (flag(cmd, "--rank"), "--join" in cmd) == ("0", True)
    assert "--world-size" not in cmd and "--threads" not in cmd


def test_a_world_in_ups_own_environment_does_not_reach_the_children(tmp_path, monkeypatch):
    # The executors read their world from these when no flag gives it: a restarted executor would rejoin.
    for name in WORLD_ENV:
        monkeypatch.setenv(name, "1")
    children = spawned(monkeypatch, ["--log-dir", str(tmp_path), "--executors", "2"])
    for child in children.values():
        if child["role"] != "nats-server":
            assert not set(WORLD_ENV) & set(child["env"])


def test_a_planners_file_gives_each_executor_its_devices_memory_and_the_planned_context(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({
        "instances": [{"members": ["exec0", "exec1"], "slots": "placed",
                       "layers": [{"placement": ["exec0"]}, {"placement": ["exec1"], "bits": 4}]}],
        "devices": [{"executor": "exec0", "name": "cpu", "memory": 503316480},
                    {"executor": "exec1", "name": "cpu", "memory": 681574400}],
        "workload": {"batch": 16, "prompt": 448, "output": 64, "chunks": 1, "context": 512}}))
    args = parse_args(["--plan", str(plan)])
    assert args.executors == 2 and args.max_model_len == 512 and refused(args) is None
    budgets = [executor_args(args, "nats://x", i)[executor_args(args, "nats://x", i).index("--memory-budget") + 1]
               for i in range(2)]
    assert budgets == ["503316480", "681574400"]
    given = parse_args(["--plan", str(plan), "--memory-budget", "1GiB", "--max-model-len", "256"])
    assert "1GiB" in executor_args(given, "nats://x", 1) and given.max_model_len == 256


def test_enforce_eager_reaches_every_executor():
    args = parse_args(["--device", "cuda", "--executors", "2", "--enforce-eager"])
    assert all("--enforce-eager" in executor_args(args, NATS, i) for i in range(2))
    assert "--enforce-eager" not in executor_args(parse_args(["--device", "cuda"]), NATS, 0)
