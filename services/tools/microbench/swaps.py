"""The GPU benchmark's swap section: one layer to INT4 and back and to INT8 and back, idle and then between
decode steps, as the executor swaps; what the step that overlaps a swap costs more than the steps before it,
and whether the first step after a swap stalled (a kernel compiled on the critical path)."""

from __future__ import annotations

import statistics
import time

from services.executor.engine.engine import LLMEngine
from services.executor.engine.morphing.swapper import LayerSwapper
from services.executor.engine.morphing.variants import VariantStore
from services.tools.microbench.timing import Clock, print_table, random_prompts
from shared.sampling import SamplingOptions

# Swaps between decode steps: (pure decode steps before it, bits); None is the full precision.
SWAP_PLAN = ((8, 4), (18, None), (28, 8), (38, None))
BASELINE_STEPS = 5  # steps before a swap that its overlapping step is compared with
STALL_MARGIN_MS = 50.0  # above the copy itself: far beyond step jitter, far below a Triton compile


def swap_section(engine: LLMEngine, args, clock: Clock) -> dict:
    model, cfg = engine.model, engine.model_config
    full = model.full_bits
    layer = cfg.num_layers // 2
    # An in-memory store (no disk cache): an 8B's variants on disk would be another 25 GB to write.
    store = VariantStore(model, fingerprint=None, bits=(8, 4))
    t0 = time.perf_counter()
    store.prepare(progress=True)
    prepare_s = time.perf_counter() - t0
    swapper = LayerSwapper(model, engine.arena, engine.scheduler, store)

    idle = []
    for bits in (4, None, 8, None):
        bits = bits or full
        t0 = clock.now()
        report = swapper.set_bits([layer], bits)
        enqueued = time.perf_counter() - t0
        done = clock.now() - t0
        idle.append(dict(to_bits=bits, enqueue_ms=enqueued * 1e3, complete_ms=done * 1e3,
                         bytes=store.entry_bytes[bits], write_gbs=store.entry_bytes[bits] / done / 1e9,
                         pages_released=report.pages_released, pages_reclaimed=report.pages_reclaimed,
                         blocks_relocated=report.blocks_relocated))
    print_table(f"one layer (layer {layer}) swapped while idle", ["to bits", "enqueue ms", "complete ms", "MB",
                                                                   "GB/s"],
                [[r["to_bits"], r["enqueue_ms"], r["complete_ms"], r["bytes"] / 1e6, r["write_gbs"]]
                 for r in idle])

    during = swaps_during_decode(engine, swapper, layer, args, clock, {r["to_bits"]: r["complete_ms"] for r in idle})
    print_table(f"the same swaps between decode steps of {args.swap_batch} sequences (ms)",
                ["to bits", "swap call", "steps before", "overlapping", "added", "added %", "next step", "stall"],
                [[r["to_bits"], r["swap_call_ms"], r["baseline_step_ms"], r["overlapping_step_ms"], r["added_ms"],
                  r["added_percent"], r["next_step_ms"], r["compile_stall"]] for r in during["swaps"]])
    return dict(layer=layer, variant_prepare_s=prepare_s, variant_store_bytes=store.total_bytes, idle=idle,
                during_decode=during)


def swaps_during_decode(engine: LLMEngine, swapper: LayerSwapper, layer: int, args, clock: Clock,
                        copy_ms: dict[int, float]) -> dict:
    """Decode `swap_batch` sequences; between two steps (as the executor does) swap per SWAP_PLAN."""
    full = engine.model.full_bits
    plan = {before: bits or full for before, bits in SWAP_PLAN if before < args.swap_steps - 1}
    prompts = random_prompts(args.swap_batch, args.prompt_tokens, engine.model_config.vocab_size, args.seed + 100)
    params = SamplingOptions(temperature=0.0, max_tokens=args.swap_steps + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"swap-{i}", prompt, params)
    steps: list[float] = []  # pure decode steps, in order
    swaps: list[dict] = []
    while engine.has_unfinished():
        running = engine.scheduler.running
        pure = (not engine.scheduler.waiting and len(running) == len(prompts)
                and not any(s.in_prefill for s in running))
        t0 = clock.now()  # the device is idle: whatever runs from here on is this step's, and the swap's
        if pure and len(steps) in plan and not any(s["at_step"] == len(steps) for s in swaps):
            report = swapper.set_bits([layer], plan[len(steps)])
            swaps.append(dict(to_bits=plan[len(steps)], at_step=len(steps),
                              swap_call_ms=(time.perf_counter() - t0) * 1e3, blocks_relocated=report.blocks_relocated))
        # No synchronisation here: on CUDA the swap's copy is still running beside the step, as in serving.
        t1 = time.perf_counter()
        engine.step()
        if pure:
            steps.append(clock.now() - t1)
    if engine.model.layer_bits[layer] != full:
        swapper.restore([layer])
    swapped_at = {s["at_step"] for s in swaps}
    for s in swaps:
        at = s["at_step"]
        # Steady steps before the swap: not one that overlapped an earlier swap, nor the one right after it.
        before = [steps[i] for i in range(max(0, at - BASELINE_STEPS - 2), at)
                  if i not in swapped_at and i - 1 not in swapped_at][-BASELINE_STEPS:]
        baseline = statistics.median(before) * 1e3
        overlap = steps[at] * 1e3
        after = steps[at + 1] * 1e3 if at + 1 < len(steps) else None
        added = overlap - baseline
        # A stall is a one-off: the layer's new bits may make every later step slower too (INT4 dequantizes on
        # CPU), so the step is held against the one after it as well as those before.
        excess = overlap - max(baseline, after if after is not None else baseline)
        s |= dict(baseline_step_ms=baseline, overlapping_step_ms=overlap, added_ms=added,
                  added_percent=100 * added / baseline, added_with_call_ms=added + s["swap_call_ms"],
                  next_step_ms=after, compile_stall=excess > copy_ms[s["to_bits"]] + STALL_MARGIN_MS)
    return dict(batch=args.swap_batch, decode_steps=len(steps), step_ms=[t * 1e3 for t in steps], swaps=swaps,
                compile_stall_rule=f"the overlapping step exceeds both the median of the {BASELINE_STEPS} steady "
                                   f"steps before it and the step after it by more than the idle swap's complete "
                                   f"time plus {STALL_MARGIN_MS} ms")
