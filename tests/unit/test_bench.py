"""`morphling bench`'s pieces without a system: traces, prompts, metrics, the perplexity lookup, plots."""

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.tools.bench import suite
from services.tools.bench.client import ClusterSample, RequestRecord
from services.tools.bench.events import actions, reaction
from services.tools.bench.metrics import percentile, precision_share, preemptions, summarize, timeline
from services.tools.bench.modes import MODES, ModeError, up_args
from services.tools.bench.plots import plot_timeline, plot_ttft_cdf
from services.tools.bench.prompts import PromptPool, fit, read_texts
from services.tools.bench.quality import PerplexityTable, quality
from services.tools.bench.report import add_quality, comparison, mode_summary, window_result
from services.tools.bench.rest import at_rest, shape
from services.tools.bench.run import parse_args
from services.tools.bench.suite import Replay
from services.tools.bench.trace import TraceError, load_trace, read_rows, scale_lengths
from shared.config import data_dir, parse_size
from shared.core.plans import read_plan_file
from shared.messages import Event

AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
         "2023-11-16 18:15:46.6805900,374,44\r\n"
         "2023-11-16 18:15:47.1805900,100,10\r\n"
         "2023-11-16 18:15:50.0000000,5000,400\r\n"
         "2023-11-16 18:15:56.6805900,20,3\r\n")
BURSTGPT = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "5.0,ChatGPT,200,0,200,Conversation log\n"  # a failed request: nothing to ask for
            "7.5,ChatGPT,300,30,330,Conversation log\n"
            "6.0,GPT-4,50,5,55,API log\n")


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(text.encode())
    return path


def test_azure_trace_keeps_gaps_and_scales_time_and_lengths(tmp_path):
    path = write(tmp_path, "azure.csv", AZURE)
    rows = read_rows(path)
    assert [round(r.time_s, 4) for r in rows] == [0.0, 0.5, 3.3194, 10.0]
    reqs = load_trace(path, start_s=0.4, duration_s=10.0, rate_scale=0.5, len_scale=0.1, max_len=256)
    # the window [0.4, 10.4) drops the first row; times are relative to its start, then stretched 2x
    assert [r.arrival_s for r in reqs] == pytest.approx([0.2, (3.31941 - 0.4) * 2, 19.2])
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == [(10, 1), (256 - 40, 40), (2, 1)]


def test_burstgpt_trace_sorts_by_time_and_skips_failed_requests(tmp_path):
    path = write(tmp_path, "burst.csv", BURSTGPT)
    reqs = load_trace(path, 0.0, 100.0)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [(1.0, 50, 5), (2.5, 300, 30)]


@pytest.mark.parametrize("text, args, message", [
    ("a,b\n1,2\n", (0, 10), "neither the Azure columns"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", (0, 10), "no requests"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,x,3\n", (0, 10), "line 2"),
    (AZURE, (100, 10), "no request arrives in [100, 110) s"),
    (AZURE, (0, 0), "duration > 0"),
])
def test_bad_traces_and_windows_fail_with_the_reason(tmp_path, text, args, message):
    path = write(tmp_path, "t.csv", text)
    with pytest.raises(TraceError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_trace(path, *args)
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.csv", 0, 10)


@given(st.integers(0, 100_000), st.integers(0, 100_000), st.floats(0.001, 10), st.integers(2, 8192))
def test_scaled_lengths_always_fit_the_context(prompt, output, scale, max_len):
    p, o = scale_lengths(prompt, output, scale, max_len)
    assert p >= 1 and o >= 1 and p + o <= max_len and o <= max(1, max_len // 2)


def test_prompts_are_real_text_of_the_exact_length():
    texts = read_texts(data_dir() / "prompts")
    assert len(texts) == 1000 + 252
    pool = PromptPool(texts, lambda t: [ord(c) for c in t], seed=1)
    for length in (1, 7, 300, 5000):
        ids = pool.take(length)
        assert len(ids) == length
    assert fit([1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1] and fit([1, 2, 3], 2) == [1, 2]
    with pytest.raises(ValueError, match="encodes to any token"):
        PromptPool(["x"], lambda t: []).take(3)


def test_percentile_matches_numpy():
    values = [0.3, 5.0, 1.2, 0.7, 9.9, 2.2, 0.1]
    for q in (0, 50, 95, 99, 100):
        assert math.isclose(percentile(values, q), float(np.percentile(values, q)))
    assert percentile([], 50) is None


def record(i, sent, ttft, tokens, error=None, step=0.1):
    r = RequestRecord(i, scheduled_s=sent, prompt_tokens=10, output_tokens=tokens, sent_s=sent)
    if ttft is not None:
        r.chunk_s = [sent + ttft + k * step for k in range(tokens)]
        r.completion_tokens = tokens if error is None else tokens - 1
    if error is None:
        r.done_s = r.chunk_s[-1]
    r.error = error
    return r


def executor(layers, used=10, base=100, extension=0, preempted=0, ident="e0"):
    return {"id": ident, "alive": True, "layers": layers, "block_size": 16, "running": 1, "waiting": 0,
            "preemptions": preempted, "kv": {"pages_base": base, "pages_extension": extension, "pages_used": used}}


def test_summary_counts_failures_as_violations_and_measures_what_finished():
    records = [record(0, 0.0, 0.5, 11), record(1, 1.0, 3.0, 11), record(2, 2.0, 0.2, 5, error="boom"),
               record(3, 3.0, None, 5, error="HTTP 429: busy")]
    samples = [ClusterSample(0.0, [executor([16] * 4, preempted=2)]),
               ClusterSample(2.0, [executor([8, 8, 16, 16], used=40, extension=30, preempted=5)])]
    s = summarize(records, samples, slo_ttft_s=1.0)
    assert (s["request_count"], s["finished"], s["failed"]) == (4, 2, 2)
    assert s["slo_violation_pct"] == 75.0  # one too slow, two failed
    assert math.isclose(s["ttft_p50"], 0.5) and s["tpot_p50"] == pytest.approx(0.1)
    span = records[1].done_s - 0.0
    assert s["throughput_tok_s"] == pytest.approx(22 / span) and s["goodput_req_s"] == pytest.approx(1 / span)
    assert s["preemptions"] == 3
    assert (s["kv_capacity_start_tokens"], s["kv_capacity_peak_tokens"], s["kv_used_peak_tokens"]) == \
           (1600, 2080, 640)
    line = timeline(samples)
    assert line["int8_layers"] == [0, 2] and line["int4_layers"] == [0, 0]


def test_tokens_are_attributed_to_the_precision_of_their_moment():
    # tokens at 0.0..0.9 (10) before the swap at 1.0, at 1.0..1.9 (10) after it
    records = [record(0, 0.0, 0.0, 20)]
    samples = [ClusterSample(0.0, [executor([16, 16, 16])]), ClusterSample(1.0, [executor([8, 4, 16])])]
    assert precision_share(records, samples) == pytest.approx({(0, 0): 0.5, (1, 1): 0.5})
    # two executors: each token counts half for each executor's state
    two = [ClusterSample(0.0, [executor([16, 16]), executor([8, 8], ident="e1")])]
    assert precision_share(records, two) == pytest.approx({(0, 0): 0.5, (2, 0): 0.5})
    assert preemptions(two) == 0


def table_rows():
    rows = [{"bits": 8, "order": "front", "k": k, "ppl": 20.0 + 0.01 * k} for k in (0, 1, 2, 4, 8, 30)]
    rows += [{"bits": 4, "order": "front", "k": k, "ppl": 20.0 + k} for k in (0, 1, 2, 4, 8, 30)]
    rows += [{"bits": 4, "order": "back", "k": k, "ppl": 99.0} for k in (1, 2)]
    rows += [{"bits": 4, "order": "back", "k": 30, "ppl": 50.0}]  # all layers: the same in every order
    return rows


def test_perplexity_lookup_reads_interpolates_and_estimates(tmp_path):
    path = tmp_path / "ppl.json"
    path.write_text(json.dumps({"model": "default", "rows": table_rows()}))
    table = PerplexityTable.load(path, order="front")
    assert table.ppl(0, 0) == (20.0, "table")
    assert table.ppl(0, 2) == (22.0, "table")
    assert table.ppl(0, 30) == (50.0, "table")
    assert table.ppl(6, 0) == (pytest.approx(20.06), "interpolated")
    assert table.ppl(3, 2) == (pytest.approx(22.0 + 0.05 - 0.02), "estimated")
    assert table.ppl(0, 40) == (None, "unknown")
    q = quality({(0, 0): 0.75, (0, 2): 0.25}, table, "default")
    assert q["ppl_token_weighted"] == pytest.approx(0.75 * 20 + 0.25 * 22) and q["full_precision_token_share"] == 0.75
    assert quality({(0, 0): 1.0}, table, "another-model")["mixes"][0]["ppl"] is None
    assert PerplexityTable.load(tmp_path / "missing.json") is None


def played(records, samples, elapsed=8.0):
    return Replay(records, samples, elapsed, 1000.0)


def test_modes_are_summed_over_windows_compared_with_fp16_window_by_window_and_plotted(tmp_path):
    samples = [ClusterSample(0.0, [executor([16] * 4)]), ClusterSample(1.5, [executor([8, 8, 16, 16], extension=30)])]
    slow = [record(0, 0.0, 2.0, 5), record(1, 1.0, 4.0, 5), record(2, 2.0, None, 3, "failed")]
    fast = [record(0, 0.0, 0.5, 5), record(1, 1.0, 1.0, 5), record(2, 2.0, 2.0, 3)]
    replays = {"fp16": {"w1": played(slow, samples[:1]), "w2": played(fast, samples[:1])},
               "morph": {"w1": played(fast, samples), "w2": played(fast, samples)}}
    results = {mode: {name: window_result(r, [{"t": 1.0, "kind": "quantize"}], {"decided_after_s": 0.2,
                                                                              "applied_after_s": 0.5}, 1.0, None, "m")
                      for name, r in ws.items()} for mode, ws in replays.items()}
    add_quality(results, replays)
    modes = {mode: mode_summary(ws) for mode, ws in results.items()}
    base, morph = modes["fp16"], modes["morph"]
    assert base["windows"]["w1"]["slo_violation_pct"] == 100 and base["windows"]["w2"]["slo_violation_pct"] < 100
    assert base["slo_violation_pct"] == pytest.approx((100 + base["windows"]["w2"]["slo_violation_pct"]) / 2)
    assert base["spread"]["slo_violation_pct"] == [base["windows"]["w2"]["slo_violation_pct"], 100]
    assert morph["reaction"]["decided_after_s"] == pytest.approx(0.2) and morph["actions"] == 2
    c = comparison(modes)["morph"]
    w1 = base["windows"]["w1"]["ttft_p95"] / morph["windows"]["w1"]["ttft_p95"]
    assert c["ttft_p95_x_spread"] == [pytest.approx(1.0), pytest.approx(w1)]  # w2 served the same in both
    assert c["ttft_p95_x_better_than_fp16"] == pytest.approx((w1 + 1) / 2)
    assert plot_timeline("morph w1", results["morph"]["w1"], 1.0, tmp_path / "t.png").stat().st_size > 10_000
    pooled = {m: {"requests": [r for w in ws.values() for r in w["requests"]]} for m, ws in results.items()}
    assert plot_ttft_cdf(pooled, 1.0, tmp_path / "cdf.png").stat().st_size > 10_000


def test_every_mode_gets_the_same_total_memory_and_only_its_levers(tmp_path):
    total = 2 * parse_size("1GiB")
    for name, mode in MODES.items():
        flags = up_args(mode, 2, "1GiB", "accuracy", "default", tmp_path)
        value = dict(zip(flags[::2], flags[1::2]))
        assert int(value["--executors"]) * int(value["--memory-budget"]) == total
        assert value["--levers"] == (",".join(mode.levers) or "none")
        assert value["--mode"] == ("accuracy" if mode.levers else "off")
    one = dict(zip(*[iter(up_args(MODES["cocoserve"], 1, "1GiB", "accuracy", "default", tmp_path))] * 2))
    assert one["--executors"] == "2" and int(one["--memory-budget"]) == parse_size("1GiB") // 2
    plans = read_plan_file(one["--plan"], ["exec0", "exec1"], 30)
    assert [p.members for p in plans] == [["exec0", "exec1"]] and all(
        layer.placement == ["exec0"] for layer in plans[0].layers)
    with pytest.raises(ModeError, match="even number"):
        up_args(MODES["cocoserve"], 3, "1GiB", "accuracy", "default", tmp_path)


def test_reaction_runs_from_the_first_pressure_event_to_the_first_quantize_after_it():
    def command(t, kind, latency, ok=True):
        return Event(kind="command", source="ctl0", time=t, data={"executor": "exec0", "kind": kind, "ok": ok,
                                                                  "latency_s": latency, "reason": "why"})

    stream = [command(1000.5, "quantize", 0.1), Event(kind="pressure", source="exec0", time=1002.0),
              Event(kind="pressure", source="exec0", time=1003.0), command(1002.9, "quantize", 0.6),
              command(1004.0, "restore", 0.2), Event(kind="executor_up", source="monitor", time=1004.5)]
    assert [a["kind"] for a in actions(stream, 1000.0)] == ["quantize", "quantize", "restore"]
    assert actions(stream, 1000.0)[1]["decided_t"] == pytest.approx(2.3)
    r = reaction(stream, 1000.0)
    assert r["pressure_events"] == 2 and r["first_pressure_s"] == 2.0
    assert r["decided_after_s"] == pytest.approx(0.3) and r["applied_after_s"] == pytest.approx(0.9)
    assert reaction(stream[:3], 1000.0)["decided_after_s"] is None  # none after the first pressure


@pytest.mark.parametrize("argv, message", [
    (["--modes", "fp16,bf17"], "--modes takes"),
    (["--modes", "fp16,fp16"], "twice"),
    (["--modes", "morph,ladder"], "add fp16 to --modes, or give --rate-scale"),
    (["--url", "http://x", "--modes", "fp16,morph"], "exactly one"),
    (["--rate-scale", "0"], "--rate-scale and --executors must be positive"),
    (["--executors", "3"], "even number"),
    (["--busy", "1", "--window-s", "0"], "--window-s must be positive"),
    (["--memory-budget", "lots"], "size"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_at_rest_means_every_pressure_action_undone_but_replicas_on_idle_capacity_may_stay():
    def cluster(bits=16, cap=64, placement=("exec0",), alive=True, tp=1):
        layers = [{"placement": list(placement), "bits": bits}] * 2
        # a member reports its instance's bits, layer by layer, wherever the layers are placed
        return {"executors": [{"id": "exec0", "alive": True, "layers": [bits, bits], "max_num_seqs": cap},
                              {"id": "exec1", "alive": alive, "layers": [bits, bits], "max_num_seqs": 0}],
                "instances": [{"id": "i0", "members": ["exec0", "exec1"], "tp": tp, "layers": layers}]}

    start = at_rest(cluster())
    assert at_rest(cluster(alive=False)) != start  # a member gone is not the same system
    for pressed in (cluster(bits=8), cluster(cap=9), cluster(tp=2)):
        assert at_rest(pressed) != start
    replicated = cluster(placement=("exec0", "exec1"))
    assert at_rest(replicated) == start and shape(replicated) != shape(cluster())  # rest, yet still a move


def test_settle_waits_until_the_cluster_is_at_rest_and_still(monkeypatch):
    """A cluster that restores, then moves a replica, then holds still: settled only once it has held."""
    views = iter([{"bits": 8}, {"bits": 16}, {"bits": 16, "placement": ("exec0", "exec1")}]
                 + [{"bits": 16, "placement": ("exec0", "exec1")}] * 10)
    seen = []

    def cluster(bits=16, placement=("exec0",)):
        layers = [{"placement": list(placement), "bits": bits}]
        return {"executors": [{"id": "exec0", "alive": True, "layers": [bits], "max_num_seqs": 8}],
                "instances": [{"id": "i0", "members": ["exec0"], "tp": 1, "layers": layers}]}

    class Answer:
        def __init__(self, body):
            self.body = body

        def json(self):
            return self.body

    clock = [0.0]
    monkeypatch.setattr(suite.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(suite.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(suite.httpx.Client, "get", lambda self, url: seen.append(url) or Answer(cluster(**next(views))))
    waited, settled = suite.settle("http://gw", {}, at_rest(cluster()), rest_s=2.0, timeout_s=60.0, still_s=3.0)
    assert settled and waited == 2.0 + 5.0  # rest, then two moves, then three still seconds
    assert len(seen) == 6
    clock[0] = 0.0
    views = iter([{"bits": 8}] * 100)
    assert suite.settle("http://gw", {}, at_rest(cluster()), rest_s=2.0, timeout_s=5.0, still_s=3.0)[1] is False


def test_morph_settings_given_to_bench_reach_the_systems_of_modes_that_morph(tmp_path):
    args = parse_args(["--modes", "fp16,morph", "--rate-scale", "0.3", "--morph-mode", "performance",
                       "--morph-set", "max_layers=30", "--out", str(tmp_path)])
    assert "--morph-set=max_layers=30" in suite.up_command(args, "morph", 8000, tmp_path)
    assert not any(flag.startswith("--morph-set") for flag in suite.up_command(args, "fp16", 8000, tmp_path))
