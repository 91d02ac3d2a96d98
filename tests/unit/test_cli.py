"""The `morphling` command line and the process orchestration of `morphling up`, without the services."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services import admin_cli, up
from services.cli import COMMANDS
from services.controller.service import parse_setting
from services.supervisor import (CRASH_LOOP, CRASH_LOOP_RESTARTS, CRASH_LOOP_WINDOW_S, GIVE_UP, RESTART,
                                 RESTART_FIRST_DELAY_S, RESTART_MAX_DELAY_S, RESTART_RESET_AFTER_S, STARTUP_FAILURE,
                                 WAIT, Cluster, RestartPolicy, decide)
from services.up import parse_args, refused
from shared.config import BUS_MAX_PAYLOAD_BYTES, read_swap_order
from shared.net import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_every_subcommand():
    result = run_cli("--help")
    assert result.returncode == 0
    for name in ("up", "gateway", "executor", "monitor", "controller", "bench-engine"):
        assert name in COMMANDS
        assert name in result.stdout


def test_unknown_subcommand_is_a_usage_error():
    result = run_cli("no-such-command")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


@pytest.mark.parametrize("mode, bits", [("default", "8"), ("performance", "4"), ("accuracy", "8")])
def test_up_refuses_morphing_on_top_of_static_bits_at_once(mode, bits):
    started = time.monotonic()
    result = run_cli("up", "--port", "1", "--mode", mode, "--static-bits", bits, timeout=30)
    assert result.returncode == 2
    assert f"--mode {mode}" in result.stderr and f"--static-bits {bits}" in result.stderr
    assert "static baselines run with --mode off" in result.stderr
    # Refused before anything starts: no log directory announced, no child waited for.
    assert "logs in" not in result.stderr and "ready" not in result.stdout
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("argv", [[], ["--mode", "performance"], ["--mode", "accuracy", "--static-bits", "16"],
                                  ["--static-bits", "8"], ["--mode", "off", "--static-bits", "4"]])
def test_up_accepts_morphing_modes_and_static_baselines(argv):
    assert refused(parse_args(argv)) is None


def test_up_passes_the_mode_to_the_controller_and_the_bits_to_every_executor(tmp_path, monkeypatch):
    started: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(Cluster, "start_service",
                        lambda self, role, args, name=None: started.append((role, list(args))))
    monkeypatch.setattr(up, "_wait_and_serve", lambda *a: 0)
    assert up.main(["--nats", "nats://127.0.0.1:1", "--executors", "2", "--mode", "performance",
                    "--log-dir", str(tmp_path)]) == 0
    (controller,) = [args for role, args in started if role == "controller"]
    assert controller[controller.index("--mode") + 1] == "performance"
    executors = [args for role, args in started if role == "executor"]
    assert len(executors) == 2 and all(a[a.index("--static-bits") + 1] == "16" for a in executors)
    started.clear()
    assert up.main(["--nats", "nats://127.0.0.1:1", "--static-bits", "4", "--log-dir", str(tmp_path)]) == 0
    (controller,) = [args for role, args in started if role == "controller"]
    assert controller[controller.index("--mode") + 1] == "off"
    (executor,) = [args for role, args in started if role == "executor"]
    assert executor[executor.index("--static-bits") + 1] == "4"


def _started_by_up(argv, tmp_path, monkeypatch) -> dict[str, list[str]]:
    started: dict[str, list[str]] = {}
    monkeypatch.setattr(Cluster, "start_service",
                        lambda self, role, args, name=None: started.setdefault(role, list(args)))
    monkeypatch.setattr(up, "_wait_and_serve", lambda *a: 0)
    assert up.main(["--nats", "nats://127.0.0.1:1", "--log-dir", str(tmp_path), *argv]) == 0
    return started


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize("argv, mode, cocoserve, levers, tp_scheduler", [
    ([], "default", "default", "quantize,replicate,tp", None),  # every lever, the gateway merging
    (["--mode", "accuracy", "--levers", "quantize"], "accuracy", "off", "quantize", "off"),
    (["--levers", "replicate,tp"], "default", "default", "replicate,tp", None),
    (["--levers", "none"], "default", "off", "none", "off"),
    (["--static-bits", "4"], "off", "off", "quantize,replicate,tp", "off"),  # a static baseline moves nothing
    (["--mode", "off"], "off", "off", "quantize,replicate,tp", "off"),
])
def test_up_presets_cover_the_ladder_and_levers_limit_it(argv, mode, cocoserve, levers, tp_scheduler, tmp_path,
                                                         monkeypatch):
    started = _started_by_up(argv, tmp_path, monkeypatch)
    controller, gateway = started["controller"], started["gateway"]
    assert (_flag(controller, "--mode"), _flag(controller, "--cocoserve"), _flag(controller, "--levers")) == \
        (mode, cocoserve, levers)
    assert _flag(gateway, "--tp-scheduler") == tp_scheduler


@pytest.mark.parametrize("argv, complaint", [
    (["--levers", "quantize,teleport"], "unknown lever(s) teleport"),
    (["--levers", "quantize", "--cocoserve", "default"], "needs the replicate lever"),
    (["--levers", "quantize", "--tp-scheduler", "rr"], "no tp lever"),
])
def test_up_refuses_levers_that_contradict_other_flags(argv, complaint):
    result = run_cli("up", "--port", "1", *argv, timeout=30)
    assert result.returncode == 2 and complaint in result.stderr, result.stderr


@pytest.mark.parametrize("args, complaint", [
    (["--levers", "quantize,bogus"], "unknown lever(s) bogus"),
    (["--mode", "fast"], "invalid choice"),
    (["--morph-set", "no_such_setting=1"], "unknown morph setting"),
    (["--morph-set", "kv_high"], "key=value"),
    (["--mode", "performance", "--morph-set", "kv_low=0.9"], "kv_low < kv_high"),
    (["--swap-order", "/no/such/profile.json"], "cannot read the swap order"),
])
def test_controller_rejects_bad_morph_settings_before_connecting(args, complaint):
    result = run_cli("controller", "--nats", "nats://127.0.0.1:1", *args, timeout=30)
    assert result.returncode == 2
    assert complaint in result.stderr


def test_controller_reads_a_profile_swap_order(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"order": [3, 0, 2, 1], "scores": {"0": 0.1}}))
    assert read_swap_order(str(profile)) == (3, 0, 2, 1)
    profile.write_text(json.dumps({"scores": {}}))
    with pytest.raises(ValueError, match="no swap order"):
        read_swap_order(str(profile))
    assert parse_setting("bits_order=[8]") == ("bits_order", (8,))
    assert parse_setting("kv_high=0.85") == ("kv_high", 0.85)


def test_executor_static_bits_take_16_8_or_4_only():
    result = run_cli("executor", "--static-bits", "2", timeout=60)
    assert result.returncode == 2
    assert "--static-bits" in result.stderr and "invalid choice" in result.stderr


def test_up_rejects_a_bad_memory_budget():
    result = run_cli("up", "--memory-budget", "lots", timeout=30)
    assert result.returncode == 2
    assert "cannot read size" in result.stderr


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


async def round_trip(url: str, size: int) -> tuple[int, int]:
    """(the server's max_payload, the bytes a message of `size` arrived with)."""
    nc = await nats.connect(url)
    try:
        sub = await nc.subscribe("big")
        await nc.publish("big", b"x" * size)
        return nc.max_payload, len((await sub.next_msg(timeout=5)).data)
    finally:
        await nc.close()


def test_embedded_nats_server_starts_and_stops(tmp_path):
    with Cluster(tmp_path) as cluster:
        url = cluster.start_nats()
        port = int(url.rsplit(":", 1)[1])
        assert url.startswith("nats://127.0.0.1:")
        assert _listening(port)
        assert cluster.supervise(time.monotonic(), ready=False) is None
        # JetStream is on: the server keeps its store in the run directory.
        deadline = time.monotonic() + 5
        while not (tmp_path / "jetstream").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "jetstream").exists()
        # It carries a cluster state of more executors than NATS's default 1 MiB allows (~1,180).
        assert asyncio.run(round_trip(url, 2 << 20)) == (BUS_MAX_PAYLOAD_BYTES, 2 << 20)
    (nats,) = cluster.children
    assert nats.proc.poll() is not None
    assert not _listening(port)
    assert "Server is ready" in (tmp_path / "nats-server.log").read_text()


# A stand-in service: records when SIGTERM arrives, then lingers a little before exiting, or
# ignores SIGTERM altogether when told to (a straggler).
STAND_IN = """
import signal, sys, time
name, record, stubborn = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
def on_term(signum, frame):
    with open(record, "a") as f:
        f.write(f"{name} {time.monotonic()}\\n")
    if not stubborn:
        time.sleep(0.2)
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print(name, "started", flush=True)
while True:
    time.sleep(0.05)
"""


def test_stop_goes_front_to_back_and_kills_stragglers(tmp_path):
    record = tmp_path / "terms.txt"
    cluster = Cluster(tmp_path, stop_timeouts={"controller": 0.5})
    for name, role, stubborn in [("monitor", "monitor", "0"), ("controller", "controller", "1"),
                                 ("exec0", "executor", "0"), ("exec1", "executor", "0"),
                                 ("gateway", "gateway", "0")]:
        cluster.spawn(name, role, [sys.executable, "-c", STAND_IN, name, str(record), stubborn])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all("started" in "".join(c.tail()) for c in cluster.children):
        time.sleep(0.05)
    assert all(c.proc.poll() is None for c in cluster.children)
    cluster.stop()
    assert all(c.proc.poll() is not None for c in cluster.children)
    order = [line.split()[0] for line in record.read_text().splitlines()]
    assert order[0] == "gateway"
    assert sorted(order[1:3]) == ["exec0", "exec1"]
    assert order[3:] == ["controller", "monitor"]
    (controller,) = [c for c in cluster.children if c.name == "controller"]
    assert controller.proc.returncode == -9  # ignored SIGTERM, so it was killed after its timeout


def test_before_ready_an_exit_status_is_a_start_up_failure_with_its_last_lines(tmp_path):
    cluster = Cluster(tmp_path)
    child = cluster.spawn("exec0", "executor",
                          [sys.executable, "-c", "import sys; print('loading'); sys.exit('out of memory')"])
    child.proc.wait(timeout=20)
    assert cluster.supervise(time.monotonic(), ready=False) == (child, STARTUP_FAILURE)
    assert child.restarts == 0
    assert child.tail()[-2:] == ["loading", "out of memory"]
    cluster.stop()


# --- the options `up` hands to its children -------------------------------------------------------

def started_with(monkeypatch, argv: list[str]) -> dict[str, list[str]]:
    """The arguments each child would be started with, by child name, for `morphling up ARGV`."""
    started: dict[str, list[str]] = {}
    monkeypatch.setattr(Cluster, "start_service",
                        lambda self, role, args, name=None: started.__setitem__(name or role, list(args)))
    monkeypatch.setattr(up, "_wait_and_serve", lambda *a: 0)
    assert up.main(["--nats", "nats://127.0.0.1:1", *argv]) == 0
    return started


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_up_hands_thresholds_and_bounds_to_the_services_that_take_them(tmp_path, monkeypatch):
    started = started_with(monkeypatch, ["--log-dir", str(tmp_path), "--executors", "2", "--suspect-after", "0.5",
                                         "--dead-after", "2.5", "--bus-outage", "2", "--failover-timeout", "1"])
    assert (flag(started["monitor"], "--suspect-after"), flag(started["monitor"], "--dead-after")) == ("0.5", "2.5")
    assert (flag(started["gateway"], "--bus-outage"), flag(started["gateway"], "--failover-timeout")) == ("2", "1")
    for name in ("exec0", "exec1"):
        assert flag(started[name], "--bus-outage") == "2"
        assert "--failover-timeout" not in started[name] and "--dead-after" not in started[name]
    assert "--bus-outage" not in started["monitor"] and "--bus-outage" not in started["controller"]


def test_up_leaves_thresholds_to_the_services_own_defaults_when_not_given(tmp_path, monkeypatch):
    started = started_with(monkeypatch, ["--log-dir", str(tmp_path)])
    given = {"--suspect-after", "--dead-after", "--bus-outage", "--failover-timeout"}
    assert not {name: given & set(args) for name, args in started.items() if given & set(args)}


@pytest.mark.parametrize("argv, complaint", [
    (["--dead-after", "0"], "must be more than 0 seconds"),
    (["--bus-outage", "soon"], "not a number of seconds"),
    (["--failover-timeout", "-1"], "must be more than 0 seconds"),
])
def test_up_rejects_a_bad_duration(argv, complaint):
    result = run_cli("up", *argv, timeout=30)
    assert result.returncode == 2
    assert complaint in result.stderr and argv[0] in result.stderr


def test_up_refuses_a_suspect_threshold_beyond_the_dead_one():
    assert "--suspect-after 8 must not be longer than --dead-after 6" in refused(
        parse_args(["--suspect-after", "8", "--dead-after", "6"]))
    assert refused(parse_args(["--suspect-after", "8"])) is None  # the monitor judges it against its own default


# --- logs -------------------------------------------------------------------------------------------

def test_up_keeps_its_logs_under_the_checkout_and_says_where(tmp_path, monkeypatch, capsys):
    (tmp_path / "pyproject.toml").write_text("")
    monkeypatch.setattr(up, "PROJECT_ROOT", tmp_path)
    started_with(monkeypatch, [])
    (log_dir,) = (tmp_path / "logs").iterdir()
    assert log_dir.name.endswith(f"-{os.getpid()}")
    err = capsys.readouterr().err
    assert f"logs in {log_dir}" in err and f"logs kept in {log_dir}" in err


def test_run_dir_still_names_the_log_dir(tmp_path, monkeypatch, capsys):
    started_with(monkeypatch, ["--run-dir", str(tmp_path / "old")])
    assert (tmp_path / "old").is_dir() and f"logs kept in {tmp_path / 'old'}" in capsys.readouterr().err


def test_the_ready_output_names_the_url_to_export_and_warns_when_auth_is_off(monkeypatch, capsys):
    monkeypatch.delenv("MORPHLING_API_KEYS", raising=False)
    monkeypatch.delenv("MORPHLING_ADMIN_KEYS", raising=False)
    up.announce_ready("http://127.0.0.1:9000 (model m, 1 executor, bus nats://127.0.0.1:4222, up in 1.0 s)",
                      "http://127.0.0.1:9000")
    out, err = capsys.readouterr()
    assert out.splitlines() == ["morphling ready: http://127.0.0.1:9000 (model m, 1 executor, bus "
                                "nats://127.0.0.1:4222, up in 1.0 s)", "export MORPHLING_URL=http://127.0.0.1:9000"]
    assert "authentication is off" in err and "MORPHLING_API_KEYS=" in err and "MORPHLING_ADMIN_KEYS=" in err
    monkeypatch.setenv("MORPHLING_API_KEYS", "k1")
    up.announce_ready("http://127.0.0.1:9000", "http://127.0.0.1:9000")
    assert "authentication is off" not in capsys.readouterr().err


# --- MORPHLING_URL ----------------------------------------------------------------------------------

def test_status_and_morph_find_the_gateway_through_morphling_url(monkeypatch, capsys):
    nobody = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MORPHLING_URL", nobody)
    assert admin_cli.status_main([]) == 1
    assert f"cannot reach {nobody}/v1/cluster" in capsys.readouterr().err
    assert admin_cli.morph_main(["--executor", "*", "--action", "restore", "--layers", "1"]) == 1
    assert f"cannot reach {nobody}/v1/cluster/morph" in capsys.readouterr().err
    # --url wins over the variable.
    other = f"http://127.0.0.1:{free_port()}"
    assert admin_cli.status_main(["--url", other]) == 1
    assert f"cannot reach {other}/v1/cluster" in capsys.readouterr().err
    monkeypatch.delenv("MORPHLING_URL")
    assert admin_cli.default_url() == "http://127.0.0.1:8000"


# --- restarting children ----------------------------------------------------------------------------

def exits_after(durations: list[float], policy: RestartPolicy = RestartPolicy()):
    """Drives the policy like `up` does for a child whose runs last `durations`, restarting it as soon as
    it is due: (the waits before each restart, the restart times, when it gave up or None)."""
    runs, waits, t = [(0.0, None)], [], 0.0
    for duration in durations:
        t += duration
        runs[-1] = (runs[-1][0], t)
        decision = decide(runs, t, policy)
        if decision.action == GIVE_UP:
            return waits, [start for start, _ in runs[1:]], t
        assert decision.action == WAIT or decision.at <= t
        t = max(t, decision.at)
        assert decide(runs, t, policy).action == RESTART
        waits.append(round(decision.at - runs[-1][1], 6))
        runs.append((t, None))
    return waits, [start for start, _ in runs[1:]], None


def test_quick_exits_double_the_wait_up_to_its_cap():
    waits, _, gave_up_at = exits_after([1.0] * 8, RestartPolicy(crash_loop_restarts=100))
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert gave_up_at is None


def test_a_long_run_starts_the_backoff_over():
    waits, _, _ = exits_after([1.0, 1.0, 1.0, RESTART_RESET_AFTER_S, 1.0])
    assert waits == [0.5, 1.0, 2.0, 0.5, 1.0]


def test_more_than_five_restarts_within_two_minutes_is_a_crash_loop():
    _, restarts, gave_up_at = exits_after([1.0] * 10)
    assert gave_up_at is not None and len(restarts) == CRASH_LOOP_RESTARTS == 5
    # As many restarts spread over more than the window are no loop.
    _, restarts, gave_up_at = exits_after([30.0] * 10)
    assert gave_up_at is None and len(restarts) == 10


def test_a_decision_needs_a_run_that_ended():
    with pytest.raises(ValueError):
        decide([(0.0, None)], 1.0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=3 * RESTART_RESET_AFTER_S), max_size=40))
def test_restarts_stay_within_the_crash_loop_bound_and_waits_within_the_backoff_bounds(durations):
    waits, restarts, gave_up_at = exits_after(durations)
    assert all(RESTART_FIRST_DELAY_S <= w <= RESTART_MAX_DELAY_S for w in waits)
    for i, start in enumerate(restarts):
        in_window = [t for t in restarts[i:] if t - start < CRASH_LOOP_WINDOW_S]
        assert len(in_window) <= CRASH_LOOP_RESTARTS
    if gave_up_at is not None:  # only ever because of a loop: the bound was reached within the last window
        assert len([t for t in restarts if gave_up_at - t < CRASH_LOOP_WINDOW_S]) == CRASH_LOOP_RESTARTS


@settings(max_examples=100, deadline=None)
# Over a minute, not exactly one: the run time is a difference of clock readings, rounded.
@given(st.lists(st.floats(min_value=RESTART_RESET_AFTER_S + 0.001, max_value=10 * RESTART_RESET_AFTER_S), max_size=40))
def test_a_child_that_runs_over_a_minute_each_time_is_restarted_forever_without_delay_growing(durations):
    waits, restarts, gave_up_at = exits_after(durations)
    assert gave_up_at is None and len(restarts) == len(durations)
    assert set(waits) <= {RESTART_FIRST_DELAY_S}


def supervise_until(cluster: Cluster, ready: bool, done, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        verdict = cluster.supervise(time.monotonic(), ready)
        if verdict is not None or done():
            return verdict
        time.sleep(0.02)
    raise AssertionError("supervision did not get there in time")


def test_a_killed_child_comes_back_with_the_same_command_line(tmp_path, capsys):
    record = tmp_path / "terms.txt"
    cluster = Cluster(tmp_path, policy=RestartPolicy(first_delay_s=0.05))
    child = cluster.spawn("exec0", "executor", [sys.executable, "-c", STAND_IN, "exec0", str(record), "0"])
    first = child.proc
    assert (tmp_path / "exec0.pid").read_text().strip() == str(first.pid)
    assert supervise_until(cluster, True, lambda: child.tail() == ["exec0 started"]) is None
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=20)
    assert supervise_until(cluster, True, lambda: child.proc is not first and "started" in child.tail()[-1]) is None
    assert child.proc.args == first.args and child.restarts == 1
    assert (tmp_path / "exec0.pid").read_text().strip() == str(child.proc.pid)
    log = (tmp_path / "exec0.log").read_text()
    assert log.count("exec0 started") == 2 and "restart 1: the last run was killed by SIGKILL" in log
    err = capsys.readouterr().err
    assert "exec0 was killed by SIGKILL; restart 1 in" in err and "exec0 restarted (restart 1" in err
    cluster.stop()
    assert child.proc.poll() is not None and not (tmp_path / "exec0.pid").exists()


def test_before_ready_a_child_killed_by_a_signal_is_restarted(tmp_path):
    cluster = Cluster(tmp_path, policy=RestartPolicy(first_delay_s=0.05))
    killed = cluster.spawn("exec0", "executor", [sys.executable, "-c", "import time; time.sleep(60)"])
    killed.proc.kill()
    killed.proc.wait(timeout=20)
    assert supervise_until(cluster, False, lambda: killed.restarts == 1) is None
    assert killed.proc.poll() is None
    cluster.stop()


def test_a_child_in_a_crash_loop_is_given_up(tmp_path):
    cluster = Cluster(tmp_path, policy=RestartPolicy(first_delay_s=0.01, max_delay_s=0.02))
    child = cluster.spawn("monitor", "monitor", [sys.executable, "-c", "import sys; sys.exit(3)"])
    assert supervise_until(cluster, True, lambda: False, timeout=60) == (child, CRASH_LOOP)
    assert child.restarts == CRASH_LOOP_RESTARTS and child.proc.returncode == 3
    cluster.stop()
