"""`morphling bench`: replay a bursty trace against the whole system, once per precision mode.

For each mode it starts the system exactly as `morphling up` does (same model, same memory budget,
only the precision settings differ), replays the same requests with the same prompts open loop,
stops the system, and then prints one table, writes `results.json` and the plots into `--out`:

    fp16   full precision as loaded, the controller off      (`morphling up --mode off`)
    int8   every decoder layer INT8, fixed                    (`--static-bits 8`)
    int4   every decoder layer INT4, fixed                    (`--static-bits 4`)
    morph  full precision, the controller morphing under load (`--mode <--morph-mode>`)

("fp16" names the full-precision baseline whatever its dtype: float32 on the CPU, bfloat16 on CUDA.)
With `--url` it drives a gateway that is already running instead, as one mode.

The defaults make the CPU run meaningful and short (about seven minutes for the three default modes;
the reasons are in docs/benchmarks.md, "Bursty trace"): the 60 requests of a 14-second window of the
Azure conversation trace (calm, a burst of 27 arrivals in 3 seconds, calm again), played about 7x
slower with lengths at a tenth, and an arena that holds the default model's full-precision layers
plus 40 KV pages (640 tokens), so that full precision runs out of KV during the burst while
quantizing layers can several-fold it. The morph run uses the controller's accuracy mode, the mode of
MorphServe's headline comparison.
"""

import argparse
import asyncio
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from services.bench.client import ClusterSample, RequestRecord, replay, served_model, tokenize
from services.bench.metrics import precision_share, summarize, timeline
from services.bench.plots import plot_timeline, plot_ttft_cdf
from services.bench.prompts import PromptPool, read_texts
from services.bench.quality import DEFAULT_TABLE, PerplexityTable, quality
from services.bench.trace import TraceError, TraceRequest, load_trace
from shared.provenance import provenance
from shared.config import data_dir, parse_size
from shared.net import free_port

DEFAULT_TRACE = data_dir() / "traces" / "AzureLLMInferenceTrace_conv.first30min.csv"
# mode -> (controller mode, static bits); "morph" takes the controller mode from --morph-mode
MODES: dict[str, tuple[str | None, int]] = {"fp16": ("off", 16), "int8": ("off", 8), "int4": ("off", 4),
                                            "morph": (None, 16)}
TABLE_COLUMNS = (("ttft_p50", "TTFT p50", "{:.2f}"), ("ttft_p95", "p95", "{:.2f}"), ("ttft_p99", "p99", "{:.2f}"),
                 ("tpot_p50", "TPOT p50", "{:.3f}"), ("tpot_p99", "p99", "{:.3f}"), ("e2e_p95", "e2e p95", "{:.1f}"),
                 ("slo_violation_pct", "SLO viol %", "{:.1f}"), ("throughput_tok_s", "tok/s", "{:.1f}"),
                 ("goodput_req_s", "good req/s", "{:.2f}"), ("preemptions", "preempt", "{}"),
                 ("kv_capacity_peak_tokens", "KV peak", "{}"), ("failed", "failed", "{}"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="morphling bench", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="an Azure or BurstGPT CSV")
    ap.add_argument("--start", type=float, default=729.0, help="start of the window, trace seconds (default %(default)s)")
    ap.add_argument("--duration", type=float, default=14.0, help="length of the window, trace seconds (default %(default)s)")
    ap.add_argument("--rate-scale", type=float, default=0.14,
                    help="arrival rate multiplier: 0.14 plays the window about 7x slower (default %(default)s)")
    ap.add_argument("--len-scale", type=float, default=0.1, help="token count multiplier (default %(default)s)")
    ap.add_argument("--max-len", type=int, default=512,
                    help="cap on prompt + output tokens of one request, and the started system's --max-model-len")
    ap.add_argument("--modes", default="fp16,int4,morph", help="comma-separated: fp16, int8, int4, morph")
    ap.add_argument("--morph-mode", default="accuracy", choices=("accuracy", "default", "performance"),
                    help="the controller's mode in the morph run (default %(default)s)")
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO in seconds (default %(default)s)")
    ap.add_argument("--memory-budget", default="450MiB", help="each executor's page arena (default %(default)s)")
    ap.add_argument("--model", default="default", help="as for `morphling up`")
    ap.add_argument("--device", default="cpu", help="as for `morphling up`")
    ap.add_argument("--drain-timeout", type=float, default=90.0,
                    help="seconds after the last arrival before unfinished requests count as failed")
    ap.add_argument("--data", type=Path, default=data_dir(), help="the shared data folder (prompts)")
    ap.add_argument("--ppl-table", type=Path, default=DEFAULT_TABLE, help="`morphling eval ppl --table` output")
    ap.add_argument("--seed", type=int, default=0, help="the order prompts are drawn in")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--url", help="bench a gateway that is already running, as the one mode in --modes")
    ap.add_argument("--api-key", help="for --url: a key the gateway accepts (an admin key, for /v1/cluster)")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a system to become ready")
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES and not args.url]
    if unknown or not args.modes:
        ap.error(f"--modes takes {', '.join(MODES)}; got {', '.join(unknown) or 'nothing'}")
    if len(set(args.modes)) != len(args.modes):
        ap.error("--modes names a mode twice")
    if args.url and len(args.modes) != 1:
        ap.error("--url benches one running system: give exactly one name in --modes")
    for name in ("rate_scale", "len_scale", "slo_ttft", "drain_timeout", "duration"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    try:
        parse_size(args.memory_budget)
    except ValueError as e:
        ap.error(str(e))
    return args


def up_command(args: argparse.Namespace, mode: str, port: int, log_dir: Path) -> list[str]:
    controller_mode, bits = MODES[mode]
    return [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--model", args.model,
            "--device", args.device, "--memory-budget", args.memory_budget,
            "--mode", controller_mode or args.morph_mode, "--static-bits", str(bits), "--log-dir", str(log_dir),
            "--max-model-len", str(args.max_len), "--timeout", str(args.startup_timeout)]


class UpProcess:
    """One `morphling up` in a child process: started, waited for, stopped the way Ctrl-C stops it."""

    def __init__(self, cmd: list[str], log_path: Path):
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
                return line.split("ready:", 1)[1].split()[0]
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
def system_for(mode: str, args) -> Iterator[str]:
    """The URL to bench `mode` at: --url's, or that of a `morphling up` started for it and stopped after."""
    if args.url:
        yield args.url.rstrip("/")
        return
    log_dir = args.out / "logs" / mode
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"morphling bench: starting the system for {mode} (logs in {log_dir})...", file=sys.stderr)
    system = UpProcess(up_command(args, mode, free_port(), log_dir), log_dir / "up.log")
    try:
        yield system.wait_ready(args.startup_timeout)
    finally:
        system.stop()


def tokenized_prompts(client: httpx.Client, url: str, model: str, seed: int, texts: list[str],
                      requests: list[TraceRequest]) -> list[list[int]]:
    """A real prompt of exactly the trace's length for every request, in the served model's own token
    ids: the served system's /tokenize does the encoding, so the bench needs no model of its own."""
    pool = PromptPool(texts, lambda text: tokenize(client, url, model, text), seed)
    return [pool.take(r.prompt_tokens) for r in requests]


def run_mode(mode: str, url: str, model: str, args, requests: list[TraceRequest], prompts: list[list[int]]
             ) -> tuple[list[RequestRecord], list[ClusterSample], float]:
    from tqdm import tqdm

    failures = 0
    with tqdm(total=len(requests), desc=f"{mode:>5}", unit="req", dynamic_ncols=True, file=sys.stderr) as bar:
        def done(record: RequestRecord) -> None:
            nonlocal failures
            failures += record.error is not None
            bar.update(1)

        def sampled(sample: ClusterSample) -> None:
            line = timeline([sample])
            if line:
                capacity = line["kv_capacity_tokens"][0] or 1
                bar.set_postfix_str(f"KV {100 * line['kv_used_tokens'][0] / capacity:.0f}% of {capacity}, "
                                    f"INT8 {line['int8_layers'][0]} INT4 {line['int4_layers'][0]}, "
                                    f"running {line['running'][0]} waiting {line['waiting'][0]}, failed {failures}",
                                    refresh=False)

        return asyncio.run(replay(url, model, requests, prompts, args.drain_timeout, args.api_key, done, sampled))


def mode_result(records: list[RequestRecord], samples: list[ClusterSample], elapsed: float, args,
                table: PerplexityTable | None) -> dict:
    result = summarize(records, samples, args.slo_ttft)
    result["precision"] = quality(precision_share(records, samples), table, args.model)
    result["replay_s"] = elapsed
    result["requests"] = [{"scheduled_s": r.scheduled_s, "sent_s": r.sent_s, "ttft_s": r.ttft_s,
                           "e2e_s": r.e2e_s, "prompt_tokens": r.prompt_tokens,
                           "output_tokens": r.output_tokens, "completion_tokens": r.completion_tokens,
                           "error": r.error} for r in records]
    return result


def comparison(results: dict[str, dict]) -> dict[str, dict]:
    """Each mode against fp16: how many times lower its P95 TTFT, how much fewer SLO violations."""
    base = results.get("fp16")
    if not base:
        return {}
    out = {}
    for mode, r in results.items():
        if mode == "fp16":
            continue
        speedup = base["ttft_p95"] / r["ttft_p95"] if base["ttft_p95"] and r["ttft_p95"] else None
        fewer = (100.0 * (1 - r["slo_violation_pct"] / base["slo_violation_pct"])
                 if base["slo_violation_pct"] else None)
        out[mode] = {"ttft_p95_x_better_than_fp16": speedup, "slo_violations_fewer_pct": fewer}
    return out


def print_table(results: dict[str, dict], compared: dict[str, dict]) -> None:
    def cell(value, fmt):
        return "-" if value is None else fmt.format(value)

    headers = ["mode", *(h for _, h, _ in TABLE_COLUMNS), "FP tokens", "ppl"]
    rows = []
    for mode, r in results.items():
        q = r["precision"]
        rows.append([mode, *(cell(r[k], f) for k, _, f in TABLE_COLUMNS),
                     cell(100 * q["full_precision_token_share"], "{:.0f}%"), cell(q["ppl_token_weighted"], "{:.2f}")])
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    for row in (headers, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    for mode, c in compared.items():
        print(f"{mode} vs fp16: P95 TTFT {cell(c['ttft_p95_x_better_than_fp16'], '{:.2f}')}x better, "
              f"SLO violations {cell(c['slo_violations_fewer_pct'], '{:.0f}')}% fewer")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        requests = load_trace(args.trace, args.start, args.duration, args.rate_scale, args.len_scale, args.max_len)
    except TraceError as e:
        print(f"morphling bench: {e}", file=sys.stderr)
        return 2
    texts = read_texts(args.data / "prompts")
    table = PerplexityTable.load(args.ppl_table)
    args.out.mkdir(parents=True, exist_ok=True)
    replay_s = requests[-1].arrival_s
    print(f"morphling bench: {len(requests)} requests over {replay_s:.0f} s "
          f"({sum(r.prompt_tokens for r in requests)} prompt and {sum(r.output_tokens for r in requests)} output "
          f"tokens) from {args.trace.name} [{args.start:g}, {args.start + args.duration:g}) s", file=sys.stderr)

    results: dict[str, dict] = {}
    prompts: list[list[int]] | None = None  # tokenized by the first system, for every mode alike
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    for mode in args.modes:
        try:
            with system_for(mode, args) as url, httpx.Client(headers=headers, timeout=30) as client:
                model = served_model(client, url)
                prompts = prompts or tokenized_prompts(client, url, model, args.seed, texts, requests)
                outcome = run_mode(mode, url, model, args, requests, prompts)
        except (RuntimeError, httpx.HTTPError) as e:
            print(f"morphling bench: {mode}: {e}", file=sys.stderr)
            return 1
        results[mode] = mode_result(*outcome, args, table)
        plot_timeline(mode, results[mode], args.slo_ttft, args.out / f"timeline_{mode}.png")

    compared = comparison(results)
    plot_ttft_cdf(results, args.slo_ttft, args.out / "ttft_cdf.png")
    report = {"modes": results, "comparison": compared, **provenance(args, skip=("api_key",))}
    report["config"] |= {"requests": len(requests), "replay_s": replay_s}
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print_table(results, compared)
    print(f"wrote {args.out / 'results.json'}, {args.out / 'ttft_cdf.png'} and a timeline per mode")
    return 0
