"""`morphling bench-engine --executors N (--tp K | --plan FILE)`: one instance across N processes vs one alone.

Both generate exactly `--new-tokens` greedy tokens for each of the same ShareGPT prompts, one batch size
after another, on the same cores: the executor alone uses all of them, each of the instance's N processes
its 1/N share (as `morphling up` gives them). On one CPU this measures what the fabric costs (step
metadata, hops, all-reduces, a batch split over processes that share the cores), not what it gains: the
gain of TP, placement and replicas is more memory and more devices, which one CPU does not have. The
tokens must match; the table gives tokens/s, time per step and the ratio, and the JSON and a chart go to
`--out`.
"""

import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from services.executor.engine.engine import LLMEngine
from services.executor.fabric.offline import Shape, instance_engine
from services.tools.microbench.prompts import sharegpt_prompts
from shared.config import EngineConfig, parse_size
from shared.sampling import SamplingOptions


def timed(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, list[list[int]]]:
    """Seconds, engine steps and the tokens of generating `new_tokens` for every prompt."""
    params = SamplingOptions(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    steps = engine.stats().steps
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    return time.perf_counter() - start, engine.stats().steps - steps, [c.outputs[0].token_ids for c in done]


def measure(engine: LLMEngine, batches: list[list[list[int]]], new_tokens: int) -> list[dict]:
    timed(engine, batches[0][:2], 4)  # warm-up
    rows = []
    for prompts in batches:
        seconds, steps, tokens = timed(engine, prompts, new_tokens)
        rows.append(dict(prompts=len(prompts), seconds=seconds, steps=steps,
                         tok_s=len(prompts) * new_tokens / seconds, step_ms=1000 * seconds / steps, tokens=tokens))
    return rows


def run(args) -> dict:
    shape = Shape(args.executors, args.tp or 1, str(args.plan) if args.plan else None)
    label = f"plan {Path(args.plan).name}" if args.plan else f"TP{shape.tp}"
    cores = len(os.sched_getaffinity(0))
    config = EngineConfig(model=args.model, memory_budget=parse_size(args.memory_budget),
                          max_model_len=args.max_prompt_tokens + args.new_tokens)
    torch.set_num_threads(cores)
    alone = LLMEngine(config, progress=True)
    path = args.data / "prompts" / "ShareGPT_V3_filtered_1000.json"
    batches = [sharegpt_prompts(alone, path, int(count), args.max_prompt_tokens, args.seed)
               for count in args.batches.split(",")]
    print(f"one executor alone ({cores} threads) ...", flush=True)
    single = measure(alone, batches, args.new_tokens)
    kv_alone = alone.stats().ledger.pages_kv
    del alone
    threads = max(1, cores // args.executors)
    print(f"{label} over {args.executors} executors ({threads} threads each) ...", flush=True)
    with instance_engine(config, shape, threads=threads) as leader:
        spread = measure(leader, batches, args.new_tokens)
        kv_instance = leader.stats().ledger.pages_kv
    rows = []
    print(f"instance: {label} over {args.executors} executors")
    print(f"{'prompts':>8} {'alone tok/s':>12} {'instance tok/s':>15} {'alone ms/step':>14} "
          f"{'instance ms/step':>17} {'ratio':>6} {'same tokens':>12}")
    for a, s in zip(single, spread):
        row = dict(prompts=a["prompts"], alone_tok_s=a["tok_s"], instance_tok_s=s["tok_s"], alone_step_ms=a["step_ms"],
                   instance_step_ms=s["step_ms"], ratio=s["tok_s"] / a["tok_s"], same_tokens=a["tokens"] == s["tokens"])
        rows.append(row)
        print(f"{row['prompts']:>8} {row['alone_tok_s']:>12.1f} {row['instance_tok_s']:>15.1f} "
              f"{row['alone_step_ms']:>14.1f} {row['instance_step_ms']:>17.1f} {row['ratio']:>5.2f}x "
              f"{str(row['same_tokens']):>12}", flush=True)
    print(f"KV blocks of {config.block_size} tokens: alone {kv_alone}, instance {kv_instance} "
          f"({kv_instance / kv_alone:.2f}x), each executor with a {args.memory_budget} arena")
    result = dict(rows=rows, kv_blocks=dict(alone=kv_alone, instance=kv_instance),
                  shape=dict(executors=args.executors, tp=shape.tp, plan=shape.plan_file, label=label),
                  config=dict(model=args.model, new_tokens=args.new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                              memory_budget=args.memory_budget, threads_alone=cores, threads_each=threads),
                  machine=dict(platform=platform.platform(), processor=platform.processor(), cpus=cores),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    name = f"fabric_bench_{label.replace(' ', '_').replace('.json', '')}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(rows, label, args.out / f"{name}.png")
    print(f"wrote {args.out / (name + '.json')} and {args.out / (name + '.png')}")
    return result


def plot(rows: list[dict], label: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([i - 0.2 for i in x], [r["alone_tok_s"] for r in rows], 0.4, label="one executor")
    ax.bar([i + 0.2 for i in x], [r["instance_tok_s"] for r in rows], 0.4, label=label)
    ax.set_xticks(list(x), [str(r["prompts"]) for r in rows])
    ax.set_xlabel("prompts in the batch")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"One executor vs {label} on the same cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
