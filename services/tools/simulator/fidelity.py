"""How well a simulation predicts a measured run: the same modes and windows of `morphling bench`'s
results.json against `morphling simulate`'s, key by key; on a GPU, the decode steps of `morphling
bench-engine --device cuda` against the fleet's cost model (costs.step_seconds); and the steps of `morphling
bench-amoebas`, alone and merged TP2, against the same model and a merged instance's (tp.py).

The error of a prediction is (predicted - measured) / measured, signed, so that a reader sees which way the
model leans; a mode's summary is the mean of the absolute errors over its windows. The controller's actions
are compared as counts per kind, since their times depend on everything before them.

Several measured runs of one bench command set the prediction's error beside the machine's own: the runs taken
as predictions of one another (`repeatability`). A simulation cannot be expected to come closer to one run than
a second run of the same command does.
"""

import itertools
import statistics
from collections import Counter

from services.tools.simulator import tp
from services.tools.simulator.costs import step_seconds
from services.tools.simulator.executor import SimExecutor
from services.tools.simulator.fleet import ExecutorSpec, Fleet, FleetError
from shared.core.planner.memory import FULL_BITS
from shared.core.scheduling.scheduler import ScheduledChunk
from shared.core.scheduling.sequence import Sequence
from shared.messages import TpMergeArgs
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


def mean_errors(tables: list[dict]) -> dict:
    """{mode: {key: the mean over `tables` (compare's) of their mean |error|}}, for the modes all of them have."""
    modes = [mode for mode in tables[0] if all(mode in t for t in tables)]
    out = {}
    for mode in modes:
        errors = {key: [t[mode]["mean_abs_error"][key] for t in tables] for key in KEYS}
        out[mode] = {key: statistics.fmean(e) if None not in e else None for key, e in errors.items()}
    return out


def repeatability(runs: list[dict]) -> dict:
    """How far measured runs of one command are from one another: each run taken as a prediction of every earlier
    one (compare), the mean |error| averaged over the pairs, per mode."""
    return mean_errors([compare(later, earlier) for earlier, later in itertools.combinations(runs, 2)])


def fidelity(simulated: dict, paths: list, runs: list[dict]) -> dict:
    """results.json's "fidelity": the simulation against the first measured run (of `paths`), window by window;
    with several runs of one command, against each and the runs against one another."""
    out = {"measured": str(paths[0]), "modes": compare(simulated, runs[0])}
    if len(runs) > 1:
        out |= {"runs": [str(p) for p in paths], "against_each": mean_errors([compare(simulated, r) for r in runs]),
                "repeatability": repeatability(runs)}
    return out


def print_errors(title: str, errors: dict) -> None:
    """A table of mean |error| per mode and key ({mode: {key: error}})."""
    print(title)
    print(f"{'mode':>9} " + " ".join(f"{key:>18}" for key in KEYS))
    for mode, row in errors.items():
        print(f"{mode:>9} " + " ".join(f"{'-' if row[k] is None else f'{100 * row[k]:.0f}%':>18}" for k in KEYS))


def print_fidelity(table: dict) -> None:
    print_errors("prediction error, (simulated - measured) / measured, mean |error| over the windows:",
                 {mode: row["mean_abs_error"] for mode, row in table.items()})
    for mode, row in table.items():
        for name, w in row["windows"].items():
            print(f"  {mode} {name}: " + ", ".join(
                f"{key} {w[key]['measured']:.3g} -> {w[key]['predicted']:.3g}" for key in KEYS
                if w[key]["measured"] is not None and w[key]["predicted"] is not None)
                + f"; actions {w['actions']['measured'] or '{}'} -> {w['actions']['predicted'] or '{}'}")


def decodes(batch: int, context: int) -> list[ScheduledChunk]:
    """A step of `batch` decodes, each of a sequence whose prompt is done, its new token reading `context`
    tokens of KV."""
    return [ScheduledChunk(Sequence(f"step-{k}", 0, [0] * (context - 1), SamplingOptions(), 0.0), context - 1, 1)
            for k in range(batch)]


def decode_steps(spec: ExecutorSpec, num_layers: int, measured: dict) -> list[dict]:
    """Each decode row of a `morphling bench-engine --device cuda` result (tools/microbench/gpu.py): the
    step it measured, replayed from graphs, against step_seconds of that batch at its mean context with every
    layer at full precision, as an executor of `spec` would run it."""
    rows = []
    for row in measured["decode"]["rows"]:
        batch = row["batch"]
        context = max(1, round(row["kv_tokens_mean"] / batch))  # the bench counts the batch's KV tokens in all
        predicted = step_seconds(spec, [FULL_BITS] * num_layers, decodes(batch, context))
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


def tp_steps(fleet: Fleet, measured: dict) -> list[dict]:
    """The three phases of a `morphling bench-amoebas` result (tools/microbench/amoebas.py) against the
    fleet's first two executors: each alone over its `requests` sequences, then merged TP2 over both's, then
    alone again, `steps` timed steps a phase after prompts of `prompt_tokens`; each phase at its mean context."""
    config, measured_ms = measured["config"], measured["summary"]["step_ms"]
    batch, steps = config["requests"], config["steps"]
    if len(fleet.executors) < 2:
        raise FleetError(f"a TP2 merge takes two executors, and the fleet has {len(fleet.executors)}")
    members = {s.id: SimExecutor(s, fleet, in_world=True) for s in fleet.executors[:2]}
    for member in members.values():
        member.join_world(list(members), FULL_BITS)
    merged, _, _ = tp.merge(members, TpMergeArgs(executors=list(members), instance="tp2"), 0.0)
    leader = next(iter(members.values()))
    rows = []
    for phase_index, (phase, sequences) in enumerate((("alone", batch), ("merged", 2 * batch), ("after", batch))):
        context = config["prompt_tokens"] + phase_index * steps + steps // 2
        chunks = decodes(sequences, context)
        predicted = (merged.step_seconds(chunks)[0] if phase == "merged"
                     else step_seconds(leader.spec, [FULL_BITS] * leader.shape.num_layers, chunks))
        rows.append({"phase": phase, "batch": sequences, "context": context, "measured_ms": measured_ms[phase],
                     "predicted_ms": predicted * 1e3, "error": relative_error(predicted * 1e3, measured_ms[phase])})
    return rows


def print_tp_steps(rows: list[dict]) -> None:
    print("steps alone and merged TP2: measured by bench-amoebas, predicted from the fleet's profiles")
    print(f"{'phase':>6} {'batch':>5} {'context':>7} {'measured ms':>11} {'predicted ms':>12} {'error':>7}")
    for r in rows:
        print(f"{r['phase']:>6} {r['batch']:>5} {r['context']:>7} {r['measured_ms']:>11.1f} {r['predicted_ms']:>12.1f} "
              f"{100 * r['error']:>6.0f}%")
