"""The cluster view without a bus or a clock: smoothing, liveness (suspect, dead, gone), restarts, up/down
transitions and SLO windows."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.config import MonitorConfig
from shared.core.monitor.aggregate import ClusterView, ewma_alpha
from shared.core.plans import tp_plans
from shared.messages import ExecutorTelemetry, InstancePlan, KvPages, RequestLatency


def telemetry(executor: str, at: float, used: int = 0, free: int = 100, waiting: int = 0,
              queue_delay_s: float = 0.0, instance: str = "i0", plan: InstancePlan | None = None) -> ExecutorTelemetry:
    kv = KvPages(pages_total=used + free + 40, pages_slot=40, pages_free=free, pages_used=used,
                 pages_base=used + free, pages_extension=0)
    return ExecutorTelemetry(executor=executor, instance=instance, time=at, model="m", max_model_len=2048,
                             block_size=16, page_bytes=4096, kv=kv, layers=[16] * 4, swap_order=[], running=0,
                             waiting=waiting, max_waiting=256, preemptions=0, prompt_tokens=0, generated_tokens=0,
                             queue_delay_s=queue_delay_s, ttft_s=0.0, tpot_s=0.0, plan=plan)


def test_a_report_of_new_pressure_events_asks_for_the_state_at_once():
    view = ClusterView(MonitorConfig())
    assert not view.observe(telemetry("a", 0.0), now=0.0)
    pressed = telemetry("a", 0.1).model_copy(update={"preemptions": 1})
    assert view.observe(pressed, now=0.1)
    assert not view.observe(pressed.model_copy(update={"time": 0.2}), now=0.2)  # nothing new
    assert view.observe(pressed.model_copy(update={"time": 0.3, "admission_blocked": 1}), now=0.3)
    assert view.observe(pressed.model_copy(update={"time": 0.4, "admission_blocked": 1, "rejected": 2}), now=0.4)
    restarted = telemetry("a", 0.5, instance="i1").model_copy(update={"preemptions": 1})
    assert view.observe(restarted, now=0.5)  # a new process: its first event is new, however it compares
    assert view.observe(telemetry("b", 0.5).model_copy(update={"rejected": 1}), now=0.5)  # new executor


def test_ewma_follows_a_step_with_the_configured_half_life():
    view = ClusterView(MonitorConfig(ewma_half_life_s=1.0, dead_after_s=10.0))
    view.observe(telemetry("a", 0.0, used=0, free=100), now=0.0)
    # Irregular report times: a time-aware EWMA must land on the same value whatever the spacing.
    times = [0.05, 0.1, 0.35, 0.4, 0.7, 0.75, 0.9, 1.0, 1.3, 1.55, 2.0]
    at = {}
    for t in times:
        view.observe(telemetry("a", t, used=100, free=0, waiting=8, queue_delay_s=2.0), now=t)
        at[t] = view.state(t).executors[0]
    # The step happened at t=0 (the first sample after it weighs the whole 0.05 s since then).
    assert math.isclose(at[1.0].kv_usage, 0.5, abs_tol=1e-9)
    assert math.isclose(at[2.0].kv_usage, 0.75, abs_tol=1e-9)
    assert math.isclose(at[1.0].waiting, 4.0, abs_tol=1e-9)
    assert math.isclose(at[2.0].queue_delay_s, 1.5, abs_tol=1e-9)
    assert at[2.0].telemetry.waiting == 8  # the raw report rides along unsmoothed


def test_ewma_alpha_edges():
    assert ewma_alpha(0.0, 1.0) == 0.0
    assert math.isclose(ewma_alpha(1.0, 1.0), 0.5)
    assert ewma_alpha(0.3, 0.0) == 1.0  # half-life 0: no smoothing


def test_first_report_is_taken_as_is():
    view = ClusterView(MonitorConfig())
    view.observe(telemetry("a", 5.0, used=30, free=70), now=5.0)
    assert math.isclose(view.state(5.0).executors[0].kv_usage, 0.3)


def test_a_silent_executor_dies_and_comes_back_with_one_down_then_one_up():
    view = ClusterView(MonitorConfig(dead_after_s=1.0))
    for i in range(6):
        view.observe(telemetry("a", i / 10), now=i / 10)
        view.observe(telemetry("b", i / 10), now=i / 10)
    assert view.transitions(0.5) == [("a", "up"), ("b", "up")]
    view.observe(telemetry("b", 1.4), now=1.4)  # b keeps reporting, a goes silent after 0.5
    assert [e.alive for e in view.state(1.5).executors] == [True, True]  # exactly dead_after: alive
    assert view.transitions(1.5) == []
    state = view.state(1.6)
    assert [(e.executor, e.alive) for e in state.executors] == [("a", False), ("b", True)]
    assert state.executors[0].last_seen == 0.5
    assert view.transitions(1.6) == [("a", "down")]
    assert view.transitions(1.7) == []
    view.observe(telemetry("a", 2.0), now=2.0)
    assert view.state(2.0).executors[0].alive
    assert view.transitions(2.0) == [("a", "up")]
    assert view.transitions(2.1) == []


def test_death_between_two_looks_is_still_reported():
    view = ClusterView(MonitorConfig(dead_after_s=1.0))
    view.observe(telemetry("a", 0.0), now=0.0)
    assert view.transitions(0.0) == [("a", "up")]
    view.observe(telemetry("a", 3.0), now=3.0)  # silent for 3 s, back before anyone looked
    assert view.transitions(3.0) == [("a", "down"), ("a", "up")]


def test_an_executor_never_seen_alive_by_a_look_gets_no_transition():
    view = ClusterView(MonitorConfig(dead_after_s=1.0))
    view.observe(telemetry("a", 0.0), now=0.0)
    assert view.transitions(5.0) == []  # it was up and down before the first look: nothing to retract
    assert [e.alive for e in view.state(5.0).executors] == [False]


operations = st.lists(st.tuples(st.sampled_from(["observe", "state", "transitions"]),
                                st.sampled_from(["a", "b", "c"]),
                                st.floats(min_value=0.0, max_value=1.5, allow_nan=False),
                                st.integers(min_value=0, max_value=100)),
                      max_size=60)


@settings(max_examples=300, deadline=None)
@given(operations)
def test_liveness_and_transitions_agree_with_the_reports(ops):
    dead_after = 0.5
    view = ClusterView(MonitorConfig(suspect_after_s=dead_after / 2, dead_after_s=dead_after, ewma_half_life_s=0.3))
    now = 0.0
    last: dict[str, float] = {}
    emitted: dict[str, list[str]] = {}
    for op, executor, dt, used in ops:
        now += dt
        if op == "observe":
            view.observe(telemetry(executor, now, used=used, free=100 - used), now=now)
            last[executor] = now
        elif op == "state":
            state = view.state(now)
            assert [e.executor for e in state.executors] == sorted(last)  # every executor ever seen
            for e in state.executors:
                assert e.alive == (now - last[e.executor] <= dead_after)
                assert e.last_seen == last[e.executor]
                assert 0.0 <= e.kv_usage <= 1.0
        else:
            for name, change in view.transitions(now):
                emitted.setdefault(name, []).append(change)
            for name, seen in last.items():
                changes = emitted.get(name, [])
                # They alternate, starting with "up", and the last one says what is true now.
                assert changes == ["up", "down"] * (len(changes) // 2) + ["up"] * (len(changes) % 2)
                alive = now - seen <= dead_after
                assert (changes[-1] == "up") == alive if changes else not alive


def test_a_stall_is_suspect_before_it_is_dead_and_ends_as_if_nothing_happened():
    view = ClusterView(MonitorConfig(suspect_after_s=1.0, dead_after_s=6.0))
    view.observe(telemetry("a", 0.0), now=0.0)
    assert view.transitions(0.0) == [("a", "up")]
    (e,) = view.state(0.9).executors
    assert (e.alive, e.suspect) == (True, False)
    (e,) = view.state(3.0).executors  # a several-second stall: no new requests, the running ones go on
    assert (e.alive, e.suspect) == (True, True)
    assert view.suspects(3.0) == ["a"]
    view.observe(telemetry("a", 3.5), now=3.5)  # it wakes up
    (e,) = view.state(3.6).executors
    assert (e.alive, e.suspect, e.restarts) == (True, False, 0)
    assert view.transitions(3.6) == []  # never down
    (e,) = view.state(10.0).executors
    assert (e.alive, e.suspect) == (False, False)
    assert view.transitions(10.0) == [("a", "down")]


def test_a_gone_process_is_dead_at_once_unless_it_reported_after_the_check():
    view = ClusterView(MonitorConfig(suspect_after_s=1.0, dead_after_s=6.0))
    view.observe(telemetry("a", 0.0), now=0.0)
    view.transitions(0.0)
    view.mark_gone("a", checked_at=1.5)
    assert not view.state(1.6).executors[0].alive
    assert view.transitions(1.6) == [("a", "down")]
    view.observe(telemetry("a", 2.0), now=2.0)  # something answers again: alive
    assert view.state(2.1).executors[0].alive
    view.mark_gone("a", checked_at=1.9)  # a check older than the last report changes nothing
    assert view.state(2.1).executors[0].alive
    view.mark_gone("nobody", checked_at=5.0)
    assert [e.executor for e in view.state(5.0).executors] == ["a"]


def test_a_new_instance_counts_a_restart_and_a_down_even_without_a_missed_heartbeat():
    view = ClusterView(MonitorConfig(suspect_after_s=1.0, dead_after_s=6.0))
    view.observe(telemetry("a", 0.0, used=90, free=10), now=0.0)
    assert view.transitions(0.0) == [("a", "up")]
    view.observe(telemetry("a", 0.5, used=0, free=100, instance="i1"), now=0.5)
    (e,) = view.state(0.5).executors
    assert e.restarts == 1
    assert e.kv_usage == 0.0  # the new process's load, not a blend with its predecessor's
    assert view.transitions(0.5) == [("a", "down"), ("a", "up")]
    view.observe(telemetry("a", 0.6, instance="i1"), now=0.6)
    assert view.state(0.6).executors[0].restarts == 1


def test_thresholds_must_be_ordered():
    import pytest

    with pytest.raises(ValueError):
        MonitorConfig(suspect_after_s=2.0, dead_after_s=1.0)
    with pytest.raises(ValueError):
        MonitorConfig(suspect_after_s=0.0)


def test_instances_are_the_plans_of_the_live_leaders_once_each_by_id():
    view = ClusterView(MonitorConfig(dead_after_s=1.0))
    second, first = tp_plans(["c", "d", "a", "b"], 2, 4)  # ids i0 (c, d) and i1 (a, b): by id, not by executor
    for name, plan in (("a", first), ("b", first), ("c", second), ("d", second)):
        view.observe(telemetry(name, 0.0, plan=plan), now=0.0)
    view.observe(telemetry("solo", 0.0), now=0.0)  # standalone: an executor, but no instance to show
    state = view.state(0.5)
    assert [p.id for p in state.instances] == ["i0", "i1"]
    assert state.instances == [second, first] and state.instances[0].members == ["c", "d"]
    assert [e.executor for e in state.executors] == ["a", "b", "c", "d", "solo"]


def test_two_worlds_on_one_bus_show_every_instance_when_each_names_its_own():
    """The monitor keys instances by id: two worlds numbering theirs alike show half of them (one world's i0
    hides the other's), each with its own prefix all of them."""
    def shown(first_prefix: str, second_prefix: str) -> list[str]:
        view = ClusterView(MonitorConfig(dead_after_s=1.0))
        for names, prefix in ((["a0", "a1", "a2", "a3"], first_prefix), (["b0", "b1", "b2", "b3"], second_prefix)):
            for plan in tp_plans(names, 2, 4, prefix=prefix):
                for member in plan.members:
                    view.observe(telemetry(member, 0.0, plan=plan), now=0.0)
        return [p.id for p in view.state(0.5).instances]

    assert shown("i", "i") == ["i0", "i1"]
    assert shown("a", "b") == ["a0", "a1", "b0", "b1"]


def test_an_instance_goes_with_its_leader_whatever_its_followers_report():
    view = ClusterView(MonitorConfig(dead_after_s=1.0))
    (plan,) = tp_plans(["lead", "follow"], 2, 4)
    view.observe(telemetry("lead", 0.0, plan=plan), now=0.0)
    view.observe(telemetry("follow", 0.0, plan=plan), now=0.0)
    view.observe(telemetry("follow", 1.5, plan=plan), now=1.5)
    assert view.state(1.5).instances == []  # the leader is silent past dead_after
    view.observe(telemetry("lead", 1.6, plan=plan), now=1.6)
    assert view.state(1.6).instances == [plan]
    view.mark_gone("lead", checked_at=1.7)
    assert view.state(1.7).instances == []


def test_without_plans_there_are_no_instances():
    view = ClusterView(MonitorConfig())
    view.observe(telemetry("a", 0.0), now=0.0)
    assert view.state(0.0).instances == [] and len(view.state(0.0).executors) == 1


def finished(report: ExecutorTelemetry, *latencies: tuple[float, float]) -> ExecutorTelemetry:
    """`report` carrying requests finished since the previous one, as (ttft_s, tpot_s)."""
    return report.model_copy(update={"requests": [RequestLatency(ttft_s=t, tpot_s=p) for t, p in latencies]})


def test_each_executor_has_the_slo_window_of_its_own_finished_requests():
    view = ClusterView(MonitorConfig(slo_ttft_s=1.0, slo_tpot_s=0.1, slo_window_s=5.0))
    view.observe(finished(telemetry("a", 0.0), (0.5, 0.05), (3.0, 0.05)), now=0.0)
    view.observe(finished(telemetry("a", 0.1), (0.4, 0.05)), now=0.1)
    view.observe(telemetry("a", 0.2), now=0.2)  # nothing finished since: the window still has all three
    view.observe(finished(telemetry("b", 0.2), (0.2, 0.5)), now=0.2)
    a, b = view.state(0.3).executors
    assert (a.slo.requests, a.slo.violation_rate, a.slo.ttft_p95_s) == (3, 1 / 3, 3.0)
    assert (b.slo.requests, b.slo.violation_rate, b.slo.tpot_p50_s) == (1, 1.0, 0.5)
    assert a.telemetry.requests == [] and b.telemetry.requests == []  # the window has them, not one report
    later = view.state(5.05).executors[0].slo  # the first report's two have left the window
    assert (later.requests, later.violation_rate) == (1, 0.0)


def test_a_restarted_executor_starts_a_fresh_slo_window():
    view = ClusterView(MonitorConfig(slo_ttft_s=1.0, slo_tpot_s=0.1, slo_window_s=10.0))
    view.observe(finished(telemetry("a", 0.0), (5.0, 0.5), (4.0, 0.5)), now=0.0)
    assert view.state(0.0).executors[0].slo.violation_rate == 1.0
    view.observe(telemetry("a", 0.5, instance="i1"), now=0.5)
    assert view.state(0.5).executors[0].slo.requests == 0  # the old process's slow requests say nothing of it
    view.observe(finished(telemetry("a", 0.6, instance="i1"), (0.1, 0.02)), now=0.6)
    slo = view.state(0.6).executors[0].slo
    assert (slo.requests, slo.violation_rate, slo.ttft_p50_s) == (1, 0.0, 0.1)
