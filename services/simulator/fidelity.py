"""How well a simulation predicts a measured run: the same modes and windows of `morphling bench`'s
results.json against `morphling simulate`'s, key by key.

The error of a prediction is (predicted - measured) / measured, signed, so that a reader sees which way the
model leans; a mode's summary is the mean of the absolute errors over its windows. The controller's actions
are compared as counts per kind, since their times depend on everything before them.
"""

import statistics
from collections import Counter

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
