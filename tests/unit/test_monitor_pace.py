"""The monitor's pace (shared/core/monitor/pace.py): publishing the cluster state takes at most half of its time,
and a monitor whose states are cheap keeps its clock and its states between ticks."""

from hypothesis import given
from hypothesis import strategies as st

from shared.core.monitor.pace import pace

intervals = st.floats(min_value=0.01, max_value=5.0)
costs = st.floats(min_value=0.0, max_value=10.0)


@given(intervals, costs)
def test_publishing_takes_at_most_half_the_monitors_time(interval, cost):
    step = pace(interval, cost)
    states_per_tick = 2 if step.urgent else 1  # a tick's state, and at most one of new pressure before the next
    assert states_per_tick * cost <= 0.5 * step.tick_s + 1e-12
    assert step.tick_s >= interval


@given(intervals, st.floats(min_value=0.0, max_value=0.2499))
def test_cheap_states_keep_the_clock_and_the_states_between_ticks(interval, share):
    step = pace(interval, share * interval)
    assert step.tick_s == interval and step.urgent


def test_a_thousand_executors_on_the_gpu_machine():
    """Its states cost ~100 ms at 1,000 executors and ~160 ms at 2,000 (docs/benchmarks.md), the clock 200 ms."""
    assert pace(0.2, 0.04) == pace(0.2, 0.0)  # 300 executors on two cores: unchanged
    thousand = pace(0.2, 0.1)
    assert thousand.tick_s == 0.2 and not thousand.urgent  # 5 Hz, no states between ticks
    two_thousand = pace(0.2, 0.16)
    assert abs(two_thousand.tick_s - 0.32) < 1e-9 and not two_thousand.urgent
