"""The controller plans on the newest state only (services/controller/loop.py): states that came while it was busy
are dropped unvalidated, and one that does not validate is dropped without stopping the planning. No bus: bodies
are handed to the subscription callback as the bus would."""

import asyncio

from services.controller.loop import Controller
from shared.bus import encode, unpack
from shared.config import ControllerConfig, MonitorConfig
from shared.core.monitor.aggregate import ClusterView
from tests.unit.test_monitor_aggregate import telemetry


def state_body(at: float) -> dict:
    view = ClusterView(MonitorConfig())
    view.observe(telemetry("a", at), at)
    return unpack(encode(view.state(at)))


def test_states_that_came_while_it_was_busy_are_dropped_and_the_newest_is_planned():
    planned_on: list[float] = []

    def record(state, history, config):
        planned_on.append(state.time)
        return []

    async def scenario():
        controller = Controller(ControllerConfig(stats_interval_s=0), [record])
        runner = asyncio.create_task(controller._run())
        for at in (1.0, 2.0, 3.0):  # all before the planner runs
            controller._on_state("morphling.state", state_body(at))
        await asyncio.sleep(0.05)
        controller._on_state("morphling.state", state_body(4.0) | {"time": "not a time"})
        await asyncio.sleep(0.05)
        controller._on_state("morphling.state", state_body(5.0))
        await asyncio.sleep(0.05)
        runner.cancel()
        return controller

    controller = asyncio.run(scenario())
    assert planned_on == [3.0, 5.0]
    assert (controller.received, controller.planned) == (5, 2)
    assert controller.latest.time == 5.0
