"""`morphling bench-engine --device cuda --dtype bfloat16 --shape llama-3-8b`: one command that measures what a
decode step costs on a device, against the device's own memory bandwidth and against transformers.

The model is a named shape with random weights (shapes.py, written once and cached) or a checkpoint
directory. In one process, in this order:

1. Copy bandwidth: a large device-to-device copy, counting the bytes read and written. Every fraction below
   is of this number, measured in the same run, not of a datasheet figure.
2. Decode (section `decode`): per batch, the same random prompts through our engine and through
   transformers' `generate` (greedy, a fixed number of new tokens, same weights, dtype and device). Ours:
   the mean time of the engine steps that are pure decode of the whole batch; transformers': the mean
   time per generated token after the first. The roofline is the bytes a decode step must read (decoder
   weights at their bits, LM head, embedding rows, the batch's KV) over the copy bandwidth.
3. Swaps (section `swap`): one layer to INT4 and back and to INT8 and back, idle and then between decode
   steps; what the step that overlaps a swap costs more than the steps before it, and whether the first
   step after a swap stalled (a kernel compiled on the critical path).
4. Kernels (section `kernels`, CUDA only): W8A16 and W4A16 (ours, and PyTorch's built-in weight-only ops
   where the installed torch has them) against cuBLAS on the three Llama-3-8B linear shapes; paged decode
   attention against SDPA on contiguous K/V.

Each section prints a table; everything goes into `engine_gpu_bench.json` in --out, with charts.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from services.executor.engine.engine import DTYPES, LLMEngine
from services.executor.engine.memory.arena import ArenaGeometry
from services.executor.engine.model.decoder import layer_layout
from services.executor.engine.model.loader import load_checkpoint
from services.tools.microbench.kernels import kernel_section
from services.tools.microbench.swaps import SWAP_PLAN, swap_section
from services.tools.microbench.timing import (COPY_CONVENTION, Clock, copy_bandwidth, machine_info, print_table,
                                                  random_prompts, release)
from services.tools.shapes import DEFAULT_CACHE_DIR, SHAPES, cached_checkpoint, ensure_checkpoint
from shared.config import EngineConfig, parse_size
from shared.sampling import SamplingOptions

RESULT_FILE = "engine_gpu_bench.json"
SECTIONS = ("decode", "swap", "kernels")
DEFAULTS = dict(batches="1,16,64", new_tokens=128, prompt_tokens=128)
BLOCK_SIZE = 16
KV_HEADROOM = 1.25  # KV pages beyond the run's tokens: a restore moves live KV out of the slot it takes back
HF_ACTIVATIONS = 2 << 30  # what transformers' generate holds beside its weights and cache, roughly


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (a missing shape, too little device memory)."""


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The flags only this benchmark reads (engine.py adds --device, --dtype and --shape)."""
    group.add_argument("--prompt-tokens", type=int, default=DEFAULTS["prompt_tokens"],
                       help="random prompt length (default %(default)s)")
    group.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                       help="where named shapes are written once (default %(default)s)")
    group.add_argument("--sections", default=",".join(SECTIONS),
                       help="comma-separated, of decode, swap, kernels (copy bandwidth always runs)")
    group.add_argument("--swap-batch", type=int, help="sequences decoding while a layer swaps (default: the "
                                                      "smallest of --batches)")
    group.add_argument("--swap-steps", type=int, default=SWAP_PLAN[-1][0] + 10,
                       help="decode steps of the swap run (default %(default)s)")


# --- the engine and transformers --------------------------------------------------------------

def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def memory_budget(cfg, dtype: torch.dtype, tokens: int, device: torch.device, with_transformers: bool) -> int:
    """An arena for the decoder layers plus the run's KV with headroom, checked against the free memory of a
    CUDA device, which transformers' copy of the model (same process) shares."""
    geometry = ArenaGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE, dtype)
    _, layer_bytes = layer_layout(cfg, dtype)
    pages = (cfg.num_layers * geometry.pages_for_bytes(layer_bytes)
             + math.ceil(tokens * KV_HEADROOM / BLOCK_SIZE) + 16)
    budget = pages * geometry.page_bytes
    if device.type == "cuda":
        itemsize = torch.empty((), dtype=dtype).element_size()
        outside = cfg.vocab_size * cfg.hidden_size * itemsize * (1 if cfg.tie_word_embeddings else 2)
        hf = (cfg.num_layers * layer_bytes + outside + tokens * kv_bytes_per_token(cfg, dtype) + HF_ACTIVATIONS
              if with_transformers else 0)
        free, _ = torch.cuda.mem_get_info(device)
        if budget + outside + hf > 0.9 * free:
            raise BenchError(f"this run needs about {(budget + outside + hf) / 2**30:.1f} GiB of {device} memory "
                             f"(arena {budget / 2**30:.1f} GiB, embeddings {outside / 2**30:.1f} GiB, transformers "
                             f"{hf / 2**30:.1f} GiB) but {free / 2**30:.1f} GiB are free: use smaller --batches or "
                             f"--prompt-tokens, or give --memory-budget")
    return budget


def load_transformers(path: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM  # test/benchmark-only dependency

    # In its dtype from disk: casting a loaded model would round RoPE's inv_freq too (shared/gpu.md).
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": str(device)}).eval()


def run_ours(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, clock: Clock, tag: str) -> dict:
    """Generate for the whole batch; the steps that are pure decode of the whole batch are timed one by one."""
    params = SamplingOptions(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps, kv_tokens = [], []
    start = clock.now()
    while engine.has_unfinished():
        running = engine.scheduler.running
        pure = (not engine.scheduler.waiting and len(running) == len(prompts)
                and not any(s.in_prefill for s in running))
        context = sum(s.num_computed + 1 for s in running)  # each reads its cached tokens and the new one
        t0 = clock.now()
        engine.step()
        if pure:
            steps.append(clock.now() - t0)
            kv_tokens.append(context)
    total = clock.now() - start
    return dict(steps=steps, kv_tokens=kv_tokens, total_s=total)


def run_eager(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, clock: Clock, tag: str) -> dict | None:
    """`run_ours` with the engine's decode graphs set aside, which is what they save; None without graphs."""
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is None:
        return None
    engine.runner.graphs = None
    try:
        run_ours(engine, prompts, 3, clock, f"warm-{tag}")
        return run_ours(engine, prompts, new_tokens, clock, tag)
    finally:
        engine.runner.graphs = graphs


def run_transformers(model, prompts: list[list[int]], new_tokens: int, pad_id: int, clock: Clock) -> dict:
    """One `generate` of the batch; a logits processor stamps the time each token's logits are ready."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamps(LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(clock.now())
            return scores

    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    stamps = Stamps()
    start = clock.now()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
                             logits_processor=LogitsProcessorList([stamps]))
    total = clock.now() - start
    if out.shape[1] != ids.shape[1] + new_tokens or len(stamps.times) != new_tokens:
        raise BenchError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens ({len(stamps.times)} "
                         f"stamped), not {new_tokens}")
    return dict(steps=[b - a for a, b in zip(stamps.times, stamps.times[1:])], total_s=total)


def decode_read_bytes(engine: LLMEngine, batch: int, kv_tokens: float) -> int:
    """Bytes one decode step of `batch` sequences over `kv_tokens` context tokens in all must read."""
    model, cfg = engine.model, engine.model_config
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    weights = sum(model.slot_layout(bits)[1] for bits in model.layer_bits)
    head = model.lm_head.numel() * itemsize + batch * cfg.hidden_size * itemsize
    return int(weights + head + kv_tokens * kv_bytes_per_token(cfg, model.dtype))


def decode_section(engine: LLMEngine, path: Path, args, clock: Clock, copy_gbs: float) -> dict:
    device, dtype = torch.device(engine.config.device), engine.model.dtype
    print("\nloading transformers for the same checkpoint ...", flush=True)
    reference = load_transformers(path, dtype, device)
    pad_id = engine.eos_token_ids[0] if engine.eos_token_ids else 0
    vocab = engine.model_config.vocab_size
    rows = []
    try:
        for b, batch in enumerate(args.batch_list):
            prompts = random_prompts(batch, args.prompt_tokens, vocab, args.seed + b)
            # Warm-up at this batch: kernels specialise on it (Triton compiles, cuBLAS picks algorithms).
            run_ours(engine, prompts, 3, clock, f"warm{batch}")
            run_transformers(reference, prompts, 3, pad_id, clock)
            ours = run_ours(engine, prompts, args.new_tokens, clock, f"b{batch}")
            eager = run_eager(engine, prompts, args.new_tokens, clock, f"eager{batch}")
            theirs = run_transformers(reference, prompts, args.new_tokens, pad_id, clock)
            ours_s, theirs_s = statistics.fmean(ours["steps"]), statistics.fmean(theirs["steps"])
            eager_s = statistics.fmean(eager["steps"]) if eager else None
            kv_tokens = statistics.fmean(ours["kv_tokens"])
            read = decode_read_bytes(engine, batch, kv_tokens)
            roofline_s = read / (copy_gbs * 1e9)
            generated = batch * args.new_tokens
            rows.append(dict(
                batch=batch, ours_step_ms=ours_s * 1e3, ours_step_p50_ms=statistics.median(ours["steps"]) * 1e3,
                ours_decode_steps=len(ours["steps"]), ours_decode_tok_s=batch / ours_s,
                ours_e2e_tok_s=generated / ours["total_s"], transformers_step_ms=theirs_s * 1e3,
                transformers_step_p50_ms=statistics.median(theirs["steps"]) * 1e3,
                transformers_decode_tok_s=batch / theirs_s, transformers_e2e_tok_s=generated / theirs["total_s"],
                ours_eager_step_ms=eager_s * 1e3 if eager else None, graph_speedup=eager_s / ours_s if eager else None,
                speedup=theirs_s / ours_s, kv_tokens_mean=kv_tokens, read_bytes=read, roofline_ms=roofline_s * 1e3,
                roofline_fraction=roofline_s / ours_s, transformers_roofline_fraction=roofline_s / theirs_s))
    finally:
        attn = getattr(reference.config, "_attn_implementation", None)
        del reference
        release(device)
    print_table("decode step by batch (ms; tok/s of decode steps alone; fraction of the copy-bandwidth roofline)",
                ["batch", "ours ms", "eager ms", "hf ms", "speedup", "ours tok/s", "hf tok/s", "roofline ms",
                 "ours frac", "hf frac"],
                [[r["batch"], r["ours_step_ms"], r["ours_eager_step_ms"], r["transformers_step_ms"], r["speedup"],
                  r["ours_decode_tok_s"], r["transformers_decode_tok_s"], r["roofline_ms"], r["roofline_fraction"],
                  r["transformers_roofline_fraction"]] for r in rows])
    return dict(rows=rows, transformers_attention=attn, roofline_convention=COPY_CONVENTION,
                ours_timing="mean wall time of engine.step() calls that decode every sequence of the batch and "
                            "prefill nothing (synchronized); ours_eager_step_ms: the same run with the decode graphs "
                            "set aside (null without graphs: off CUDA, or --enforce-eager)",
                transformers_timing="mean time between consecutive tokens' logits in one generate call (after "
                                    "the first token)")


# --- charts -----------------------------------------------------------------------------------

def plot(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = (result.get("decode") or {}).get("rows")
    if rows:
        x = range(len(rows))
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([i - 0.2 for i in x], [r["ours_step_ms"] for r in rows], 0.4, label="morphling")
        ax.bar([i + 0.2 for i in x], [r["transformers_step_ms"] for r in rows], 0.4, label="transformers")
        ax.plot(list(x), [r["roofline_ms"] for r in rows], "k_", markersize=30, label="roofline (copy bandwidth)")
        ax.set_xticks(list(x), [str(r["batch"]) for r in rows])
        ax.set_xlabel("sequences in the batch")
        ax.set_ylabel("decode step (ms)")
        config, where = result["config"], result["machine"].get("gpu", "CPU")
        ax.set_title(f"{config['shape']} {config['dtype']} on {where}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "engine_gpu_decode.png", dpi=120)
        plt.close(fig)
        written.append("engine_gpu_decode.png")
    linear = (result.get("kernels") or {}).get("linear")
    if linear:
        cases = list(dict.fromkeys((r["out_features"], r["in_features"], r["rows"]) for r in linear))
        names = [n for n in dict.fromkeys(r["kernel"] for r in linear) if n != "cublas"]
        fig, ax = plt.subplots(figsize=(10, 4))
        width = 0.8 / max(1, len(names))
        for j, name in enumerate(names):
            got = {(r["out_features"], r["in_features"], r["rows"]): r.get("speedup_vs_cublas") or 0.0
                   for r in linear if r["kernel"] == name}
            ax.bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(cases))],
                   [got.get(c, 0.0) for c in cases], width, label=name)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xticks(range(len(cases)), [f"{n}x{k}\nM={m}" for n, k, m in cases], fontsize=8)
        ax.set_ylabel("speed-up over cuBLAS")
        ax.set_title("weight-only linears vs cuBLAS (0 = unavailable)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "engine_gpu_kernels.png", dpi=120)
        plt.close(fig)
        written.append("engine_gpu_kernels.png")
    return written


# --- the run ----------------------------------------------------------------------------------

def engine_sections(path: Path, args, device: torch.device, dtype_name: str, clock: Clock, copy_gbs: float,
                    result: dict, save) -> None:
    """Decode and swap: one engine for both, freed on return so that the kernels get the device to themselves."""
    dtype = DTYPES[dtype_name]
    cfg = load_checkpoint(str(path)).config
    steps_needed = max(args.new_tokens, args.swap_steps + 1 if "swap" in args.section_list else 0)
    max_len = args.prompt_tokens + steps_needed
    tokens = max(max(args.batch_list) * max_len, args.swap_batch * max_len)
    budget = (parse_size(args.memory_budget) if args.memory_budget
              else memory_budget(cfg, dtype, tokens, device, "decode" in args.section_list))
    result["config"]["memory_budget_bytes"] = budget
    engine = LLMEngine(EngineConfig(model=str(path), device=str(device), dtype=dtype_name, memory_budget=budget,
                                    block_size=BLOCK_SIZE, max_model_len=max_len,
                                    max_num_seqs=max(max(args.batch_list), args.swap_batch), seed=args.seed))
    # Whether decode steps replay captured CUDA graphs (the engine's default on CUDA) or run eagerly.
    result["config"]["cuda_graphs"] = getattr(engine.runner, "graphs", None) is not None
    itemsize = torch.empty((), dtype=dtype).element_size()
    result["model"] = dict(
        name=cfg.name, architecture=cfg.architecture, layers=cfg.num_layers, hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        vocab=cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
        decoder_bytes=cfg.num_layers * engine.model.slot_layout(engine.model.full_bits)[1],
        lm_head_bytes=engine.model.lm_head.numel() * itemsize, kv_bytes_per_token=kv_bytes_per_token(cfg, dtype))
    if "decode" in args.section_list:
        t0 = time.perf_counter()
        result["decode"] = decode_section(engine, path, args, clock, copy_gbs)
        result["seconds"]["decode"] = time.perf_counter() - t0
        save(json.dumps(result, indent=2))
    if "swap" in args.section_list:
        t0 = time.perf_counter()
        result["swap"] = swap_section(engine, args, clock)
        result["seconds"]["swap"] = time.perf_counter() - t0
        save(json.dumps(result, indent=2))


def run(args) -> dict:
    """`bench-engine` with --device or --shape: the args of engine.py's parser."""
    started = time.perf_counter()
    device = torch.device(args.device or "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda, but torch sees no CUDA device here")
    dtype_name = EngineConfig(device=str(device), dtype=args.dtype).resolved_dtype()
    args.batch_list = [int(b) for b in (args.batches or DEFAULTS["batches"]).split(",")]
    args.new_tokens = args.new_tokens or DEFAULTS["new_tokens"]
    args.section_list = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(args.section_list) - set(SECTIONS)
    if unknown:
        raise BenchError(f"unknown --sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    args.swap_batch = args.swap_batch or min(args.batch_list)
    if args.swap_steps <= SWAP_PLAN[0][0] + 1:
        raise BenchError(f"--swap-steps must be above {SWAP_PLAN[0][0] + 1}: the first swap comes after "
                         f"{SWAP_PLAN[0][0]} decode steps")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    clock = Clock(device)

    written_before = cached_checkpoint(args.shape, dtype_name, args.cache_dir, str(device)) is not None
    t0 = time.perf_counter()
    path = ensure_checkpoint(args.shape, dtype_name, args.cache_dir, str(device))
    result = dict(
        machine=machine_info(device), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        config=dict(shape=args.shape, checkpoint=str(path), device=str(device), dtype=dtype_name,
                    batches=args.batch_list, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                    memory_budget=args.memory_budget or "auto", block_size=BLOCK_SIZE, seed=args.seed,
                    sections=args.section_list, swap_batch=args.swap_batch, swap_steps=args.swap_steps,
                    swap_plan=[dict(after_decode_steps=s, to_bits=b or "full") for s, b in SWAP_PLAN]),
        checkpoint=dict(path=str(path), cached=written_before or args.shape not in SHAPES,
                        seconds=time.perf_counter() - t0),
        seconds={})

    t0 = time.perf_counter()
    result["copy_bandwidth"] = copy = copy_bandwidth(device)
    result["seconds"]["copy"] = time.perf_counter() - t0
    release(device)  # the copy's buffers, before free memory sizes the arena
    print_table(f"copy bandwidth on {device}", ["MiB", "median ms", "GB/s (read+write)"],
                [[copy["bytes"] >> 20, copy["median_ms"], copy["gbs"]]])

    # Written after every section as well: a run cut short (a device lent for minutes) keeps what it measured.
    save = (args.out / RESULT_FILE).write_text
    save(json.dumps(result, indent=2))
    if {"decode", "swap"} & set(args.section_list):
        engine_sections(path, args, device, dtype_name, clock, copy["gbs"], result, save)
        release(device)
    if "kernels" in args.section_list:
        t0 = time.perf_counter()
        result["kernels"] = kernel_section(device, DTYPES[dtype_name], copy["gbs"], args.seed)
        result["seconds"]["kernels"] = time.perf_counter() - t0
    result["seconds"]["total"] = time.perf_counter() - started
    result["charts"] = plot(result, args.out)
    save(json.dumps(result, indent=2))
    print(f"\nwrote {args.out / RESULT_FILE}" + "".join(f", {args.out / c}" for c in result["charts"])
          + f" in {result['seconds']['total']:.0f} s")
    return result
