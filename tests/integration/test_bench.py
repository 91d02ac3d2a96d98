"""`morphling bench` end to end: it starts the real system per mode (or drives a running gateway),
replays a slice of the real Azure trace with real prompts, and accounts for every request."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import data_dir
from tests.system import System

pytestmark = pytest.mark.slow

TRACE = data_dir() / "traces" / "AzureLLMInferenceTrace_conv.first30min.csv"
METRICS = {"ttft_p50", "ttft_p95", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p95", "slo_violation_pct",
           "throughput_tok_s", "goodput_req_s", "preemptions", "kv_capacity_peak_tokens", "precision", "timeline",
           "requests", "request_count", "finished", "failed"}


def arrivals_in(start: float, duration: float) -> int:
    """Requests of the trace window, counted straight from the CSV."""
    with open(TRACE, newline="") as f:
        rows = list(csv.DictReader(f))
    first = min(r["TIMESTAMP"] for r in rows)

    def seconds(ts: str) -> float:
        (h, m, s), (h0, m0, s0) = (ts.split()[1].split(":"), first.split()[1].split(":"))
        return (int(h) - int(h0)) * 3600 + (int(m) - int(m0)) * 60 + float(s) - float(s0)

    return sum(1 for r in rows if start <= seconds(r["TIMESTAMP"]) < start + duration and int(r["GeneratedTokens"]) > 0)


def bench(out: Path, *args: str, timeout: float = 900) -> dict:
    cmd = [sys.executable, "-m", "services.cli", "bench", "--trace", str(TRACE), "--data", str(data_dir()),
           "--out", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "TTFT p50" in done.stdout  # the table
    return json.loads((out / "results.json").read_text())


def check_mode(result: dict, expected_requests: int) -> None:
    assert METRICS <= set(result)
    reqs = result["requests"]
    # every request is accounted for: finished with all its tokens, or failed with a reason
    assert len(reqs) == result["request_count"] == result["finished"] + result["failed"] == expected_requests
    for r in reqs:
        assert (r["error"] is None) == (r["e2e_s"] is not None)
        if r["error"] is None:
            assert r["completion_tokens"] == r["output_tokens"] and r["ttft_s"] <= r["e2e_s"]
    assert result["finished"] > 0 and 0 <= result["slo_violation_pct"] <= 100
    assert result["ttft_p50"] <= result["ttft_p95"] <= result["ttft_p99"]
    shares = [m["token_share"] for m in result["precision"]["mixes"]]
    assert shares and sum(shares) == pytest.approx(1.0)
    assert len(result["timeline"]["t"]) > 10 and result["kv_capacity_peak_tokens"] > 0


def test_bench_starts_each_mode_and_accounts_for_every_request(tmp_path):
    # The busiest 3 s window of the trace, played at a fifth of its rate: the rule picks it, the test recounts it.
    report = bench(tmp_path, "--window-s", "3", "--busy", "1", "--ordinary", "0", "--rate-scale", "0.2",
                   "--len-scale", "0.05", "--modes", "fp16,int4", "--executors", "1", "--memory-budget", "480MiB",
                   "--max-len", "512", "--drain-timeout", "60")
    (window,) = report["windows"]
    expected = arrivals_in(window["start_s"], window["duration_s"])
    assert window["kind"] == "busy" and window["requests"] == window["arrivals"] == expected
    assert set(report["modes"]) == {"fp16", "int4"}
    for mode, summary in report["modes"].items():
        result = summary["windows"][window["name"]]
        check_mode(result, expected)
        assert summary["ttft_p95"] == result["ttft_p95"]  # the mean over one window is that window
        assert result["rest"]["started_at_rest"] and result["actions"] == []  # static modes move nothing
        assert (tmp_path / f"timeline_{mode}_{window['name']}.png").stat().st_size > 10_000
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 10_000
    fp16, int4 = (report["modes"][m]["windows"][window["name"]] for m in ("fp16", "int4"))
    # the static baselines really ran at their precision, and INT4 layers left room for more KV
    assert fp16["precision"]["full_precision_token_share"] == 1.0
    assert [(m["int8_layers"], m["int4_layers"]) for m in int4["precision"]["mixes"]] == [(0, 30)]
    assert int4["kv_capacity_peak_tokens"] > 2 * fp16["kv_capacity_peak_tokens"]
    # quality measured on the tokens served: fp16 is the reference, INT4's tokens were compared with it
    assert fp16["quality"]["prefix_agreement"] == 1.0
    assert int4["quality"]["requests_compared"] > 0 and 0 <= int4["quality"]["prefix_agreement"] <= 1
    assert "int4" in report["comparison"]


def test_bench_drives_a_running_gateway(tmp_path):
    system = System(tmp_path).start()
    try:
        report = bench(tmp_path / "out", "--url", system.url, "--modes", "fp16", "--window-s", "2", "--busy", "1",
                       "--ordinary", "0", "--rate-scale", "0.5", "--len-scale", "0.05", "--max-len", "512")
    finally:
        system.stop()
    (window,) = report["windows"]
    check_mode(report["modes"]["fp16"]["windows"][window["name"]], arrivals_in(window["start_s"], window["duration_s"]))
    assert report["comparison"] == {}  # nothing to compare with
