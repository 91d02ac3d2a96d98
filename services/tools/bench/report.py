"""What a `morphling bench` run reports: each (mode, window) result, each mode's mean over the windows with
its spread, the ratios against full precision window by window, and the table printed at the end.

A mode's top-level keys are today's (`ttft_p95`, `slo_violation_pct`, ...) as the mean over the windows, so
a script reading results.json of an earlier run reads this one too; `spread` gives each key's minimum and
maximum over the windows and `windows` every window's own result. `quality` is measured on the tokens served
(agreement.py: agreement with fp16's greedy tokens for the same requests), beside the perplexity the
precision mixes would have on the eval table (quality.py), which is context, not a measurement of this run.
"""

import statistics

from services.tools.bench.agreement import agreement, mean_logprob
from services.tools.bench.metrics import precision_share, summarize
from services.tools.bench.quality import PerplexityTable, quality

SUMMED = ("ttft_p50", "ttft_p95", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p95", "slo_violation_pct",
          "throughput_tok_s", "goodput_req_s", "preemptions", "kv_capacity_peak_tokens", "failed")
TABLE = (("ttft_p50", "TTFT p50", "{:.2f}"), ("ttft_p95", "p95", "{:.2f}"), ("tpot_p50", "TPOT p50", "{:.3f}"),
         ("slo_violation_pct", "SLO viol %", "{:.1f}"), ("throughput_tok_s", "tok/s", "{:.1f}"),
         ("goodput_req_s", "good req/s", "{:.2f}"), ("preemptions", "preempt", "{:.0f}"),
         ("failed", "failed", "{:.0f}"))


def window_result(played, actions: list[dict], reaction: dict, slo_ttft_s: float, table: PerplexityTable | None,
                  model: str, rest: dict | None = None, slo_tpot_s: float | None = None) -> dict:
    result = summarize(played.records, played.samples, slo_ttft_s, slo_tpot_s)
    result["rest"] = rest or {"waited_s": 0.0, "started_at_rest": True}
    result["precision"] = quality(precision_share(played.records, played.samples), table, model)
    result["replay_s"] = played.elapsed_s
    result["actions"] = actions
    result["reaction"] = reaction
    result["requests"] = [{"scheduled_s": r.scheduled_s, "sent_s": r.sent_s, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                           "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                           "completion_tokens": r.completion_tokens, "error": r.error} for r in played.records]
    return result


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _spread(values: list) -> list | None:
    values = [v for v in values if v is not None]
    return [min(values), max(values)] if values else None


def mode_summary(windows: dict[str, dict]) -> dict:
    """Mean and [min, max] over the windows of every summed key, of quality and of the reaction."""
    rows = list(windows.values())
    out = {key: _mean([r[key] for r in rows]) for key in SUMMED}
    out["spread"] = {key: _spread([r[key] for r in rows]) for key in SUMMED}
    quality_keys = ("prefix_agreement", "token_agreement", "exact_share", "mean_logprob", "ppl_token_weighted",
                    "full_precision_token_share")
    out["quality"] = {key: _mean([r["quality"].get(key) for r in rows]) for key in quality_keys}
    out["quality"]["spread"] = {key: _spread([r["quality"].get(key) for r in rows]) for key in quality_keys}
    out["reaction"] = {key: _mean([r["reaction"][key] for r in rows]) for key in ("decided_after_s", "applied_after_s")}
    out["reaction"]["spread"] = {key: _spread([r["reaction"][key] for r in rows])
                                 for key in ("decided_after_s", "applied_after_s")}
    out["actions"] = sum(len(r["actions"]) for r in rows)
    out["windows"] = windows
    return out


def model_summaries(windows: dict[str, dict]) -> dict:
    """For a fleet serving several models (`morphling simulate`'s): `models`, each model's mean over the windows
    of every summed key; nothing for one model."""
    first = next(iter(windows.values()))
    if "models" not in first:
        return {}
    return {"models": {name: {key: _mean([w["models"][name][key] for w in windows.values()]) for key in SUMMED}
                       for name in first["models"]}}


def add_quality(results: dict[str, dict[str, dict]], replays: dict[str, dict]) -> None:
    """Each (mode, window) result's `quality`: agreement with fp16's tokens for the same requests."""
    reference = replays.get("fp16", {})
    for mode, windows in results.items():
        for name, result in windows.items():
            served = replays[mode][name].records
            measured = agreement(served, reference[name].records, "fp16") if name in reference else {}
            result["quality"] = measured | {
                "mean_logprob": mean_logprob(served),
                "ppl_token_weighted": result["precision"]["ppl_token_weighted"],
                "full_precision_token_share": result["precision"]["full_precision_token_share"]}


def comparison(modes: dict[str, dict]) -> dict[str, dict]:
    """Each mode against fp16, window by window: how many times lower its P95 TTFT, how many fewer violations
    (in percentage points and relative), as the mean over windows and the [min, max]."""
    base = modes.get("fp16")
    if not base:
        return {}
    out = {}
    for mode, summary in modes.items():
        if mode == "fp16":
            continue
        better, fewer = [], []
        for name, r in summary["windows"].items():
            b = base["windows"].get(name)
            if b is None:
                continue
            if b["ttft_p95"] and r["ttft_p95"]:
                better.append(b["ttft_p95"] / r["ttft_p95"])
            fewer.append(b["slo_violation_pct"] - r["slo_violation_pct"])
        out[mode] = {"ttft_p95_x_better_than_fp16": _mean(better), "ttft_p95_x_spread": _spread(better),
                     "slo_violation_points_fewer": _mean(fewer), "slo_violation_points_spread": _spread(fewer)}
    return out


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def print_table(modes: dict[str, dict], compared: dict[str, dict]) -> None:
    headers = ["mode", *(h for _, h, _ in TABLE), "agree", "reaction s", "actions"]
    rows = []
    for mode, s in modes.items():
        cells = []
        for key, _, fmt in TABLE:
            lo_hi = s["spread"][key]
            cells.append(_cell(s[key], fmt) + (f" ({fmt.format(lo_hi[0])}-{fmt.format(lo_hi[1])})"
                                               if lo_hi and len(s["windows"]) > 1 else ""))
        rows.append([mode, *cells, _cell(s["quality"]["prefix_agreement"], "{:.3f}"),
                     _cell(s["reaction"]["decided_after_s"], "{:.2f}"), str(s["actions"])])
    _print_rows(headers, rows)
    for mode, c in compared.items():
        x, xs = c["ttft_p95_x_better_than_fp16"], c["ttft_p95_x_spread"]
        p, ps = c["slo_violation_points_fewer"], c["slo_violation_points_spread"]
        print(f"{mode} vs fp16: P95 TTFT {_cell(x, '{:.2f}')}x better"
              + (f" ({xs[0]:.2f}-{xs[1]:.2f})" if xs else "")
              + f", SLO violations {_cell(p, '{:+.1f}')} points fewer"
              + (f" ({ps[0]:+.1f} to {ps[1]:+.1f})" if ps else ""))


def print_sweep(modes: dict[str, dict]) -> None:
    """Each mode's SLO capacity, its ratio to fp16's, and the quality of its tokens there."""
    base = modes.get("fp16", {}).get("slo_capacity")
    rows = []
    for mode, s in modes.items():
        at = s.get("quality_at_capacity") or {}
        ratio = s["slo_capacity"] / base if base and s["slo_capacity"] is not None else None
        rows.append([mode, _cell(s["slo_capacity"], "{:.3g}"), _cell(ratio, "{:.2f}x"),
                     _cell(at.get("token_agreement"), "{:.3f}"), _cell(at.get("full_precision_token_share"), "{:.2f}"),
                     " ".join(f"x{p['rate_scale']:.3g}:{'ok' if p['meets_slo'] else 'miss'}" for p in s["sweep"])])
    print("SLO capacity (the rate multiplier of the windows within the P95 TTFT SLO, no failure):")
    _print_rows(["mode", "capacity", "vs fp16", "agree", "fp16 share", "points"], rows)


def print_models(modes: dict[str, dict]) -> None:
    """The table's columns model by model, for the modes that have `models`."""
    rows = [[mode, name, *(_cell(m[key], fmt) for key, _, fmt in TABLE)]
            for mode, s in modes.items() for name, m in s.get("models", {}).items()]
    if not rows:
        return
    print("by model:")
    _print_rows(["mode", "model", *(h for _, h, _ in TABLE)], rows)


def _print_rows(headers: list[str], rows: list[list]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    for row in (headers, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
