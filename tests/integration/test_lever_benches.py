"""The levers' own benchmarks end to end at a tiny size: `bench-reshape` (CoCoServe's operations by layer count),
`bench-amoebas` (a TP merge and split, part by part), `bench-plan` (SplitQuant's planner, its plan served here) and
`bench-cocoserve` (CoCoServe against a static instance over a rate sweep). Each runs as a user runs it, through
`morphling`, on the default model, and must write its JSON and plot with every row it promises; what the figures
are is the benchmarks' business, not these tests'."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import PROJECT_ROOT, data_dir

pytestmark = pytest.mark.slow


def morphling(*args: str, timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    return done


def test_bench_reshape_times_every_operation_at_every_layer_count(tmp_path):
    morphling("bench-reshape", "--layers", "1,2", "--prompts", "2", "--repeats", "1", "--data", str(data_dir()),
              "--out", str(tmp_path), timeout=600)
    result = json.loads((tmp_path / "reshape_cost.json").read_text())
    rows = {(r["layers"], r["operation"]): r for r in result["rows"]}
    assert set(rows) == {(n, op) for n in (1, 2) for op in ("replicate", "evict", "migrate", "migrate back")}
    assert all(r["seconds"] > 0 for r in rows.values())
    for n in (1, 2):  # a replica and a migration carry the layers' weights; a migration the running requests' KV
        assert rows[(n, "replicate")]["bytes_moved"] > 0 and rows[(n, "migrate")]["bytes_moved"] > 0
        assert rows[(n, "migrate")]["kv_rows_moved"] > 0
    assert rows[(2, "replicate")]["bytes_moved"] > rows[(1, "replicate")]["bytes_moved"]
    assert result["recompute_s"] > 0 and (tmp_path / "reshape_cost.png").stat().st_size > 10_000


def test_bench_amoebas_reports_each_part_of_a_merge_and_a_split_on_both_members(tmp_path):
    morphling("bench-amoebas", "--requests", "2", "--prompt-tokens", "32", "--steps", "2", "--repeats", "1",
              "--data", str(data_dir()), "--out", str(tmp_path), timeout=600)
    result = json.loads((tmp_path / "amoebas_transform.json").read_text())
    assert len(result["rows"]) == 1
    summary = result["summary"]
    assert all(summary["step_ms"][phase] > 0 for phase in ("alone", "merged", "after"))
    for member in ("exec0", "exec1"):
        merge, split = summary[f"{member} merge"], summary[f"{member} split"]
        for report in (merge, split):
            assert report["total_s"] >= max(report[p] for p in ("ffn_s", "share_s", "plan_s", "kv_s")) > 0
        assert merge["ffn_pages_freed"] > 0  # the FFN cut in place gives pages back as KV


def test_bench_plan_solves_plans_fleets_and_serves_one_here(tmp_path):
    done = morphling("bench-plan", "--steps", "2", "--fleets", "1", "--out", str(tmp_path), timeout=900)
    record = json.loads((tmp_path / "splitquant.json").read_text())
    assert record["solve_times"] and all(r["ilp_s"] >= 0 and r["heuristic_s"] >= 0 for r in record["solve_times"])
    (fleet,) = record["fleets"]
    assert fleet["plan_tokens_s"] > 0 and fleet["uniform_tokens_s"] > 0
    served = record["served_on_cpu"]
    assert served["prefill_measured_s"] > 0 and "prefill of one" in done.stdout
    assert (tmp_path / "splitquant_fleets.png").stat().st_size > 10_000


def test_bench_cocoserve_runs_both_configurations_at_each_rate(tmp_path):
    morphling("bench-cocoserve", "--rates", "1", "--duration", "4", "--rest", "1", "--data", str(data_dir()),
              "--out", str(tmp_path), timeout=900)
    report = json.loads((tmp_path / "results.json").read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == {"static", "cocoserve"}
    for row in rows.values():
        assert row["rate"] == 1 and row["requests"] > 0 and row["failed"] == 0 and row["throughput_tok_s"] > 0
    assert rows["static"]["replicas_at_start"] == 0  # the static instance moves nothing
    (compared,) = report["compared"]
    assert compared["rate"] == 1 and compared["throughput_ratio"] > 0
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
