"""`morphling bench-engine --against URL`: our served system beside another OpenAI-compatible server (vLLM),
on the same prompts, lengths and concurrencies, in one run.

Each concurrency C is a closed loop, as `vllm bench serve --max-concurrency C` runs one: C clients, each
sending the next prompt as soon as its last one finished, until every prompt was served once. A request is
the bench's own (services/tools/bench/client.py): streaming `/v1/completions`, the prompt as token ids, greedy,
`--new-tokens` tokens with `ignore_eos`. The prompts are chat-templated first turns of ShareGPT, tokenized
once by our server's `/tokenize` and sent to both as ids, so that both serve exactly the same tokens. Each
round at each concurrency has prompts of its own, which both servers serve: none has seen them before, so
a prefix cache (vLLM's is on by default) saves no more than the chat template's shared head, as in serving.

The servers take turns round by round (ours first in even rounds, theirs in odd ones), so that a slow spell
of a noisy host falls on both; a figure pools its server's rounds. TPOT is per request (first to last
token over the tokens after the first), tokens/s is the tokens generated over the loop's wall time.
Agreement compares the two servers' greedy tokens prompt by prompt (bench.agreement's rule): both run
float32 on the same weights, so it says whether the numbers compare the same computation.
"""

import argparse
import asyncio
import json
import platform
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx

from services.tools.bench.agreement import agreement
from services.tools.bench.client import RequestRecord, request_body, send_one, served_model
from services.tools.bench.metrics import percentile, tpot_s
from services.tools.bench.prompts import read_texts
from services.tools.bench.system import started
from services.tools.bench.trace import TraceRequest
from shared.config import data_dir
from shared.net import free_port

SERVERS = ("ours", "peer")


@dataclass
class Loop:
    records: list[RequestRecord]
    elapsed_s: float


async def closed_loop(url: str, model: str, prompts: list[list[int]], new_tokens: int, concurrency: int) -> Loop:
    """Every prompt once, `concurrency` at a time, each client starting its next as its last one ends."""
    records = [RequestRecord(i, 0.0, len(p), new_tokens) for i, p in enumerate(prompts)]
    pending = iter(zip(records, prompts))
    timeout = httpx.Timeout(10.0, read=600.0)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency), timeout=timeout) as client:
        t0 = time.monotonic()

        async def client_loop() -> None:
            for record, prompt in pending:
                req = TraceRequest(0.0, len(prompt), new_tokens)
                await send_one(client, url, request_body(model, req, prompt), record, t0)

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return Loop(records, time.monotonic() - t0)


def figures(loops: list[Loop]) -> dict:
    """One server's figures at one concurrency, its rounds pooled."""
    records = [r for loop in loops for r in loop.records]
    served = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in served]
    tpot = [t for t in map(tpot_s, served) if t is not None]
    generated = sum(r.completion_tokens for r in served)
    return dict(requests=len(records), failures=len(records) - len(served),
                ttft_p50_s=percentile(ttft, 50), ttft_p95_s=percentile(ttft, 95),
                tpot_p50_s=percentile(tpot, 50), tpot_p95_s=percentile(tpot, 95),
                output_tok_s=generated / sum(loop.elapsed_s for loop in loops))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def row(concurrency: int, loops: dict[str, list[Loop]]) -> dict:
    """Both servers' figures at `concurrency`, ours over theirs, and how often they chose the same tokens."""
    ours, peer = figures(loops["ours"]), figures(loops["peer"])
    same = [agreement(a.records, b.records, "peer") for a, b in zip(loops["ours"], loops["peer"])]

    def mean(key: str) -> float | None:
        values = [r[key] for r in same if r[key] is not None]
        return sum(values) / len(values) if values else None

    return dict(concurrency=concurrency, ours=ours, peer=peer,
                ratios={k: _ratio(ours[k], peer[k]) for k in ("tpot_p50_s", "ttft_p95_s", "output_tok_s")},
                token_agreement=mean("token_agreement"), exact_share=mean("exact_share"))


def chat_prompts(client: httpx.Client, url: str, model: str, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Each text as a user turn under the model's chat template, in token ids (its last `max_tokens`)."""
    out = []
    for text in texts:
        turn = [{"role": "user", "content": text}]
        response = client.post(f"{url}/tokenize", json={"model": model, "messages": turn})
        response.raise_for_status()
        out.append(response.json()["tokens"][-max_tokens:])
    return out


def print_rows(rows: list[dict], peer_name: str) -> None:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.0f}"

    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    print(f"{'conc':>4} | {'TPOT P50 ms':^19} | {'TTFT P50/P95 s':^25} | {'tokens/s':^21} | agree")
    print(f"{'':>4} | {'ours':>5} {peer_name[:6]:>6} {'o/p':>6} | {'ours':>11} {peer_name[:11]:>11} | "
          f"{'ours':>6} {peer_name[:6]:>6} {'o/p':>6} |")
    for r in rows:
        o, p, q = r["ours"], r["peer"], r["ratios"]
        print(f"{r['concurrency']:>4} | {ms(o['tpot_p50_s']):>5} {ms(p['tpot_p50_s']):>6} {x(q['tpot_p50_s']):>6} | "
              f"{o['ttft_p50_s'] or 0:>5.2f}/{o['ttft_p95_s'] or 0:<5.2f} {p['ttft_p50_s'] or 0:>5.2f}/"
              f"{p['ttft_p95_s'] or 0:<5.2f} | {o['output_tok_s']:>6.1f} {p['output_tok_s']:>6.1f} "
              f"{x(q['output_tok_s']):>6} | {r['token_agreement'] or 0:.2f}", flush=True)


def plot(rows: list[dict], peer_name: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, scale, label in ((left, "tpot_p50_s", 1e3, "TPOT P50 (ms, lower is better)"),
                                  (right, "output_tok_s", 1, "output tokens / s (higher is better)")):
        for shift, server, name in ((-0.2, "ours", "morphling"), (0.2, "peer", peer_name)):
            ax.bar([i + shift for i in x], [(r[server][key] or 0) * scale for r in rows], 0.4, label=name)
        ax.set_xticks(list(x), [str(r["concurrency"]) for r in rows])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("The same prompts through both servers, side by side")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def compare(ours: str, against: str, args) -> dict:
    """The table of both servers at every concurrency of `args`, rounds taken in turns."""
    with httpx.Client(timeout=60) as client:
        models = {"ours": served_model(client, ours), "peer": served_model(client, against)}
        runs = len(args.concurrency) * args.rounds
        texts = read_texts(args.data / "prompts")[:(runs + 1) * args.num_prompts]  # ShareGPT's first turns first
        prompts = chat_prompts(client, ours, models["ours"], texts, args.max_prompt_tokens)
    sets = iter(prompts[i:i + args.num_prompts] for i in range(0, len(prompts), args.num_prompts))
    urls = {"ours": ours, "peer": against}
    warmup = next(sets)[:2]
    for server in SERVERS:  # a first request compiles or warms whatever each server warms lazily
        asyncio.run(closed_loop(urls[server], models[server], warmup, 4, 2))
    rows = []
    for concurrency in args.concurrency:
        loops: dict[str, list[Loop]] = {s: [] for s in SERVERS}
        for round_ in range(args.rounds):
            served = next(sets)
            for server in (SERVERS if round_ % 2 == 0 else SERVERS[::-1]):
                print(f"  concurrency {concurrency}, round {round_ + 1}/{args.rounds}: {server}...", file=sys.stderr)
                loops[server].append(asyncio.run(
                    closed_loop(urls[server], models[server], served, args.new_tokens, concurrency)))
        rows.append(row(concurrency, loops))
    return dict(rows=rows, servers=dict(ours=ours, peer=against, peer_name=args.against_name, models=models),
                config=dict(num_prompts=args.num_prompts, prompt_tokens_mean=sum(map(len, prompts)) / len(prompts),
                            new_tokens=args.new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                            concurrency=args.concurrency, rounds=args.rounds),
                machine=dict(platform=platform.platform(), processor=platform.processor()),
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def run(args) -> dict:
    """Compare `args.against` with `args.ours`, or with a `morphling up --mode off` of the default model started
    here."""
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ours:
        result = compare(args.ours, args.against, args)
    else:
        # The engine at fixed full precision, as the peer serves it: morphing's gain is bench --sweep's question.
        cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(free_port()), "--model", args.model,
               "--mode", "off", "--log-dir", str(args.out / "logs")]
        with started(cmd, args.out / "logs", 600, "the engine comparison") as endpoints:
            result = compare(endpoints.url, args.against, args)
    print_rows(result["rows"], args.against_name)
    (args.out / "engine_vs_peer.json").write_text(json.dumps(result, indent=2))
    plot(result["rows"], args.against_name, args.out / "engine_vs_peer.png")
    print(f"wrote {args.out / 'engine_vs_peer.json'} and {args.out / 'engine_vs_peer.png'}")
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="morphling bench-engine", description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="URL", required=True,
                    help="the other server's base URL, e.g. http://127.0.0.1:8100")
    ap.add_argument("--against-name", default="vLLM", help="what to call it in the table and plot")
    ap.add_argument("--ours", metavar="URL", help="a running Morphling gateway (default: start `morphling up`)")
    ap.add_argument("--model", default="default", help="the model ours starts with (without --ours)")
    ap.add_argument("--concurrency", default="1,16", help="comma-separated client counts (closed loop)")
    ap.add_argument("--num-prompts", type=int, default=32, help="ShareGPT first turns a round, each served once")
    ap.add_argument("--rounds", type=int, default=2, help="turns each server takes at each concurrency")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--data", type=Path, default=data_dir(), help="the shared data folder")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency takes comma-separated integers, not {args.concurrency!r}")
    if min(args.concurrency) < 1 or min(args.num_prompts, args.rounds, args.new_tokens, args.max_prompt_tokens) < 1:
        ap.error("--concurrency, --num-prompts, --rounds, --new-tokens and --max-prompt-tokens must be positive")
    try:
        return run(args)
    except httpx.HTTPError as e:  # a server that is not there, or refuses /v1/models or /tokenize: said, not traced
        raise SystemExit(f"morphling bench-engine: a server did not answer as an OpenAI-compatible one: "
                         f"{type(e).__name__}: {e}")
