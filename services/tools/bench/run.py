"""`morphling bench`: replay bursty trace windows against the whole system, once per mode, at the baseline's
measured capacity, and compare the modes on latency, SLO violations and the quality of the tokens served.

Nothing in a run is picked by hand (suite.py has the rules): the memory is `morphling up`'s default budget
per executor, the same in total for every mode; the load is scaled to the full-precision system's capacity,
measured first at steady load; the windows are the trace's k busiest and k most ordinary by arrival count;
every mode replays every window; quality is measured on the tokens each mode served. The modes (modes.py):

    fp16 int8 int4     full precision, and every layer at 8 or 4 bits, fixed: nothing morphs
    morph              MorphServe's lever alone: quantize under pressure, restore after
    cocoserve          CoCoServe's alone: replicate onto an idle executor, migrate, evict, cut the batch
    amoebas            AMOEBAs' alone: merge executors into a TP instance for a request none holds, split after
    ladder             every lever on one event stream, the controller `morphling up` runs by default

It prints the capacity measurement, then one table (each mode's mean over the windows, with the range), and
writes `results.json`, a TTFT CDF and a timeline per mode and window (the controller's actions marked) into
`--out`. With `--url` it drives a server that is already running instead, as the one mode given, by any name: a
Morphling gateway, or any OpenAI-compatible server (vLLM, say), for which the rest rule and the cluster timeline are
skipped, since it has no `/v1/cluster`.

`--sweep` finds each mode's SLO capacity (sweep.py): the highest rate multiplier of the windows at which P95 TTFT
stays within the SLO with no failure, its goodput against rate as `goodput_sweep.png`, and its quality at that
point. `--burstiness B` replaces the trace's arrival times with Gamma-distributed ones of shape B at each window's
own rate (`vllm bench serve`'s). `--regime memory-bound` (regimes.py) sets the arena and the lengths where
MorphServe's premise holds: weights most of each executor's memory, longer requests.
"""

import argparse
import json
import sys
from pathlib import Path

from services.tools.bench import suite, sweep
from services.tools.bench.agreement import agreement
from services.tools.bench.modes import MODES, ModeError, executors_for
from services.tools.bench.plots import plot_goodput, plot_timeline, plot_ttft_cdf
from services.tools.bench.prompts import read_texts
from services.tools.bench.quality import DEFAULT_TABLE, PerplexityTable
from services.tools.bench.regimes import REGIMES, RegimeError, apply_regime
from services.tools.bench.report import add_quality, comparison, mode_summary, print_sweep, print_table
from services.tools.bench.trace import TraceError, read_rows
from services.tools.bench.windows import pick_windows
from shared.config import data_dir, parse_size
from shared.provenance import provenance

DEFAULT_TRACE = data_dir() / "traces" / "AzureLLMInferenceTrace_conv.first30min.csv"
SUITES = {"full": ",".join(MODES), "quick": "fp16,morph,ladder"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="morphling bench", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="an Azure or BurstGPT CSV")
    ap.add_argument("--suite", choices=SUITES, default="full",
                    help=f"the modes: full ({SUITES['full']}) or quick ({SUITES['quick']}); --modes overrides")
    ap.add_argument("--modes", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--window-s", type=float, default=20.0, help="length of each window, trace seconds")
    ap.add_argument("--busy", type=int, default=2, help="the k busiest windows of the trace (default %(default)s)")
    ap.add_argument("--ordinary", type=int, default=2, help="the k windows closest to the median (default %(default)s)")
    ap.add_argument("--load", type=float, default=1.0,
                    help="the trace's median rate as a multiple of the measured capacity (default %(default)s)")
    ap.add_argument("--rate-scale", type=float,
                    help="play the trace at this rate multiplier instead of measuring the capacity")
    ap.add_argument("--probe-s", type=float, default=30.0, help="seconds of steady load per capacity probe")
    ap.add_argument("--probe-start", type=float, default=0.5, help="the first capacity probe's rate, req/s")
    ap.add_argument("--regime", choices=REGIMES, default="default",
                    help="memory-bound: each executor's arena and the request lengths where weights fill most of "
                         "the memory (regimes.py); explicit --memory-budget, --len-scale, --max-len win")
    ap.add_argument("--len-scale", type=float, help="token count multiplier (default: the regime's, 0.1)")
    ap.add_argument("--max-len", type=int,
                    help="cap on prompt + output tokens of one request, and the system's --max-model-len "
                         "(default: the regime's, 512)")
    sweep.add_arguments(ap)
    ap.add_argument("--executors", type=int, default=2,
                    help="executors per mode; cocoserve and amoebas take at least two (default %(default)s)")
    ap.add_argument("--memory-budget",
                    help="each executor's arena, times --executors: every mode's total (default: the regime's; "
                         "`morphling up`'s for the default regime)")
    ap.add_argument("--morph-mode", default="accuracy", choices=("accuracy", "default", "performance"),
                    help="the controller's preset where a mode moves anything (default %(default)s)")
    ap.add_argument("--morph-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one setting of that preset, as `morphling up --morph-set` (repeatable)")
    ap.add_argument("--slo-ttft", type=float, default=2.0,
                    help="TTFT SLO in seconds: the table's violations, and the system's (default %(default)s)")
    ap.add_argument("--slo-tpot", type=float, default=0.5,
                    help="the system's TPOT SLO, which CoCoServe's scale-down reads with the TTFT one; the table "
                         "counts TTFT and failures only (default %(default)s)")
    ap.add_argument("--rest-s", type=float, default=10.0, help="seconds of rest between two replays on one system")
    ap.add_argument("--settle-timeout", type=float, default=180.0,
                    help="seconds more to wait, after the rest, for the system to be back at rest "
                         "(default %(default)s)")
    ap.add_argument("--model", default="default", help="as for `morphling up`")
    ap.add_argument("--device", default="cpu", help="as for `morphling up`")
    ap.add_argument("--drain-timeout", type=float, default=90.0,
                    help="seconds after the last arrival before unfinished requests count as failed")
    ap.add_argument("--data", type=Path, default=data_dir(), help="the shared data folder (prompts)")
    ap.add_argument("--ppl-table", type=Path, default=DEFAULT_TABLE, help="`morphling eval ppl --table` output")
    ap.add_argument("--seed", type=int, default=0, help="the order prompts are drawn in, and the steady load's")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--url", help="bench a server that is already running (a Morphling gateway, or any "
                                  "OpenAI-compatible one) as the one mode in --modes, which it may name freely")
    ap.add_argument("--api-key", help="for --url: a key the gateway accepts (an admin key, for /v1/cluster)")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a system to become ready")
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in (args.modes or SUITES[args.suite]).split(",") if m.strip()]
    if args.url:
        if len(args.modes) != 1:
            ap.error("--url benches one running system: give exactly one name in --modes")
    else:
        unknown = [m for m in args.modes if m not in MODES]
        if unknown or not args.modes:
            ap.error(f"--modes takes {', '.join(MODES)}; got {', '.join(unknown) or 'nothing'}")
        if len(set(args.modes)) != len(args.modes):
            ap.error("--modes names a mode twice")
        if args.rate_scale is None and "fp16" not in args.modes:
            ap.error("the load is scaled to fp16's measured capacity: add fp16 to --modes, or give --rate-scale")
        args.modes.sort(key=lambda m: m != "fp16")  # fp16 first: its system measures the capacity
    try:
        apply_regime(args)
    except RegimeError as e:
        ap.error(str(e))
    sweep.check_arguments(ap, args)
    for name in ("len_scale", "slo_ttft", "slo_tpot", "drain_timeout", "window_s", "probe_s", "probe_start", "load"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.rate_scale is not None and args.rate_scale <= 0 or args.executors < 1 or min(args.rest_s,
                                                                                          args.settle_timeout) < 0:
        ap.error("--rate-scale and --executors must be positive, --rest-s and --settle-timeout not negative")
    try:
        parse_size(args.memory_budget)
        for mode in args.modes if not args.url else ():
            executors_for(MODES[mode], args.executors)
    except ValueError as e:  # ModeError among them
        ap.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rows = read_rows(args.trace)
        windows = pick_windows(rows, args.window_s, args.busy, args.ordinary)
    except TraceError as e:
        print(f"morphling bench: {e}", file=sys.stderr)
        return 2
    texts = read_texts(args.data / "prompts")
    table = PerplexityTable.load(args.ppl_table)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"morphling bench: modes {', '.join(args.modes)}; windows of {args.window_s:g} s of {args.trace.name}: "
          + ", ".join(f"{w.name} ({w.arrivals} arrivals)" for w in windows), file=sys.stderr)
    try:
        capacity, workload, runs = suite.run(args, rows, windows, texts, table)
    except (RuntimeError, ModeError, OSError) as e:
        print(f"morphling bench: {e}", file=sys.stderr)
        return 1
    if not capacity["given"]:
        print(f"capacity of {args.modes[0]} at steady load: {capacity['capacity_rps']:.2f} req/s (P95 TTFT crosses "
              f"{args.slo_ttft:g} s); trace played at x{capacity['rate_scale']:.3f}, its median "
              f"{capacity['ordinary_rps']:.2f} req/s becoming {capacity['ordinary_rps'] * capacity['rate_scale']:.2f}")

    # Today's keys are every mode at the base multiplier, which every mode played first.
    results = {mode: run.results[run.base] for mode, run in runs.items()}
    add_quality(results, {mode: run.replays[run.base] for mode, run in runs.items()})
    modes = {mode: mode_summary(windows_of) for mode, windows_of in results.items()}
    if args.sweep:
        add_sweeps(modes, runs)
        plot_goodput(modes, args.slo_ttft, args.out / "goodput_sweep.png")
    for mode, windows_of in results.items():
        for name, result in windows_of.items():
            plot_timeline(f"{mode} {name}", result, args.slo_ttft, args.out / f"timeline_{mode}_{name}.png")
    pooled = {mode: {"requests": [r for w in ws.values() for r in w["requests"]]} for mode, ws in results.items()}
    plot_ttft_cdf(pooled, args.slo_ttft, args.out / "ttft_cdf.png")

    compared = comparison(modes)
    report = {"modes": modes, "comparison": compared, "capacity": capacity,
              "windows": [vars(w) | {"name": w.name, "requests": len(workload[w.name][0])} for w in windows],
              **provenance(args, skip=("api_key",))}
    if not args.url:
        report["config"] |= {"executors_by_mode": {m: executors_for(MODES[m], args.executors) for m in args.modes}}
    (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    print_table(modes, compared)
    if args.sweep:
        print_sweep(modes)
    print(f"wrote {args.out / 'results.json'}, {args.out / 'ttft_cdf.png'}"
          + (f", {args.out / 'goodput_sweep.png'}" if args.sweep else "") + " and a timeline per mode and window")
    return 0


def add_sweeps(modes: dict[str, dict], runs: dict[str, suite.ModeRun]) -> None:
    """Each mode's `slo_capacity`, `quality_at_capacity` and `sweep` (its points), beside today's keys."""
    reference = runs.get("fp16")
    for mode, run in runs.items():
        def agreed(rate: float, fp16_rate: float, run=run) -> dict:
            served = [r for w in run.replays[rate].values() for r in w.records]
            return agreement(served, [r for w in reference.replays[fp16_rate].values() for r in w.records], "fp16")

        modes[mode] |= sweep.sweep_keys(run.sweep, agreed, reference.sweep if reference else None)
