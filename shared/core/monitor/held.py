"""What the monitor does with a report between two ticks (monitor/service.py), and the simulator with its
simulated executors' reports (simulator/cluster.py): read it for new pressure as it arrives, hold each
executor's newest with the finished requests of those it replaced, and hand them over at the tick, when the
newest alone goes into the view.

Pure bookkeeping over whatever a report is (the service holds unvalidated bodies, the simulator
ExecutorTelemetry), so that both keep time the same way.
"""

from dataclasses import dataclass
from typing import Generic, TypeVar

from shared.messages import pressure_since

Report = TypeVar("Report")


@dataclass
class HeldReport(Generic[Report]):
    """An executor's latest report since the last tick, with the finished requests of all of them."""
    body: Report
    arrived: float
    requests: list
    reports: int = 1


class HeldReports(Generic[Report]):
    def __init__(self) -> None:
        self._held: dict[str, HeldReport[Report]] = {}  # by executor: reports not yet judged
        self._last: dict[str, tuple[object, int]] = {}  # by executor: (instance, pressure events) it last reported

    def arrive(self, executor: str, report: Report, requests: list, instance: object, pressure: int | None,
               now: float) -> bool:
        """Hold `report`, which came at `now`; True when it counts pressure events its process's previous report
        had not (a new process counts from zero). `pressure` None: unreadable, so it shows none."""
        held = self._held.get(executor)
        if held is None:
            self._held[executor] = HeldReport(report, now, list(requests))
        else:
            held.body, held.arrived, held.reports = report, now, held.reports + 1
            held.requests.extend(requests)
        if pressure is None:
            return False
        earlier_instance, before = self._last.get(executor, (None, 0))
        self._last[executor] = (instance, pressure)
        return pressure_since(pressure, instance, earlier_instance, before) > 0

    def arrived(self, executor: str) -> float | None:
        """When `executor`'s held report came; None when none is held."""
        held = self._held.get(executor)
        return None if held is None else held.arrived

    def take(self) -> dict[str, HeldReport[Report]]:
        """Every executor's held report since the last call, which empties the hold."""
        held, self._held = self._held, {}
        return held
