"""`morphling up`: the whole system on one machine, for development and single-host serving.

It starts an embedded nats-server (unless --nats points at one), then monitor, controller, the
executors and a gateway as separate processes, exactly as a deployment runs them, so that what works
here works under docker compose. It prints one line containing `ready` and the URL once the gateway's
/ready answers 200; scripts and tests wait for that line. On SIGINT/SIGTERM it stops the processes
front to back (the gateway first, so it can drain in-flight requests while executors still run).

Children write to log files in a log directory rather than through pipes into our stdout: a pipe
that nobody reads would block a child's logging, and our stdout stays free for progress and the
ready line. The logs stay after `up` ends, a clean stop included.

Once the system has been ready, a child that exits is restarted with the same command line after a
growing delay, as a supervisor would (the embedded nats-server on the same port and store, so every
client, which reconnects forever, finds it again); a crash loop makes `up` give up. Before the first
ready, a child that exits with a status is a start-up failure (a bad model, a bad flag) that no
restart would cure, so `up` stops there. The process table and that policy are services/supervisor.py.

With more than one executor, the executors meet over the bus as one world of peers and serve as the
instances `--tp` or `--plan` describe (DESIGN.md, "Instances across executors"). A restarted executor
runs with the same flags: it meets its peers again and, its instance's other members serving alone by
then, serves alone (TP1) as a peer they can merge with.
"""

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from services.supervisor import CRASH_LOOP, Child, Cluster, Flag, exit_description, progress
from shared.config import (DEFAULT_MODEL_NAME, LEVERS, PROJECT_ROOT, parse_levers, parse_size, seconds,
                           served_model_name)
from shared.core.plans import FFN_PIECES, PlanError, read_plan_file

MORPHING_MODES = ("accuracy", "default", "performance")


def default_log_dir() -> Path:
    """A fresh folder per run, under the checkout when there is one (so `ls logs/` finds them), else
    under the user's state directory: an installed package's folder is no place for logs."""
    base = PROJECT_ROOT / "logs" if (PROJECT_ROOT / "pyproject.toml").exists() else \
        Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "morphling" / "logs"
    return base / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def executor_device(device: str, index: int) -> str:
    # One executor per GPU: a bare "cuda" spreads the executors over cuda:0, cuda:1, ...
    return f"cuda:{index}" if device == "cuda" else device


def executor_ids(count: int) -> list[str]:
    return [f"exec{i}" for i in range(count)]


def cpu_cores() -> int:
    # The cores this process may run on, which a container or taskset can make fewer than the machine's.
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="morphling up", description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000, help="the gateway's HTTP port")
    ap.add_argument("--host", default="127.0.0.1", help="the gateway's HTTP address")
    ap.add_argument("--executors", type=int,
                    help="executor processes (one per GPU on cuda); default 1, or one per device of a --plan from "
                         "`morphling plan`")
    ap.add_argument("--model", default="default",
                    help=f"'default' ({DEFAULT_MODEL_NAME}), a Hugging Face directory or a .gguf file")
    ap.add_argument("--device", default="cpu",
                    help="cpu, or cuda (executor i on cuda:i), or one explicit device for every executor")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="on CUDA, run every step eagerly instead of replaying captured decode graphs")
    ap.add_argument("--memory-budget", help="bytes of each executor's page arena, e.g. 2GiB (default: the memory a "
                                            "`morphling plan` file gives each device, else the executor's)")
    ap.add_argument("--max-model-len", type=int,
                    help="longest sequence (prompt + output) served; default: the context a `morphling plan` file "
                         "was planned for, else the model's own")
    ap.add_argument("--mode", choices=("off", *MORPHING_MODES),
                    help="the controller's preset for the whole ladder: how eagerly it quantizes under load "
                         "(accuracy, default, performance), CoCoServe's operations and AMOEBAs' merges with each; "
                         "off: none of them (default: default, or off with --static-bits 8 or 4)")
    ap.add_argument("--levers", type=levers_arg, default=LEVERS, metavar="LEVER[,LEVER...]",
                    help=f"the levers the ladder may use, of {', '.join(LEVERS)} (quantize: MorphServe; "
                         f"replicate: CoCoServe; tp: AMOEBAs), or none (default: all)")
    ap.add_argument("--cocoserve", choices=("off", "scale-down", "default"),
                    help="CoCoServe: replicate layers onto idle members of an instance (--plan), or onto an idle "
                         "executor serving alone, released at the next arrival; migrate, evict and cut the batch "
                         "under SLO violations (default: default with the "
                         "replicate lever and a --mode other than off, else off)")
    ap.add_argument("--morph-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one morph setting of the controller's preset, e.g. max_layers=30 (repeatable)")
    ap.add_argument("--cocoserve-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one CoCoServe setting of the controller, e.g. t_down=0.2 (repeatable)")
    ap.add_argument("--capacity-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one setting of when the controller asks for more executors or fewer, e.g. "
                         "sustain_s=10 (repeatable)")
    ap.add_argument("--static-bits", type=int, default=16, choices=(16, 8, 4),
                    help="bits of every decoder layer, fixed: 8 or 4 are the static baselines (with --mode off), "
                         "16 is full precision as loaded (default %(default)s)")
    ap.add_argument("--swap-order", default="auto", metavar="auto|front|PATH",
                    help="the order layers are quantized in: the model's LIS profile (auto), front to back, or a "
                         "`morphling profile` JSON (default %(default)s)")
    ap.add_argument("--latency-profile", default="auto", metavar="auto|none|PATH",
                    help="each executor's `morphling profile --latency` JSON (measured for this model on this "
                         "device): the controller then quantizes for a queue only where fewer bits are faster; "
                         "auto: the one shipped for the device where it fits the model (the default model on CPU), "
                         "none: no profile (default %(default)s)")
    ap.add_argument("--nats", help="an existing NATS server; without it an embedded one is started")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for /ready")
    ap.add_argument("--log-dir", type=Path,
                    help="where the children's logs (and pid files while they run) go; kept after the stop "
                         "(default: logs/<date>-<time>-<pid> in the checkout)")
    # The flag's old name, from when the folder was removed after a clean run.
    ap.add_argument("--run-dir", dest="log_dir", type=Path, help=argparse.SUPPRESS)
    # Passed on only when given, so that each service's own default rules.
    ap.add_argument("--suspect-after", type=seconds(), metavar="SECONDS",
                    help="the monitor calls an executor suspect after this long without telemetry (its default 1.0)")
    ap.add_argument("--dead-after", type=seconds(), metavar="SECONDS",
                    help="the monitor calls an executor dead after this long without telemetry (its default 6.0)")
    ap.add_argument("--slo-ttft", type=seconds(), metavar="SECONDS",
                    help="the monitor's time-to-first-token SLO, for its SLO-violation rates (its default 2)")
    ap.add_argument("--slo-tpot", type=seconds(), metavar="SECONDS",
                    help="the monitor's time-per-output-token SLO, for its SLO-violation rates (its default 0.15)")
    ap.add_argument("--slo-window", type=seconds(), metavar="SECONDS",
                    help="seconds of finished requests the monitor's SLO-violation rates are over (its default 10)")
    ap.add_argument("--bus-outage", type=seconds(), metavar="SECONDS",
                    help="how long the bus may be gone before the gateway and executors end in-flight streams "
                         "with an error (their default 3)")
    ap.add_argument("--failover-timeout", type=seconds(), metavar="SECONDS",
                    help="how long the gateway tries to continue a stream on another executor when its executor "
                         "dies (its default 10)")
    ap.add_argument("--tp-scheduler", choices=("amoebas", "rr", "llf", "off"),
                    help="with several executors: where requests go and which executors merge into a TP instance "
                         "for a request none holds alone (AMOEBAs; rr and llf are its baselines, round-robin and "
                         "least-load-first; off: no merges). The gateway's default amoebas")
    shape = ap.add_mutually_exclusive_group()
    shape.add_argument("--tp", type=int, metavar="K",
                       help="consecutive executors form instances of tensor-parallel degree K (K divides --executors; "
                            "default: every executor serves a whole model on its own)")
    shape.add_argument("--plan", type=Path, metavar="FILE",
                       help="the instances as a JSON plan file (members, tp, per-layer placement and bits) over the "
                            "executors exec0 ... exec<N-1>; needs --executors 2 or more")
    ap.add_argument("--dist-timeout", type=seconds(), metavar="SECONDS",
                    help="with several executors: how long each collective between them may take before it fails "
                         "(the executors' default 30)")
    args = ap.parse_args(argv)
    args.planned = planned(args.plan) if args.plan is not None else {}
    if args.executors is None:
        args.executors = len(args.planned.get("devices", [])) or 1
    if args.max_model_len is None and "context" in args.planned:
        args.max_model_len = args.planned["context"]
    if args.executors < 1:
        ap.error("--executors must be at least 1")
    if args.tp is not None and args.tp < 1:
        ap.error("--tp must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 2:
        ap.error("--max-model-len must leave room for a prompt and an output token")
    if args.memory_budget is not None:
        try:
            parse_size(args.memory_budget)
        except ValueError as e:
            ap.error(str(e))
    return args


def planned(path: Path) -> dict:
    """What a `morphling plan` file says beside its instances: each executor's memory (`devices`) and the
    context the plan reserved KV for. A hand-written plan has neither; an unreadable one is refused later."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    out = {}
    devices = data.get("devices")
    if isinstance(devices, list) and all(isinstance(d, dict) and isinstance(d.get("memory"), int) for d in devices):
        out["devices"] = {d.get("executor", f"exec{i}"): d["memory"] for i, d in enumerate(devices)}
    workload = data.get("workload")
    context = workload.get("context") if isinstance(workload, dict) else None
    if isinstance(context, int) and context >= 2:
        out["context"] = context
    return out


def levers_arg(text: str) -> tuple[str, ...]:
    try:
        return parse_levers(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def resolve_ladder(args: argparse.Namespace) -> None:
    """Fill in what --mode and --levers imply for the flags left out: the mode (off for a static baseline),
    CoCoServe's mode and whether the gateway merges TP instances."""
    if args.mode is None:
        args.mode = "default" if args.static_bits == 16 else "off"
    on = args.mode != "off"
    if args.cocoserve is None:
        args.cocoserve = "default" if on and "replicate" in args.levers else "off"
    if args.tp_scheduler is None and not (on and "tp" in args.levers):
        args.tp_scheduler = "off"


def refused(args: argparse.Namespace) -> str | None:
    """Why these arguments make no sense together, or None. Checked before anything starts."""
    if args.cocoserve not in (None, "off") and "replicate" not in args.levers:
        return f"--cocoserve {args.cocoserve} needs the replicate lever, which --levers leaves out"
    if args.tp_scheduler not in (None, "off") and "tp" not in args.levers:
        return f"--tp-scheduler {args.tp_scheduler} merges TP instances, which --levers leaves out (no tp lever)"
    if args.mode not in (None, "off") and args.static_bits != 16:
        # The controller would restore "quantized" layers to full precision at the first lull, so
        # the run would be neither the static baseline nor morphing.
        return (f"--mode {args.mode} cannot be combined with --static-bits {args.static_bits}: the static "
                f"baselines run with --mode off (or morph from full precision with --static-bits 16)")
    if args.suspect_after is not None and args.dead_after is not None and args.suspect_after > args.dead_after:
        return (f"--suspect-after {args.suspect_after:g} must not be longer than --dead-after {args.dead_after:g}: "
                f"an executor is suspect before it is dead")
    if args.tp is not None and FFN_PIECES % args.tp:
        return f"--tp {args.tp} must be 1, 2 or 4: every layer's FFN is stored in {FFN_PIECES} pieces that TP splits"
    if args.tp is not None and args.executors % args.tp:
        return (f"--tp {args.tp} must divide --executors {args.executors}: each instance is {args.tp} consecutive "
                f"executors")
    if args.plan is not None and args.executors == 1:
        # The executors read a plan only as members of a world, and one executor forms none.
        return f"--plan {args.plan} needs --executors 2 or more: a lone executor serves the whole model itself"
    if args.plan is not None:
        # Without the model's depth (no model is read yet): each executor checks the layers when it loads.
        try:
            read_plan_file(args.plan, executor_ids(args.executors), None)
        except PlanError as e:
            return f"--plan {args.plan} does not fit --executors {args.executors}: {e}"
    if args.latency_profile not in ("auto", "none"):
        from shared.core.planner.latency import LatencyError, load_profile  # numpy and scipy: only when asked

        try:  # each executor checks it against the layers it loads
            load_profile(args.latency_profile)
        except LatencyError as e:
            return f"--latency-profile: {e}"
    return None


def _given(args: argparse.Namespace, *names: str) -> list[str]:
    """`--flag value` for each of these options the user gave."""
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", f"{value:g}" if isinstance(value, float) else str(value)]
    return out


def monitor_args(args: argparse.Namespace, nats_url: str) -> list[str]:
    return ["--nats", nats_url, *_given(args, "suspect_after", "dead_after", "slo_ttft", "slo_tpot", "slo_window")]


def executor_args(args: argparse.Namespace, nats_url: str, index: int) -> list[str]:
    """Executor `index`'s arguments apart from the world's (world_args)."""
    device = executor_device(args.device, index)
    out = ["--nats", nats_url, "--id", f"exec{index}", "--model", args.model,
           "--device", device, "--static-bits", str(args.static_bits), "--swap-order", args.swap_order]
    if args.memory_budget is not None:
        out += ["--memory-budget", args.memory_budget]
    elif f"exec{index}" in args.planned.get("devices", {}):
        out += ["--memory-budget", str(args.planned["devices"][f"exec{index}"])]
    if args.max_model_len is not None:
        out += ["--max-model-len", str(args.max_model_len)]
    if args.latency_profile != "auto":  # the executor's own default
        out += ["--latency-profile", "none" if args.latency_profile == "none"
                else str(Path(args.latency_profile).resolve())]
    if args.enforce_eager:
        out.append("--enforce-eager")
    if device == "cpu" and args.executors > 1:
        # torch takes every core for each process by default: N executors would oversubscribe the CPU N-fold,
        # and the slowest member holds up every collective of its instance.
        out += ["--threads", str(max(1, cpu_cores() // args.executors))]
    return out + _given(args, "bus_outage")


def join_args(args: argparse.Namespace, index: int) -> list[str]:
    """What makes executor `index`, added while the deployment runs (`morphling scale`), a peer of the world."""
    return ["--join", "--rank", str(index), *_given(args, "dist_timeout")]


def world_args(args: argparse.Namespace, index: int) -> list[str]:
    """What puts executor `index` into the executors' world and its instance."""
    if args.executors == 1:  # no world to plan for; a peer all the same, so that executors `scale` adds can merge
        return join_args(args, index)
    out = ["--rank", str(index), "--world-size", str(args.executors)]
    if args.tp is not None:
        out += ["--tp", str(args.tp)]
    if args.plan is not None:
        out += ["--plan", str(args.plan.resolve())]
    return out + _given(args, "dist_timeout")


def gateway_args(args: argparse.Namespace, nats_url: str) -> list[str]:
    return ["--nats", nats_url, "--host", args.host, "--port", str(args.port),
            *_given(args, "bus_outage", "failover_timeout", "tp_scheduler")]


def _report_death(child: Child) -> None:
    progress(f"{child.name} {exit_description(child.proc.returncode)}; last lines of {child.log_path}:")
    for line in child.tail():
        print(f"  {child.name} | {line}", file=sys.stderr)
    sys.stderr.flush()


def announce_ready(summary: str, base: str) -> None:
    """The ready line (scripts wait for it; its form stays), the variable that `morphling status` and
    `morphling morph` read, and, on the console, whether anyone at all may call this gateway."""
    print(f"morphling ready: {summary}", flush=True)
    print(f"export MORPHLING_URL={base}", flush=True)
    if not (os.environ.get("MORPHLING_API_KEYS", "").strip() or os.environ.get("MORPHLING_ADMIN_KEYS", "").strip()):
        progress("authentication is off: anyone who reaches the gateway may call every endpoint, admin ones "
                  "included. To turn it on, start with MORPHLING_API_KEYS=key1,key2 (for /v1/*) and "
                  "MORPHLING_ADMIN_KEYS=key3 (for /v1/cluster*) in the environment")


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
    resolve_ladder(args)

    started = time.monotonic()
    stop_requested = Flag()
    log_dir = args.log_dir or default_log_dir()
    cluster = Cluster(log_dir)

    def on_signal(signum, frame):
        if stop_requested.is_set():
            cluster.hurry.set()  # a second Ctrl-C: stop waiting for graceful exits
        stop_requested.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 1
    try:
        progress(f"logs in {log_dir}")
        if args.nats:
            nats_url = args.nats
        else:
            progress("starting nats-server...")
            nats_url = cluster.start_nats()
            progress(f"nats-server listening at {nats_url}")
        cluster.start_service("monitor", monitor_args(args, nats_url))
        cluster.start_service("controller", ["--nats", nats_url, "--mode", args.mode, "--cocoserve", args.cocoserve,
                                             "--levers", ",".join(args.levers) or "none",
                                             *(f"--morph-set={kv}" for kv in args.morph_set),
                                             *(f"--cocoserve-set={kv}" for kv in args.cocoserve_set),
                                             *(f"--capacity-set={kv}" for kv in args.capacity_set)])
        if args.executors > 1:
            shape = f"--plan {args.plan}" if args.plan else f"TP{args.tp or 1} instances"
            progress(f"the executors meet as one world over the bus ({shape})")
        for i in range(args.executors):
            cluster.start_service("executor", executor_args(args, nats_url, i) + world_args(args, i),
                                  name=f"exec{i}")
        cluster.start_service("gateway", gateway_args(args, nats_url))

        # A wildcard bind address is not something to connect to.
        local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(args.host, args.host)
        base = f"http://[{local}]:{args.port}" if ":" in local else f"http://{local}:{args.port}"
        status = _wait_and_serve(cluster, args, base, nats_url, started, stop_requested)
    except RuntimeError as e:
        progress(str(e))
        status = 1
    finally:
        if stop_requested.is_set() or status != 0:
            progress("stopping...")
        cluster.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        # The bus's store is of this run only; the logs are what is worth keeping.
        shutil.rmtree(log_dir / "jetstream", ignore_errors=True)
        progress(f"stopped; logs kept in {log_dir}")
    return status


def _wait_and_serve(cluster: Cluster, args, base: str, nats_url: str, started: float, stop_requested: Flag) -> int:
    """Waits for /ready, prints the ready line, then supervises until a signal. Returns the exit status."""
    # Imported here: the gateway's HTTP client library is not needed to reject bad arguments.
    import httpx

    deadline = started + args.timeout
    phase, last_note = None, 0.0
    with httpx.Client(timeout=2.0) as client:
        while True:
            if stop_requested.is_set():
                return 0
            if _ended(cluster, time.monotonic(), ready=False):
                return 1
            if _http_status(client, f"{base}/ready") == 200:
                break
            now = time.monotonic()
            if now > deadline:
                progress(f"the gateway's /ready did not answer 200 within {args.timeout:.0f} s")
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
                    progress(f"waiting for {plural} to load the model...{elapsed}")
                else:
                    progress(f"waiting for the gateway to listen on {base}...{elapsed}")
                phase, last_note = current, now
            stop_requested.wait(0.25)
        name = served_model(client, base, served_model_name(args.model))
    count = f"{args.executors} executor{'s' if args.executors > 1 else ''}"
    announce_ready(f"{base} (model {name}, {count}, bus {nats_url}, up in {time.monotonic() - started:.1f} s)", base)

    from services.scaling import ScaleService

    def start_executor(name: str) -> None:
        index = int(name.removeprefix("exec"))
        cluster.start_service("executor", executor_args(args, nats_url, index) + join_args(args, index), name=name)
        progress(f"{name} added (morphling scale)")

    scaler = ScaleService(nats_url, lambda: [c.name for c in cluster.children if c.role == "executor"],
                          start_executor, cluster.retire)
    scaler.start()
    try:
        while not stop_requested.wait(0.25):
            scaler.run_pending()
            if _ended(cluster, time.monotonic(), ready=True):
                return 1
        return 0
    finally:
        scaler.stop()


def _ended(cluster: Cluster, now: float, ready: bool) -> bool:
    """One round of supervision; True when a child's failure ends the run (after saying why)."""
    verdict = cluster.supervise(now, ready)
    if verdict is None:
        return False
    child, why = verdict
    _report_death(child)
    if why == CRASH_LOOP:
        progress(f"giving up: {child.name} keeps exiting ({child.restarts} restarts within "
                  f"{cluster.policy.crash_loop_window_s:.0f} s), so restarting it again would not help; "
                  f"its log: {child.log_path}")
    return True
