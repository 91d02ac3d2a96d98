"""What a restarted child runs, with real processes: its first command line again, in an environment without
the world `up` itself may have inherited."""

import sys
import time

from services.supervisor import WORLD_ENV, Cluster, RestartPolicy

# Prints its arguments, then waits to be killed.
ECHO = "import sys, time; print('args', *sys.argv[1:], flush=True); time.sleep(60)"


def supervise_until(cluster: Cluster, done, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert cluster.supervise(time.monotonic(), ready=True) is None
        assert time.monotonic() < deadline, "supervision did not get there in time"
        time.sleep(0.02)


def started_lines(cluster: Cluster, name: str) -> list[str]:
    return [line for line in (cluster.log_dir / f"{name}.log").read_text().splitlines() if line.startswith("args")]


def test_a_restart_runs_the_first_command_line_again(tmp_path):
    cluster = Cluster(tmp_path, policy=RestartPolicy(first_delay_s=0.05))
    child = cluster.spawn("monitor", "monitor", [sys.executable, "-c", ECHO, "--same"])
    try:
        supervise_until(cluster, lambda: len(started_lines(cluster, "monitor")) == 1)
        child.proc.kill()
        child.proc.wait(timeout=20)
        supervise_until(cluster, lambda: len(started_lines(cluster, "monitor")) == 2)
        assert started_lines(cluster, "monitor") == ["args --same", "args --same"]
    finally:
        cluster.stop()


class FakeProc:
    pid = 1

    def poll(self):
        return None


def test_start_service_passes_on_no_inherited_world(tmp_path, monkeypatch):
    for name in WORLD_ENV:
        monkeypatch.setenv(name, "2")
    monkeypatch.setenv("MORPHLING_API_KEYS", "k")
    popened = []
    monkeypatch.setattr(Cluster, "_popen", lambda self, name, cmd, env: popened.append((name, cmd, env)) or FakeProc())
    cluster = Cluster(tmp_path)
    member = cluster.start_service("executor", ["--id", "exec0", "--rank", "0"], name="exec0")
    gateway = cluster.start_service("gateway", ["--port", "1"])
    prefix = [sys.executable, "-m", "services.cli", "executor"]
    assert member.cmd == [*prefix, "--id", "exec0", "--rank", "0"]
    assert gateway.name == "gateway" and gateway.cmd == [*prefix[:-1], "gateway", "--port", "1"]
    for _, _, env in popened:
        assert not set(WORLD_ENV) & set(env)
        assert env["MORPHLING_API_KEYS"] == "k" and env["PYTHONUNBUFFERED"] == "1"
