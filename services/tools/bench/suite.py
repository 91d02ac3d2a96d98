"""One `morphling bench` run: the baseline's capacity, then every mode over the same trace windows.

1. Capacity. The full-precision system (mode fp16) is driven at steady Poisson load with the trace's length
   mix (capacity.py), rate by rate, until the rate at which its P95 TTFT crosses the SLO is bracketed; the
   trace is then played at the rate scale that puts its median (ordinary) rate at that capacity, so its
   bursts go above it as far as the trace's own bursts go above its median (windows.rate_scale_for).
2. Windows. The k busiest and k most ordinary windows of the trace by arrival count (windows.pick_windows):
   no window is picked by hand, and a reader can recompute the pick from the trace.
3. Modes. One system per mode (modes.py), started as `morphling up` starts it and measured once every one of
   its executors serves (`up` is ready at the first); every window is replayed
   against it in turn, open loop, with the same requests and prompts in every mode. Between two windows the
   bench rests `rest_s`, then waits (up to `settle_timeout`) until every pressure action is undone (the
   starting bits, batch caps, members and TP degree; replicas on idle capacity may stay, as they are
   CoCoServe's rest) and the cluster has stopped changing: every window starts at rest, and a result says how
   long that took and whether it got there.

Each (mode, window) gives the metrics of metrics.summarize, the controller's actions and its reaction time
from the event stream (events.py), and the tokens served, which report.py compares with fp16's.
"""

import asyncio
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import httpx

from services.tools.bench import events as bench_events
from services.tools.bench.capacity import Probe, search, steady_load
from services.tools.bench.client import ClusterSample, RequestRecord, replay, served_model, tokenize
from services.tools.bench.metrics import percentile, timeline
from services.tools.bench.modes import MODES, executors_for, up_args
from services.tools.bench.prompts import PromptPool
from services.tools.bench.quality import PerplexityTable
from services.tools.bench.report import window_result
from services.tools.bench.rest import at_rest, shape
from services.tools.bench.sweep import Sweep, sweep
from services.tools.bench.system import Endpoints, started
from services.tools.bench.trace import TraceRequest, TraceRow
from services.tools.bench.windows import Window, median_rate, rate_scale_for, requests_in
from shared.net import free_port


@dataclass
class Replay:
    records: list[RequestRecord]
    samples: list[ClusterSample]
    elapsed_s: float
    wall_t0: float  # epoch seconds at the replay's start: the event stream's clock


def up_command(args, mode: str, port: int, log_dir) -> list[str]:
    return [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--model", args.model,
            "--device", args.device, "--max-model-len", str(args.max_len), "--log-dir", str(log_dir),
            # The system judges its SLOs as the bench does: CoCoServe scales down on what is scored.
            "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot),
            "--timeout", str(args.startup_timeout),
            *up_args(MODES[mode], args.executors, args.memory_budget, args.morph_mode, args.model, args.out / "plans"),
            *(f"--morph-set={kv}" for kv in args.morph_set if MODES[mode].levers)]


def play(url: str, model: str, requests: list[TraceRequest], prompts: list[list[int]], args, label: str) -> Replay:
    from tqdm import tqdm

    with tqdm(total=len(requests), desc=f"{label:>22}", unit="req", dynamic_ncols=True, file=sys.stderr) as bar:
        def sampled(sample: ClusterSample) -> None:
            line = timeline([sample])
            if line:
                bar.set_postfix_str(f"KV {line['kv_used_tokens'][0]}/{line['kv_capacity_tokens'][0]}, INT8 "
                                    f"{line['int8_layers'][0]} INT4 {line['int4_layers'][0]}, waiting "
                                    f"{line['waiting'][0]}", refresh=False)

        wall_t0 = time.time()
        records, samples, elapsed = asyncio.run(replay(url, model, requests, prompts, args.drain_timeout,
                                                       args.api_key, lambda _: bar.update(1), sampled))
    return Replay(records, samples, elapsed, wall_t0)


def measure_capacity(url: str, model: str, pool: PromptPool, rows: list[TraceRow], args) -> dict:
    """The fp16 system's capacity: the steady rate at which its P95 TTFT crosses the SLO."""
    def measure(rate: float) -> Probe:
        load = steady_load(rows, rate, args.probe_s, args.len_scale, args.max_len, args.seed)
        played = play(url, model, load, [pool.take(r.prompt_tokens) for r in load], args, f"capacity {rate:.2f}/s")
        time.sleep(args.rest_s)
        ttfts = [r.ttft_s for r in played.records if r.ttft_s is not None]
        return Probe(rate, percentile(ttfts, 95), sum(not r.ok for r in played.records), len(played.records))

    capacity, probes = search(measure, args.probe_start, args.slo_ttft)
    return {"capacity_rps": capacity, "probe_s": args.probe_s, "slo_ttft_s": args.slo_ttft,
            "probes": [vars(p) | {"meets_slo": p.meets(args.slo_ttft)} for p in probes]}


def auth_headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


@contextmanager
def system_for(mode: str, args) -> Iterator[Endpoints]:
    """The system to bench `mode` on: --url's, or a `morphling up` started for it and stopped after."""
    if args.url:
        yield Endpoints(args.url.rstrip("/"), None)
        return
    log_dir = args.out / "logs" / mode
    with started(up_command(args, mode, free_port(), log_dir), log_dir, args.startup_timeout, mode) as system:
        # `up` is ready once one executor serves; a measurement starts once all of them do, and hold still.
        expected = executors_for(MODES[mode], args.executors)
        waited, cluster = wait_for(system.url, auth_headers(args), lambda c: alive(c) >= expected, 0.0,
                                   args.startup_timeout)
        if cluster is None:
            raise RuntimeError(f"{mode}: {expected} executors did not all come up within {waited:.0f} s; "
                               f"see {log_dir}")
        yield system


@dataclass
class ModeRun:
    """What one mode's system played: each window's Replay and report.window_result at every rate multiplier, the
    first of them `base`, the multiplier every mode plays; with --sweep, the SLO capacity that was found."""
    base: float
    replays: dict[float, dict[str, Replay]]
    results: dict[float, dict[str, dict]]
    sweep: Sweep | None = None


def run(args, rows: list[TraceRow], windows: list[Window], texts: list[str], table: PerplexityTable | None
        ) -> tuple[dict, dict, dict[str, ModeRun]]:
    """(capacity, the requests of each window at the base multiplier, what each mode played)."""
    headers = auth_headers(args)
    capacity: dict = {"rate_scale": args.rate_scale, "given": args.rate_scale is not None}
    workload: dict[str, tuple[list[TraceRequest], list[list[int]]]] = {}
    runs: dict[str, ModeRun] = {}
    for mode in args.modes:
        with system_for(mode, args) as system, httpx.Client(headers=headers, timeout=30) as client:
            model = served_model(client, system.url)
            if not workload:  # the first system tokenizes every prompt, for every mode alike
                pool = PromptPool(texts, lambda text: tokenize(client, system.url, model, text), args.seed)
                if args.rate_scale is None:
                    capacity |= measure_capacity(system.url, model, pool, rows, args)
                    capacity["rate_scale"] = rate_scale_for(capacity["capacity_rps"], median_rate(rows, args.window_s),
                                                            args.load)
                capacity["ordinary_rps"] = median_rate(rows, args.window_s)
                for w in windows:
                    reqs = requests_in(rows, w, capacity["rate_scale"], args.len_scale, args.max_len,
                                       args.burstiness, args.seed)
                    workload[w.name] = (reqs, [pool.take(r.prompt_tokens) for r in reqs])
            runs[mode] = play_mode(system, model, windows, workload, capacity["rate_scale"], args, mode, table)
    return capacity, workload, runs


def play_mode(system: Endpoints, model: str, windows: list[Window], workload: dict, base: float, args, mode: str,
              table: PerplexityTable | None) -> ModeRun:
    """Every window at the base multiplier, then, with --sweep, at the multipliers the sweep asks for; every pass
    after the first starts at rest, as every window after the first does."""
    played = ModeRun(base, {}, {})
    start = cluster_at_rest(system.url, auth_headers(args), mode)

    def at(rate_scale: float) -> dict[str, dict]:
        requests = {name: ([replace(r, arrival_s=r.arrival_s * base / rate_scale) for r in reqs], prompts)
                    for name, (reqs, prompts) in workload.items()}
        raw = run_windows(system, model, windows, requests, args, f"{mode} x{rate_scale:.3g}" if args.sweep else mode,
                          start, rested_first=bool(played.replays))
        played.replays[rate_scale] = {name: w["replay"] for name, w in raw.items()}
        played.results[rate_scale] = {
            name: window_result(w["replay"], w["actions"], w["reaction"], args.slo_ttft, table, args.model, w["rest"],
                                args.slo_tpot) for name, w in raw.items()}
        return played.results[rate_scale]

    if args.sweep:
        played.sweep = sweep(at, base, args.slo_ttft, args.sweep_points, mode)
    else:
        at(base)
    return played


def cluster_at_rest(url: str, headers: dict, mode: str) -> dict | None:
    """The cluster's rest as the replays start (rest.at_rest), or None for a server without `/v1/cluster` (any
    OpenAI-compatible one): the rest rule is then skipped, and the bench says so."""
    with httpx.Client(headers=headers, timeout=30) as client:
        response = client.get(f"{url}/v1/cluster")
    if response.status_code == 404:
        print(f"morphling bench: {mode}: {url} has no /v1/cluster, so the rest rule is skipped (a plain pause of "
              f"--rest-s between two windows) and no cluster timeline or controller actions are recorded",
              file=sys.stderr)
        return None
    if response.status_code != 200:  # an admin key missing, say: said, not a traceback
        raise RuntimeError(f"{mode}: GET {url}/v1/cluster answered {response.status_code}: {response.text[:200]} "
                           f"(give --api-key an admin key)")
    return at_rest(response.json())


def wait_for(url: str, headers: dict, wanted: Callable[[dict], bool], rest_s: float, timeout_s: float,
             still_s: float = 3.0) -> tuple[float, dict | None]:
    """Rest `rest_s`, then wait (up to `timeout_s` more) until GET /v1/cluster is `wanted` and its whole shape has
    not changed for `still_s`, so that nothing is mid-move. Returns (seconds waited, that cluster, or None)."""
    began = time.monotonic()
    time.sleep(rest_s)
    last, since = None, time.monotonic()
    with httpx.Client(headers=headers, timeout=10) as client:
        while True:
            try:
                cluster = client.get(f"{url}/v1/cluster").json()
                now = shape(cluster)
                if now != last:
                    last, since = now, time.monotonic()
                elif wanted(cluster) and time.monotonic() - since >= still_s:
                    return time.monotonic() - began, cluster
            except (httpx.HTTPError, ValueError, KeyError):
                pass  # an answer missed under load: ask again
            if time.monotonic() - began > rest_s + timeout_s:
                return time.monotonic() - began, None
            time.sleep(1.0)


def settle(url: str, headers: dict, start: dict, rest_s: float, timeout_s: float, still_s: float = 3.0
           ) -> tuple[float, bool]:
    """Rest, then wait until the cluster is `start` again by `at_rest`, and still: every window starts rested.
    Returns (seconds waited, whether it got there)."""
    waited, cluster = wait_for(url, headers, lambda c: at_rest(c) == start, rest_s, timeout_s, still_s)
    return waited, cluster is not None


def alive(cluster: dict) -> int:
    return sum(1 for e in cluster["executors"] if e["alive"])


def run_windows(system: Endpoints, model: str, windows: list[Window], workload: dict, args, label: str,
                start: dict | None, rested_first: bool) -> dict:
    """Each window replayed in turn, after a rest back to `start` (the first only if `rested_first`); for a peer
    without `/v1/cluster` (`start` None) the rest is a plain pause."""
    out, rested = {}, {}
    started_at = time.time()
    headers = auth_headers(args)
    for i, w in enumerate(windows):
        if i or rested_first:
            if start is None:
                time.sleep(args.rest_s)
                rested[w.name] = (args.rest_s, None)
            else:
                rested[w.name] = settle(system.url, headers, start, args.rest_s, args.settle_timeout)
                if not rested[w.name][1]:
                    print(f"morphling bench: {label}: not back at rest {rested[w.name][0]:.0f} s after the last "
                          f"replay; {w.name} starts from where it is", file=sys.stderr)
        requests, prompts = workload[w.name]
        out[w.name] = play(system.url, model, requests, prompts, args, f"{label} {w.name}")
    stream = bench_events.read_events(system.nats_url, started_at - 1.0)
    for w in windows:
        played = out[w.name]
        end = played.wall_t0 + played.elapsed_s
        mine = [e for e in stream if played.wall_t0 - 1.0 <= e.time <= end]
        waited, settled = rested.get(w.name, (0.0, True if start is not None else None))
        out[w.name] = {"replay": played, "actions": bench_events.actions(mine, played.wall_t0),
                       "reaction": bench_events.reaction(mine, played.wall_t0),
                       "rest": {"waited_s": round(waited, 1), "started_at_rest": settled}}
    return out
