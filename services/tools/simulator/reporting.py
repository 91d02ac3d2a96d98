"""What the executors report and what the monitor and the controller make of it, in a simulation (mixed into
Simulation, cluster.py): periodic and out-of-cycle reports as the executor's heartbeat sends them, the monitor's
states at its pace, the controller's plan on each, and the commands that may go out (shared/core/delivery.py);
and what the bench's cluster poll would have read.
"""

import time

from services.tools.simulator.executor import SimExecutor
from shared.core.delivery import sendable
from shared.core.monitor.pace import pace


class SimReporting:
    def _beat(self) -> None:
        """Every executor's periodic report, in the executors' order: they started together and beat alike, so one
        event stands for a thousand."""
        self._woken.clear()
        self._next_beat = self.now + self.settings.telemetry_interval_s
        self.at(self._next_beat, self._beat)
        for name in self.executors:
            if self._superseded(name):
                self._unbuilt[name] = self.now
            else:
                self._report(name)

    def _report_pressure(self, name: str) -> None:
        """A report out of cycle, for new pressure."""
        if name in self._woken:
            return  # the executor's heartbeat: one report out of cycle between two beats, the rest with the beat
        self._woken.add(name)
        if self._unheard(name):
            self._published[name] = self.executors[name].pressure_events()
            return
        self._report(name)

    def _report(self, name: str) -> None:
        if self._build_report(name) and self._urgent_open:
            self._urgent_open = False  # the monitor's cap: one state between two ticks for new pressure
            self._publish()

    def _superseded(self, name: str) -> bool:
        """Whether the monitor's next tick would take this periodic report's successor instead, and nothing else
        reads it: it shows no new pressure (the arrival's only judgement) and its finished requests ride on the
        next one. Left unbuilt, it was half of a thousand-executor run's reports at 10 Hz to 5 states a second."""
        return (self._replaced_before_tick()
                and self.executors[name].pressure_events() <= self._published.get(name, 0))

    def _replaced_before_tick(self) -> bool:
        """Whether the next periodic reports come before the monitor's next tick, and so take a report's place."""
        return self._next_beat < self._next_tick

    def _unheard(self, name: str) -> bool:
        """Whether a report of new pressure would change no state: the one state between two ticks that new pressure
        may bring has gone out, and a periodic report comes before the tick and replaces this one unread. Left
        unbuilt, as the executor's own next report takes its pressure and finished requests. Under overload every
        refusal is new pressure, and each report walks a full queue: the whole trace had run at 0.03x real time."""
        return not self._urgent_open and self._replaced_before_tick()

    def _build_report(self, name: str) -> bool:
        """Report now; True when the report shows new pressure."""
        self._unbuilt.pop(name, None)
        telemetry = self.executors[name].telemetry(self.now)
        self._published[name] = telemetry.pressure_events
        rose = self._held.arrive(name, telemetry, telemetry.requests, telemetry.instance, telemetry.pressure_events,
                                 self.now)
        return rose

    def _tick(self) -> None:
        step = pace(self.settings.monitor.publish_interval_s, self.settings.monitor_state_s * len(self.fleet.executors))
        self._next_tick = self.now + step.tick_s
        self._publish()
        self._urgent_open = step.urgent
        self.at(self._next_tick, self._tick)

    def _publish(self) -> None:
        # A state between two ticks (new pressure) takes the reports left unbuilt as well, built now: up to a
        # report interval fresher than the monitor would have them.
        for name in list(self._unbuilt):
            self._build_report(name)
        for report in self._held.take().values():
            telemetry = report.body if report.reports == 1 else report.body.model_copy(
                update={"requests": report.requests})
            self.view.observe(telemetry, report.arrived)
        self.state = self.view.state(self.now)
        self.unreported.forget_reported(self.state)
        if not self.controller.policies:
            return
        began = time.perf_counter()
        planned = self.controller.plan(self.state)
        self.plan_seconds += time.perf_counter() - began
        self.decisions += 1
        reported = {e.executor: e.telemetry.time for e in self.state.executors}
        for name, commands in sendable(planned, self._busy, reported, self._settled).items():
            self._busy.add(name)
            self.at(self.now + self.settings.bus_latency_s, self._deliver, name, commands, self.now)

    # --- what the bench's cluster poll would have seen ---------------------------------------------------
    def _sample(self) -> None:
        for executor in self.executors.values():
            executor.settle(self.now)
        self.samples.append((self.now, [self._polled(e) for e in self.executors.values()]))
        self.at(self.now + self.settings.sample_interval_s, self._sample)
        if self._progress is not None:
            self._progress()

    def _polled(self, e: SimExecutor) -> dict:
        """What the poll reads of `e`, sharing what is unchanged since the last poll with it (the samples are only
        read): a thousand executors polled four times a second over a whole trace's half hour would otherwise
        hold gigabytes of equal copies."""
        kv, layers, last = e.kv_pages(e.ledger.snapshot()), list(e.layer_bits), self._last_polled.get(e.id)
        if last is not None:
            kv = last["kv"] if last["kv"] == kv else kv
            layers = last["layers"] if last["layers"] == layers else layers
        sample = {"id": e.id, "role": "leader" if e.leads else "follower", "kv": kv,
                  "block_size": e.limits.block_size, "layers": layers,
                  "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                  "preemptions": e.scheduler.num_preemptions}
        if sample == last:
            return last
        self._last_polled[e.id] = sample
        return sample
