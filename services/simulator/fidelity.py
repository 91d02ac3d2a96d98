"""How well a simulation predicts a measured run: the same modes and windows of `morphling bench`'s
results.json against `morphling simulate`'s, key by key; and, on a GPU, the decode steps of `morphling
bench-engine --device cuda` against the fleet's cost model (costs.step_seconds).

The error of a prediction is (predicted - measured) / measured, signed, so that a reader sees which way the
model leans; a mode's summary is the mean of the absolute errors over its windows. The controller's actions
are compared as counts per kind, since their times depend on everything before them.
"""

import statistics
from collections import Counter

from services.executor.engine.scheduling.scheduler import ScheduledChunk
from services.executor.engine.scheduling.sequence import Sequence
from services.simulator.costs import step_seconds
from services.simulator.fleet import ExecutorSpec
from shared.planner.memory import FULL_BITS
from shared.sampling import SamplingOptions

KEYS = ("ttft_p50", "ttft_p95", "tpot_p50", "tpot_p99", "slo_violation_pct")


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def compare(predicted: dict, measured: dict) -> dict:
    """{mode: {"windows": {window: {key: {measured, predicted, error}, "actions": ...}}, "mean_abs_error": {key}}}
    over the modes and windows both runs have."""
    out = {}
    for mode, run in predicted["modes"].items():
        real = measured["modes"].get(mode)
        if real is None:
            continue
        windows = {}
        for name, p in run["windows"].items():
            m = real["windows"].get(name)
            if m is None:
                continue
            row = {key: {"measured": m[key], "predicted": p[key], "error": relative_error(p[key], m[key])}
                   for key in KEYS}
            row["actions"] = {"measured": dict(Counter(a["kind"] for a in m["actions"] if a.get("ok", True))),
                              "predicted": dict(Counter(a["kind"] for a in p["actions"] if a.get("ok", True)))}
            windows[name] = row
        errors = {key: [abs(w[key]["error"]) for w in windows.values() if w[key]["error"] is not None]
                  for key in KEYS}
        out[mode] = {"windows": windows,
                     "mean_abs_error": {key: statistics.fmean(e) if e else None for key, e in errors.items()}}
    return out


def print_fidelity(table: dict) -> None:
    print("prediction error, (simulated - measured) / measured, mean |error| over the windows:")
    print(f"{'mode':>9} " + " ".join(f"{key:>18}" for key in KEYS))
    for mode, row in table.items():
        cells = [row["mean_abs_error"][key] for key in KEYS]
        print(f"{mode:>9} " + " ".join(f"{'-' if c is None else f'{100 * c:.0f}%':>18}" for c in cells))
    for mode, row in table.items():
        for name, w in row["windows"].items():
            print(f"  {mode} {name}: " + ", ".join(
                f"{key} {w[key]['measured']:.3g} -> {w[key]['predicted']:.3g}" for key in KEYS
                if w[key]["measured"] is not None and w[key]["predicted"] is not None)
                + f"; actions {w['actions']['measured'] or '{}'} -> {w['actions']['predicted'] or '{}'}")


def decode_steps(spec: ExecutorSpec, num_layers: int, measured: dict) -> list[dict]:
    """Each decode row of a `morphling bench-engine --device cuda` result (executor/tools/bench_gpu.py): the
    step it measured, replayed from graphs, against step_seconds of that batch at its mean context with every
    layer at full precision, as an executor of `spec` would run it."""
    rows = []
    for row in measured["decode"]["rows"]:
        batch = row["batch"]
        context = max(1, round(row["kv_tokens_mean"] / batch))  # the bench counts the batch's KV tokens in all
        # A decode of a sequence whose prompt is done: its one new token reads `context` tokens of KV.
        chunks = [ScheduledChunk(Sequence(f"step-{k}", 0, [0] * (context - 1), SamplingOptions(), 0.0), context - 1, 1)
                  for k in range(batch)]
        predicted = step_seconds(spec, [FULL_BITS] * num_layers, chunks)
        rows.append({"batch": batch, "context": context, "measured_ms": row["ours_step_ms"],
                     "predicted_ms": predicted * 1e3,
                     "error": relative_error(predicted * 1e3, row["ours_step_ms"])})
    return rows


def print_decode_steps(rows: list[dict], spec: ExecutorSpec, measured: dict) -> None:
    print(f"decode steps: {measured.get('machine', {}).get('gpu', 'the measured device')} measured, "
          f"{spec.device.name}'s predicted from its {spec.latency.source} layers")
    print(f"{'batch':>5} {'context':>7} {'measured ms':>11} {'predicted ms':>12} {'error':>7}")
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>7} {r['measured_ms']:>11.2f} {r['predicted_ms']:>12.2f} "
              f"{100 * r['error']:>6.0f}%")
