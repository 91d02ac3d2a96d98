"""The executor's heartbeat: telemetry every interval, and new pressure at once, once between two beats."""

import asyncio
import time

from services.executor.service import heartbeat
from shared import subjects
from shared.messages import ExecutorTelemetry
from tests.unit.test_bounded_queues import EXEC, until
from tests.unit.test_monitor_aggregate import telemetry


class RecordingBus:
    def __init__(self):
        self.reports: list[tuple[float, ExecutorTelemetry]] = []

    async def publish(self, subject: str, message) -> None:
        assert subject == subjects.telemetry(EXEC)
        self.reports.append((time.monotonic(), message))


def beating(interval_s: float):
    """A heartbeat on a recording bus whose reports carry the pressure counter at the time each was built."""
    bus, wake, pressure = RecordingBus(), asyncio.Event(), [0]

    def report() -> ExecutorTelemetry:
        return telemetry(EXEC, time.time()).model_copy(update={"preemptions": pressure[0]})

    task = asyncio.create_task(heartbeat(bus, EXEC, report, interval_s, wake))
    return bus, wake, pressure, task


def test_new_pressure_goes_out_at_once_and_more_of_it_waits_for_the_beat():
    async def scenario():
        bus, wake, pressure, task = beating(interval_s=3600.0)  # no beat comes within the test
        await until(lambda: len(bus.reports) == 1, "the first beat")
        pressure[0] = 1
        wake.set()
        await until(lambda: len(bus.reports) == 2, "the report of new pressure, before the next beat")
        assert bus.reports[1][1].preemptions == 1
        # Overload: every step and every refusal raises pressure. The monitor would read only the newest report.
        for count in range(2, 52):
            pressure[0] = count
            wake.set()
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.2)
        assert len(bus.reports) == 2
        task.cancel()

    asyncio.run(scenario())


def test_after_a_beat_new_pressure_goes_out_at_once_again_with_what_waited_for_it():
    async def scenario():
        interval_s = 1.0
        bus, wake, pressure, task = beating(interval_s)
        await until(lambda: len(bus.reports) == 1, "the first beat")
        pressure[0] = 1
        wake.set()
        await until(lambda: len(bus.reports) == 2, "the report of new pressure")
        pressure[0] = 2
        wake.set()  # held for the beat
        await until(lambda: len(bus.reports) == 3, "the next beat")
        beat_at, beat = bus.reports[2]
        assert beat.preemptions == 2 and beat_at - bus.reports[0][0] >= interval_s * 0.99
        pressure[0] = 3
        wake.set()
        await until(lambda: len(bus.reports) == 4, "the report of new pressure after the beat")
        woken_at, woken = bus.reports[3]
        assert woken.preemptions == 3 and woken_at - beat_at < interval_s / 2
        task.cancel()

    asyncio.run(scenario())
