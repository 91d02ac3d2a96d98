"""`morphling up` in a child process, as a user runs it, for the integration tests that need all of it.

Its stdout is read line by line on a thread (the `ready` line gives the URL and the bus), its console
(stderr) goes to a file, and its children's logs to a log directory beside it; `logs()` gathers the
tails of all of them for failure messages. SIGINT stops it, as a Ctrl-C would.
"""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from shared.config import PROJECT_ROOT
from shared.net import free_port


class UpProcess:
    def __init__(self, workdir: Path, *flags: str, env: dict[str, str] | None = None):
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir = workdir / "logs"
        self.console_path = workdir / "console.txt"
        with open(self.console_path, "wb") as console:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "up", "--port", str(free_port()),
                 "--log-dir", str(self.log_dir), *flags],
                cwd=PROJECT_ROOT, env=os.environ if env is None else env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=console, text=True)
        self.url = ""
        self.stdout: list[str] = []
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name="up-stdout", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.stdout.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def console(self) -> str:
        return self.console_path.read_text(errors="replace")

    def logs(self) -> str:
        """`up`'s console and the last lines of each child's log, for failure messages."""
        tails = "\n".join(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
                          for path in sorted(self.log_dir.glob("*.log")))
        return f"--- console\n{self.console()[-6000:]}\n{tails}"

    def wait_ready(self, timeout: float) -> str:
        """The gateway's URL, from the ready line; fails the test if `up` exits or says nothing in time."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            assert line is not None, f"`morphling up` exited with {self.proc.wait()} before ready:\n{self.logs()}"
            if line.startswith("morphling ready:"):
                self.url = line.split("ready:", 1)[1].split()[0]
                return self.url
        raise AssertionError(f"`morphling up` printed no ready line within {timeout:.0f} s:\n{self.logs()}")

    def nats_url(self) -> str:
        ready = next(line for line in self.stdout if line.startswith("morphling ready:"))
        return ready.split(" bus ", 1)[1].split(",")[0]

    def pid(self, child: str) -> int:
        """The pid of one of `up`'s children, from the pid file `up` keeps in its log directory."""
        return int((self.log_dir / f"{child}.pid").read_text())

    def wait_console(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.console():
            assert self.proc.poll() is None, f"`morphling up` exited with {self.proc.returncode}:\n{self.logs()}"
            assert time.monotonic() < deadline, f"`morphling up` never said {text!r}:\n{self.logs()}"
            time.sleep(0.2)

    def interrupt(self, timeout: float) -> int | None:
        """Ctrl-C, then its exit status; None if it did not exit within `timeout` (it is killed then)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
