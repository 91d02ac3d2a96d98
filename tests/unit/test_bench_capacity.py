"""The baseline's capacity: steady load, the SLO crossing between probes, and the search, against a fake system."""

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.tools.bench.capacity import CapacityError, Probe, crossing, search, steady_load
from services.tools.bench.trace import TraceRow, scale_lengths

SLO = 2.0


def queue_p95(rate: float) -> Probe:
    """A fake system whose P95 TTFT is 0.5 / (1 - rate / 2): 2.0 s, the SLO, at 1.5 req/s; at 2 req/s and
    beyond the queue grows without bound, so requests time out and there is no P95."""
    if rate >= 2:
        return Probe(rate, None, 10, 10)
    return Probe(rate, 0.5 / (1 - rate / 2), 0, 10)


def test_steady_load_is_poisson_at_the_rate_with_the_traces_lengths():
    rows = [TraceRow(0.0, 1000, 100), TraceRow(1.0, 20, 400), TraceRow(2.0, 20, 400)]
    requests = steady_load(rows, rate_rps=50, duration_s=100, len_scale=0.5, max_len=256, seed=7)
    # 5000 arrivals expected, standard deviation sqrt(5000) ~ 71: four of them is 283.
    assert abs(len(requests) - 5000) < 283
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 100
    # Exponential gaps: their standard deviation equals their mean (1/50 s), which evenly spaced
    # or uniformly jittered arrivals would not give.
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    mean = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert mean == pytest.approx(0.02, rel=0.06) and sd == pytest.approx(mean, rel=0.1)
    # Lengths come from the rows, scaled: (206, 50) a third of the time, (10, 128) two thirds,
    # each capped to fit 256 tokens.
    mix = Counter((r.prompt_tokens, r.output_tokens) for r in requests)
    assert set(mix) == {scale_lengths(1000, 100, 0.5, 256), scale_lengths(20, 400, 0.5, 256)} == {(206, 50), (10, 128)}
    assert mix[(206, 50)] / len(requests) == pytest.approx(1 / 3, abs=0.03)


def test_steady_load_is_reproducible_by_seed():
    rows = [TraceRow(0.0, 100, 10), TraceRow(1.0, 30, 300)]
    assert steady_load(rows, 5, 60, 1.0, 512, seed=1) == steady_load(rows, 5, 60, 1.0, 512, seed=1)
    assert steady_load(rows, 5, 60, 1.0, 512, seed=1) != steady_load(rows, 5, 60, 1.0, 512, seed=2)


def test_steady_load_rejects_what_cannot_be_played():
    rows = [TraceRow(0.0, 100, 10)]
    for bad in ((rows, 0, 60, 1.0, 512), (rows, 5, -1, 1.0, 512), (rows, 5, 60, 0.0, 512)):
        with pytest.raises(CapacityError, match="must be positive"):
            steady_load(*bad, seed=0)
    with pytest.raises(CapacityError, match="max_len"):
        steady_load(rows, 5, 60, 1.0, 1, seed=0)
    with pytest.raises(CapacityError, match="no trace rows"):
        steady_load([], 5, 60, 1.0, 512, seed=0)


def test_probe_meets_only_within_the_slo_and_without_failures():
    assert Probe(1.0, 2.0, 0, 10).meets(2.0)
    assert not Probe(1.0, 2.01, 0, 10).meets(2.0)
    assert not Probe(1.0, 0.1, 1, 10).meets(2.0)
    assert not Probe(1.0, None, 0, 0).meets(2.0)


def test_crossing_interpolates_between_the_bracketing_probes():
    # p95 1.0 at 1 req/s, 3.0 at 2 req/s: the line reaches 2.0 half way, at 1.5.
    assert crossing([Probe(2.0, 3.0, 0, 10), Probe(1.0, 1.0, 0, 10)], SLO) == pytest.approx(1.5)
    # 1.25 at 1.2 and 5.0 at 1.8: 0.75 of the 3.75 rise, a fifth of the 0.6 gap, is 1.32. The probe at
    # 0.5 req/s is below the highest meeting rate and plays no part.
    probes = [Probe(0.5, 0.3, 0, 10), Probe(1.2, 1.25, 0, 10), Probe(1.8, 5.0, 0, 10)]
    assert crossing(probes, SLO) == pytest.approx(1.32)


def test_crossing_edge_cases():
    meets = Probe(1.0, 1.0, 0, 10)
    assert crossing([meets, Probe(2.0, None, 10, 10)], SLO) == 1.0  # nothing to interpolate towards
    assert crossing([meets, Probe(2.0, 2.5, 1, 10)], SLO) == 1.0  # a failure misses at the point itself
    assert crossing([meets, Probe(0.5, 0.5, 0, 10)], SLO) == 1.0  # no miss above: the highest meeting rate
    assert crossing([Probe(1.0, 3.0, 0, 10), Probe(0.5, 1.0, 2, 10)], SLO) is None
    assert crossing([], SLO) is None
    # The next higher probe, not the highest: the miss at 4 req/s is beyond the one at 2.
    assert crossing([meets, Probe(4.0, 9.0, 0, 10), Probe(2.0, 3.0, 0, 10)], SLO) == pytest.approx(1.5)
    with pytest.raises(CapacityError):
        crossing([meets], 0)


probes_st = st.lists(st.builds(Probe, st.floats(0.1, 10), st.one_of(st.none(), st.floats(0.0, 5.0)),
                               st.sampled_from([0, 0, 1]), st.just(10)),
                     max_size=8, unique_by=lambda p: p.rate_rps)


@settings(max_examples=300, deadline=None)
@given(probes=probes_st)
def test_crossing_lies_between_the_highest_meeting_rate_and_the_next_probe(probes):
    meeting = [p.rate_rps for p in probes if p.meets(SLO)]
    capacity = crossing(probes, SLO)
    if not meeting:
        assert capacity is None
        return
    above = [p.rate_rps for p in probes if p.rate_rps > max(meeting)]
    assert max(meeting) <= capacity <= min(above, default=max(meeting))
    assert crossing(list(reversed(probes)), SLO) == capacity


def test_search_walks_up_brackets_bisects_and_interpolates():
    lines = []
    capacity, probes = search(queue_p95, 0.8, SLO, progress=lines.append)
    # 0.8 and 1.2 meet, 1.8 misses, then the bisection at sqrt(1.2 * 1.8) ~ 1.470 meets (p95 1.886 s).
    mid = math.sqrt(1.2 * 1.8)
    assert [p.rate_rps for p in probes] == pytest.approx([0.8, 1.2, mid, 1.8])
    # The true crossing is 1.5. The p95 curve is convex, so the line between (mid, 1.886) and (1.8, 5.0)
    # lies above it and reaches the SLO sooner: the estimate falls in [mid, 1.5], here ~1.482.
    assert mid <= capacity <= 1.5
    assert capacity == pytest.approx(crossing(probes, SLO))
    assert capacity == pytest.approx(1.4818, abs=1e-4)
    # One line per probe in the order probed, then the result.
    assert len(lines) == 5 and "1.8 req/s" in lines[2] and "misses the 2 s SLO" in lines[2]
    assert "1.47 req/s" in lines[3] and lines[-1] == "capacity: 1.48 req/s"
    assert lines[0] == "capacity probe at 0.8 req/s: TTFT p95 0.833 s, 0 of 10 failed: meets the 2 s SLO"


def test_search_walks_down_from_an_overloaded_start():
    lines = []
    capacity, probes = search(queue_p95, 3.0, SLO, progress=lines.append)
    # 3 and 2 fail outright, 4/3 meets (p95 1.5 s); the bisection at sqrt(8/3) ~ 1.633 misses (2.72 s).
    assert [p.rate_rps for p in probes] == pytest.approx([4 / 3, math.sqrt(8 / 3), 2.0, 3.0])
    assert 4 / 3 <= capacity <= 1.5
    assert capacity == pytest.approx(crossing(probes, SLO))
    assert "failed: misses" in lines[0]


def test_search_stops_at_max_probes_and_bisects_only_within_them():
    calls = []

    def always_meets(rate):
        calls.append(rate)
        return Probe(rate, 0.1, 0, 10)

    lines = []
    capacity, probes = search(always_meets, 1.0, SLO, factor=2.0, max_probes=4, progress=lines.append)
    assert calls == [1.0, 2.0, 4.0, 8.0] and capacity == 8.0
    assert "lower bound" in lines[-1]
    # Bracketed on the second probe, but max_probes=2 leaves no room for the bisection.
    capacity, probes = search(queue_p95, 1.2, SLO, max_probes=2, progress=lambda _: None)
    assert [p.rate_rps for p in probes] == pytest.approx([1.2, 1.8])
    assert capacity == pytest.approx(1.32)


def test_search_with_nothing_meeting_returns_the_lowest_rate_and_says_so():
    lines = []
    capacity, probes = search(lambda rate: Probe(rate, 9.0, 0, 10), 1.0, SLO, factor=2.0, max_probes=3,
                              progress=lines.append)
    assert capacity == 0.25 and [p.rate_rps for p in probes] == [0.25, 0.5, 1.0]
    assert "no probe met the 2 s SLO" in lines[-1]


def test_search_rejects_arguments_it_cannot_search_with():
    for kwargs in ({"start_rps": 0}, {"slo_s": -1}, {"factor": 1.0}, {"max_probes": 1}):
        args = {"measure": queue_p95, "start_rps": 1.0, "slo_s": SLO} | kwargs
        with pytest.raises(CapacityError):
            search(**args, progress=lambda _: None)
