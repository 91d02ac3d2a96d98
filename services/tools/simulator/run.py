"""`morphling simulate`: the bench's experiment on a simulated fleet, with the real monitor, controller and router.

The same rules as `morphling bench` (services/tools/bench/run.py), applied to simulated executors (cluster.py):
fp16's capacity at steady load first (the same probes and interpolation, bench/capacity.py), the trace scaled
so its median rate is that capacity, the k busiest and k most ordinary windows (bench/windows.py), every mode
on every window, and the same results.json shape, table and plots. As the bench does, a mode replays its
windows in turn on one cluster, resting between two (`--rest-s`, then until every pressure action is undone,
up to `--settle-timeout`: bench/rest.py's rule), so a window starts where the previous one and its rest left
the cluster (CoCoServe's replicas, say). Quality is the perplexity of the precision mixes the tokens were
generated at (bench/quality.py, exact per token here), since simulated tokens carry no text to compare.

Added beside the bench's keys: `simulation`, per mode and window, with the simulated seconds per wall second
(a mode's first window counts building its cluster, `setup_s`, which `loop_simulated_s_per_wall_s` leaves out),
the controller's decisions per simulated minute and the wall seconds its policies took per decision; and for a
fleet of several models, `models`, per mode and window, each model's own summary (its requests, its executors).

`--shards N` plays a window's models in N processes side by side, one per core (shards.py): the same results,
faster by as much as the models' work is even; one window at a given rate, on a fleet whose monitor publishes on
its clock alone (a thousand executors' states are too dear to publish between ticks). Its wall time counts the
shards' set-up and putting their runs together.

Modes: all the bench's. The fleet's executors run every mode, as `morphling bench --executors N` does
(bench/modes.py): several join one world; cocoserve starts from the spare plan (instances of two, every layer
on the first, replicated, migrated, evicted and its batch cut by the controller); amoebas serves them alone
and merges them for a request none holds (the gateway's merges) and splits after (the controller's). The
ladder runs every lever on executors alone: its replicate rung finds no instance of several to act on, as in
the bench's own ladder shape; its tp rung splits what the gateway merged. A mode whose shape the fleet cannot
take (cocoserve on an odd count) fails with the fleet's error.
"""

import argparse
import gc
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from services.tools.bench.capacity import Probe, search, steady_load
from services.tools.bench.client import ClusterSample, RequestRecord
from services.tools.bench.events import actions, reaction
from services.tools.bench.metrics import percentile, summarize
from services.tools.bench.modes import MODES
from services.tools.bench.plots import plot_goodput, plot_timeline, plot_ttft_cdf
from services.tools.bench.quality import DEFAULT_TABLE, PerplexityTable, quality
from services.tools.bench.report import (comparison, mode_summary, model_summaries, print_models, print_sweep, print_table,
                                   window_result)
from services.tools.bench.sweep import add_arguments as add_sweep_arguments
from services.tools.bench.sweep import check_arguments as check_sweep_arguments
from services.tools.bench.sweep import sweep, sweep_keys
from services.tools.bench.trace import TraceError, TraceRequest, read_rows
from services.tools.bench.windows import median_rate, pick_windows, rate_scale_for, requests_in
from services.tools.simulator.cluster import SimRun, SimSettings, Simulation, no_cycle_collection
from services.tools.simulator.executor import SimRequest
from services.tools.simulator.fidelity import (decode_steps, fidelity, print_decode_steps, print_errors, print_fidelity,
                                        print_tp_steps, tp_steps)
from services.tools.simulator.fleet import DEFAULT_MODEL, Fleet, FleetError, read_fleet
from services.tools.simulator.shards import deal, play_sharded
from shared.config import ControllerConfig, MonitorConfig, data_dir
from shared.provenance import provenance

DEFAULT_TRACE = data_dir() / "traces" / "AzureLLMInferenceTrace_conv.first30min.csv"
DEFAULT_FLEET = Path(__file__).parent / "fleets" / "cpu-bench.json"
SIMULATED = ("fp16", "int8", "int4", "morph", "cocoserve", "amoebas", "ladder")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="morphling simulate", description=__doc__.splitlines()[0])
    ap.add_argument("--fleet", type=Path, default=DEFAULT_FLEET,
                    help="a fleet JSON (services/tools/simulator/fleet.py)")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="an Azure or BurstGPT CSV")
    ap.add_argument("--modes", default=",".join(SIMULATED), help=f"comma-separated, of {', '.join(SIMULATED)}")
    ap.add_argument("--window-s", type=float, default=20.0, help="length of each window, trace seconds")
    ap.add_argument("--busy", type=int, default=2, help="the k busiest windows of the trace")
    ap.add_argument("--ordinary", type=int, default=2, help="the k windows closest to the median")
    ap.add_argument("--load", type=float, default=1.0, help="the trace's median rate as a multiple of capacity")
    ap.add_argument("--rate-scale", type=float, help="play the trace at this rate multiplier instead")
    ap.add_argument("--copies", type=int, default=1,
                    help="superpose this many copies of each window's requests (after --load or --rate-scale): "
                         "a fleet far larger than the trace's own needs more users, not a faster clock")
    ap.add_argument("--probe-s", type=float, default=30.0, help="seconds of steady load per capacity probe")
    ap.add_argument("--probe-start", type=float, default=0.5, help="the first capacity probe's rate, req/s")
    add_sweep_arguments(ap)  # each sweep point a fresh fleet
    ap.add_argument("--len-scale", type=float, default=0.1, help="token count multiplier")
    ap.add_argument("--max-len", type=int, default=512, help="cap on prompt + output tokens of one request")
    ap.add_argument("--morph-mode", default="accuracy", choices=("accuracy", "default", "performance"))
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO in seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.5, help="the system's TPOT SLO")
    ap.add_argument("--poll-s", type=float, default=SimSettings.sample_interval_s,
                    help="seconds between two samples of the cluster, as the bench polls it: a whole trace over a "
                         "thousand executors at the bench's 0.25 s holds gigabytes of samples")
    ap.add_argument("--telemetry-interval", type=float, default=0.1, help="seconds between an executor's reports")
    ap.add_argument("--monitor-state-s", type=float, default=SimSettings.monitor_state_s,
                    help="seconds a cluster state costs the monitor, per executor: its pace (default %(default)g, "
                         "measured on a 16-core host)")
    ap.add_argument("--rest-s", type=float, default=10.0, help="seconds of rest between two windows of a mode")
    ap.add_argument("--settle-timeout", type=float, default=180.0,
                    help="seconds more, after the rest, for the cluster to be back at rest (default %(default)s)")
    ap.add_argument("--drain-timeout", type=float, default=90.0,
                    help="seconds after the last arrival before unfinished requests count as failed")
    ap.add_argument("--ppl-table", type=Path, default=DEFAULT_TABLE, help="`morphling eval ppl --table` output")
    ap.add_argument("--seed", type=int, default=0, help="the steady load's")
    ap.add_argument("--compare", type=Path, action="append",
                    help="a `morphling bench` results.json: replay its windows at its rate scale and report how far "
                         "each prediction is from what it measured; given again, another run of the same bench "
                         "command: the prediction is set against each, and the runs against one another")
    ap.add_argument("--compare-steps", type=Path,
                    help="instead, a `morphling bench-engine --device cuda` JSON: the fleet's predicted decode steps "
                         "against the ones it measured (written to steps.json in --out)")
    ap.add_argument("--compare-tp", type=Path,
                    help="instead, a `morphling bench-amoebas` JSON: the fleet's predicted steps alone and merged TP2 "
                         "against the ones it measured (written to tp_steps.json in --out)")
    ap.add_argument("--single-steps", action="store_true",
                    help="the scheduler schedules every step alone, no decode runs or decode batches (the same "
                         "results, slower: to compare)")
    ap.add_argument("--shards", type=int, default=1,
                    help="play a window's models in this many processes side by side, one per core (shards.py: "
                         "the same results); one window only, as a rest between two is the whole fleet's")
    ap.add_argument("--out", type=Path, default=Path("simulate-results"))
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in SIMULATED for m in args.modes) or len(set(args.modes)) != len(args.modes):
        ap.error(f"--modes takes each of {', '.join(SIMULATED)} at most once; got {','.join(args.modes) or 'nothing'}")
    args.modes.sort(key=lambda m: m != "fp16")
    if args.compare_steps is not None:
        try:
            args.measured_steps = json.loads(args.compare_steps.read_text())
            rows = args.measured_steps["decode"]["rows"]
            if not rows or any(not {"batch", "kv_tokens_mean", "ours_step_ms"} <= set(row) for row in rows):
                raise ValueError("no decode rows of batch, kv_tokens_mean and ours_step_ms")
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--compare-steps {args.compare_steps}: not a `morphling bench-engine --device cuda` result "
                     f"with decode rows ({e})")
    if args.compare_tp is not None:
        try:
            args.measured_tp = json.loads(args.compare_tp.read_text())
            if not ({"requests", "prompt_tokens", "steps"} <= set(args.measured_tp["config"])
                    and {"alone", "merged", "after"} <= set(args.measured_tp["summary"]["step_ms"])):
                raise ValueError("no config of requests, prompt_tokens and steps, or no step_ms alone, merged, after")
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--compare-tp {args.compare_tp}: not a `morphling bench-amoebas` result ({e})")
    if args.compare is not None:
        args.measured = [read_measured(ap, path) for path in args.compare]
        first = args.measured[0]
        for path, run in zip(args.compare[1:], args.measured[1:]):
            if not same_command(first, run):
                ap.error(f"--compare {path}: not a run of the same bench command as {args.compare[0]} (its windows "
                         f"or rate scale differ)")
        args.rate_scale = args.rate_scale or first["capacity"]["rate_scale"]
    if args.rate_scale is None and "fp16" not in args.modes:
        ap.error("the load is scaled to fp16's capacity: add fp16 to --modes, or give --rate-scale")
    for name in ("window_s", "load", "probe_s", "probe_start", "len_scale", "slo_ttft", "slo_tpot",
                 "telemetry_interval", "poll_s", "drain_timeout"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.rate_scale is not None and args.rate_scale <= 0:
        ap.error("--rate-scale must be positive")
    if args.copies < 1:
        ap.error("--copies must be at least 1")
    check_sweep_arguments(ap, args)
    if args.sweep and (args.compare is not None or args.shards > 1):
        ap.error("--sweep takes neither --compare nor --shards")
    if args.shards < 1:
        ap.error("--shards must be at least 1")
    if args.shards > 1 and args.busy + args.ordinary != 1:
        ap.error("--shards plays one window: give --busy and --ordinary that sum to 1")
    if args.shards > 1 and args.rate_scale is None:
        ap.error("--shards plays the trace at a given rate: add --rate-scale (capacity probes run in one process)")
    if min(args.rest_s, args.settle_timeout) < 0:
        ap.error("--rest-s and --settle-timeout must not be negative")
    return args


def superposed(arrivals: list[TraceRequest], copies: int) -> list[TraceRequest]:
    """`copies` copies of a window's requests, copy i shifted by i/copies of the window's mean gap between
    arrivals: the volume grows `copies` times and every burst of the trace stays where it was."""
    if copies == 1 or not arrivals:
        return arrivals
    span = arrivals[-1].arrival_s - arrivals[0].arrival_s
    gap = span / max(1, len(arrivals) - 1)
    out = [replace(r, arrival_s=r.arrival_s + i * gap / copies) for i in range(copies) for r in arrivals]
    return sorted(out, key=lambda r: r.arrival_s)


def settings_for(mode: str, args) -> SimSettings:
    """The controller and monitor `morphling up` would run for `mode` (bench/modes.py's table)."""
    m = MODES[mode]
    controller = ControllerConfig(levers=m.levers, morph_mode=args.morph_mode if "quantize" in m.levers else "off",
                                  cocoserve_mode="default" if "replicate" in m.levers else "off",
                                  amoebas="tp" in m.levers)
    monitor = MonitorConfig(slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
    return SimSettings(controller, monitor, m.static_bits, args.telemetry_interval, args.monitor_state_s,
                       sample_interval_s=args.poll_s, drain_s=args.drain_timeout, spare=m.spare,
                       decode_runs=not args.single_steps)


def timed(simulation: Simulation, arrivals, label: str, every_s: float = 30.0) -> tuple[SimRun, float]:
    """The window played, and its wall time; a window longer than `every_s` of wall time says how far it has got
    every `every_s`."""
    began = time.perf_counter()
    last = (began, 0.0)

    def progress(simulated_s: float) -> None:
        nonlocal last
        if (now := time.perf_counter()) - last[0] >= every_s:
            recent = (simulated_s - last[1]) / max(now - last[0], 1e-9)
            last = (now, simulated_s)
            print(f"  {label}: {simulated_s:.0f} s simulated in {now - began:.0f} s "
                  f"({simulated_s / max(now - began, 1e-9):.2f}x real time; {recent:.2f}x since the last line)",
                  file=sys.stderr, flush=True)

    played = simulation.run(arrivals, progress)
    return played, time.perf_counter() - began


def records(played: SimRun) -> list[RequestRecord]:
    """The client's view of each simulated request, as the bench's client records it: times from the window's
    start."""
    out, origin = [], played.origin
    for i, r in enumerate(played.requests):
        chunks = [t - origin for t in (r.first_token_s, r.last_token_s if r.tokens > 1 else None) if t is not None]
        out.append(RequestRecord(i, r.arrival_s - origin, r.prompt_tokens, r.output_tokens,
                                 sent_s=r.arrival_s - origin, chunk_s=chunks, completion_tokens=r.tokens,
                                 done_s=None if r.done_s is None else r.done_s - origin, error=r.error))
    return out


def precision_share(requests: list[SimRequest]) -> dict[tuple[int, int], float]:
    """Share of the generated tokens at each (INT8 layers, INT4 layers) mix, counted token by token."""
    counts: dict[tuple[int, int], int] = {}
    for r in requests:
        for mix, n in r.token_bits.items():
            counts[mix] = counts.get(mix, 0) + n
    total = sum(counts.values())
    return {mix: n / total for mix, n in sorted(counts.items())} if total else {}


def table_name(models: list[str]) -> str:
    """The model a perplexity table names (`morphling eval ppl`'s): "default" for the default model; several
    models have no one table."""
    return "+".join("default" if name == DEFAULT_MODEL else name for name in models)


def by_model(played: SimRun, replay: argparse.Namespace, fleet: Fleet, args, table) -> dict[str, dict]:
    """A fleet of several models: each model's own summary, over the requests that asked for it and the samples
    of the executors serving it, with the precision its tokens were generated at."""
    serves = {s.id: s.shape.name for s in fleet.executors}
    out = {}
    for name in fleet.models:
        mine = [i for i, r in enumerate(played.requests) if r.model == name]
        samples = [ClusterSample(s.time_s, [e for e in s.executors if serves[e["id"]] == name])
                   for s in replay.samples]
        summary = summarize([replay.records[i] for i in mine], samples, args.slo_ttft)
        del summary["timeline"]
        share = precision_share([played.requests[i] for i in mine])
        out[name] = summary | {"precision": quality(share, table, table_name([name]))}
    return out


def window_report(played: SimRun, wall_s: float, args, table, fleet: Fleet, rest: dict | None = None,
                  setup_s: float = 0.0) -> dict:
    """The bench's window result, and the simulation's own figures; `wall_s` counts `setup_s`."""
    replay = argparse.Namespace(records=records(played), elapsed_s=played.elapsed_s,
                                samples=[ClusterSample(t, executors) for t, executors in played.samples])
    named = table_name(list(fleet.models))
    result = window_result(replay, actions(played.events, played.origin), reaction(played.events, played.origin),
                           args.slo_ttft, table, named, rest, args.slo_tpot)
    result["precision"] = quality(precision_share(played.requests), table, named)
    if len(fleet.models) > 1:
        result["models"] = by_model(played, replay, fleet, args, table)
        for record, request in zip(result["requests"], played.requests):
            record["model"] = request.model
    result["quality"] = {"ppl_token_weighted": result["precision"]["ppl_token_weighted"],
                         "full_precision_token_share": result["precision"]["full_precision_token_share"]}
    tokens = sum(r.tokens for r in played.requests)
    result["simulation"] = {
        "simulated_s": played.elapsed_s, "wall_s": wall_s,
        # What the simulator's speed follows: a token generated costs about the same wall time whatever the fleet,
        # so a fleet runs in real time while it generates fewer tokens a second than this says the CPU simulates.
        "generated_tokens": tokens,
        "loop_wall_us_per_token": 1e6 * (wall_s - setup_s) / tokens if tokens else None,
        "simulated_s_per_wall_s": played.elapsed_s / wall_s if wall_s > 0 else None,
        "setup_s": setup_s,
        "loop_simulated_s_per_wall_s": played.elapsed_s / (wall_s - setup_s) if wall_s > setup_s else None,
        "decisions": played.decisions,
        "decisions_per_min": 60 * played.decisions / played.elapsed_s if played.elapsed_s > 0 else 0.0,
        "controller_ms_per_decision": 1e3 * played.plan_seconds / played.decisions if played.decisions else None}
    return result


def measure_capacity(fleet, rows, args) -> dict:
    def measure(rate: float) -> Probe:
        load = steady_load(rows, rate, args.probe_s, args.len_scale, args.max_len, args.seed)
        played, _ = timed(Simulation(fleet, settings_for("fp16", args)), load, f"capacity probe at {rate:.2f} req/s")
        ttfts = [r.first_token_s - r.arrival_s for r in played.requests if r.first_token_s is not None]
        return Probe(rate, percentile(ttfts, 95), sum(r.error is not None for r in played.requests), len(load))

    capacity, probes = search(measure, args.probe_start, args.slo_ttft)
    return {"capacity_rps": capacity, "probe_s": args.probe_s, "slo_ttft_s": args.slo_ttft,
            "probes": [vars(p) | {"meets_slo": p.meets(args.slo_ttft)} for p in probes]}


def compare_steps(fleet: Fleet, args: argparse.Namespace) -> int:
    spec = fleet.executors[0]
    steps = decode_steps(spec, spec.shape.num_layers, args.measured_steps)
    print_decode_steps(steps, spec, args.measured_steps)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"steps": steps, "measured": str(args.compare_steps), "device": spec.device.name,
              "latency": spec.latency.source, **provenance(args, skip=("measured_steps",))}
    (args.out / "steps.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.out / 'steps.json'}")
    return 0


def compare_tp(fleet: Fleet, args: argparse.Namespace) -> int:
    rows = tp_steps(fleet, args.measured_tp)
    print_tp_steps(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"steps": rows, "measured": str(args.compare_tp), **provenance(args, skip=("measured_tp",))}
    (args.out / "tp_steps.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.out / 'tp_steps.json'}")
    return 0


def read_measured(ap: argparse.ArgumentParser, path: Path) -> dict:
    try:
        run = json.loads(path.read_text())
        if not isinstance(run["capacity"]["rate_scale"], (int, float)) or not run["modes"] or not run["windows"]:
            raise ValueError("no rate scale, modes or windows")
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--compare {path}: not a `morphling bench` results.json ({e})")
    return run


def same_command(first: dict, run: dict) -> bool:
    """Whether `run` replayed the windows of `first` at its rate scale, to 1% (a scale given by hand: rounded)."""
    names = [w["name"] for w in first["windows"]]
    scale = first["capacity"]["rate_scale"]
    return [w["name"] for w in run["windows"]] == names and abs(run["capacity"]["rate_scale"] - scale) <= 0.01 * scale


def check_modes(fleet: Fleet, modes: list[str]) -> None:
    """FleetError for a mode the fleet's executors cannot start in: CoCoServe's pairs of executors serving alone,
    on a fleet that starts every executor in a TP instance (where some serve alone, they pair)."""
    cannot = [m for m in modes if MODES[m].spare] if all(s.tp > 1 for s in fleet.executors) else []
    if cannot:
        raise FleetError(f"{', '.join(cannot)} cannot run on a fleet started in TP{fleet.tp} instances: CoCoServe "
                         f"starts from pairs of executors serving alone")


def play_mode(fleet: Fleet, mode: str, windows, rows, rate_scale: float, args, table) -> dict[str, dict]:
    """Every window of `mode` on one cluster, in turn, with the bench's rest between two: each window's result."""
    if args.shards > 1:
        return {windows[0].name: play_shards(fleet, mode, windows[0], rows, rate_scale, args, table)}
    results, rest = {}, None
    began = time.perf_counter()
    simulation = Simulation(fleet, settings_for(mode, args))
    setup_s = time.perf_counter() - began
    for i, w in enumerate(windows):
        if i:
            waited, settled = simulation.rest(args.rest_s, args.settle_timeout)
            rest = {"waited_s": round(waited, 1), "started_at_rest": settled}
        arrivals = superposed(requests_in(rows, w, rate_scale, args.len_scale, args.max_len, args.burstiness,
                                          args.seed), args.copies)
        played, loop_s = timed(simulation, arrivals, f"{mode} {w.name}")
        built_s = setup_s if i == 0 else 0.0
        wall_s = loop_s + built_s
        results[w.name] = window_report(played, wall_s, args, table, fleet, rest, built_s)
        per_token = results[w.name]["simulation"]["loop_wall_us_per_token"]
        print(f"  {mode} {w.name}: {len(arrivals)} requests, {played.elapsed_s:.0f} s simulated in {wall_s:.1f} s"
              + (f" (building the cluster {built_s:.1f} s of it)" if built_s else "")
              + (f" after a rest of {rest['waited_s']:.0f} s" if rest else "")
              + (f", {per_token:.1f} us a generated token" if per_token else ""), file=sys.stderr)
    del simulation
    gc.collect()  # the mode's cluster: its instances and merge room hold cycles
    return results


def play_shards(fleet: Fleet, mode: str, window, rows, rate_scale: float, args, table) -> dict:
    """`mode` on one window, its models played in `args.shards` processes side by side: the window's result, its
    wall time counting the shards' set-up and putting their runs together."""
    settings = settings_for(mode, args)
    groups = deal(fleet, args.shards, settings)
    arrivals = superposed(requests_in(rows, window, rate_scale, args.len_scale, args.max_len, args.burstiness,
                                      args.seed), args.copies)
    began = time.perf_counter()
    played = play_sharded(fleet, settings, groups, arrivals,
                          lambda simulation, mine, label: timed(simulation, mine, f"{mode} {window.name} {label}")[0])
    wall_s = time.perf_counter() - began
    print(f"  {mode} {window.name}: {len(arrivals)} requests in {len(groups)} shards, {played.elapsed_s:.0f} s "
          f"simulated in {wall_s:.1f} s ({played.elapsed_s / wall_s:.2f}x real time)", file=sys.stderr)
    return window_report(played, wall_s, args, table, fleet)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        fleet = read_fleet(args.fleet)
        if args.compare_steps is not None:
            return compare_steps(fleet, args)
        if args.compare_tp is not None:
            return compare_tp(fleet, args)
        check_modes(fleet, args.modes)
        deal(fleet, args.shards, settings_for(args.modes[0], args))
        rows = read_rows(args.trace)
        windows = pick_windows(rows, args.window_s, args.busy, args.ordinary)
    except (FleetError, TraceError) as e:
        print(f"morphling simulate: {e}", file=sys.stderr)
        return 2
    table = PerplexityTable.load(args.ppl_table)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"morphling simulate: {len(fleet.executors)} executors of {' and '.join(fleet.models)}; modes "
          f"{', '.join(args.modes)}; windows " + ", ".join(w.name for w in windows), file=sys.stderr)
    if args.rate_scale is None:
        capacity = measure_capacity(fleet, rows, args)
        ordinary = median_rate(rows, args.window_s)
        capacity |= {"given": False, "ordinary_rps": ordinary,
                     "rate_scale": rate_scale_for(capacity["capacity_rps"], ordinary, args.load)}
        print(f"capacity of fp16 at steady load: {capacity['capacity_rps']:.2f} req/s; trace played at "
              f"x{capacity['rate_scale']:.3f}")
    else:
        capacity = {"given": True, "rate_scale": args.rate_scale}
    base, sweeps = capacity["rate_scale"], {}
    with no_cycle_collection():  # collected once a mode: between windows it rescanned every arena's lists
        for mode in args.modes if args.sweep else ():
            sweeps[mode] = sweep(lambda rate, mode=mode: play_mode(fleet, mode, windows, rows, rate, args, table),
                                 base, args.slo_ttft, args.sweep_points, mode)
        results = ({mode: sw.played[base] for mode, sw in sweeps.items()} if args.sweep else
                   {mode: play_mode(fleet, mode, windows, rows, base, args, table) for mode in args.modes})
    modes = {mode: mode_summary(ws) | model_summaries(ws) for mode, ws in results.items()}
    for mode, sw in sweeps.items():
        modes[mode] |= sweep_keys(sw, None, sweeps.get("fp16"))
    if args.sweep:
        plot_goodput(modes, args.slo_ttft, args.out / "goodput_sweep.png")
    for mode, ws in results.items():
        for name, result in ws.items():
            plot_timeline(f"{mode} {name}", result, args.slo_ttft, args.out / f"timeline_{mode}_{name}.png")
    plot_ttft_cdf({m: {"requests": [r for w in ws.values() for r in w["requests"]]} for m, ws in results.items()},
                  args.slo_ttft, args.out / "ttft_cdf.png")
    if len(fleet.models) > 1:
        for model in fleet.models:
            plot_ttft_cdf({m: {"requests": [r for w in ws.values() for r in w["requests"] if r["model"] == model]}
                           for m, ws in results.items()}, args.slo_ttft, args.out / f"ttft_cdf_{model}.png")
    compared = comparison(modes)
    report = {"modes": modes, "comparison": compared, "capacity": capacity, "simulated": True,
              "fleet": {"models": list(fleet.models), "traffic": fleet.traffic, "executors": [
                  {"id": s.id, "device": s.device.name, "model": s.shape.name, "tp": s.tp, "memory": s.memory,
                   "latency": s.latency.source} for s in fleet.executors]},
              "windows": [vars(w) | {"name": w.name} for w in windows], **provenance(args, skip=("measured",))}
    if args.compare is not None:
        report["fidelity"] = fidelity(report, args.compare, args.measured)
    (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    print_table(modes, compared)
    print_models(modes)
    if args.sweep:
        print_sweep(modes)
    if args.compare is not None:
        print_fidelity(report["fidelity"]["modes"])
        if len(args.measured) > 1:
            print_errors(f"the same against each of the {len(args.measured)} measured runs, mean |error|:",
                         report["fidelity"]["against_each"])
            print_errors("the measured runs against one another (the machine's own repeat), mean |error|:",
                         report["fidelity"]["repeatability"])
    print(f"wrote {args.out / 'results.json'}, {args.out / 'ttft_cdf.png'} (and one per model of several) and a "
          f"timeline per mode and window")
    return 0
