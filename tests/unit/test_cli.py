"""The `morphling` command line and the process orchestration of `morphling up`, without the services."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services import up
from services.cli import COMMANDS
from services.controller.service import parse_setting
from shared.config import read_swap_order
from services.up import Cluster, parse_args, refused

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
                    "--run-dir", str(tmp_path)]) == 0
    (controller,) = [args for role, args in started if role == "controller"]
    assert controller[controller.index("--mode") + 1] == "performance"
    executors = [args for role, args in started if role == "executor"]
    assert len(executors) == 2 and all(a[a.index("--static-bits") + 1] == "16" for a in executors)
    started.clear()
    assert up.main(["--nats", "nats://127.0.0.1:1", "--static-bits", "4", "--run-dir", str(tmp_path)]) == 0
    (controller,) = [args for role, args in started if role == "controller"]
    assert controller[controller.index("--mode") + 1] == "off"
    (executor,) = [args for role, args in started if role == "executor"]
    assert executor[executor.index("--static-bits") + 1] == "4"


@pytest.mark.parametrize("args, complaint", [
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


def test_embedded_nats_server_starts_and_stops(tmp_path):
    with Cluster(tmp_path) as cluster:
        url = cluster.start_nats()
        port = int(url.rsplit(":", 1)[1])
        assert url.startswith("nats://127.0.0.1:")
        assert _listening(port)
        assert cluster.exited() is None
        # JetStream is on: the server keeps its store in the run directory.
        deadline = time.monotonic() + 5
        while not (tmp_path / "jetstream").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "jetstream").exists()
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
    assert cluster.exited() is None
    cluster.stop()
    assert all(c.proc.poll() is not None for c in cluster.children)
    order = [line.split()[0] for line in record.read_text().splitlines()]
    assert order[0] == "gateway"
    assert sorted(order[1:3]) == ["exec0", "exec1"]
    assert order[3:] == ["controller", "monitor"]
    (controller,) = [c for c in cluster.children if c.name == "controller"]
    assert controller.proc.returncode == -9  # ignored SIGTERM, so it was killed after its timeout


def test_a_dead_child_is_noticed_with_its_last_lines(tmp_path):
    cluster = Cluster(tmp_path)
    child = cluster.spawn("exec0", "executor",
                          [sys.executable, "-c", "import sys; print('loading'); sys.exit('out of memory')"])
    child.proc.wait(timeout=20)
    assert cluster.exited() is child
    assert child.tail()[-2:] == ["loading", "out of memory"]
    cluster.stop()
