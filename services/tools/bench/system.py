"""The systems a benchmark drives: one `morphling up` in a child process, started, waited for and stopped the
way Ctrl-C stops it, with its gateway's URL and its bus's from the ready line."""

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_BUS = re.compile(r"bus (nats://\S+?)[,)]")


@dataclass(frozen=True)
class Endpoints:
    url: str  # the gateway
    nats_url: str | None  # the bus, where the controller's and executors' events can be read back


def _exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def unwind_on_sigterm() -> None:
    """Make a SIGTERM unwind the benchmark like Ctrl-C, through the `finally` that stops its systems: by default
    Python dies at once and leaves every `morphling up` it started running."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit)


class UpProcess:
    """One `morphling up` in a child process: started, waited for, stopped the way Ctrl-C stops it."""

    def __init__(self, cmd: list[str], log_path: Path):
        unwind_on_sigterm()
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_ready(self, timeout_s: float) -> str:
        """The gateway's URL from the `ready` line."""
        return self.wait_endpoints(timeout_s).url

    def wait_endpoints(self, timeout_s: float) -> Endpoints:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"`morphling up` exited with status {self.proc.wait()} before it was ready; "
                                   f"see {self.log.name}")
            if "ready" in line and "http" in line:
                bus = _BUS.search(line)
                return Endpoints(line.split("ready:", 1)[1].split()[0], bus.group(1) if bus else None)
        raise RuntimeError(f"`morphling up` was not ready within {timeout_s:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@contextmanager
def started(cmd: list[str], log_dir: Path, timeout_s: float, what: str) -> Iterator[Endpoints]:
    """The endpoints of a `morphling up` started with `cmd` (logs in `log_dir`), stopped after."""
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"morphling bench: starting the system for {what} (logs in {log_dir})...", file=sys.stderr)
    system = UpProcess(cmd, log_dir / "up.log")
    try:
        yield system.wait_endpoints(timeout_s)
    finally:
        system.stop()
