"""The monitor process: executor telemetry in, ClusterState and executor up/down events out.

The gateway routes and the controller decides on what this publishes, so it publishes on a fixed
clock (≥ 4 Hz) rather than on each telemetry message: the state's rate stays bounded however many
executors report, and a dead executor is noticed even when nothing at all arrives. One exception: a
report that shows new pressure events (a preemption, an admission waiting for KV, a refusal) publishes the
state at once, between ticks, because the controller's first reaction should not wait for the clock; once
per tick at most, so that the rate stays bounded when many executors are under pressure. Where a state is
dear (a thousand executors and more) the clock slows and the states between ticks stop, so that publishing
takes at most half of the monitor's time (pace.py). The judging itself lives in aggregate.py (pure); this file
only wires it to the bus and the wall clock.

Reports are judged per tick, not per message: on arrival a report is only unpacked, read for new pressure
events and held, the latest of each executor replacing the one before (its finished requests kept); at the
tick the latest one is validated and taken into the view, at the time it arrived. With reports every 100 ms
and states every 200 ms that costs about what validating every report did (35 against 33-39 us a report,
docs/benchmarks.md); its point is the monitor that falls behind (1,000 executors send 10,000 reports a second):
a report that a newer one replaces costs ~10-15 us instead of ~25, so a backlog drains faster, and the validation
work per tick is bounded by the executors, not by the reports. The smoothing is time-aware, so skipping a report
within one tick changes its weights, not its half-life. The state goes out with each executor's telemetry as its
report's body came (validated, its finished requests taken out), not dumped again from the model: the
telemetry is most of a state, and dumping it again a quarter of what a state cost (state_body).

It also has JetStream keep the events subject (MonitorConfig.events), since it is the one process
every deployment runs and starts first: what the controller and the monitor decided, and why, can
then be read back with `morphling events`. Every `stats_interval_s` it adds a "stats" event with its counts
since it started (telemetry reports taken in, states published and the seconds judging the reports, building
and sending the states took): whether it keeps up with its executors is then read off the bus
(`morphling bench-bus` does).

An executor that falls silent is probed with a ping on its command subject: a process that is gone
has no subscription left, so the server answers "no responders" at once and the executor is dead
now, its streams free to move elsewhere; a stalled one still holds its subscriptions, the ping just
goes unanswered, and it stays merely suspect until dead_after_s. A gateway silent as long is gone too
(gateways.py).
"""

import argparse
import asyncio
import logging
import sys
import itertools
import time
import uuid

from services.monitor.gateways import GatewayJudge
from shared import subjects
from shared.bus import BadMessage, Bus, BusError, NoResponders, StreamError, stop_on_signals, unsubscribe, validate
from shared.config import EventStreamConfig, MonitorConfig, parse_size, seconds
from shared.core.monitor.aggregate import UP, ClusterView
from shared.core.monitor.held import HeldReports
from shared.core.monitor.pace import pace
from shared.messages import ClusterState, Command, CommandResult, Event, ExecutorTelemetry, PingArgs, pressure_events
from shared.telemetry import setup_tracing

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.5  # "no responders" comes back at once; a stalled executor's silence is not waited out


def raw_pressure(body: dict) -> int | None:
    """The pressure events an unvalidated report counts; None where its counters are not whole numbers."""
    counts = (body.get("preemptions"), body.get("admission_blocked", 0), body.get("rejected", 0))
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        return None
    return pressure_events(*counts)


class MonitorService:
    def __init__(self, config: MonitorConfig):
        self.config = config
        self.view = ClusterView(config)
        self._bus: Bus | None = None
        self._sub = None
        self._task: asyncio.Task | None = None
        self._probing: dict[str, asyncio.Task] = {}
        # Executors remember (issuer, seq) to answer retries from a record: a restarted monitor must not
        # look like a retry of its predecessor's pings.
        self._issuer = f"monitor-{uuid.uuid4().hex[:8]}"
        self._probe_seq = itertools.count(1)
        self._urgent = asyncio.Event()  # set by a report of new pressure: publish before the next tick
        self._held: HeldReports[dict] = HeldReports()  # the reports since the last tick, unvalidated
        self._bodies: dict[str, dict] = {}  # by executor: the body of the report the view holds (state_body)
        self.reports = 0  # telemetry reports taken in
        self.states = 0  # cluster states published
        self.state_s = 0.0  # seconds building and sending them
        self.last_state_s = 0.0  # what the latest one took: it sets the pace of the next (pace.py)

    async def start(self, bus: Bus) -> None:
        self._bus = bus
        # Before the first tick, so that the executor_up events of a starting cluster are kept too.
        await self._keep_events(bus)
        self._sub = await bus.subscribe_bodies(subjects.TELEMETRY_ALL, self._on_report)
        await bus.flush()
        self._task = asyncio.create_task(self._publish_loop(), name="monitor-publish")

    async def stop(self) -> None:
        if self._sub is not None:
            await unsubscribe(self._sub)
            self._sub = None
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for task in self._probing.values():
            task.cancel()

    async def _keep_events(self, bus: Bus) -> None:
        """Create or update the events stream; without it events still go out, only nothing keeps them."""
        stream = self.config.events
        try:
            jetstream = await bus.ensure_stream(stream.name, [subjects.EVENTS], stream.max_age_s, stream.max_bytes)
        except StreamError as exc:
            log.error("monitor: events are not kept: %s", exc)
            return
        if jetstream:
            log.info("monitor: events on %s are kept in stream %s for %.4g days, up to %d MiB", subjects.EVENTS,
                     stream.name, stream.max_age_s / 86400, stream.max_bytes >> 20)
        else:
            log.warning("monitor: events are not kept: the NATS server runs without JetStream (start nats-server "
                        "with -js to keep them)")

    def _on_report(self, subject: str, body: dict) -> None:
        self.reports += 1
        now = time.time()
        executor = body.get("executor") if isinstance(body.get("executor"), str) else subjects.executor_of(subject)
        requests = body.get("requests") if isinstance(body.get("requests"), list) else []
        # A report whose counters are unreadable shows no pressure; validation refuses it at the tick.
        if self._held.arrive(executor, body, requests, body.get("instance"), raw_pressure(body), now):
            self._urgent.set()

    def _judge_held(self) -> None:
        """Take each executor's latest report since the last tick into the view."""
        for executor, report in self._held.take().items():
            body = report.body if report.reports == 1 else report.body | {"requests": report.requests}
            try:
                telemetry = validate(body, ExecutorTelemetry)
            except BadMessage as exc:
                log.warning("dropped a report of %s: %s", executor, exc)
                continue
            self.view.observe(telemetry, report.arrived)
            self._bodies[telemetry.executor] = body | {"requests": []}  # the view keeps none either

    async def _publish_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        next_stats = loop.time() + self.config.stats_interval_s
        while True:
            try:
                await self._publish_once(time.time())
                if self.config.stats_interval_s and loop.time() >= next_stats:
                    next_stats += self.config.stats_interval_s
                    await self._publish_stats(time.time())
            except Exception:  # a failed publish (e.g. mid-reconnect) must not stop the clock
                log.exception("publishing the cluster state failed")
            # Ticks are scheduled from a fixed origin so that slow publishes do not drift the rate; a report of
            # new pressure publishes between ticks without moving them, so the controller hears of it at once.
            step = pace(self.config.publish_interval_s, self.last_state_s)
            ticked = loop.time() >= next_tick
            if ticked:
                next_tick += step.tick_s
            delay = next_tick - loop.time()
            if delay < 0:
                next_tick = loop.time()
                delay = 0
            self._urgent.clear()
            if not ticked or not step.urgent:
                # One state between two ticks at most: with many executors under pressure their reports would
                # otherwise publish states back to back (1,000 executors: ~50 ms to build and encode each, ~30 ms
                # to decode for every subscriber). Pressure reported meanwhile goes out with the tick. None
                # while states are dear (pace.py).
                await asyncio.sleep(delay)
                continue
            try:
                await asyncio.wait_for(self._urgent.wait(), delay)
            except TimeoutError:
                pass

    async def _publish_once(self, now: float) -> None:
        assert self._bus is not None
        started = time.perf_counter()
        self._judge_held()
        for executor, change in self.view.transitions(now):
            kind = "executor_up" if change == UP else "executor_down"
            log.info("executor %s is %s", executor, change)
            await self._bus.publish(subjects.EVENTS, Event(kind=kind, source="monitor", time=now,
                                                           data={"executor": executor}))
        await self._bus.publish_body(subjects.STATE, state_body(self.view.state(now), self._bodies))
        self.states += 1
        self.last_state_s = time.perf_counter() - started
        self.state_s += self.last_state_s
        for executor in self.view.suspects(now):
            if executor not in self._probing:
                task = asyncio.create_task(self._probe(executor), name=f"probe-{executor}")
                self._probing[executor] = task
                task.add_done_callback(lambda _, name=executor: self._probing.pop(name, None))

    async def _publish_stats(self, now: float) -> None:
        await self._bus.publish(subjects.EVENTS, Event(kind="stats", source="monitor", time=now, data={
            "telemetry": self.reports, "states": self.states, "state_s": self.state_s}))

    async def _probe(self, executor: str) -> None:
        checked_at = time.time()
        ping = Command.of(next(self._probe_seq), self._issuer, PingArgs())
        try:
            await self._bus.request(subjects.command(executor), ping, CommandResult, timeout=PROBE_TIMEOUT_S)
        except NoResponders:
            # A report held for the next tick is not in the view yet: one that came while the ping was out says
            # the process is there, only it was slow (a stalled loop), and must win as a judged one would.
            arrived = self._held.arrived(executor)
            if arrived is not None and arrived >= checked_at:
                return
            log.warning("executor %s is silent and nothing answers on its subjects: its process is gone", executor)
            self.view.mark_gone(executor, checked_at)
        except BusError:  # unanswered: stalled, or the bus itself is down; silence alone decides then
            pass


def state_body(state: ClusterState, bodies: dict[str, dict]) -> dict:
    """`state` as sent, each executor's telemetry the body of its report (`bodies`) rather than the model dumped
    again. A receiver validates it into the same ClusterState: the body validated into that model, and a model's
    dump validates back into itself. At 1,000 executors: 20 ms against 39 to encode (this CPU, docs/benchmarks.md)."""
    body = state.model_dump(mode="json", exclude={"executors": {"__all__": {"telemetry"}}})
    for executor in body["executors"]:
        executor["telemetry"] = bodies[executor["executor"]]
    return body


async def _run_until_signalled(config: MonitorConfig) -> None:
    stop = stop_on_signals()
    bus = await Bus.connect_unless(stop, config.nats_url, "monitor")
    if bus is None:
        log.info("monitor: stopped before the bus connected")
        return
    service, gateways = MonitorService(config), GatewayJudge(config.dead_after_s)
    await service.start(bus)
    await gateways.start(bus)
    log.info("monitor: publishing the cluster state every %.2f s on %s", config.publish_interval_s,
             config.nats_url)
    await stop.wait()
    log.info("monitor: stopping")
    await gateways.stop()
    await service.stop()
    await bus.close()


def main(argv: list[str] | None = None) -> int:
    defaults = MonitorConfig()
    parser = argparse.ArgumentParser(prog="morphling monitor", description=__doc__.splitlines()[0])
    parser.add_argument("--nats", default=defaults.nats_url, help="NATS server URL")
    parser.add_argument("--interval", type=float, default=defaults.publish_interval_s,
                        help="seconds between ClusterState publications (≤ 0.25 for the promised ≥ 4 Hz)")
    parser.add_argument("--suspect-after", type=float, default=defaults.suspect_after_s,
                        help="seconds without telemetry before an executor gets no new requests "
                             "(default %(default)g)")
    parser.add_argument("--dead-after", type=float, default=defaults.dead_after_s,
                        help="seconds without telemetry before an executor's requests are given up, unless its "
                             "process is found gone sooner; and without a heartbeat before a gateway's requests are "
                             "cancelled (default %(default)g)")
    parser.add_argument("--half-life", type=float, default=defaults.ewma_half_life_s,
                        help="EWMA half-life in seconds of KV usage, queueing delay and waiting")
    parser.add_argument("--events-max-age-days", type=float, default=defaults.events.max_age_s / 86400,
                        help="days the event stream keeps an event (default %(default)g)")
    parser.add_argument("--events-max-bytes", type=parse_size, default=defaults.events.max_bytes,
                        help="size at which the event stream drops its oldest events, e.g. 1GiB (default 256MiB)")
    parser.add_argument("--slo-ttft", type=seconds(), default=defaults.slo_ttft_s, metavar="SECONDS",
                        help="the time-to-first-token SLO a request violates above it (default %(default)g)")
    parser.add_argument("--slo-tpot", type=seconds(), default=defaults.slo_tpot_s, metavar="SECONDS",
                        help="the time-per-output-token SLO a request violates above it (default %(default)g)")
    parser.add_argument("--slo-window", type=seconds(), default=defaults.slo_window_s, metavar="SECONDS",
                        help="seconds of finished requests each executor's SLO-violation rate is over "
                             "(default %(default)g)")
    parser.add_argument("--stats-interval", type=seconds(allow_zero=True), default=defaults.stats_interval_s,
                        metavar="SECONDS", help="seconds between its stats events (telemetry taken in, states "
                                                "published); 0: none (default %(default)g)")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be positive")
    if args.events_max_age_days <= 0 or args.events_max_bytes <= 0:
        parser.error("--events-max-age-days and --events-max-bytes must be positive")
    events = EventStreamConfig(max_age_s=args.events_max_age_days * 86400, max_bytes=args.events_max_bytes)
    try:
        config = MonitorConfig(nats_url=args.nats, publish_interval_s=args.interval,
                               suspect_after_s=args.suspect_after, dead_after_s=args.dead_after,
                               ewma_half_life_s=args.half_life, slo_ttft_s=args.slo_ttft,
                               slo_tpot_s=args.slo_tpot, slo_window_s=args.slo_window, events=events,
                               stats_interval_s=args.stats_interval)
    except ValueError as exc:  # the thresholds' rule lives with them, in MonitorConfig
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.interval > 0.25:
        log.warning("--interval %.2f s publishes below the 4 Hz the gateway and controller expect",
                    args.interval)
    setup_tracing("monitor")
    try:
        asyncio.run(_run_until_signalled(config))
    except BusError as exc:
        log.error("monitor: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
