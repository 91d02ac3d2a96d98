"""The monitor judges reports per tick (services/monitor/service.py): on arrival a report is only unpacked, read for
new pressure and held, the latest per executor; at the tick that one is validated and taken into the view, with the
finished requests of every report it replaced. Driven here without a bus: bodies in, the view out."""

import asyncio
import random
import time

import msgpack

from services.monitor.service import MonitorService, state_body
from services.tools.bench.bus_load import SyntheticExecutor
from shared.bus import NoResponders, decode, unpack, encode
from shared.config import MonitorConfig
from shared.core.plans import tp_plans
from shared.messages import ClusterState, RequestLatency
from tests.unit.test_monitor_aggregate import telemetry


def body(executor: str, at: float, **changes) -> dict:
    return unpack(encode(telemetry(executor, at).model_copy(update=changes)))


def test_only_the_latest_report_of_a_tick_is_judged_with_the_finished_requests_of_all():
    monitor = MonitorService(MonitorConfig())
    done = RequestLatency(ttft_s=0.5, tpot_s=0.05)
    monitor._on_report("morphling.telemetry.a", body("a", 1.0, requests=[done], waiting=1))
    monitor._on_report("morphling.telemetry.a", body("a", 1.1, requests=[done, done], waiting=7))
    monitor._on_report("morphling.telemetry.b", body("b", 1.1))
    assert monitor.reports == 3 and monitor.view.state(time.time()).executors == []  # nothing judged before the tick
    monitor._judge_held()
    a, b = monitor.view.state(time.time()).executors
    assert (a.executor, b.executor) == ("a", "b")
    assert a.telemetry.time == 1.1 and a.telemetry.waiting == 7
    assert a.slo.requests == 3
    monitor._judge_held()  # nothing new: the view stays as it was
    assert monitor.view.state(time.time()).executors[0].telemetry.time == 1.1


def test_new_pressure_events_ask_for_a_state_at_once_on_arrival():
    monitor = MonitorService(MonitorConfig())
    monitor._on_report("morphling.telemetry.a", body("a", 1.0))
    assert not monitor._urgent.is_set()
    monitor._on_report("morphling.telemetry.a", body("a", 1.1, preemptions=1))
    assert monitor._urgent.is_set()
    monitor._urgent.clear()
    monitor._on_report("morphling.telemetry.a", body("a", 1.2, preemptions=1))  # no news
    assert not monitor._urgent.is_set()
    monitor._on_report("morphling.telemetry.a", body("a", 1.3, preemptions=1, instance="i1"))  # a new process
    assert monitor._urgent.is_set()


def test_a_report_that_does_not_validate_is_dropped_at_the_tick_and_the_others_are_judged():
    monitor = MonitorService(MonitorConfig())
    monitor._on_report("morphling.telemetry.a", body("a", 1.0) | {"running": "many"})
    monitor._on_report("morphling.telemetry.b", body("b", 1.0))
    monitor._judge_held()
    assert [e.executor for e in monitor.view.state(time.time()).executors] == ["b"]


def test_the_state_sent_with_the_reports_bodies_is_the_state_of_the_view():
    monitor = MonitorService(MonitorConfig())
    done = RequestLatency(ttft_s=0.5, tpot_s=0.05)
    plan = tp_plans(["c", "d"], 2, 4)[0]
    busy = SyntheticExecutor("e", random.Random(0)).telemetry(1.0)
    minimal = body("b", 1.0)
    for field in ("draining", "gpu", "plan", "requests", "world", "kv_units", "busy", "rejected"):
        minimal.pop(field)  # a report may leave out what has a default
    minimal["time"] = 1  # and give a float as an int
    for subject, report in [("a", body("a", 1.0, requests=[done])), ("a", body("a", 1.1, requests=[done, done])),
                            ("b", minimal), ("c", body("c", 1.0, plan=plan)), ("d", body("d", 1.0, plan=plan)),
                            ("e", unpack(encode(busy)))]:
        monitor._on_report(f"morphling.telemetry.{subject}", report)
    monitor._judge_held()
    now = time.time()
    state = monitor.view.state(now)
    assert [e.executor for e in state.executors] == ["a", "b", "c", "d", "e"] and state.instances == [plan]
    sent = msgpack.packb(state_body(state, monitor._bodies), use_bin_type=True)
    assert decode(sent, ClusterState) == state


class _NobodyAnswers:
    """A bus on which no executor subscribes to its command subject, while `meanwhile` runs before it says so."""

    def __init__(self, meanwhile):
        self.meanwhile = meanwhile

    async def request(self, subject, *args, **kwargs):
        self.meanwhile()
        raise NoResponders(subject, "no responders")


def test_a_report_that_comes_while_the_ping_is_out_keeps_a_silent_executor_alive():
    # A stalled executor (or a stalled monitor) looks silent; its report that arrives while the monitor's ping
    # is out is held for the next tick, and it must win over the "no responders" as a judged one would.
    monitor = MonitorService(MonitorConfig())
    monitor._on_report("morphling.telemetry.a", body("a", 1.0))
    monitor._judge_held()
    assert monitor.view.transitions(time.time()) == [("a", "up")]
    monitor._bus = _NobodyAnswers(lambda: monitor._on_report("morphling.telemetry.a", body("a", 2.0)))
    asyncio.run(monitor._probe("a"))
    assert monitor.view.state(time.time()).executors[0].alive
    monitor._judge_held()
    assert monitor.view.transitions(time.time()) == []  # no down and up again


def test_an_executor_nobody_answers_for_is_dead_at_once():
    monitor = MonitorService(MonitorConfig())
    monitor._on_report("morphling.telemetry.a", body("a", 1.0))
    monitor._judge_held()
    monitor.view.transitions(time.time())
    monitor._bus = _NobodyAnswers(lambda: None)
    asyncio.run(monitor._probe("a"))
    assert not monitor.view.state(time.time()).executors[0].alive
    assert monitor.view.transitions(time.time()) == [("a", "down")]
