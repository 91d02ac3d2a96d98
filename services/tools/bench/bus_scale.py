"""`morphling bench-bus`: what the real monitor and controller sustain as executors grow to 1,000 (issue 17).

For each N, a fresh system as `morphling up` starts it, minus executors and gateway: a nats-server (with its
HTTP counters on), the monitor and the controller as child processes (services/supervisor.py, the controller
with its default levers). Synthetic executors exec0 ... exec<N-1> stand in for the real ones (bus_load.py),
`--per-process` of them per publishing process, each reporting every `--interval`.

After a warm-up, for `--duration` seconds, it records what a user of the bus would see: every ClusterState
the monitor publishes (its rate, its bytes, and how old each executor's report in it is when it arrives:
the staleness), the monitor's and the controller's "stats" events (telemetry taken in, states planned, the
seconds planning took), the controller's command audit events, nats-server's /varz counters, and the CPU
time of each process. It prints a table, writes results.json and bus_scale.png to `--out`.
"""

import argparse
import asyncio
import json
import shutil
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from services.supervisor import Cluster
from services.tools.bench.bus_load import BenchBusError, Publishers, executor_names
from services.tools.bench.metrics import percentile
from shared import subjects
from shared.bus import Bus, BusError, Incoming
from shared.messages import ClusterState, Event
from shared.net import free_port
from shared.provenance import provenance

CONTROLLER_ID = "ctl0"  # the controller's default --id: the source of its events
STATS_INTERVAL_S = 1.0  # the monitor's and the controller's stats events, several per measured window


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="morphling bench-bus", description=__doc__.splitlines()[0])
    ap.add_argument("--executors", default="10,100,300,1000",
                    help="numbers of synthetic executors, one system each (default %(default)s)")
    ap.add_argument("--interval", type=float, default=0.1,
                    help="seconds between one executor's telemetry reports (default %(default)s)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds measured per N (default %(default)s)")
    ap.add_argument("--warmup", type=float, default=5.0,
                    help="seconds between the monitor seeing every executor and the measurement (default %(default)s)")
    ap.add_argument("--per-process", type=int, default=1000,
                    help="synthetic executors per publishing process (default %(default)s)")
    ap.add_argument("--startup-timeout", type=float, default=60.0,
                    help="seconds to wait for the monitor and the controller, then for every executor to be seen")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-out/bus"))
    args = ap.parse_args(argv)
    try:
        args.executors = [int(n) for n in args.executors.split(",")]
    except ValueError:
        ap.error(f"--executors takes whole numbers separated by commas, got {args.executors!r}")
    if any(n < 1 for n in args.executors) or args.per_process < 1:
        ap.error("--executors and --per-process must be at least 1")
    if min(args.interval, args.duration) <= 0 or args.warmup < 0:
        ap.error("--interval and --duration must be positive, --warmup not negative")
    return args


# --- what the bus shows -----------------------------------------------------------------------------
@dataclass
class StateSample:
    received: float  # wall clock, when it arrived here
    time: float  # the monitor's, when it built it
    size: int  # bytes on the wire
    staleness: list[float]  # per executor of ours: received - the time of its report in the state
    alive: int


@dataclass
class Watch:
    """Every ClusterState and event on the bus, those of the measured window kept."""
    names: set[str]
    recording: bool = False
    samples: list[StateSample] = field(default_factory=list)
    stats: dict[str, list[tuple[float, dict]]] = field(default_factory=dict)  # by source, (time, counters)
    commands: list[dict] = field(default_factory=list)  # the audit events' data
    alive: int = 0  # of ours in the latest state

    async def on_state(self, incoming: Incoming) -> None:
        received = time.time()
        state: ClusterState = incoming.message
        ours = [e for e in state.executors if e.executor in self.names]
        self.alive = sum(1 for e in ours if e.alive)
        if self.recording:
            self.samples.append(StateSample(received, state.time, incoming.size,
                                            [received - e.telemetry.time for e in ours], self.alive))

    async def on_event(self, incoming: Incoming) -> None:
        event: Event = incoming.message
        if event.kind == "stats":
            self.stats.setdefault(event.source, []).append((event.time, event.data))
        elif event.kind == "command" and self.recording and event.source == CONTROLLER_ID:
            self.commands.append(event.data)


async def until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


def varz(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as response:
        return json.loads(response.read())


def cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float]:
    """User and system CPU seconds so far, summed over each role's processes, and the whole machine's busy
    seconds ("machine"): what other work took of the same cores is the difference."""
    machine = psutil.cpu_times()
    out = {"machine": sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)}
    for role, group in pids.items():
        total = 0.0
        for pid in group:
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        out[role] = total
    return out


def resident_mib(pids: dict[str, list[int]]) -> dict[str, float]:
    """Resident memory, summed over each role's processes."""
    out = {}
    for role, group in pids.items():
        total = 0
        for pid in group:
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:
                continue
        out[role] = total / (1 << 20)
    return out


@dataclass
class Snapshot:
    wall: float
    cpu: dict[str, float]
    varz: dict
    sent: int
    missed: int
    rss_mib: dict[str, float] = field(default_factory=dict)


async def snapshot(pids: dict[str, list[int]], varz_port: int, publishers: Publishers) -> Snapshot:
    sent, missed = publishers.counts()
    return Snapshot(time.time(), cpu_seconds(pids), await asyncio.to_thread(varz, varz_port), sent, missed,
                    resident_mib(pids))


# --- the figures, from what was recorded (pure) -------------------------------------------------------
def counter_rate(stats: list[tuple[float, dict]], key: str, start: float, end: float) -> float | None:
    """Per second, from the first to the last stats event in [start, end] of a counter they carry."""
    inside = [(t, d) for t, d in stats if start <= t <= end and key in d]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (t0, d0), (t1, d1) = inside[0], inside[-1]
    return (d1[key] - d0[key]) / (t1 - t0)


def seconds_per_count(stats: list[tuple[float, dict]], seconds_key: str, count_key: str, start: float,
                      end: float) -> float | None:
    """The mean of what `seconds_key` times, per `count_key`, between the first and last stats event inside."""
    inside = [d for t, d in stats if start <= t <= end]
    if len(inside) < 2 or inside[-1][count_key] == inside[0][count_key]:
        return None
    return (inside[-1][seconds_key] - inside[0][seconds_key]) / (inside[-1][count_key] - inside[0][count_key])


def cpu_percent(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Per role, % of one core over `wall_s`; "other" is what the machine was busy with beyond the roles."""
    out = {role: 100 * (after[role] - before.get(role, 0.0)) / wall_s for role in after}
    if "machine" in out:
        out["other"] = out.pop("machine") - sum(out.values())
    return out


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def summarize(n: int, interval_s: float, begin: Snapshot, end: Snapshot, watch: Watch) -> dict:
    wall = end.wall - begin.wall
    staleness = [s for sample in watch.samples for s in sample.staleness]
    monitor, controller = watch.stats.get("monitor", []), watch.stats.get(CONTROLLER_ID, [])
    planned = [d for t, d in controller if begin.wall <= t <= end.wall]
    cpu = cpu_percent(begin.cpu, end.cpu, wall)
    ingested = counter_rate(monitor, "telemetry", begin.wall, end.wall)
    received = counter_rate(controller, "states", begin.wall, end.wall)
    return dict(
        executors=n, duration_s=wall, target_msg_s=n / interval_s,
        offered_msg_s=(end.sent - begin.sent) / wall, missed_ticks=end.missed - begin.missed,
        ingested_msg_s=ingested,
        # CPU time per unit of work, which waiting for a core does not inflate: what the figures scale with.
        monitor_cpu_us_per_report=1e4 * cpu["monitor"] / ingested if ingested and "monitor" in cpu else None,
        staleness_p50_ms=ms(percentile(staleness, 50)), staleness_p95_ms=ms(percentile(staleness, 95)),
        staleness_max_ms=ms(max(staleness, default=None)),
        alive_min=min((s.alive for s in watch.samples), default=0),
        states=len(watch.samples), states_s=len(watch.samples) / wall,
        state_bytes=round(sum(s.size for s in watch.samples) / len(watch.samples)) if watch.samples else None,
        state_build_ms=ms(seconds_per_count(monitor, "state_s", "states", begin.wall, end.wall)),
        controller_states_s=received,
        controller_cpu_ms_per_state=10 * cpu["controller"] / received if received and "controller" in cpu else None,
        decisions_s=counter_rate(controller, "planned", begin.wall, end.wall),
        decision_ms=ms(seconds_per_count(controller, "plan_s", "planned", begin.wall, end.wall)),
        decision_max_ms=ms(max((d["plan_max_s"] for d in planned[1:]), default=None)),
        commands_s=len(watch.commands) / wall,
        commands_ok=sum(1 for c in watch.commands if c.get("ok")),
        cpu_pct=cpu, rss_mib_at_end=end.rss_mib,
        nats_in_msg_s=(end.varz["in_msgs"] - begin.varz["in_msgs"]) / wall,
        nats_out_msg_s=(end.varz["out_msgs"] - begin.varz["out_msgs"]) / wall,
        nats_out_mib_s=(end.varz["out_bytes"] - begin.varz["out_bytes"]) / wall / (1 << 20),
        slow_consumers=end.varz.get("slow_consumers", 0))


# --- one system per N ---------------------------------------------------------------------------------
def run_at(n: int, args: argparse.Namespace) -> dict:
    log_dir = args.out / "logs" / f"n{n}"
    cluster = Cluster(log_dir)
    try:
        varz_port = free_port()
        nats_url = cluster.start_nats(port=free_port(), monitor_port=varz_port)
        stats = ["--stats-interval", f"{STATS_INTERVAL_S:g}"]
        monitor = cluster.start_service("monitor", ["--nats", nats_url, *stats])
        controller = cluster.start_service("controller", ["--nats", nats_url, *stats])
        nats = next(c for c in cluster.children if c.role == "nats-server")
        pids = {"monitor": [monitor.proc.pid], "controller": [controller.proc.pid], "nats-server": [nats.proc.pid]}
        return asyncio.run(_measure(n, args, nats_url, varz_port, pids))
    finally:
        cluster.stop()
        shutil.rmtree(log_dir / "jetstream", ignore_errors=True)


async def _measure(n: int, args: argparse.Namespace, nats_url: str, varz_port: int,
                   pids: dict[str, list[int]]) -> dict:
    names = executor_names(n)
    watch = Watch(set(names))
    bus = await Bus.connect(nats_url, "bench-bus")
    try:
        await bus.subscribe(subjects.STATE, ClusterState, watch.on_state)
        await bus.subscribe(subjects.EVENTS, Event, watch.on_event)
        await bus.flush()
        if not await until(lambda: "monitor" in watch.stats and CONTROLLER_ID in watch.stats, args.startup_timeout):
            raise BenchBusError(f"the monitor and the controller did not report within {args.startup_timeout:g} s; "
                                f"see their logs in {args.out / 'logs' / f'n{n}'}")
        publishers = Publishers.start(names, args.per_process, nats_url, args.interval, args.seed,
                                      args.startup_timeout)
        try:
            pids = pids | {"publishers": [p.pid for p in publishers.processes], "bench": [psutil.Process().pid]}
            if not await until(lambda: watch.alive == n, args.startup_timeout):
                print(f"morphling bench-bus: N={n}: the monitor saw {watch.alive} executors alive after "
                      f"{args.startup_timeout:g} s; measuring anyway", file=sys.stderr)
            await asyncio.sleep(args.warmup)
            begin = await snapshot(pids, varz_port, publishers)
            watch.recording = True
            await asyncio.sleep(args.duration)
            watch.recording = False
            end = await snapshot(pids, varz_port, publishers)
        finally:
            publishers.close()
        return summarize(n, args.interval, begin, end, watch) | {"publishing_processes": len(publishers.processes)}
    finally:
        await bus.close()


# --- the report -----------------------------------------------------------------------------------------
COLUMNS = [("N", "executors", "{:d}"), ("target/s", "target_msg_s", "{:.0f}"), ("offered/s", "offered_msg_s", "{:.0f}"),
           ("ingested/s", "ingested_msg_s", "{:.0f}"), ("mon us/report", "monitor_cpu_us_per_report", "{:.0f}"),
           ("stale p50 ms", "staleness_p50_ms", "{:.0f}"),
           ("p95 ms", "staleness_p95_ms", "{:.0f}"), ("states/s", "states_s", "{:.1f}"),
           ("state KiB", "state_kib", "{:.0f}"), ("build ms", "state_build_ms", "{:.1f}"),
           ("plans/s", "decisions_s", "{:.1f}"), ("ms/plan", "decision_ms", "{:.1f}"),
           ("max ms", "decision_max_ms", "{:.0f}"), ("ctl ms/state", "controller_cpu_ms_per_state", "{:.1f}"),
           ("cmds/s", "commands_s", "{:.1f}"),
           ("CPU% mon", "cpu_monitor", "{:.0f}"), ("ctl", "cpu_controller", "{:.0f}"), ("nats", "cpu_nats", "{:.0f}"),
           ("pub", "cpu_publishers", "{:.0f}"), ("other", "cpu_other", "{:.0f}"), ("slow", "slow_consumers", "{:d}")]


def table_row(row: dict) -> dict:
    cpu = row["cpu_pct"]
    return row | {"state_kib": None if row["state_bytes"] is None else row["state_bytes"] / 1024,
                  "cpu_monitor": cpu.get("monitor"), "cpu_controller": cpu.get("controller"),
                  "cpu_nats": cpu.get("nats-server"), "cpu_publishers": cpu.get("publishers"),
                  "cpu_other": cpu.get("other")}


def print_table(rows: list[dict]) -> None:
    cells = [[head for head, _, _ in COLUMNS]]
    for row in map(table_row, rows):
        cells.append(["-" if row[key] is None else fmt.format(row[key]) for _, key, fmt in COLUMNS])
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    for line in cells:
        print(" ".join(cell.rjust(w) for cell, w in zip(line, widths)))


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    n = [r["executors"] for r in rows]
    fig, (rate_ax, stale_ax) = plt.subplots(1, 2, figsize=(11, 4))
    rate_ax.plot(n, [r["target_msg_s"] for r in rows], "k--", label="target")
    rate_ax.plot(n, [r["offered_msg_s"] for r in rows], marker="o", label="offered (sent)")
    rate_ax.plot(n, [r["ingested_msg_s"] or 0 for r in rows], marker="s", label="ingested by the monitor")
    rate_ax.set(xlabel="executors", ylabel="telemetry messages / s", title="telemetry rate", xscale="log",
                yscale="log")
    rate_ax.legend()
    stale_ax.plot(n, [r["staleness_p50_ms"] or 0 for r in rows], marker="o", label="p50")
    stale_ax.plot(n, [r["staleness_p95_ms"] or 0 for r in rows], marker="s", label="p95")
    stale_ax.set(xlabel="executors", ylabel="ms", title="age of an executor's report in the state on arrival",
                 xscale="log", yscale="log")
    stale_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.executors:
        print(f"morphling bench-bus: {n} executors, {n / args.interval:.0f} reports/s, {args.duration:g} s "
              f"(load average {psutil.getloadavg()[0]:.2f})", file=sys.stderr)
        try:
            rows.append(run_at(n, args))
        except (BenchBusError, BusError, RuntimeError) as exc:
            print(f"morphling bench-bus: N={n}: {exc}", file=sys.stderr)
            return 1
    print_table(rows)
    (args.out / "results.json").write_text(json.dumps(dict(rows=rows, **provenance(args)), indent=1))
    plot(rows, args.out / "bus_scale.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'bus_scale.png'}")
    return 0
