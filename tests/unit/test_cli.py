"""The `morphling` command line and the process orchestration of `morphling up`, without the services."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.cli import COMMANDS
from services.up import Cluster

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


@pytest.mark.parametrize("args, flag", [(["--mode", "default"], "--mode default"),
                                        (["--static-bits", "4"], "--static-bits 4"),
                                        (["--static-bits", "8"], "--static-bits 8")])
def test_up_refuses_morphing_options_at_once(args, flag):
    started = time.monotonic()
    result = run_cli("up", "--port", "1", *args, timeout=30)
    assert result.returncode == 2
    assert flag in result.stderr and "morphing support" in result.stderr
    # Refused before anything starts: no log directory announced, no child waited for.
    assert "logs in" not in result.stderr and "ready" not in result.stdout
    assert time.monotonic() - started < 20


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
