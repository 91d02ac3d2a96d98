"""The monitor's SLO windows without a bus or a clock: violation rates and nearest-rank percentiles over the
requests finished in the last window, and the flags that set the SLOs."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services import up
from services.monitor import service as monitor_service
from shared.config import MonitorConfig
from shared.core.monitor.slo import SloTracker, _window, nearest_rank
from shared.messages import RequestLatency, SloWindow


def latency(ttft_s: float, tpot_s: float) -> RequestLatency:
    return RequestLatency(ttft_s=ttft_s, tpot_s=tpot_s)


def test_the_window_counts_requests_over_either_slo_and_takes_percentiles_of_each():
    tracker = SloTracker(ttft_s=1.0, tpot_s=0.1, window_s=10.0)
    tracker.add([latency(0.5, 0.05), latency(1.5, 0.05), latency(0.5, 0.2), latency(0.2, 0.0)], now=100.0)
    window = tracker.window(100.5)
    assert window.requests == 4
    assert window.violation_rate == 0.5  # one over the TTFT SLO, one over the TPOT SLO
    assert (window.ttft_p50_s, window.ttft_p95_s) == (0.5, 1.5)
    # The one-token completion has no TPOT: its 0 would pull the TPOT percentiles down.
    assert (window.tpot_p50_s, window.tpot_p95_s) == (0.05, 0.2)


def test_a_request_exactly_at_an_slo_meets_it():
    tracker = SloTracker(ttft_s=1.0, tpot_s=0.1, window_s=10.0)
    tracker.add([latency(1.0, 0.1)], now=0.0)
    assert tracker.window(0.0).violation_rate == 0.0


def test_requests_leave_the_window_once_it_has_passed_them():
    tracker = SloTracker(ttft_s=1.0, tpot_s=0.1, window_s=10.0)
    tracker.add([latency(5.0, 0.05)], now=0.0)
    tracker.add([latency(0.1, 0.05)], now=4.0)
    assert (tracker.window(10.0).requests, tracker.window(10.0).violation_rate) == (2, 0.5)
    after = tracker.window(10.5)
    assert (after.requests, after.violation_rate, after.ttft_p95_s) == (1, 0.0, 0.1)
    assert tracker.window(14.5) == SloWindow()  # nothing finished lately: no rate, no percentiles


def test_nearest_rank_percentiles_are_samples_and_never_off_by_a_float():
    twenty = [float(i) for i in range(1, 21)]
    assert nearest_rank(twenty, 95) == 19.0  # rank 0.95 * 20 = 19 exactly, which floats would round up to 20
    assert nearest_rank(twenty, 50) == 10.0
    assert nearest_rank([3.0], 50) == nearest_rank([3.0], 95) == 3.0
    assert nearest_rank([], 95) == 0.0


samples = st.lists(st.tuples(st.floats(min_value=0.0, max_value=5.0), st.floats(min_value=0.0, max_value=0.5)),
                   max_size=8)
operations = st.lists(st.tuples(st.sampled_from(["add", "look"]), st.floats(min_value=0.0, max_value=4.0), samples),
                      max_size=40)


@settings(max_examples=300, deadline=None)
@given(operations)
def test_the_window_is_exactly_the_recent_samples(ops):
    slo_ttft, slo_tpot, window_s = 2.0, 0.15, 10.0
    tracker = SloTracker(slo_ttft, slo_tpot, window_s)
    arrived: list[tuple[float, RequestLatency]] = []
    now = 0.0
    for op, dt, batch in ops:
        now += dt
        if op == "add":
            batch = [latency(t, p) for t, p in batch]
            tracker.add(batch, now)
            arrived += [(now, s) for s in batch]
            continue
        window = tracker.window(now)
        inside = [s for at, s in arrived if now - at <= window_s]
        assert window.requests == len(inside)
        if not inside:
            assert window == SloWindow()
            continue
        over = [s for s in inside if s.ttft_s > slo_ttft or s.tpot_s > slo_tpot]
        assert window.violation_rate == len(over) / len(inside)
        ttfts, tpots = {s.ttft_s for s in inside}, {s.tpot_s for s in inside if s.tpot_s > 0}
        assert {window.ttft_p50_s, window.ttft_p95_s} <= ttfts
        assert window.ttft_p50_s <= window.ttft_p95_s
        if tpots:
            assert {window.tpot_p50_s, window.tpot_p95_s} <= tpots
            assert window.tpot_p50_s <= window.tpot_p95_s
        else:
            assert window.tpot_p50_s == window.tpot_p95_s == 0.0


latencies = st.one_of(*[st.floats(min_value=0.0, max_value=5.0)] * 3,  # a tie, infinity, a non-number now and then
                      st.sampled_from([0.0, 0.1, math.inf, math.nan]))
mixed = st.lists(st.tuples(st.sampled_from(["add", "look", "look back"]), st.floats(min_value=0.0, max_value=4.0),
                           st.lists(st.tuples(latencies, latencies), max_size=6)), max_size=40)


@settings(max_examples=500, deadline=None)
@given(mixed)
def test_the_window_kept_in_order_is_the_window_sorted_afresh(ops):
    """The tracker keeps its latencies in order as samples come and go; its window is the one sorting the
    samples inside gives, ties, infinities and latencies that are not numbers (which no order holds) included,
    and for a look back at a time some samples came after."""
    tracker = SloTracker(2.0, 0.15, 10.0)
    arrived: list[tuple[float, RequestLatency]] = []
    clock = latest = 0.0  # the clock samples arrive by; the latest time the window was asked for
    for op, dt, batch in ops:
        if op == "add":
            clock += dt
            batch = [latency(t, p) for t, p in batch]
            tracker.add(batch, clock)
            arrived += [(clock, s) for s in batch]
            continue
        at = clock - dt if op == "look back" else clock + dt
        latest = max(latest, at)  # a window forgets what has left it for good
        inside = [s for arrival, s in arrived if arrival <= at and latest - arrival <= 10.0]
        assert tracker.window(at) == _window(inside, 2.0, 0.15)


# --- the flags ----------------------------------------------------------------------------------------

def configured(monkeypatch, argv: list[str]) -> MonitorConfig:
    """The MonitorConfig `morphling monitor ARGV` would run with."""
    seen: list[MonitorConfig] = []

    async def run(config: MonitorConfig) -> None:
        seen.append(config)

    monkeypatch.setattr(monitor_service, "_run_until_signalled", run)
    monkeypatch.setattr(monitor_service, "setup_tracing", lambda name: None)
    assert monitor_service.main(argv) == 0
    (config,) = seen
    return config


def test_the_monitor_takes_its_slos_from_flags_and_defaults_to_the_config(monkeypatch):
    config = configured(monkeypatch, ["--slo-ttft", "0.5", "--slo-tpot", "0.05", "--slo-window", "30"])
    assert (config.slo_ttft_s, config.slo_tpot_s, config.slo_window_s) == (0.5, 0.05, 30.0)
    defaults, config = MonitorConfig(), configured(monkeypatch, [])
    assert (config.slo_ttft_s, config.slo_tpot_s, config.slo_window_s) == (
        defaults.slo_ttft_s, defaults.slo_tpot_s, defaults.slo_window_s)


@pytest.mark.parametrize("argv", [["--slo-ttft", "0"], ["--slo-tpot", "-0.1"], ["--slo-window", "soon"]])
def test_the_monitor_refuses_an_slo_that_is_not_a_positive_number_of_seconds(monkeypatch, argv, capsys):
    with pytest.raises(SystemExit) as exited:
        configured(monkeypatch, argv)
    assert exited.value.code == 2 and argv[0] in capsys.readouterr().err


def test_up_hands_the_slos_to_the_monitor_only_when_given():
    given = up.parse_args(["--slo-ttft", "0.5", "--slo-tpot", "0.05", "--slo-window", "30"])
    args = up.monitor_args(given, "nats://x")
    assert [args[args.index(f) + 1] for f in ("--slo-ttft", "--slo-tpot", "--slo-window")] == ["0.5", "0.05", "30"]
    assert not {"--slo-ttft", "--slo-tpot", "--slo-window"} & set(up.monitor_args(up.parse_args([]), "nats://x"))
