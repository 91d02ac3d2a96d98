"""When the controller asks for more executors or fewer (shared/core/policies/capacity.py), and the gauge an
autoscaler reads it from."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.metrics import GatewayMetrics
from shared.core.policies.capacity import CapacityAdvice, CapacitySettings, capacity_settings
from shared.messages import ClusterState, Event, SloWindow
from tests.unit.test_router import executor

SETTINGS = CapacitySettings(violation_rate=0.1, min_requests=5, sustain_s=10.0, idle_s=30.0, minimum=1)


def at(now: float, n: int, violating: bool, running: int) -> ClusterState:
    executors = [executor(f"exec{i}", running=running).model_copy(update={
        "slo": SloWindow(requests=10, violation_rate=0.5 if violating else 0.0)}) for i in range(n)]
    return ClusterState(time=now, executors=executors)


@given(st.lists(st.tuples(st.floats(0.1, 20), st.booleans(), st.integers(0, 2), st.integers(0, 1)),
                min_size=1, max_size=40), st.integers(1, 4))
def test_it_asks_one_more_only_after_sustained_exhausted_failure_and_one_fewer_only_after_idling(steps, n):
    advice, now = CapacityAdvice(SETTINGS), 0.0
    failing_since = idle_since = None
    for wait, violating, running, planned in steps:
        now += wait
        desired = advice.desired(at(now, n, violating, running), planned)
        exhausted = violating and not planned
        failing_since = (now if failing_since is None else failing_since) if exhausted else None
        idle_since = (now if idle_since is None else idle_since) if running == 0 else None
        if failing_since is not None and now - failing_since >= SETTINGS.sustain_s:
            assert desired == n + 1
        elif idle_since is not None and now - idle_since >= SETTINGS.idle_s:
            assert desired == max(1, n - 1)
        else:
            assert desired == n


def test_a_command_planned_means_a_lever_is_still_trying():
    advice = CapacityAdvice(SETTINGS)
    assert advice.desired(at(0, 2, True, 1), planned=0) == 2
    assert advice.desired(at(9, 2, True, 1), planned=1) == 2  # the window starts again
    assert advice.desired(at(15, 2, True, 1), planned=0) == 2
    assert advice.desired(at(25, 2, True, 1), planned=0) == 3
    assert "every lever exhausted" in advice.reason(at(25, 2, True, 1), 3)


def test_settings_by_name_and_a_bad_one_refused():
    assert capacity_settings(sustain_s=2).sustain_s == 2
    with pytest.raises(ValueError, match="unknown capacity setting"):
        capacity_settings(nope=1)
    with pytest.raises(ValueError, match="non-negative numbers"):
        capacity_settings(idle_s="soon")


def test_the_gauge_is_what_there_is_until_the_controller_says_otherwise():
    metrics = GatewayMetrics()
    metrics.observe_state(at(0, 2, False, 0))
    assert b"morphling_desired_executors 2.0" in metrics.render()
    metrics.observe_event(Event(kind="command", source="ctl0", time=0, data={"desired_executors": 7}))
    assert b"morphling_desired_executors 2.0" in metrics.render()  # only its own events count
    metrics.observe_event(Event(kind="scale", source="ctl0", time=0, data={"desired_executors": 3}))
    metrics.observe_state(at(1, 2, False, 0))
    assert b"morphling_desired_executors 3.0" in metrics.render()
