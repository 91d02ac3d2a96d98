"""`morphling bench-hybrid`: AMOEBAs' scheduler against round-robin and least-load-first on the paper's hybrid
workload in miniature (§4, Fig. 12): short requests at a steady rate, and every so often a long one that no
executor holds alone.

Each strategy gets its own `morphling up --executors N --tp-scheduler S` with the same budget, so that a
long request needs a TP2 merge (the gateway merges for it, the controller splits back after), and the same
requests: Poisson arrivals of short requests and long ones at fixed times, real prompts of fixed lengths,
played open loop. The table gives throughput and TTFT (short and long requests apart), failures and the
merges each strategy made; the JSON and a timeline plot (TP instances and each request's TTFT over time)
go to `--out`.
"""

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

import httpx

from services.tools.bench.client import ClusterSample, RequestRecord, replay, served_model, tokenized_prompts
from services.tools.bench.metrics import percentile
from services.tools.bench.prompts import read_texts
from services.tools.bench.system import UpProcess
from services.tools.bench.trace import TraceRequest
from shared.config import data_dir
from shared.net import free_port
from shared.provenance import provenance

STRATEGIES = ("amoebas", "rr", "llf")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="morphling bench-hybrid", description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="(default %(default)s)")
    ap.add_argument("--executors", type=int, default=4, help="executor processes (default %(default)s)")
    ap.add_argument("--memory-budget", default="470MiB", help="each executor's arena (default %(default)s)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals (default %(default)s)")
    ap.add_argument("--short-rate", type=float, default=1.0, help="short requests per second (default %(default)s)")
    ap.add_argument("--short-tokens", default="64,32", help="prompt,output tokens of a short request")
    ap.add_argument("--long-every", type=float, default=10.0,
                    help="seconds between long requests (default %(default)s)")
    ap.add_argument("--long-tokens", default="1600,32", help="prompt,output tokens of a long request")
    ap.add_argument("--drain-timeout", type=float, default=180.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, default=data_dir())
    ap.add_argument("--out", type=Path, default=Path("docs/results/amoebas_hybrid"))
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    args.strategies = args.strategies.split(",")
    if set(args.strategies) - set(STRATEGIES):
        ap.error(f"--strategies takes {', '.join(STRATEGIES)}")
    args.short_tokens, args.long_tokens = (tuple(int(x) for x in v.split(",")) for v in (args.short_tokens,
                                                                                           args.long_tokens))
    return args


def hybrid_requests(args) -> list[TraceRequest]:
    """Shorts with Poisson arrivals; a long request at long_every/2, then every long_every seconds."""
    rng = random.Random(args.seed)
    out, t = [], rng.expovariate(args.short_rate)
    while t < args.duration:
        out.append(TraceRequest(t, *args.short_tokens))
        t += rng.expovariate(args.short_rate)
    t = args.long_every / 2
    while t < args.duration:
        out.append(TraceRequest(t, *args.long_tokens))
        t += args.long_every
    return sorted(out, key=lambda r: r.arrival_s)


def up_command(args, strategy: str, port: int, log_dir: Path) -> list[str]:
    return [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--executors", str(args.executors),
            "--memory-budget", args.memory_budget, "--max-model-len", str(args.max_model_len),
            "--levers", "tp", "--tp-scheduler", strategy, "--log-dir", str(log_dir),
            "--timeout", str(args.startup_timeout)]


def merged_instances(sample: ClusterSample) -> int:
    return len({e["instance"] for e in sample.executors if e.get("instance", "").startswith("tp-")})


def summary(records: list[RequestRecord], samples: list[ClusterSample], long_prompt: int) -> dict:
    finished = [r for r in records if r.ok]
    span = max((r.done_s for r in finished), default=0.0) - min((r.scheduled_s for r in records), default=0.0)
    out = {"requests": len(records), "failed": len(records) - len(finished),
           "errors": sorted({r.error for r in records if r.error})[:5],
           "throughput_tok_s": sum(r.completion_tokens for r in finished) / span if span > 0 else 0.0,
           "max_merged_instances": max((merged_instances(s) for s in samples), default=0),
           "merged_share": (sum(merged_instances(s) > 0 for s in samples) / len(samples)) if samples else 0.0}
    for kind, mine in (("short", [r for r in records if r.prompt_tokens < long_prompt]),
                       ("long", [r for r in records if r.prompt_tokens >= long_prompt])):
        ttft = [r.ttft_s for r in mine if r.ttft_s is not None]
        out |= {f"{kind}_ttft_p50": percentile(ttft, 50), f"{kind}_ttft_p95": percentile(ttft, 95),
                f"{kind}_e2e_p50": percentile([r.e2e_s for r in mine if r.ok], 50)}
    return out


def run_strategy(strategy: str, args, texts: list[str], requests: list[TraceRequest]) -> dict:
    log_dir = args.out / "logs" / strategy
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"morphling bench-hybrid: starting {args.executors} executors for {strategy} (logs in {log_dir})...",
          file=sys.stderr)
    system = UpProcess(up_command(args, strategy, free_port(), log_dir), log_dir / "up.log")
    try:
        url = system.wait_ready(args.startup_timeout)
        with httpx.Client(timeout=30) as client:
            model = served_model(client, url)
            prompts = tokenized_prompts(client, url, model, args.seed, texts, requests)
        print(f"  {strategy}: {len(requests)} requests over {args.duration:g} s", file=sys.stderr)
        records, samples, elapsed = asyncio.run(replay(url, model, requests, prompts, args.drain_timeout))
    finally:
        system.stop()
    return {"strategy": strategy, "replay_s": elapsed, **summary(records, samples, args.long_tokens[0]),
            "records": [{"scheduled_s": r.scheduled_s, "prompt_tokens": r.prompt_tokens, "ttft_s": r.ttft_s,
                         "e2e_s": r.e2e_s, "error": r.error} for r in records],
            "merged_timeline": [[s.time_s, merged_instances(s)] for s in samples]}


def print_table(results: list[dict]) -> None:
    base = next((r for r in results if r["strategy"] == "amoebas"), results[0])
    head = (f"{'strategy':>9} | {'tok/s':>7} {'vs amoebas':>10} | {'short TTFT p50':>14} {'p95':>6} | "
            f"{'long TTFT p50':>13} {'p95':>6} | {'merged':>6} | {'failed':>6}")
    print(head)
    print("-" * len(head))
    for r in results:
        ratio = r["throughput_tok_s"] / base["throughput_tok_s"] if base["throughput_tok_s"] else 0.0
        print(f"{r['strategy']:>9} | {r['throughput_tok_s']:>7.1f} {ratio:>9.2f}x | {r['short_ttft_p50'] or 0:>14.2f} "
              f"{r['short_ttft_p95'] or 0:>6.2f} | {r['long_ttft_p50'] or 0:>13.2f} {r['long_ttft_p95'] or 0:>6.2f} | "
              f"{100 * r['merged_share']:>5.0f}% | {r['failed']:>6}")


def plot(results: list[dict], long_prompt: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.8 * len(results)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        for kind, marker, color in (("short", ".", "tab:blue"), ("long", "s", "tab:red")):
            mine = [x for x in r["records"] if (x["prompt_tokens"] >= long_prompt) == (kind == "long")]
            ax.scatter([x["scheduled_s"] for x in mine], [x["ttft_s"] or 0 for x in mine], marker=marker, s=18,
                       color=color, label=f"{kind} TTFT")
            failed = [x["scheduled_s"] for x in mine if x["error"]]
            ax.scatter(failed, [0] * len(failed), marker="x", color="black", label="failed" if failed else None)
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{r['strategy']}: {r['throughput_tok_s']:.1f} tok/s")
        twin = ax.twinx()
        line = r["merged_timeline"]
        twin.step([t for t, _ in line], [n for _, n in line], where="post", color="tab:green", label="TP2 instances")
        twin.set_ylabel("TP2 instances")
        twin.set_ylim(0, max(2, max((n for _, n in line), default=0) + 1))
        ax.legend(loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("seconds after the replay started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    texts = read_texts(args.data / "prompts")
    requests = hybrid_requests(args)
    results = []
    for strategy in args.strategies:
        try:
            results.append(run_strategy(strategy, args, texts, requests))
        except (RuntimeError, httpx.HTTPError) as e:
            print(f"morphling bench-hybrid: {strategy}: {e}", file=sys.stderr)
            return 1
    print_table(results)
    report = dict(results=results, **provenance(args))
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    plot(results, args.long_tokens[0], args.out / "timeline.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'timeline.png'}")
    return 0
