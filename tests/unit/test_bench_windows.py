"""The rule that picks the bench's trace windows, and the rate scale that plays them against capacity."""

import statistics

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from services.tools.bench.trace import TraceError, TraceRow, read_rows
from services.tools.bench.windows import Window, median_rate, pick_windows, rate_scale_for, requests_in
from shared.config import data_dir

REAL_TRACE = data_dir() / "traces" / "AzureLLMInferenceTrace_conv.first30min.csv"


def rows_with_counts(counts: list[int], duration_s: float = 10.0) -> list[TraceRow]:
    """Rows whose whole windows of duration_s hold `counts` arrivals, plus one row that closes the last
    window (it arrives at its end, so it belongs to the next, partial one)."""
    rows = []
    for i, n in enumerate(counts):
        rows += [TraceRow(i * duration_s + (j + 0.5) * duration_s / n, 100 + j, 10 + j) for j in range(n)]
    rows.append(TraceRow(len(counts) * duration_s, 1, 1))
    return rows


# Six whole windows of 10 s; median count (4 + 5) / 2 = 4.5, distances 1.5, 3.5, 3.5, 0.5, 3.5, 0.5.
COUNTS = [3, 8, 1, 5, 8, 4]


def test_busy_are_the_most_arrivals_with_ties_to_the_earlier():
    windows = pick_windows(rows_with_counts(COUNTS), 10, 1, 0)
    assert windows == [Window(10.0, 10, "busy", 8)]  # 8 at 10 s and at 40 s: the earlier one
    assert [w.start_s for w in pick_windows(rows_with_counts(COUNTS), 10, 3, 0)] == [10.0, 30.0, 40.0]


def test_ordinary_are_closest_to_the_median_with_ties_to_the_earlier():
    rows = rows_with_counts(COUNTS)
    assert [(w.start_s, w.arrivals) for w in pick_windows(rows, 10, 0, 1)] == [(30.0, 5)]
    assert [(w.start_s, w.arrivals) for w in pick_windows(rows, 10, 0, 2)] == [(30.0, 5), (50.0, 4)]
    # Third closest: 3 arrivals at 0 s (1.5 from the median) before the 3.5s.
    assert [w.start_s for w in pick_windows(rows, 10, 0, 3)] == [0.0, 30.0, 50.0]


def test_mixed_pick_comes_back_in_start_order_with_kinds_and_names():
    windows = pick_windows(rows_with_counts(COUNTS), 10, 2, 2)
    assert [(w.name, w.arrivals) for w in windows] == [("busy@10s", 8), ("ordinary@30s", 5), ("busy@40s", 8),
                                                       ("ordinary@50s", 4)]
    assert windows[0].rate == 0.8


def test_ordinary_never_takes_a_busy_window():
    # Median 5; the busiest is 9 at 40 s, then the three 5s tie for second: busy takes the one at 10 s,
    # so the window closest to the median that is left is the 5 at 20 s.
    windows = pick_windows(rows_with_counts([1, 5, 5, 5, 9]), 10, 2, 1)
    assert [(w.kind, w.start_s) for w in windows] == [("busy", 10.0), ("ordinary", 20.0), ("busy", 40.0)]


def test_a_burst_in_the_partial_last_window_is_not_picked():
    rows = rows_with_counts([2, 3, 2]) + [TraceRow(30.5 + i * 0.1, 5, 5) for i in range(50)]
    assert [w.start_s for w in pick_windows(rows, 10, 1, 0)] == [10.0]
    assert median_rate(rows, 10) == 0.2


def test_pick_rejects_bad_arguments_and_short_traces():
    rows = rows_with_counts(COUNTS)
    with pytest.raises(TraceError, match="6 whole windows of 10 s, fewer than the 4 busy \\+ 3 ordinary"):
        pick_windows(rows, 10, 4, 3)
    with pytest.raises(TraceError, match="at least one window"):
        pick_windows(rows, 10, 0, 0)
    with pytest.raises(TraceError, match="got -1 and 2"):
        pick_windows(rows, 10, -1, 2)
    with pytest.raises(TraceError, match="duration must be positive"):
        pick_windows(rows, 0, 1, 1)
    with pytest.raises(TraceError, match="not one whole window"):
        pick_windows(rows, 100, 1, 0)
    with pytest.raises(TraceError, match="no requests"):
        pick_windows([], 10, 1, 0)


def test_median_rate_is_the_median_count_per_second():
    assert median_rate(rows_with_counts(COUNTS), 10) == pytest.approx(0.45)
    # Windows of 20 s pair the counts: 11, 6, 12; median 11 over 20 s.
    assert median_rate(rows_with_counts(COUNTS), 20) == pytest.approx(0.55)


def test_rate_scale_plays_the_median_at_load_times_capacity():
    scale = rate_scale_for(2.0, 0.45)
    assert scale == pytest.approx(2.0 / 0.45)
    assert 0.45 * rate_scale_for(2.0, 0.45, load=0.8) == pytest.approx(1.6)
    for bad in ((0, 0.45, 1), (2.0, 0, 1), (2.0, 0.45, -1)):
        with pytest.raises(ValueError, match="must be positive"):
            rate_scale_for(*bad)


def test_requests_in_cuts_scales_and_orders_the_window():
    rows = [TraceRow(12.0, 400, 40), TraceRow(9.99, 1, 1), TraceRow(10.0, 1000, 300), TraceRow(20.0, 7, 7),
            TraceRow(30.0, 1, 1)]
    window = Window(10.0, 10.0, "busy", 2)
    requests = requests_in(rows, window, rate_scale=0.5, len_scale=0.5, max_len=64)
    assert [r.arrival_s for r in requests] == [0.0, 4.0]  # 10 s and 12 s, played twice as slow
    # 500 + 150 tokens: the output capped at half of 64, the prompt at what is left; 200 + 20 fits.
    assert [(r.prompt_tokens, r.output_tokens) for r in requests] == [(32, 32), (44, 20)]


def test_requests_in_rejects_bad_scales_and_empty_windows():
    rows = rows_with_counts([2, 0, 2])
    with pytest.raises(TraceError, match="no request arrives in window ordinary@10s"):
        requests_in(rows, Window(10.0, 10.0, "ordinary", 0), 1.0, 1.0, 64)
    with pytest.raises(TraceError, match="scales must be positive"):
        requests_in(rows, Window(0.0, 10.0, "busy", 2), 0.0, 1.0, 64)
    with pytest.raises(TraceError, match="max_len"):
        requests_in(rows, Window(0.0, 10.0, "busy", 2), 1.0, 1.0, 1)


@settings(max_examples=200, deadline=None)
@given(times=st.lists(st.floats(0, 120, allow_nan=False), min_size=1, max_size=120),
       duration=st.sampled_from([3.0, 7.5, 10.0, 12.5]), k_busy=st.integers(0, 4), k_ordinary=st.integers(0, 4))
def test_pick_invariants(times, duration, k_busy, k_ordinary):
    rows = [TraceRow(t, 10, 10) for t in times] + [TraceRow(120.0, 10, 10)]
    counts = [sum(1 for t in times if i * duration <= t < (i + 1) * duration) for i in range(int(120 // duration))]
    assume(0 < k_busy + k_ordinary <= len(counts))
    windows = pick_windows(rows, duration, k_busy, k_ordinary)

    assert len(windows) == k_busy + k_ordinary
    assert [w.kind for w in windows].count("busy") == k_busy
    starts = [w.start_s for w in windows]
    assert starts == sorted(set(starts))  # in start order, and disjoint: all start on the same grid
    index = {w.start_s: round(w.start_s / duration) for w in windows}
    assert all(w.start_s == index[w.start_s] * duration and w.duration_s == duration for w in windows)
    assert all(w.arrivals == counts[index[w.start_s]] for w in windows)

    picked = set(index.values())
    unpicked = [counts[i] for i in range(len(counts)) if i not in picked]
    median = statistics.median(counts)
    for w in windows:
        if w.kind == "busy":
            assert all(w.arrivals >= n for n in unpicked)
        else:
            assert all(abs(w.arrivals - median) <= abs(n - median) for n in unpicked)
            assert all(w.arrivals <= b.arrivals for b in windows if b.kind == "busy")
    # The replay of a picked window is exactly what was counted in it.
    for w in windows:
        if w.arrivals:
            assert len(requests_in(rows, w, 1.0, 1.0, 64)) == w.arrivals


@pytest.mark.skipif(not REAL_TRACE.exists(), reason=f"{REAL_TRACE} is not there")
def test_real_trace_busy_windows_outnumber_ordinary_ones():
    rows = read_rows(REAL_TRACE)
    windows = pick_windows(rows, 20, 2, 2)
    assert len(windows) == 4
    assert all(a.start_s + a.duration_s <= b.start_s for a, b in zip(windows, windows[1:]))
    busy = [w for w in windows if w.kind == "busy"]
    ordinary = [w for w in windows if w.kind == "ordinary"]
    assert len(busy) == 2 and len(ordinary) == 2
    assert min(w.arrivals for w in busy) > max(w.arrivals for w in ordinary)
    assert all(w.start_s + w.duration_s <= rows[-1].time_s for w in windows)
    assert median_rate(rows, 20) * 20 == pytest.approx(statistics.median(w.arrivals for w in ordinary), abs=5)
