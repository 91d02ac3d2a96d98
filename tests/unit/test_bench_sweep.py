"""`bench --sweep`'s rule against fake systems, the Gamma arrivals of `--burstiness`, and `--regime`'s arena."""

import argparse
import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.tools.bench.regimes import REGIMES, RegimeError, apply_regime, arena_for, weight_bytes
from services.tools.bench.sweep import SWEEP_FACTOR, nearest, quality_at_capacity, sweep, token_shares
from services.tools.bench.trace import TraceError, TraceRow
from services.tools.bench.windows import Window, gamma_arrivals, requests_in

SLO = 2.0


def window(ttfts: list[float | None], mixes=((0, 0, 1.0),), tokens: int = 4) -> dict:
    """A window result as report.window_result gives it, with only what the sweep reads."""
    return {"requests": [{"ttft_s": t, "error": None if t is not None else "failed", "completion_tokens": tokens}
                         for t in ttfts],
            "goodput_req_s": sum(t is not None and t <= SLO for t in ttfts) / 10, "slo_violation_pct": 0.0,
            "throughput_tok_s": 1.0,
            "precision": {"mixes": [{"int8_layers": a, "int4_layers": b, "token_share": s} for a, b, s in mixes]}}


def convex_system(capacity: float, power: float):
    """Two windows whose TTFTs all equal SLO * (rate / capacity) ** power (convex in the rate for power >= 1), and
    whose requests fail beyond twice the capacity, as a queue that never drains."""
    def play(rate: float) -> dict[str, dict]:
        if rate > 2 * capacity:
            return {"busy": window([None] * 3), "ordinary": window([1.0, None])}
        ttft = SLO * (rate / capacity) ** power
        return {"busy": window([ttft] * 3), "ordinary": window([ttft] * 2)}
    return play


@settings(max_examples=200, deadline=None)
@given(capacity=st.floats(0.05, 20), start=st.floats(0.05, 20), power=st.floats(1.0, 4.0))
def test_the_capacity_found_lies_between_the_best_meeting_point_and_the_true_crossing(capacity, start, power):
    found = sweep(convex_system(capacity, power), start, SLO, max_points=6)
    rates = [p["rate_scale"] for p in found.points]
    assert rates == sorted(rates) and set(found.played) == set(rates)
    for p in found.points:  # each verdict is the probe rule: pooled P95 within the SLO and no failure
        assert p["meets_slo"] == (p["rate_scale"] <= capacity * (1 + 1e-9)) and p["requests"] == 5
    if found.best is None:
        assert found.slo_capacity is None and min(rates) > capacity * (1 - 1e-9)
        return
    # The straight line between two points lies above a convex P95 curve: the crossing found errs low, never high.
    assert found.best <= found.slo_capacity <= capacity * (1 + 1e-9)
    missing = [r for r in rates if r > found.best]
    if missing:  # bracketed: the error is at most the final bracket's width
        assert capacity - found.slo_capacity <= min(missing) - found.best + 1e-9
        assert min(missing) / found.best <= SWEEP_FACTOR + 1e-9


def test_a_sweep_that_meets_nowhere_finds_no_capacity_and_no_quality():
    found = sweep(convex_system(0.1, 1.0), 1.0, SLO, max_points=3)
    assert found.slo_capacity is None and found.best is None
    assert [p["meets_slo"] for p in found.points] == [False] * 3
    assert quality_at_capacity(found, lambda *_: {"token_agreement": 1.0}, None) is None


def test_quality_at_capacity_is_read_at_the_best_point_against_fp16s_nearest():
    fp16 = sweep(convex_system(1.0, 2.0), 1.0, SLO, max_points=4)
    morph = sweep(convex_system(1.6, 2.0), 1.0, SLO, max_points=4)
    asked = []

    def agreed(rate, fp16_rate):
        asked.append((rate, fp16_rate))
        return {"token_agreement": 0.97, "prefix_agreement": 0.9}

    q = quality_at_capacity(morph, agreed, fp16)
    assert asked == [(morph.best, nearest(fp16.played, morph.best))] and q["rate_scale"] == morph.best
    assert q["token_agreement"] == 0.97 and q["full_precision_token_share"] == 1.0
    assert morph.slo_capacity > fp16.slo_capacity
    # without fp16 swept, no agreement, but the widths are still read
    assert quality_at_capacity(morph, agreed, None)["token_agreement"] is None


def test_token_shares_are_pooled_over_windows_by_their_tokens():
    windows = {"a": window([0.1], mixes=((0, 0, 0.5), (0, 30, 0.5)), tokens=30),
               "b": window([0.1], mixes=((0, 0, 1.0),), tokens=10)}
    shares = token_shares(windows)
    assert shares == [{"int8_layers": 0, "int4_layers": 0, "token_share": pytest.approx(25 / 40)},
                      {"int8_layers": 0, "int4_layers": 30, "token_share": pytest.approx(15 / 40)}]
    assert token_shares({"a": window([0.1], mixes=())}) == []


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_keep_the_rate_and_spread_by_the_burstiness(burstiness):
    times = gamma_arrivals(20_000, 2_000.0, burstiness, "0:0")
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and times == sorted(times)
    mean = statistics.fmean(gaps)
    # gaps of Gamma(k, 1/(rate k)): mean 1 / rate, squared coefficient of variation 1 / k
    assert mean == pytest.approx(0.1, rel=0.05)
    assert statistics.pvariance(gaps) / mean ** 2 == pytest.approx(1 / burstiness, rel=0.15)
    assert gamma_arrivals(50, 5.0, burstiness, "0:0") == gamma_arrivals(50, 5.0, burstiness, "0:0")
    assert gamma_arrivals(50, 5.0, burstiness, "0:0") != gamma_arrivals(50, 5.0, burstiness, "1:0")


def test_a_bursty_window_keeps_its_requests_and_lengths_and_scales_by_the_rate():
    rows = [TraceRow(t, 100 + i, 10 + i) for i, t in enumerate([0.5, 1.0, 1.1, 3.0, 7.9, 9.0])]
    w = Window(0.0, 8.0, "busy", 5)
    trace = requests_in(rows, w, 1.0, 1.0, 512)
    drawn = requests_in(rows, w, 1.0, 1.0, 512, burstiness=0.5, seed=3)
    assert [(r.prompt_tokens, r.output_tokens) for r in drawn] == [(r.prompt_tokens, r.output_tokens) for r in trace]
    assert [r.arrival_s for r in drawn] != [r.arrival_s for r in trace]
    faster = requests_in(rows, w, 2.0, 1.0, 512, burstiness=0.5, seed=3)
    assert [r.arrival_s for r in faster] == pytest.approx([r.arrival_s / 2 for r in drawn])
    with pytest.raises(TraceError, match="burstiness must be positive"):
        requests_in(rows, w, 1.0, 1.0, 512, burstiness=0.0)


def regime_args(**given) -> argparse.Namespace:
    return argparse.Namespace(**({"regime": "memory-bound", "model": "default", "device": "cpu", "memory_budget": None,
                                  "len_scale": None, "max_len": None} | given))


def test_the_memory_bound_regime_makes_weights_most_of_the_arena():
    args = regime_args()
    apply_regime(args)
    share = weight_bytes("default", "cpu") / int(args.memory_budget)
    assert 0.65 <= share <= 0.70 and args.len_scale > REGIMES["default"].len_scale and args.max_len == 1024
    # bfloat16 on CUDA halves the weights, and so the arena
    assert arena_for("default", "cuda", 0.7) == pytest.approx(int(args.memory_budget) / 2, rel=1e-2)
    explicit = regime_args(memory_budget="2GiB", len_scale=0.05)
    apply_regime(explicit)
    assert (explicit.memory_budget, explicit.len_scale, explicit.max_len) == ("2GiB", 0.05, 1024)
    default = regime_args(regime="default")
    apply_regime(default)
    assert (default.len_scale, default.max_len) == (0.1, 512) and int(default.memory_budget) == 1 << 30


def test_a_regime_for_a_model_without_a_readable_shape_is_refused(tmp_path):
    with pytest.raises(RegimeError, match="config.json"):
        apply_regime(regime_args(model=str(tmp_path)))
    with pytest.raises(RegimeError, match="weight share"):
        arena_for("default", "cpu", 1.0)
    assert math.isclose(weight_bytes("default", "cpu"), 30 * 3_538_944 * 4)
