"""The executor's time bound on queueing (shared/core/admission.py): what it refuses and what it never does."""

from hypothesis import given
from hypothesis import strategies as st

from shared.core.admission import Departures, admits, predicted_wait_s, waiting_ahead

ahead = st.integers(min_value=0, max_value=10_000)
departures = st.integers(min_value=0, max_value=10_000)
spans = st.floats(min_value=0.0, max_value=600.0, allow_nan=False)
bounds = st.floats(min_value=0.0, max_value=600.0, allow_nan=False)


@given(departures, spans, bounds)
def test_an_empty_queue_is_never_refused(left, span, bound):
    assert predicted_wait_s(0, left, span) == 0.0
    assert admits(0, left, span, bound)


@given(ahead, spans, bounds)
def test_with_no_departure_seen_the_rate_is_unknown_and_the_request_admitted(waiting, span, bound):
    assert admits(waiting, 0, span, bound)
    if waiting:
        assert predicted_wait_s(waiting, 0, span) is None


@given(ahead, departures, spans)
def test_a_bound_of_zero_is_off(waiting, left, span):
    assert admits(waiting, left, span, 0.0)


@given(ahead, ahead, departures, spans, bounds)
def test_a_longer_queue_never_waits_less_or_is_refused_less(a, b, left, span, bound):
    shorter, longer = sorted((a, b))
    wait_short, wait_long = predicted_wait_s(shorter, left, span), predicted_wait_s(longer, left, span)
    if wait_short is not None and wait_long is not None:
        assert wait_short <= wait_long
    if not admits(shorter, left, span, bound):
        assert not admits(longer, left, span, bound)


@given(ahead, departures.filter(bool), departures.filter(bool), spans, bounds)
def test_a_faster_queue_never_waits_longer_or_is_refused_more(waiting, a, b, span, bound):
    slower, faster = sorted((a, b))  # both known: an unknown rate (no departures) admits, as tested above
    if span > 0:
        assert predicted_wait_s(waiting, faster, span) <= predicted_wait_s(waiting, slower, span)
    if not admits(waiting, faster, span, bound):
        assert not admits(waiting, slower, span, bound)


def test_the_wait_is_the_queue_over_the_rate_it_drains_at():
    # 20 requests left in the last 10 s: 2 per second, so 30 ahead take 15 s.
    assert predicted_wait_s(30, 20, 10.0) == 15.0
    assert admits(30, 20, 10.0, 15.0) and not admits(31, 20, 10.0, 15.0)


@given(ahead, ahead, st.integers(min_value=1, max_value=512))
def test_a_request_the_next_step_starts_is_not_a_wait_and_the_rest_are(waiting, running, max_num_seqs):
    behind = waiting_ahead(waiting, running, max_num_seqs)
    free = max(0, max_num_seqs - running)
    assert behind == (0 if waiting <= free else waiting - free)
    assert waiting_ahead(waiting + 1, running, max_num_seqs) >= behind  # never fewer behind a longer queue


def test_departures_count_over_the_window_or_the_executors_life_when_shorter():
    window = Departures(10.0, now=100.0)
    for t in (101.0, 102.0, 103.0):
        window.record(now=t)
    # 4 s old: the three departures are counted over 4 s, not over a window it has not lived through.
    assert window.recent(now=104.0) == (3, 4.0)
    assert window.recent(now=112.5) == (1, 10.0)  # the first two have left the window
    assert window.recent(now=200.0) == (0, 10.0)
