"""The whole system as separate processes, started the way compose starts them, for integration tests.

A real nats-server, then `morphling monitor`, `morphling controller`, N `morphling executor` and a
`morphling gateway`, each a child process with its log in a temporary folder. Tests kill and restart
pieces of it to check that the rest copes.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.nats_server import NatsServer, free_port


class System:
    def __init__(self, workdir: Path, executors: int = 1, executor_args: tuple[str, ...] = (),
                 gateway_env: dict[str, str] | None = None, controller_args: tuple[str, ...] = (),
                 gateway_args: tuple[str, ...] = ()):
        self.workdir = workdir
        self.nats = NatsServer()
        self.port = free_port()
        self.executor_args = executor_args
        self.controller_args = controller_args
        self.gateway_env = gateway_env or {}
        self.gateway_args = gateway_args
        self.procs: dict[str, subprocess.Popen] = {}
        self.num_executors = executors

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 240) -> "System":
        self.nats.start()
        self.spawn("monitor", "monitor", "--nats", self.nats.url)
        # Morphing stays off unless a test asks for it (a later --mode or --cocoserve wins): the tests of serving
        # and of faults expect the layers and placements they started with.
        self.spawn("controller", "controller", "--nats", self.nats.url, "--mode", "off", "--cocoserve", "off",
                   *self.controller_args)
        for i in range(self.num_executors):
            self.start_executor(i)
        self.spawn("gateway", "gateway", "--nats", self.nats.url, "--host", "127.0.0.1", "--port", str(self.port),
                   *self.gateway_args, env=self.gateway_env)
        self.wait_ready(timeout)
        return self

    def start_executor(self, i: int) -> None:
        # variants are built at the first swap, not at start: most tests never swap, and CI time counts
        self.spawn(f"exec{i}", "executor", "--nats", self.nats.url, "--id", f"exec{i}", "--lazy-variants",
                   "--memory-budget", "800MiB", "--max-model-len", "2048", *self.executor_args)

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        log = open(self.workdir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "services.cli", *args], stdout=log,
                                            stderr=subprocess.STDOUT, env=os.environ | (env or {}))

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float, executors: int | None = None) -> None:
        """Wait until /ready answers 200 and /v1/cluster shows `executors` live executors."""
        want = self.num_executors if executors is None else executors
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None and not name.startswith("exec"):
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200 and self.live_executors() >= want:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        logs = "\n".join(f"--- {n}\n{self.log(n)}" for n in self.procs)
        raise TimeoutError(f"system not ready after {timeout} s\n{logs}")

    def cluster(self) -> dict:
        return httpx.get(f"{self.url}/v1/cluster", timeout=5).json()

    def live_executors(self) -> int:
        return sum(e["alive"] for e in self.cluster()["executors"])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def kill_nats(self) -> None:
        """The bus gone at once (SIGKILL: no goodbye to its clients); `nats.start()` brings it back on the
        same port, where the services reconnect by themselves."""
        self.nats.proc.kill()
        self.nats.proc.wait(timeout=10)

    def stop(self) -> None:
        gateways, executors = ([n for n in self.procs if n.startswith(role)] for role in ("gateway", "exec"))
        for name in [*gateways, *executors, "controller", "monitor"]:
            proc = self.procs.get(name)
            if proc and proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.nats.stop()
