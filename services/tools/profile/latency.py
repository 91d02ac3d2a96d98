"""`morphling profile --latency`: the coefficients of SplitQuant's latency cost model (§IV-A) for this machine.

The model (shared/core/planner/latency.py) predicts the seconds of one decoder layer in each phase at
each precision; its coefficients are fitted here from times measured with the real engine. A layer is timed
as the engine runs it: `DecoderModel.run_layers` over the ForwardBatch the runner builds from the
scheduler's chunks, with every layer at the measured precision (set by the engine's swapper; 16 stands for
the serving dtype's full precision, float32 on CPU). On CUDA a decode layer is its captured graph replayed
(graphs.py), as the engine serves decode there, and every time is taken with CUDA events. At each point:

- prefill: v fresh sequences of s prompt tokens, admitted whole in one step (the step's token budget is
  raised to hold v·s). The step is scheduled, its layers timed, and the sequences aborted unrun.
- decode: v sequences one token each at c past tokens (profile_speedup.decoding: prompts of c tokens,
  prefilled by the engine). A decode's time does not depend on the values in the KV, and going down in
  precision only releases slot pages, so one prefill per c serves every precision, timed widest first;
  a smaller batch is the first v of the step's decodes. That prefill of the whole model is most of a run.

A point's time is, per timed layer, the median over --repeats runs (--decode-repeats for decode: a decode
layer takes milliseconds, so many runs cost little and steady a median that a neighbour's burst of work on
shared cores would shift) after one untimed run, the allocator's first of that shape; then the mean over
--layers-timed layers spread over the depth. On a CPU that is every layer, in the step's order: there a
decode layer timed among four spread ones came out 17-37% faster than among all 30 in turn, as a whole step
runs them (batches 2-16 of SmolLM2-135M, docs/benchmarks.md, "The machine's own repeat"), and a profile so timed
predicted served steps short. On CUDA, where a layer is one replayed graph and the GPU's time is scarce, four:
the layers share one shape.

Each (phase, bits) is fitted on the grid (latency.fit: the features of latency.PREFILL_FEATURES and
DECODE_FEATURES). Held-out points off the grid, batches and lengths between the grid's like the paper's
"unseen workloads" (§VI-B), give the fit's error: |predicted − measured| / measured, its mean and maximum.
The default grid takes about ten minutes for SmolLM2-135M on two shared CPU cores (one torch thread, every layer
timed; two minutes timing four).

Written as JSON (shared/core/planner/latency.py load_profile reads it) with a PNG of predicted
against measured beside it:

  {"kind": "latency-profile", "device", "model", "shape": {hidden_size, intermediate_size, num_heads,
   num_kv_heads, head_dim, dtype_bytes, num_layers}, "threads", "dtype", "bits", "layers_timed", "repeats",
   "decode_repeats", "features": {"prefill", "decode"},
   "coefficients": {"prefill": {"16": [...], ...}, "decode": {...}},
   "fit_error": {"prefill": {"16": {"mean_rel", "max_rel", "points"}, ...}, "decode": {...}} (held out),
   "sample_error": (the same on the grid), "samples": {"prefill": [{"bits", "batch", "prompt", "seconds"}],
   "decode": [{"bits", "batch", "context", "seconds"}]}, "heldout": (the same shape), "config", "machine",
   "seconds", "date"}
"""

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import torch
from tqdm import tqdm

from services.executor.engine.engine import LLMEngine
from services.executor.engine.model.decoder import ForwardBatch
from services.executor.engine.morphing.importance import write_json
from services.tools.profile.speedup import ProfileError, decoding, positive
from services.tools.shapes import SHAPES, ensure_checkpoint
from shared.config import RESULTS_DIR, EngineConfig, parse_size, served_model_name
from shared.core.planner.devices import table_name
from shared.core.planner.latency import FEATURES, FittedLatency, fit, fit_error
from shared.core.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from shared.provenance import provenance
from shared.sampling import SamplingOptions

DEFAULT_OUT = RESULTS_DIR / "latency_profile.json"
PROFILED_BITS = (16, 8, 4)
FULL = 16  # the profile's name for the serving dtype's full precision
LENGTH = {"prefill": "prompt", "decode": "context"}  # what a sample's second coordinate is called
# A decoding sequence holds its c prompt tokens and the one the prefill sampled; the engine ends one that
# reaches max_model_len, so the longest length needs a little room beyond it.
ROOM_TOKENS = 8
GPU_LAYERS_TIMED = 4

Point = tuple[int, int]  # (batch, prompt or context)
T = TypeVar("T")


# --- timing --------------------------------------------------------------------------------------------

def spread(num_layers: int, count: int) -> list[int]:
    """`count` layer indices spread evenly from the first layer to the last."""
    count = min(count, num_layers)
    if count == 1:
        return [num_layers // 2]
    return sorted({round(k * (num_layers - 1) / (count - 1)) for k in range(count)})


def layers_timed(num_layers: int, given: int | None, device: str) -> list[int]:
    """The layers each point times: `given` spread over the depth, by default every one on a CPU and
    GPU_LAYERS_TIMED on CUDA (the module's docstring says why)."""
    return spread(num_layers, given or (num_layers if device == "cpu" else GPU_LAYERS_TIMED))


def set_bits(engine: LLMEngine, bits: int) -> None:
    """Every decoder layer at `bits` (FULL: restored to the serving dtype's own precision)."""
    layers = list(range(engine.model_config.num_layers))
    if bits == FULL:
        engine.swapper.restore(layers)
    else:
        engine.swapper.set_bits(layers, bits)


def scheduled(engine: LLMEngine) -> SchedulerOutput:
    """The engine's next step, left undone (scheduling it again reserves nothing new), its fresh pages zeroed
    as ModelRunner.run does: attention reads past a context inside its last page."""
    out = engine.scheduler.schedule()
    if out.fresh_pages:
        kv_cache = engine.arena.kv_cache
        kv_cache[torch.tensor(out.fresh_pages, dtype=torch.int64, device=kv_cache.device)] = 0
    return out


def elapsed(run: Callable[[], T], cuda: bool) -> tuple[T, float]:
    """What `run` returns, and the seconds it takes with the device idle before it. On CUDA, events around
    it: a host clock would count its own wait, tens of microseconds against a decode layer's hundred or two."""
    if not cuda:
        start = time.perf_counter()
        result = run()
        return result, time.perf_counter() - start
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    result = run()
    end.record()
    end.synchronize()
    return result, start.elapsed_time(end) / 1000


def median_mean(runs: list[list[float]]) -> float:
    """Per timed layer the median over the runs after the first (the allocator's first of that shape), then
    the mean over the layers."""
    return statistics.fmean(statistics.median(run[i] for run in runs[1:]) for i in range(len(runs[0])))


def layer_seconds(engine: LLMEngine, batch: ForwardBatch, layers: list[int], repeats: int) -> float:
    """Seconds one decoder layer takes over `batch`, run eagerly (median_mean over `repeats` runs and
    `layers`). Each run goes through `layers` in turn from the batch's embeddings, so every layer sees
    hidden states of the right shape."""
    model, cuda = engine.model, engine.arena.buffer.is_cuda
    runs = []
    for _ in range(repeats + 1):
        x = model.embed(batch.input_ids)
        run = []
        for index in layers:
            x, seconds = elapsed(lambda: model.run_layers(x, batch, range(index, index + 1)), cuda)
            run.append(seconds)
        runs.append(run)
    return median_mean(runs)


def replayed_layer_seconds(engine: LLMEngine, decodes: list[ScheduledChunk], layers: list[int], repeats: int
                           ) -> float:
    """Seconds one decoder layer takes in a decode step of `decodes` as the engine runs it on CUDA: its graph
    at the bits the layer holds, replayed in the bucket that holds the batch (graphs.py), padding rows
    included. Timing decode eagerly there would charge each layer its kernels' launches, which the graphs
    exist to remove (4.4x at batch 1, docs/benchmarks.md). The hidden states pass through `layers` in turn,
    as in layer_seconds."""
    graphs, cuda, bits = engine.runner.graphs, engine.arena.buffer.is_cuda, engine.model.layer_bits
    static = graphs.prepare(decodes)
    runs = [[elapsed(lambda: graphs.play_layer(static, index, bits[index]), cuda)[1] for index in layers]
            for _ in range(repeats + 1)]
    return median_mean(runs)


def prompt_ids(engine: LLMEngine, index: int, length: int) -> list[int]:
    """A prompt of its own for each sequence, as profile_speedup.decoding makes them."""
    vocab = engine.model_config.vocab_size
    return [(index * length + j) % vocab for j in range(length)]


def time_prefill(engine: LLMEngine, batch_size: int, prompt: int, layers: list[int], repeats: int) -> float:
    """Seconds of one layer prefilling `batch_size` fresh sequences of `prompt` tokens in one step."""
    params = SamplingOptions(temperature=0.0, max_tokens=1, ignore_eos=True)
    request_ids = [f"latency-prefill-{k}" for k in range(batch_size)]
    try:
        for k, request_id in enumerate(request_ids):
            engine.add_request(request_id, prompt_ids(engine, k, prompt), params)
        out = scheduled(engine)
        got = [(chunk.start, chunk.length) for chunk in out.chunks]
        if out.copies or got != [(0, prompt)] * batch_size:
            raise ProfileError(f"the step holds (start, length) {got}, not {batch_size} whole prefills of {prompt} "
                               f"tokens: raise --memory-budget")
        batch, _ = engine.runner.build(out.chunks)
        return layer_seconds(engine, batch, layers, repeats)
    finally:
        for request_id in request_ids:
            engine.abort(request_id)
        engine.step()  # hands the aborts out, freeing their pages


def measure_prefill(engine: LLMEngine, bits: Iterable[int], points: list[Point], layers: list[int], repeats: int,
                    bar: tqdm) -> dict[tuple[int, int, int], float]:
    """(bits, batch, prompt) -> seconds of one layer, for every precision and point."""
    seconds = {}
    for b in bits:
        set_bits(engine, b)
        for v, s in points:
            bar.set_postfix_str(f"prefill {b}-bit {v}×{s}")
            seconds[b, v, s] = time_prefill(engine, v, s, layers, repeats)
            bar.update()
    return seconds


def measure_decode(engine: LLMEngine, bits: Iterable[int], points: list[Point], layers: list[int], repeats: int,
                   bar: tqdm) -> dict[tuple[int, int, int], float]:
    """(bits, batch, context) -> seconds of one layer in one decode step, for every precision and point."""
    widest_first = sorted(bits, reverse=True)
    seconds = {}
    for context in sorted({c for _, c in points}):
        sizes = sorted(v for v, c in points if c == context)
        set_bits(engine, FULL)  # no KV is live here: the slots take their pages back at no cost
        bar.set_postfix_str(f"prefilling {sizes[-1]}×{context} to decode")
        with decoding(engine, sizes[-1], context):
            out = scheduled(engine)
            got = [(chunk.start, chunk.length) for chunk in out.chunks]
            if out.copies or got != [(context, 1)] * sizes[-1]:
                raise ProfileError(f"the step holds (start, length) {got}, not {sizes[-1]} decodes at {context} "
                                   f"past tokens: cannot time its layers")
            replayed = engine.runner.graphs is not None
            # Graphs copy the chunks into their own buffers; eager layers read the runner's batch, built once a size.
            batches = {} if replayed else {v: engine.runner.build(out.chunks[:v])[0] for v in sizes}
            for b in widest_first:
                set_bits(engine, b)
                for v in sizes:
                    bar.set_postfix_str(f"decode {b}-bit {v}×{context}")
                    if replayed:
                        seconds[b, v, context] = replayed_layer_seconds(engine, out.chunks[:v], layers, repeats)
                    else:
                        seconds[b, v, context] = layer_seconds(engine, batches[v], layers, repeats)
                    bar.update()
    return seconds


# --- the record ----------------------------------------------------------------------------------------

def samples(seconds: dict[tuple[int, int, int], float], phase: str, points: list[Point]) -> list[dict]:
    wanted = set(points)
    return [{"bits": b, "batch": v, LENGTH[phase]: n, "seconds": s}
            for (b, v, n), s in sorted(seconds.items(), key=lambda item: (-item[0][0], item[0][1:]))
            if (v, n) in wanted]


def rows(records: list[dict], phase: str, bits: int) -> list[tuple[int, int, float]]:
    return [(r["batch"], r[LENGTH[phase]], r["seconds"]) for r in records if r["bits"] == bits]


def layer_shape(engine: LLMEngine) -> dict:
    cfg = engine.model_config
    return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "dtype_bytes": torch.finfo(engine.model.dtype).bits // 8, "num_layers": cfg.num_layers}


def latency_profile(engine: LLMEngine, args: argparse.Namespace, layers: list[int], measured: dict[str, list[dict]],
                    heldout: dict[str, list[dict]]) -> dict:
    """The record: coefficients fitted on `measured`, their error on `heldout` and on `measured`."""
    fitted = FittedLatency(args.device_name, layer_shape(engine), {
        phase: {b: fit(rows(measured[phase], phase, b), features) for b in args.bits}
        for phase, (_, features) in FEATURES.items()})
    predict = {"prefill": fitted.prefill, "decode": fitted.decode}

    def errors(records: dict[str, list[dict]]) -> dict:
        return {phase: {str(b): fit_error(rows(records[phase], phase, b), lambda v, n: predict[phase](b, v, n))
                        for b in args.bits} for phase in FEATURES}

    stored = fitted.to_profile()
    return {"kind": stored["kind"], "device": args.device_name, "model": args.model, "shape": stored["shape"],
            "threads": args.threads, "dtype": engine.config.resolved_dtype(),
            "bits": list(args.bits), "layers_timed": layers, "repeats": args.repeats,
            "decode_repeats": args.decode_repeats,
            "features": stored["features"], "coefficients": stored["coefficients"],
            "fit_error": errors(heldout), "sample_error": errors(measured),
            "samples": measured, "heldout": heldout, **provenance(args)}


def print_table(record: dict) -> None:
    print(f"{'phase':<8} {'bits':>4}  {'coefficients (seconds per unit of each feature)':<70} "
          f"{'held-out mean':>13} {'max':>7} {'grid mean':>9}")
    for phase, names in record["features"].items():
        for b in record["bits"]:
            terms = " ".join(f"{name}:{c:.3g}" for name, c in zip(names, record["coefficients"][phase][str(b)]))
            held, grid = record["fit_error"][phase][str(b)], record["sample_error"][phase][str(b)]
            print(f"{phase:<8} {b:>4}  {terms:<70} {held['mean_rel']:>13.1%} {held['max_rel']:>7.1%} "
                  f"{grid['mean_rel']:>9.1%}")


def plot(record: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fitted = FittedLatency.from_profile(record)
    predict = {"prefill": fitted.prefill, "decode": fitted.decode}
    colors = dict(zip(record["bits"], plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, phase in zip(axes, FEATURES):
        ends = []
        for key, marker, label in (("samples", "o", "grid"), ("heldout", "x", "held out")):
            for b in record["bits"]:
                points = rows(record[key][phase], phase, b)
                measured = [s * 1e3 for _, _, s in points]
                predicted = [predict[phase](b, v, n) * 1e3 for v, n, _ in points]
                ax.scatter(measured, predicted, marker=marker, color=colors[b], label=f"{b}-bit, {label}")
                ends += measured + predicted
        ax.plot([min(ends), max(ends)], [min(ends), max(ends)], "k:", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured ms")
        ax.set_ylabel("predicted ms")
        ax.set_title(f"{phase}: one decoder layer, over ({' '.join(record['features'][phase])})")
        ax.legend(fontsize=8)
    fig.suptitle(f"latency model: {served_model_name(record['model'])} on {record['device']}, "
                 f"{record['threads']} torch thread(s)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


# --- the command ---------------------------------------------------------------------------------------

def lengths(minimum: int) -> Callable[[str], tuple[int, ...]]:
    """An argparse type for a comma-separated list of at least `minimum` different positive sizes."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            sizes = tuple(sorted({int(s) for s in text.split(",") if s.strip()}))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list of sizes: {text!r}") from None
        if len(sizes) < minimum or sizes[0] < 1:
            raise argparse.ArgumentTypeError(f"need {minimum} different positive sizes at least, got {text!r}")
        return sizes

    return parse


def bits_arg(text: str) -> tuple[int, ...]:
    bits = tuple(sorted({int(b) for b in text.split(",") if b.strip()}, reverse=True))
    if not bits or not set(bits) <= set(PROFILED_BITS):
        raise argparse.ArgumentTypeError(f"bits must be some of {PROFILED_BITS}, got {text!r}")
    return bits


def grid(batches: Iterable[int], sizes: Iterable[int]) -> list[Point]:
    return list(itertools.product(batches, sizes))


def main(argv: list[str] | None = None) -> dict:
    cores = len(os.sched_getaffinity(0))
    ap = argparse.ArgumentParser(prog="morphling profile --latency", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default",
                    help="the served model's name, a checkpoint directory, or with --shape nothing")
    ap.add_argument("--shape", help=f"a named shape ({', '.join(SHAPES)}) of random weights, written once into "
                                    "~/.cache/morphling/shapes: a layer's time depends on its shape, not its weights")
    ap.add_argument("--memory-budget", default="800MiB",
                    help="the arena: the layers at full precision plus the KV of the largest decode batch")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--device-name", help="the devices-table name written into the profile: a plan applies it "
                                          "to devices of that name (default: the table's name for this "
                                          "device, else the GPU's own)")
    ap.add_argument("--threads", type=positive, default=max(1, cores // 2),
                    help="torch threads (default: half the cores, as profile --speedup)")
    ap.add_argument("--bits", type=bits_arg, default=PROFILED_BITS, help="precisions to profile, comma-separated")
    # The prefill model has five coefficients, quadratic in s: three prompt lengths and two batches at least.
    ap.add_argument("--batches", type=lengths(2), default=(1, 2, 4, 8), help="batch sizes of the fitting grid")
    ap.add_argument("--prompts", type=lengths(3), default=(32, 64, 128, 256),
                    help="prefill prompt lengths of the fitting grid")
    ap.add_argument("--contexts", type=lengths(2), default=(64, 256, 512),
                    help="decode context lengths (past tokens) of the fitting grid")
    ap.add_argument("--heldout-batches", type=lengths(1), default=(3, 5, 7),
                    help="batch sizes of the held-out points the fit's error is measured on")
    ap.add_argument("--heldout-prompts", type=lengths(1), default=(48, 96, 192))
    ap.add_argument("--heldout-contexts", type=lengths(1), default=(128, 384))
    # A GPU serves hundreds of decodes in a step but prefills a few long prompts: each phase its own batches.
    ap.add_argument("--decode-batches", type=lengths(2), help="decode's batch sizes, if not --batches")
    ap.add_argument("--heldout-decode-batches", type=lengths(1), help="decode's held-out batch sizes, if not "
                                                                        "--heldout-batches")
    ap.add_argument("--layers-timed", type=positive,
                    help="layers timed per point, spread over the depth (default: every layer on cpu, 4 on cuda)")
    ap.add_argument("--repeats", type=positive, default=3, help="timed runs per prefill point (the median is kept)")
    ap.add_argument("--decode-repeats", type=positive, default=10, help="timed runs per decode point")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON to write (the PNG goes beside it)")
    args = ap.parse_args(argv)

    points = {"prefill": grid(args.batches, args.prompts),
              "decode": grid(args.decode_batches or args.batches, args.contexts)}
    held = {"prefill": grid(args.heldout_batches, args.heldout_prompts),
            "decode": grid(args.heldout_decode_batches or args.heldout_batches, args.heldout_contexts)}
    for phase in FEATURES:
        if on_grid := sorted(set(points[phase]) & set(held[phase])):
            ap.error(f"held-out {phase} points {on_grid} are on the fitting grid")

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    if args.shape:
        args.model = str(ensure_checkpoint(args.shape, "bfloat16" if args.device == "cuda" else "float32",
                                           device=args.device))
    everything = {phase: points[phase] + held[phase] for phase in FEATURES}
    longest = max(n for phase_points in everything.values() for _, n in phase_points)
    config = EngineConfig(model=args.model, device=args.device, memory_budget=parse_size(args.memory_budget),
                          max_model_len=longest + ROOM_TOKENS,
                          max_num_seqs=max(v for phase_points in everything.values() for v, _ in phase_points),
                          max_num_batched_tokens=max(v * n for phase_points in everything.values()
                                                     for v, n in phase_points))
    engine = LLMEngine(config, progress=False)
    if engine.max_model_len < longest + ROOM_TOKENS:
        raise ProfileError(f"the model attends to {engine.max_model_len} tokens at most: lengths up to {longest} "
                           f"need {longest + ROOM_TOKENS}")
    if args.device_name is None:
        gpu = "cpu" if args.device == "cpu" else torch.cuda.get_device_name(args.device)
        args.device_name = table_name(gpu) or gpu
    layers = layers_timed(engine.model_config.num_layers, args.layers_timed, args.device)
    cfg = engine.model_config
    print(f"{served_model_name(args.model)} on {args.device_name}: {cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, {engine.config.resolved_dtype()}; timing layers {layers}, {args.repeats} repeats "
          f"({args.decode_repeats} for decode), {args.threads} threads", flush=True)

    bar = tqdm(total=len(args.bits) * sum(len(p) for p in everything.values()), desc="timing layers", unit="point")
    # A run cut short (a device lent for minutes) keeps the phase it finished, beside the record to come.
    partial = args.out.with_suffix(".partial.json")
    with bar:
        prefill = measure_prefill(engine, args.bits, everything["prefill"], layers, args.repeats, bar)
        write_json(partial, {"device": args.device_name, "model": args.model, "layers_timed": layers,
                             "prefill": samples(prefill, "prefill", everything["prefill"])})
        decode = measure_decode(engine, args.bits, everything["decode"], layers, args.decode_repeats, bar)
    seconds = {"prefill": prefill, "decode": decode}
    record = latency_profile(engine, args, layers,
                             {phase: samples(seconds[phase], phase, points[phase]) for phase in FEATURES},
                             {phase: samples(seconds[phase], phase, held[phase]) for phase in FEATURES})
    record["seconds"] = round(time.perf_counter() - started, 1)
    print_table(record)
    write_json(args.out, record)
    plot(record, args.out.with_suffix(".png"))
    partial.unlink()
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} ({record['seconds']:.0f} s)")
    return record
