"""`morphling bench` end to end: it starts the real system per mode (or drives a running gateway),
replays a slice of the real Azure trace with real prompts, and accounts for every request."""

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
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


def test_bench_sweep_finds_each_modes_slo_capacity_and_its_quality_there(tmp_path):
    # One 2 s window of short requests: fp16 and INT8 each swept from x0.2, one step towards where P95 TTFT crosses
    # a 0.5 s SLO.
    report = bench(tmp_path, "--sweep", "--sweep-points", "2", "--window-s", "2", "--busy", "1", "--ordinary", "0",
                   "--rate-scale", "0.2", "--len-scale", "0.05", "--modes", "fp16,int8", "--executors", "1",
                   "--memory-budget", "480MiB", "--max-len", "512", "--slo-ttft", "0.5", "--rest-s", "1")
    (window,) = report["windows"]
    for mode, summary in report["modes"].items():
        points = summary["sweep"]
        assert len(points) == 2 and points[0]["rate_scale"] <= 0.2 <= points[-1]["rate_scale"]
        assert [p["rate_scale"] for p in points] == sorted(p["rate_scale"] for p in points)
        for p in points:  # each point's verdict is the probe rule on every request it played
            assert p["requests"] == window["requests"]
            assert p["meets_slo"] == (p["failed"] == 0 and p["ttft_p95"] is not None and p["ttft_p95"] <= 0.5)
        best = max((p["rate_scale"] for p in points if p["meets_slo"]), default=None)
        if best is None:
            assert summary["slo_capacity"] is None and summary["quality_at_capacity"] is None
            continue
        assert summary["slo_capacity"] >= best
        at = summary["quality_at_capacity"]
        assert at["rate_scale"] == best and sum(s["token_share"] for s in at["token_shares"]) == pytest.approx(1.0)
        if mode == "fp16":
            assert at["token_agreement"] == 1.0 and at["full_precision_token_share"] == 1.0
        else:  # every INT8 token came from quantized layers and was compared with fp16's
            assert 0 <= at["token_agreement"] <= 1 and at["full_precision_token_share"] == 0.0
        # today's keys are the base multiplier's, the sweep's first point
        check_mode(summary["windows"][window["name"]], window["requests"])
    assert (tmp_path / "goodput_sweep.png").stat().st_size > 10_000


class OpenAIOnly:
    """A real gateway behind a proxy that serves only what any OpenAI-compatible server (vLLM's) serves: the bench
    must then skip what needs `/v1/cluster` and say so."""

    def __init__(self, upstream: str):
        import threading

        import uvicorn
        from fastapi import FastAPI, Request, Response
        from fastapi.responses import StreamingResponse

        from shared.net import free_port

        app, client = FastAPI(), httpx.AsyncClient(base_url=upstream, timeout=None)

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(path: str, request: Request):
            if path not in ("v1/models", "v1/completions", "tokenize"):
                return Response(status_code=404, content=b'{"detail":"Not Found"}')
            upstream_request = client.build_request(request.method, f"/{path}", content=await request.body(),
                                                    headers={"content-type": "application/json"})
            answer = await client.send(upstream_request, stream=True)
            return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code,
                                     media_type=answer.headers.get("content-type"), background=None)

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_bench_drives_any_openai_compatible_server_and_skips_the_rest_rule(tmp_path):
    system = System(tmp_path).start()
    peer = OpenAIOnly(system.url)
    try:
        cmd = [sys.executable, "-m", "services.cli", "bench", "--trace", str(TRACE), "--data", str(data_dir()),
               "--out", str(tmp_path / "out"), "--url", peer.url, "--modes", "peer", "--window-s", "2", "--busy", "1",
               "--ordinary", "1", "--rate-scale", "0.5", "--len-scale", "0.05", "--max-len", "512", "--rest-s", "1"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    finally:
        peer.stop()
        system.stop()
    assert done.returncode == 0, done.stderr[-4000:]
    assert "has no /v1/cluster, so the rest rule is skipped" in done.stderr
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    summary = report["modes"]["peer"]
    for w in report["windows"]:
        result = summary["windows"][w["name"]]
        assert result["request_count"] == result["finished"] == w["requests"]
        assert result["timeline"] == {} and result["precision"]["full_precision_token_share"] is None
    # no rule to rest by: the first window starts as it finds the server, the second after a plain pause
    assert [summary["windows"][w["name"]]["rest"] for w in report["windows"]] == [
        {"waited_s": 0.0, "started_at_rest": None}, {"waited_s": 1.0, "started_at_rest": None}]


def most_in_flight(records: list[dict]) -> int:
    """The most requests of one loop that were in flight at once, from when each was sent and finished."""
    events = sorted([(r["sent_s"], 1) for r in records] + [(r["done_s"], -1) for r in records])
    now = most = 0
    for _, change in events:
        now += change
        most = max(most, now)
    return most


def test_bench_engine_against_another_server_takes_turns_on_the_same_prompts(tmp_path, monkeypatch):
    """`bench-engine --against`: ours and a peer (here our own gateway behind a proxy that serves only the OpenAI
    endpoints, as vLLM would) on the same prompts, a closed loop per concurrency, rounds in turns."""
    from services.tools.bench import peer as peer_bench

    loops: list[tuple[str, int, list, list]] = []
    played = peer_bench.closed_loop

    async def recording(url, model, prompts, new_tokens, concurrency):
        loop = await played(url, model, prompts, new_tokens, concurrency)
        loops.append((url, concurrency, prompts, loop.records))
        return loop

    monkeypatch.setattr(peer_bench, "closed_loop", recording)
    system = System(tmp_path).start()
    other = OpenAIOnly(system.url)
    try:
        from services.cli import main

        assert main(["bench-engine", "--against", other.url, "--against-name", "proxy", "--ours", system.url,
                     "--concurrency", "1,2", "--num-prompts", "3", "--rounds", "2", "--new-tokens", "4",
                     "--max-prompt-tokens", "64", "--out", str(tmp_path / "out")]) == 0
    finally:
        other.stop()
        system.stop()
    result = json.loads((tmp_path / "out" / "engine_vs_peer.json").read_text())
    assert (tmp_path / "out" / "engine_vs_peer.png").stat().st_size > 10_000
    assert [r["concurrency"] for r in result["rows"]] == [1, 2]
    for r in result["rows"]:
        for server in ("ours", "peer"):
            assert r[server]["requests"] == 6 and r[server]["failures"] == 0 and r[server]["output_tok_s"] > 0
        assert set(r["ratios"]) == {"tpot_p50_s", "ttft_p95_s", "output_tok_s"}
    # one request alone at a time is the same computation on both: the same greedy tokens
    assert result["rows"][0]["exact_share"] == 1.0
    timed = loops[2:]  # after each server's warm-up
    assert [(url == system.url, c) for url, c, _, _ in timed] == [
        (True, 1), (False, 1), (False, 1), (True, 1), (True, 2), (False, 2), (False, 2), (True, 2)]
    # each round has prompts of its own, served by both; a loop keeps `concurrency` requests in flight
    prompts = [p for _, _, p, _ in timed]
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3] and prompts[0] != prompts[2] != prompts[4]
    assert [most_in_flight([vars(r) for r in records]) for _, _, _, records in timed] == [1, 1, 1, 1, 2, 2, 2, 2]
