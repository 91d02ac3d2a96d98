"""`morphling profile --speedup`: the coefficients of CoCoServe's speed-up model (§4.1, Eqs. 1–4), fitted from
times measured on this machine with the real engine and the real fabric.

The model needs W(P), the compute of a replication strategy, and T(P), the hops it adds. Both are lines here:

- layer: one decoder layer over a decode batch of t sequences (t tokens) on one executor, a + b·t. Each
  layer is timed on the batch the engine's next step would run, one `run_layers` call per layer; the median
  over `--repeats` is taken per layer, then the mean over layers.
- hop: B bytes of hidden states (t tokens × hidden size × dtype bytes) moved between two executors the way
  the fabric moves them (a broadcast in the pair's gloo group, fabric/member.py), h0 + h1·B. Two processes
  join one world; half the median round trip is the hop.
- all-reduce: the same B bytes summed across the pair (`dist.all_reduce` in its group), r0 + r1·B, the median
  of as many rounds. A TP instance's layer does two (fabric/member.py: attention's and the FFN's outputs), and
  over gloo one costs more than a hop: the simulator's TP step reads this line (simulator/tp.py).
- step overhead: the rest of a whole engine step at t sequences (embedding, logits, sampling, scheduling,
  detokenizing), o0 + o1·t: a step's time less the time of its n layers, timed right after it on the same
  batch, the median over repeats (differences of paired timings: a neighbour's burst of work on the shared
  cores slows both alike).

Every line is a least-squares fit whose coefficients are not negative (fit_line). `samples` holds the points
each line was fitted to, so fit_line(samples[k]) gives the line back; "step" holds the overheads, not whole
steps (a whole step is about the overhead plus num_layers times the layer time at the same t).

The deployments this models run two executors on one machine's cores, so every measurement runs with
`--threads` torch threads (half the cores by default). Written as JSON (shared/core/speedup.py
loads it) with a PNG of the points and lines beside it:

  {"kind": "speedup-profile", "model", "device", "threads", "num_layers", "hidden_size", "dtype_bytes",
   "layer": {"intercept_s", "per_token_s"}, "hop": {"intercept_s", "per_byte_s"},
   "all_reduce": {"intercept_s", "per_byte_s"}, "step_overhead": {"intercept_s", "per_token_s"},
   "samples": {"layer": [[tokens, s], ...], "hop": [[bytes, s], ...], "all_reduce": [[bytes, s], ...],
               "step": [[tokens, s], ...]},
   "context_tokens", "repeats", "machine", "seconds", "date"}
"""

import argparse
import multiprocessing
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from services.executor.engine.engine import LLMEngine
from services.executor.engine.morphing.importance import write_json
from services.executor.fabric.world import World, WorldSettings, checked
from shared.config import RESULTS_DIR, EngineConfig, parse_size
from shared.core.speedup import Line
from shared.net import free_port
from shared.sampling import SamplingOptions

DEFAULT_OUT = RESULTS_DIR / "speedup_profile.json"
DEFAULT_SIZES = (1, 2, 4, 8, 16, 32)
# A hop carries a decode batch's rows or a prefill chunk's tokens: up to the default per-step token budget.
DEFAULT_HOP_TOKENS = (1, 4, 16, 64, 256, 512)
HOP_WARMUP = 3  # gloo connects lazily: the first round trips of a pair pay for it
HOP_ROUNDS = 100  # a hop costs far less than a step: many rounds cost a second or two and steady the median
# Room beyond the prompt and the timed steps for the steps a batch's prefill takes, while its first sequences
# already decode: a sequence that reached the end would leave the batch.
GROWTH_TOKENS = 512
WORLD_TIMEOUT_S = 30.0


class ProfileError(RuntimeError):
    """The measurement could not be taken as asked (for example, the arena is too small for the batch)."""


def fit_line(points: Sequence[Sequence[float]]) -> Line:
    """The least-squares line through `points` [(x, y), ...] with intercept ≥ 0 and slope ≥ 0.

    A negative cost means nothing to the speed-up model, yet noise can tilt a free fit below zero (a layer
    time that barely grows, a hop whose fixed cost dwarfs its bytes). With two coefficients the constrained
    optimum is the free one when that is feasible, else the better of the two one-coefficient fits.
    """
    xs = np.array([p[0] for p in points], dtype=np.float64)
    ys = np.array([p[1] for p in points], dtype=np.float64)
    if len(set(xs.tolist())) < 2:
        raise ValueError(f"a line needs points at two different x at least, got x = {xs.tolist()}")
    slope, intercept = np.polyfit(xs, ys, 1)
    if slope >= 0 and intercept >= 0:
        return Line(float(intercept), float(slope))
    flat = Line(max(0.0, float(ys.mean())), 0.0)
    through_origin = Line(0.0, max(0.0, float(xs @ ys / (xs @ xs))))
    return min((flat, through_origin), key=lambda line: float(((line.intercept + line.slope * xs - ys) ** 2).sum()))


# --- compute: decode batches on one engine -----------------------------------------------------------

@dataclass(frozen=True)
class BatchTiming:
    tokens: int  # sequences decoding together, one token each
    layer_s: float  # one decoder layer: the median over repeats, averaged over layers
    step_s: float  # a whole engine step: the median over repeats
    overhead_s: float  # a step less its layers: the median over repeats


@contextmanager
def decoding(engine: LLMEngine, size: int, context: int) -> Iterator[None]:
    """`size` fresh sequences of `context` prompt tokens decoding together, aborted on the way out. All start
    at once, so their contexts stay as long as one another: the runner attends to them as one group."""
    params = SamplingOptions(temperature=0.0, max_tokens=None, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    request_ids = [f"speedup-{size}-{k}" for k in range(size)]
    try:
        for k, request_id in enumerate(request_ids):
            engine.add_request(request_id, [(k * context + j) % vocab for j in range(context)], params)
        while engine.scheduler.waiting or any(seq.in_prefill for seq in engine.scheduler.running):
            engine.step()
        stats = engine.stats()
        if stats.preemptions or stats.finished or len(engine.scheduler.running) != size:
            raise ProfileError(f"could not keep {size} sequences of {context}+ tokens decoding together "
                               f"({len(engine.scheduler.running)} running, {stats.preemptions} preempted, "
                               f"{stats.finished} finished): raise --memory-budget or lower --context")
        yield
    finally:
        for request_id in request_ids:
            engine.abort(request_id)
        engine.step()  # hands the aborts out, freeing their pages


def time_layers(engine: LLMEngine, size: int) -> list[float]:
    """Seconds each decoder layer takes over the batch the engine's next step would run, `size` decodes; the
    step stays undone (scheduling it again reserves nothing new), so the next engine.step() runs that batch."""
    out = engine.scheduler.schedule()
    if out.copies or len(out.chunks) != size or any(chunk.length != 1 for chunk in out.chunks):
        raise ProfileError(f"the next step is not {size} plain decodes but {[c.length for c in out.chunks]} "
                           f"tokens a sequence: cannot time its layers")
    kv_cache = engine.arena.kv_cache
    if out.fresh_pages:  # as ModelRunner.run does: attention reads past a context inside its last page
        kv_cache[torch.tensor(out.fresh_pages, dtype=torch.int64, device=kv_cache.device)] = 0
    batch, _ = engine.runner.build(out.chunks)
    model = engine.model
    x = model.embed(batch.input_ids)
    seconds = []
    for index in range(model.cfg.num_layers):
        start = time.perf_counter()
        x = model.run_layers(x, batch, range(index, index + 1))
        seconds.append(time.perf_counter() - start)
    return seconds


def measure_batches(engine: LLMEngine, sizes: Sequence[int], context: int, repeats: int,
                    report: Callable[[BatchTiming], None] = lambda timing: None) -> list[BatchTiming]:
    """Layer and whole-step times of decode batches of each size, smallest first."""
    timings = []
    for size in sorted(sizes):
        with decoding(engine, size, context):
            engine.step()  # the first decode, and the allocator's first batch of this shape
            steps, layers = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
                layers.append(time_layers(engine, size))
        per_layer = statistics.fmean(statistics.median(run[i] for run in layers) for i in range(len(layers[0])))
        overheads = [step - sum(run) for step, run in zip(steps, layers)]
        timings.append(BatchTiming(size, per_layer, statistics.median(steps), statistics.median(overheads)))
        report(timings[-1])
    return timings


# --- hops: two processes in one world ----------------------------------------------------------------

def _echo(url: str, token_counts: Sequence[int], hidden: int, dtype: torch.dtype, threads: int) -> None:
    """Rank 1: return every tensor rank 0 sends, and join every all-reduce, as many times as measure_hops."""
    torch.set_num_threads(threads)
    world = World.join(WorldSettings(url, 1, 2, WORLD_TIMEOUT_S), "exec1", "cpu")
    try:
        pair = world.group(("exec0", "exec1"))
        with checked("echoing hidden states to exec0"):
            for tokens in token_counts:
                buffer = torch.empty(tokens, hidden, dtype=dtype)
                for _ in range(HOP_WARMUP + HOP_ROUNDS):
                    dist.broadcast(buffer, group=pair, group_src=0)
                    dist.broadcast(buffer, group=pair, group_src=1)
                for _ in range(HOP_WARMUP + HOP_ROUNDS):
                    dist.all_reduce(buffer, group=pair)
    finally:
        world.close()


def median_round(run: Callable[[], object]) -> float:
    """The median seconds of `run` over HOP_ROUNDS rounds after HOP_WARMUP."""
    seconds = []
    for _ in range(HOP_WARMUP + HOP_ROUNDS):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[HOP_WARMUP:])


def measure_hops(token_counts: Sequence[int], hidden: int, dtype: torch.dtype, threads: int
                 ) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(bytes, seconds) of moving `tokens` rows of hidden states from one executor to another, and of summing
    them across the two, for each count: this process is rank 0 of a world of two, a spawned one rank 1."""
    url = f"tcp://127.0.0.1:{free_port()}"
    echo = multiprocessing.get_context("spawn").Process(
        target=_echo, args=(url, list(token_counts), hidden, dtype, threads), daemon=True)
    echo.start()
    world = None
    try:
        world = World.join(WorldSettings(url, 0, 2, WORLD_TIMEOUT_S), "exec0", "cpu")
        pair = world.group(("exec0", "exec1"))
        hops, reduces = [], []
        with checked("timing hidden-state hops and all-reduces between exec0 and exec1"):
            for tokens in token_counts:
                rows = torch.randn(tokens, hidden).to(dtype)
                size = rows.numel() * rows.element_size()
                trip = median_round(lambda: (dist.broadcast(rows, group=pair, group_src=0),
                                             dist.broadcast(rows, group=pair, group_src=1)))
                hops.append((size, trip / 2))
                reduces.append((size, median_round(lambda: dist.all_reduce(rows, group=pair))))
        return hops, reduces
    finally:
        if world is not None:
            world.close()
        echo.join(timeout=WORLD_TIMEOUT_S)
        if echo.is_alive():
            echo.kill()


# --- the record ---------------------------------------------------------------------------------------

def coefficients(line: Line, per: str) -> dict:
    return {"intercept_s": line.intercept, f"per_{per}_s": line.slope}


def speedup_profile(engine: LLMEngine, model: str, threads: int, context: int, repeats: int,
                    batches: list[BatchTiming], hops: list[tuple[int, float]],
                    reduces: list[tuple[int, float]]) -> dict:
    cfg = engine.model_config
    layer = [[b.tokens, b.layer_s] for b in batches]
    step = [[b.tokens, b.overhead_s] for b in batches]
    hop = [[size, seconds] for size, seconds in hops]
    reduce = [[size, seconds] for size, seconds in reduces]
    return {"kind": "speedup-profile", "model": model, "device": engine.config.device, "threads": threads,
            "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "dtype_bytes": engine.model.embed_tokens.element_size(),
            "layer": coefficients(fit_line(layer), "token"), "hop": coefficients(fit_line(hop), "byte"),
            "all_reduce": coefficients(fit_line(reduce), "byte"),
            "step_overhead": coefficients(fit_line(step), "token"),
            "samples": {"layer": layer, "hop": hop, "all_reduce": reduce, "step": step},
            "context_tokens": context, "repeats": repeats,
            "machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "cpus": len(os.sched_getaffinity(0))},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def plot(record: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (samples, fitted line, its slope, title, x unit and its scale from the samples' x, y unit and its scale)
    panels = [("layer", "layer", "per_token_s", "one decoder layer", "token", 1.0, "ms", 1e3),
              ("hop", "hop", "per_byte_s", "one hop of hidden states", "KiB", 1 / 1024, "µs", 1e6),
              ("all_reduce", "all_reduce", "per_byte_s", "one all-reduce of hidden states", "KiB", 1 / 1024, "µs",
               1e6),
              ("step", "step_overhead", "per_token_s", "step overhead (step − n·layer)", "token", 1.0, "ms", 1e3)]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    for ax, (name, fitted, slope, title, x_unit, x_scale, y_unit, y_scale) in zip(axes, panels):
        xs = [p[0] for p in record["samples"][name]]
        ax.plot([x * x_scale for x in xs], [p[1] * y_scale for p in record["samples"][name]], "o", label="measured")
        line = Line(record[fitted]["intercept_s"], record[fitted][slope])
        ends = [0, max(xs)]
        ax.plot([x * x_scale for x in ends], [line.at(x) * y_scale for x in ends], "-",
                label=f"{line.intercept * y_scale:.3g} {y_unit} + "
                      f"{line.slope * y_scale / x_scale:.3g} {y_unit}/{x_unit}")
        ax.set_title(title)
        ax.set_xlabel(f"{x_unit}s in the batch" if x_unit == "token" else x_unit)
        ax.set_ylabel(y_unit)
        ax.legend(fontsize=8)
    fig.suptitle(f"speed-up model coefficients: {record['model']} on {record['device']}, "
                 f"{record['threads']} torch thread(s) per executor")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def positive(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return int(text)


def sizes_arg(text: str) -> tuple[int, ...]:
    sizes = tuple(sorted({int(s) for s in text.split(",") if s.strip()}))
    if len(sizes) < 2 or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"need two different positive sizes at least, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> dict:
    cores = len(os.sched_getaffinity(0))
    ap = argparse.ArgumentParser(prog="morphling profile --speedup", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--memory-budget", default="800MiB", help="the arena: the layers plus the KV of every batch")
    ap.add_argument("--threads", type=positive, default=max(1, cores // 2),
                    help="torch threads of each executor (default: half the cores, as two executors share them)")
    ap.add_argument("--sizes", type=sizes_arg, default=DEFAULT_SIZES, help="decode batch sizes, comma-separated")
    ap.add_argument("--hop-tokens", type=sizes_arg, default=DEFAULT_HOP_TOKENS,
                    help="rows of hidden states per timed hop, comma-separated")
    ap.add_argument("--context", type=positive, default=32, help="prompt tokens of each decoding sequence")
    ap.add_argument("--repeats", type=positive, default=9, help="timed steps per batch size (the median is kept)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON to write (the PNG goes beside it)")
    args = ap.parse_args(argv)

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, memory_budget=parse_size(args.memory_budget),
                          max_model_len=args.context + args.repeats + GROWTH_TOKENS, max_num_seqs=max(args.sizes))
    engine = LLMEngine(config, progress=False)
    cfg = engine.model_config
    print(f"{args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}; {args.threads} threads, "
          f"{args.repeats} repeats, {args.context}-token prompts", flush=True)
    print(f"{'tokens':>6} {'layer ms':>9} {'step ms':>9} {'overhead ms':>12}", flush=True)
    batches = measure_batches(engine, args.sizes, args.context, args.repeats, lambda b: print(
        f"{b.tokens:>6} {b.layer_s * 1e3:>9.3f} {b.step_s * 1e3:>9.2f} {b.overhead_s * 1e3:>12.2f}",
        flush=True))
    dtype = engine.model.embed_tokens.dtype
    hops, reduces = measure_hops(args.hop_tokens, cfg.hidden_size, dtype, args.threads)
    print(f"{'tokens':>6} {'bytes':>9} {'hop µs':>9} {'all-reduce µs':>14}")
    for tokens, (size, seconds), (_, summed) in zip(args.hop_tokens, hops, reduces):
        print(f"{tokens:>6} {size:>9} {seconds * 1e6:>9.1f} {summed * 1e6:>14.1f}")
    record = speedup_profile(engine, args.model, args.threads, args.context, args.repeats, batches, hops, reduces)
    record["seconds"] = round(time.perf_counter() - started, 1)
    layer, hop, overhead, reduce = record["layer"], record["hop"], record["step_overhead"], record["all_reduce"]
    print(f"layer:         {layer['intercept_s'] * 1e3:.4f} ms + {layer['per_token_s'] * 1e3:.4f} ms/token\n"
          f"hop:           {hop['intercept_s'] * 1e6:.2f} µs + {hop['per_byte_s'] * 1e9:.4f} ns/byte\n"
          f"all-reduce:    {reduce['intercept_s'] * 1e6:.2f} µs + {reduce['per_byte_s'] * 1e9:.4f} ns/byte\n"
          f"step overhead: {overhead['intercept_s'] * 1e3:.4f} ms + {overhead['per_token_s'] * 1e3:.4f} ms/token")
    write_json(args.out, record)
    plot(record, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} ({record['seconds']:.0f} s)")
    return record
