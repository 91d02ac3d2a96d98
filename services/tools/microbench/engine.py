"""`morphling bench-engine`: offline generation throughput, our engine vs transformers.generate (or, with
`--executors N`, one instance across N executors vs one executor alone: fabric.py).

Both generate exactly `--new-tokens` greedy tokens for each of the same ShareGPT prompts (chat-templated,
EOS ignored), on the same weights, dtype and machine, one batch size after another. transformers runs
each batch as one padded `generate` call, the usual way to batch it; we run it as one continuous batch.
Prints a table, writes `engine_bench.json` and a bar chart into `--out`.

With `--against URL`, the command is the bench's instead (services/tools/bench/peer.py, its own flags): our served
system beside another OpenAI-compatible server (vLLM) on the same prompts at each concurrency.

With `--device` or `--shape`, it measures a named shape (random weights) or checkpoint directory on a device
instead: decode step time against transformers and the memory roofline, swaps, kernels (gpu.py).
"""

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from services.executor.engine.engine import DTYPES, LLMEngine
from services.executor.engine.model.loader import resolve_model_path
from services.tools.microbench import gpu as bench_gpu
from services.tools.microbench.prompts import sharegpt_prompts
from services.tools.shapes import SHAPES
from shared.config import EngineConfig, data_dir, parse_size
from shared.sampling import SamplingOptions


def run_ours(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingOptions(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(c.outputs[0].token_ids) == new_tokens for c in done)
    return elapsed


def run_transformers(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding, as generate wants
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + new_tokens
    return elapsed


def load_transformers(model: str):
    from transformers import AutoModelForCausalLM  # test/benchmark-only dependency

    path = Path(resolve_model_path(model))
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["prompts"]) for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([i - 0.2 for i in x], [r["ours_tok_s"] for r in rows], 0.4, label="morphling")
    ax.bar([i + 0.2 for i in x], [r["transformers_tok_s"] for r in rows], 0.4, label="transformers.generate")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("prompts in the batch")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("Offline generation throughput (same model, same machine)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="morphling bench-engine", description=__doc__.splitlines()[0],
                                 epilog="--against URL: our served system beside another OpenAI-compatible server "
                                        "(vLLM) on the same prompts; its flags: bench-engine --against URL --help")
    ap.add_argument("--model", default="default")
    ap.add_argument("--data", type=Path, default=data_dir(), help="the shared data folder")
    ap.add_argument("--batches", help="comma-separated prompt counts (default 1,8,64; with --shape 1,16,64)")
    ap.add_argument("--new-tokens", type=int, help="(default 64; with --shape 128)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--memory-budget", help="the arena's bytes (default 2GiB; with --shape: sized for the run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    fabric = ap.add_argument_group("one instance across executors", "compare it with one executor alone instead "
                                   "of with transformers (services/tools/microbench/fabric.py)")
    fabric.add_argument("--executors", type=int, default=1, help="processes the instance spans")
    shape = fabric.add_mutually_exclusive_group()
    shape.add_argument("--tp", type=int, help="tensor-parallel degree (default: --executors)")
    shape.add_argument("--plan", type=Path, help="an instance plan file over exec0..exec<N-1> (exec0 leads)")
    device = ap.add_argument_group("a named shape on a device", "random weights of a model's shape, or a checkpoint "
                                   "directory, on CPU or CUDA (services/tools/microbench/gpu.py)")
    device.add_argument("--device", help="cpu or cuda (default cpu)")
    device.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="auto: bfloat16 on CUDA, float32 on CPU")
    device.add_argument("--shape", help=f"{', '.join(SHAPES)} (written once into --cache-dir) or a Hugging Face "
                                        f"checkpoint directory")
    bench_gpu.add_arguments(device)
    args = ap.parse_args(argv)
    if args.device is not None or args.shape is not None:
        if args.shape is None:
            ap.error(f"--device needs --shape ({', '.join(SHAPES)} or a checkpoint directory)")
        return bench_gpu.run(args)
    args.batches, args.new_tokens = args.batches or "1,8,64", args.new_tokens or 64
    args.memory_budget = args.memory_budget or "2GiB"
    if args.executors > 1:
        from services.tools.microbench.fabric import run

        args.tp = args.tp or (None if args.plan else args.executors)
        return run(args)
    args.out.mkdir(parents=True, exist_ok=True)

    engine = LLMEngine(EngineConfig(model=args.model, memory_budget=parse_size(args.memory_budget),
                                    max_model_len=args.max_prompt_tokens + args.new_tokens))
    print("loading transformers for the same model ...", flush=True)
    reference = load_transformers(args.model)
    pad_id = engine.eos_token_ids[0] if engine.eos_token_ids else 0
    warmup = sharegpt_prompts(engine, args.data / "prompts" / "ShareGPT_V3_filtered_1000.json", 2, 32, args.seed + 1)
    run_ours(engine, warmup, 4)
    run_transformers(reference, warmup, 4, pad_id)

    rows = []
    print(f"{'prompts':>8} {'prompt tok':>10} {'ours tok/s':>11} {'hf tok/s':>9} {'ratio':>6}")
    for count in [int(b) for b in args.batches.split(",")]:
        prompts = sharegpt_prompts(engine, args.data / "prompts" / "ShareGPT_V3_filtered_1000.json", count,
                                   args.max_prompt_tokens, args.seed)
        generated = count * args.new_tokens
        ours = run_ours(engine, prompts, args.new_tokens)
        theirs = run_transformers(reference, prompts, args.new_tokens, pad_id)
        row = dict(prompts=count, prompt_tokens=sum(map(len, prompts)), generated_tokens=generated,
                   ours_s=ours, transformers_s=theirs, ours_tok_s=generated / ours,
                   transformers_tok_s=generated / theirs, ratio=theirs / ours)
        rows.append(row)
        print(f"{count:>8} {row['prompt_tokens']:>10} {row['ours_tok_s']:>11.1f} {row['transformers_tok_s']:>9.1f}"
              f" {row['ratio']:>5.2f}x", flush=True)

    result = dict(
        rows=rows,
        config=dict(model=args.model, new_tokens=args.new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                    memory_budget=args.memory_budget, dtype="float32", torch_threads=torch.get_num_threads(),
                    preemptions=engine.stats().preemptions),
        machine=dict(platform=platform.platform(), processor=platform.processor(), cpus=torch.get_num_threads()),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    (args.out / "engine_bench.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out / "engine_bench.png")
    print(f"wrote {args.out / 'engine_bench.json'} and {args.out / 'engine_bench.png'}")
    return result
