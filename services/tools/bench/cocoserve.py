"""`morphling bench-cocoserve`: one instance without operations vs CoCoServe scaling, over a request-rate
sweep (the paper's Fig. 6 in miniature).

Both runs start the system exactly as `morphling up --executors 2 --plan` does, with every layer on exec0
and exec1 spare (deploy/plans/default-spare-exec1.json), the same memory budget and SLOs; only the
controller differs: `--cocoserve off` (the instance as planned) or `--cocoserve default` (replicas on the
idle member, migrate/evict/batch cuts under SLO violations, and back). At each rate the same requests, with
Poisson arrivals and real prompts of fixed lengths, are played open loop; between rates the system rests
`--rest` seconds, so that CoCoServe is back where idleness takes it. The table gives throughput, P50/P95
end-to-end latency and TTFT, and SLO violations side by side; the JSON and a plot go to `--out`.
"""

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

from services.tools.bench.client import replay, served_model, tokenized_prompts
from services.tools.bench.metrics import percentile, summarize
from services.tools.bench.prompts import read_texts
from services.tools.bench.system import UpProcess
from services.tools.bench.trace import TraceRequest
from shared.config import PROJECT_ROOT, data_dir
from shared.net import free_port
from shared.provenance import provenance

CONFIGS = {"static": "off", "cocoserve": "default"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="morphling bench-cocoserve", description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.5,1,2,4", help="requests per second, one run each (default %(default)s)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate (default %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="seconds (the monitor's and the table's)")
    ap.add_argument("--slo-tpot", type=float, default=0.15, help="seconds per output token (the monitor's)")
    ap.add_argument("--memory-budget", default="1GiB")
    ap.add_argument("--plan", type=Path, default=PROJECT_ROOT / "deploy/plans/default-spare-exec1.json")
    ap.add_argument("--rest", type=float, default=20.0, help="idle seconds before each rate (default %(default)s)")
    ap.add_argument("--drain-timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, default=data_dir())
    ap.add_argument("--out", type=Path, default=Path("docs/results/cocoserve"))
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    if any(r <= 0 for r in args.rates) or args.duration <= 0:
        ap.error("--rates and --duration must be positive")
    return args


def poisson_requests(rate: float, duration: float, prompt_tokens: int, output_tokens: int,
                     seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(TraceRequest(t, prompt_tokens, output_tokens))
        t += rng.expovariate(rate)
    return out


def up_command(args, config: str, port: int, log_dir: Path) -> list[str]:
    return [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--executors", "2",
            "--levers", "replicate", "--plan", str(args.plan), "--memory-budget", args.memory_budget,
            "--max-model-len", "512",
            "--cocoserve", CONFIGS[config], "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot),
            "--log-dir", str(log_dir), "--timeout", str(args.startup_timeout)]


def replicas(client: httpx.Client, url: str) -> int:
    instances = client.get(f"{url}/v1/cluster").json()["instances"]
    return sum(r - 1 for i in instances for r in i.get("replicas", []))


def run_config(config: str, args, texts: list[str]) -> list[dict]:
    log_dir = args.out / "logs" / config
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"morphling bench-cocoserve: starting the system for {config} (logs in {log_dir})...", file=sys.stderr)
    system = UpProcess(up_command(args, config, free_port(), log_dir), log_dir / "up.log")
    rows = []
    try:
        url = system.wait_ready(args.startup_timeout)
        with httpx.Client(timeout=30) as client:
            model = served_model(client, url)
            for k, rate in enumerate(args.rates):
                requests = poisson_requests(rate, args.duration, args.prompt_tokens, args.output_tokens, args.seed + k)
                prompts = tokenized_prompts(client, url, model, args.seed + k, texts, requests)
                time.sleep(args.rest)
                held = replicas(client, url)
                print(f"  {config}: {rate:g} req/s, {len(requests)} requests, {held} layer replicas at the start",
                      file=sys.stderr)
                records, samples, elapsed = asyncio.run(replay(url, model, requests, prompts, args.drain_timeout))
                summary = summarize(records, samples, args.slo_ttft)
                e2e = [r.e2e_s for r in records if r.ok]
                rows.append(dict(config=config, rate=rate, requests=len(requests), replicas_at_start=held,
                                 throughput_tok_s=summary["throughput_tok_s"], e2e_p50=percentile(e2e, 50),
                                 e2e_p95=summary["e2e_p95"], ttft_p50=summary["ttft_p50"],
                                 ttft_p95=summary["ttft_p95"], slo_violation_pct=summary["slo_violation_pct"],
                                 failed=summary["failed"], replay_s=elapsed))
    finally:
        system.stop()
    return rows


def print_table(rows: list[dict], rates: list[float]) -> list[dict]:
    compared = []
    print(f"{'req/s':>6} | {'tok/s static':>12} {'cocoserve':>10} {'ratio':>6} | {'e2e p50':>8} {'':>8} | "
          f"{'e2e p95':>8} {'':>8} | {'SLO viol %':>10} {'':>6} | {'failed':>6}")
    print(f"{'':>6} | {'':>12} {'':>10} {'':>6} | {'static':>8} {'coco':>8} | {'static':>8} {'coco':>8} | "
          f"{'static':>10} {'coco':>6} |")
    for rate in rates:
        s = next(r for r in rows if r["config"] == "static" and r["rate"] == rate)
        c = next(r for r in rows if r["config"] == "cocoserve" and r["rate"] == rate)
        ratio = c["throughput_tok_s"] / s["throughput_tok_s"] if s["throughput_tok_s"] else None
        compared.append(dict(rate=rate, throughput_ratio=ratio,
                             e2e_p95_ratio=(s["e2e_p95"] / c["e2e_p95"]) if s["e2e_p95"] and c["e2e_p95"] else None))
        print(f"{rate:>6g} | {s['throughput_tok_s']:>12.1f} {c['throughput_tok_s']:>10.1f} "
              f"{ratio or 0:>5.2f}x | {s['e2e_p50'] or 0:>8.2f} {c['e2e_p50'] or 0:>8.2f} | "
              f"{s['e2e_p95'] or 0:>8.2f} {c['e2e_p95'] or 0:>8.2f} | {s['slo_violation_pct']:>10.1f} "
              f"{c['slo_violation_pct']:>6.1f} | {s['failed'] + c['failed']:>6}")
    return compared


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for config in CONFIGS:
        mine = [r for r in rows if r["config"] == config]
        rates = [r["rate"] for r in mine]
        axes[0].plot(rates, [r["throughput_tok_s"] for r in mine], marker="o", label=config)
        axes[1].plot(rates, [r["e2e_p95"] or 0 for r in mine], marker="o", label=config)
        axes[2].plot(rates, [r["slo_violation_pct"] for r in mine], marker="o", label=config)
    axes[0].set(xlabel="requests / s", ylabel="generated tokens / s", title="throughput")
    axes[1].set(xlabel="requests / s", ylabel="seconds", title="P95 end-to-end latency")
    axes[2].set(xlabel="requests / s", ylabel="% of requests", title="TTFT SLO violations")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    texts = read_texts(args.data / "prompts")
    rows: list[dict] = []
    for config in CONFIGS:
        try:
            rows += run_config(config, args, texts)
        except (RuntimeError, httpx.HTTPError) as e:
            print(f"morphling bench-cocoserve: {config}: {e}", file=sys.stderr)
            return 1
    compared = print_table(rows, args.rates)
    report = dict(rows=rows, compared=compared, **provenance(args))
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    plot(rows, args.out / "sweep.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'sweep.png'}")
    return 0
