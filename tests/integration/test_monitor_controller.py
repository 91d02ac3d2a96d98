"""The monitor and the controller's command machinery against a real nats-server.

Executors are played by the test: a Bus that publishes telemetry, and a responder on cmd.<x> that
records commands. The lead's test against a real executor lives elsewhere.
"""

import asyncio
import time

from services.controller.loop import Controller
from services.monitor.service import MonitorService
from shared import subjects
from shared.bus import Bus
from shared.commands import CommandSender
from shared.config import ControllerConfig, MonitorConfig
from shared.core.monitor.aggregate import ClusterView
from shared.core.policies.interface import PlannedCommand
from shared.messages import ClusterState, Command, CommandResult, Event, PingArgs, QuantizeArgs
from tests.nats_server import until_routed
from tests.unit.test_monitor_aggregate import telemetry


async def _collect(bus: Bus, subject: str, model) -> list[tuple[float, object]]:
    got: list[tuple[float, object]] = []

    async def on_message(incoming):
        got.append((time.monotonic(), incoming.message))

    await bus.subscribe(subject, model, on_message)
    return got


async def _until(predicate, timeout: float) -> float:
    """Seconds it took for `predicate()` to hold; fails the test after `timeout`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def _alive(states, executor: str) -> bool | None:
    if not states:
        return None
    for e in states[-1][1].executors:
        if e.executor == executor:
            return e.alive
    return None


def _events(events, kind: str, executor: str) -> int:
    return sum(1 for _, e in events if e.kind == kind and e.data.get("executor") == executor)


def test_monitor_publishes_state_and_executor_up_down(nats_server):
    # The test's executors answer no pings, so a suspect one is dead at once: suspect_after is kept above the
    # stalls of a busy 2-core machine (a CI run once saw e0, reporting every 50 ms, go silent for 0.3 s).
    config = MonitorConfig(nats_url=nats_server.url, publish_interval_s=0.2, suspect_after_s=0.6, dead_after_s=1.0,
                           ewma_half_life_s=0.5)

    async def scenario():
        bus = await Bus.connect(nats_server.url, "monitor")
        probe = await Bus.connect(nats_server.url, "probe")
        states = await _collect(probe, subjects.STATE, ClusterState)
        events = await _collect(probe, subjects.EVENTS, Event)
        await probe.flush()
        monitor = MonitorService(config)
        await monitor.start(bus)
        reporting = {"e0": True, "e1": True}

        async def executors():
            while True:
                for name, on in reporting.items():
                    if on:
                        await probe.publish(subjects.telemetry(name), telemetry(name, time.time(), used=20))
                await asyncio.sleep(0.05)

        feeder = asyncio.create_task(executors())
        try:
            await _until(lambda: _alive(states, "e0") and _alive(states, "e1"), timeout=3)
            # published over and over, not once; the rate it sustains is `morphling bench-bus`'s figure
            window_start = time.monotonic()
            await asyncio.sleep(3.0)
            published = sum(1 for t, _ in states if t >= window_start)
            assert published >= 3, f"{published} ClusterState messages in 3 s"
            assert all(e.alive for e in states[-1][1].executors)
            assert _events(events, "executor_up", "e0") == 1 and _events(events, "executor_up", "e1") == 1

            reporting["e1"] = False
            took = await _until(lambda: _alive(states, "e1") is False, timeout=3)
            # dead_after, plus at most one publish interval, plus slack for a busy 2-core machine.
            assert took <= config.dead_after_s + config.publish_interval_s + 0.5
            assert _alive(states, "e0")
            await _until(lambda: _events(events, "executor_down", "e1") == 1, timeout=1)
            assert _events(events, "executor_down", "e0") == 0

            reporting["e1"] = True
            await _until(lambda: _alive(states, "e1"), timeout=2)
            await _until(lambda: _events(events, "executor_up", "e1") == 2, timeout=1)
            down = [e for _, e in events if e.kind == "executor_down"][0]
            assert down.source == "monitor" and down.data == {"executor": "e1"}
        finally:
            feeder.cancel()
            await monitor.stop()
            await bus.close()
            await probe.close()

    asyncio.run(scenario())


def test_a_report_of_new_pressure_events_goes_out_in_a_state_before_the_next_tick(nats_server):
    # A clock far slower than the test: a state that shows the preemption can only come from the report itself.
    config = MonitorConfig(nats_url=nats_server.url, publish_interval_s=60.0, suspect_after_s=60.0,
                           dead_after_s=120.0)

    async def scenario():
        bus = await Bus.connect(nats_server.url, "monitor")
        probe = await Bus.connect(nats_server.url, "probe")
        states = await _collect(probe, subjects.STATE, ClusterState)
        await probe.flush()
        monitor = MonitorService(config)
        await monitor.start(bus)

        def preemptions() -> list[int]:
            return [e.telemetry.preemptions for _, s in states for e in s.executors]

        try:
            await _until(lambda: states, timeout=5)  # the first tick, with nobody in it yet
            await probe.publish(subjects.telemetry("e"), telemetry("e", time.time()))
            await probe.publish(subjects.telemetry("e"), telemetry("e", time.time()).model_copy(
                update={"preemptions": 1}))
            await _until(lambda: 1 in preemptions(), timeout=20)
            assert len(states) == 2  # one state for the report with news, none for the quiet one
        finally:
            await monitor.stop()
            await bus.close()
            await probe.close()

    asyncio.run(scenario())


def test_reports_of_new_pressure_publish_one_state_between_two_ticks_the_rest_waits_for_the_tick(nats_server):
    # With many executors under pressure, a state per report would go out back to back.
    config = MonitorConfig(nats_url=nats_server.url, publish_interval_s=1.5, suspect_after_s=60.0,
                           dead_after_s=120.0)

    async def scenario():
        bus = await Bus.connect(nats_server.url, "monitor")
        probe = await Bus.connect(nats_server.url, "probe")
        states = await _collect(probe, subjects.STATE, ClusterState)
        await probe.flush()
        monitor = MonitorService(config)
        await monitor.start(bus)
        try:
            await _until(lambda: states, timeout=5)  # the first tick
            base = telemetry("e", time.time())
            await probe.publish(subjects.telemetry("e"), base)
            for preemptions in (1, 2, 3):
                await probe.publish(subjects.telemetry("e"), base.model_copy(update={"preemptions": preemptions}))
                await asyncio.sleep(0.1)
            assert len(states) == 2  # the first news at once; the others not yet
            await _until(lambda: len(states) == 3, timeout=3)  # the tick, with the latest
            assert states[1][1].executors[0].telemetry.preemptions == 1
            assert states[2][1].executors[0].telemetry.preemptions == 3
        finally:
            await monitor.stop()
            await bus.close()
            await probe.close()

    asyncio.run(scenario())


def test_the_monitor_and_the_controller_count_what_they_did_in_stats_events(nats_server):
    async def scenario():
        monitor_bus = await Bus.connect(nats_server.url, "monitor")
        ctl_bus = await Bus.connect(nats_server.url, "ctl")
        probe = await Bus.connect(nats_server.url, "probe")
        events = await _collect(probe, subjects.EVENTS, Event)
        await probe.flush()
        monitor = MonitorService(MonitorConfig(nats_url=nats_server.url, publish_interval_s=0.1,
                                               stats_interval_s=0.5))
        controller = Controller(ControllerConfig(nats_url=nats_server.url, controller_id="ctl-stats",
                                                 stats_interval_s=0.5), [])
        await controller.start(ctl_bus)
        await monitor.start(monitor_bus)
        try:
            for _ in range(5):
                await probe.publish(subjects.telemetry("e"), telemetry("e", time.time()))
                await asyncio.sleep(0.1)

            def latest(source: str) -> dict:
                return next((e.data for _, e in reversed(events) if e.kind == "stats" and e.source == source), {})

            await _until(lambda: latest("monitor").get("telemetry", 0) > 0
                         and latest("ctl-stats").get("planned", 0) > 0, timeout=5)
            assert latest("monitor")["telemetry"] <= 5  # counted from the start, each report once
            assert latest("monitor")["states"] > 0 and latest("monitor")["state_s"] > 0
            ctl = latest("ctl-stats")
            assert ctl["states"] >= ctl["planned"] and ctl["plan_s"] > 0
        finally:
            await controller.stop()
            await monitor.stop()
            for bus in (monitor_bus, ctl_bus, probe):
                await bus.close()

    asyncio.run(scenario())


def test_a_silent_executor_whose_process_is_gone_dies_at_once_a_stalled_one_only_after_dead_after(nats_server):
    config = MonitorConfig(nats_url=nats_server.url, publish_interval_s=0.1, suspect_after_s=0.5, dead_after_s=4.0)

    async def scenario():
        bus = await Bus.connect(nats_server.url, "monitor")
        probe = await Bus.connect(nats_server.url, "probe")
        monitor = MonitorService(config)
        await monitor.start(bus)
        states = await _collect(probe, subjects.STATE, ClusterState)
        pings: list[Command] = []

        async def stalled(incoming):  # holds its subscriptions, answers nothing: a stopped process
            pings.append(incoming.message)

        # "stalled" keeps its command subscription; "gone" never had one, as after a SIGKILL.
        await probe.subscribe(subjects.command("stalled"), Command, stalled)
        await probe.flush()
        for name in ("stalled", "gone"):
            await probe.publish(subjects.telemetry(name), telemetry(name, time.time()))
        try:
            await _until(lambda: _alive(states, "stalled") and _alive(states, "gone"), timeout=3)
            silent_since = time.monotonic()
            took = await _until(lambda: _alive(states, "gone") is False, timeout=3)
            # suspect_after, one tick, the probe's instant "no responders", one tick, and slack.
            assert took < config.suspect_after_s + 1.0
            assert _alive(states, "stalled")
            stalled_state = next(e for e in states[-1][1].executors if e.executor == "stalled")
            assert stalled_state.suspect and pings and pings[0].kind == "ping"
            await _until(lambda: _alive(states, "stalled") is False, timeout=config.dead_after_s + 2)
            assert time.monotonic() - silent_since >= config.dead_after_s - 0.2
        finally:
            await monitor.stop()
            await bus.close()
            await probe.close()

    asyncio.run(scenario())


async def _responder(bus: Bus, executor: str, drop_first: int = 0, delay: float = 0.0):
    """A stand-in executor: records each Command and answers it, after `delay`, except the first
    `drop_first`; concurrency[0] is the most commands it ever had in hand at once."""
    received: list[Command] = []
    concurrency = [0, 0]  # [max, now]

    async def answer(incoming):
        cmd = incoming.message
        concurrency[1] += 1
        concurrency[0] = max(concurrency)
        await asyncio.sleep(delay)
        concurrency[1] -= 1
        await incoming.reply(CommandResult(seq=cmd.seq, issuer=cmd.issuer, executor=executor,
                                           kind=cmd.kind, ok=True, state={"n": len(received)}))

    async def on_command(incoming):
        received.append(incoming.message)
        if len(received) > drop_first:
            # Answered from a task, so that overlapping commands would show up in `concurrency`.
            asyncio.get_running_loop().create_task(answer(incoming))

    await bus.subscribe(subjects.command(executor), Command, on_command)
    await bus.flush()
    return received, concurrency


def test_command_sender_retries_with_the_same_seq_and_audits(nats_server):
    async def scenario():
        ctl = await Bus.connect(nats_server.url, "ctl")
        side = await Bus.connect(nats_server.url, "executor")
        events = await _collect(side, subjects.EVENTS, Event)
        received, _ = await _responder(side, "x", drop_first=1)
        await until_routed(ctl, subjects.command("x"))  # so that the first attempt is the one dropped
        sender = CommandSender(ctl, "ctl-test", timeout_s=0.3, retries=2)

        result = await sender.send("x", QuantizeArgs(layers=[0, 1], bits=8), "a test quantizes")
        assert result.ok and result.executor == "x" and result.issuer == "ctl-test"
        assert [c.seq for c in received] == [result.seq, result.seq]  # the retry reused the seq
        assert received[1].args == {"layers": [0, 1], "bits": 8}
        again = await sender.send("x", PingArgs())
        assert again.ok and again.seq > result.seq

        failed = await sender.send("nobody", PingArgs())
        assert not failed.ok and "no responders" in failed.error

        await _until(lambda: len(events) == 3, timeout=2)
        first, second, third = (e for _, e in events)
        assert first.kind == "command" and first.source == "ctl-test"
        assert first.data["ok"] and first.data["attempts"] == 2 and first.data["seq"] == result.seq
        assert first.data["executor"] == "x" and first.data["kind"] == "quantize"
        assert first.data["reason"] == "a test quantizes" and first.data["state"] == {"n": 2}
        assert first.data["latency_s"] >= 0.3  # one timed-out attempt
        assert second.data["attempts"] == 1
        assert not third.data["ok"] and third.data["attempts"] == 3 and third.data["error"] == failed.error
        # A restarted controller starts above the seqs its predecessor used.
        assert CommandSender(ctl, "ctl-test", 0.3, 2).next_seq() > again.seq
        await ctl.close()
        await side.close()

    asyncio.run(scenario())


def test_controller_runs_policies_one_command_at_a_time_per_executor(nats_server):
    config = ControllerConfig(nats_url=nats_server.url, controller_id="ctl-loop", command_timeout_s=2.0)
    seen_history: list[int] = []

    def ping_everyone(state, history, cfg):
        seen_history.append(len(history))
        return [PlannedCommand(e.executor, PingArgs()) for e in state.executors]

    async def scenario():
        ctl_bus = await Bus.connect(nats_server.url, "ctl")
        side = await Bus.connect(nats_server.url, "executor")
        received, concurrency = await _responder(side, "x", delay=0.3)
        controller = Controller(config, [ping_everyone])
        await controller.start(ctl_bus)
        view = ClusterView(MonitorConfig())
        view.observe(telemetry("x", time.time()), time.time())
        for _ in range(8):  # 8 states in 0.4 s while each command takes 0.3 s
            await side.publish(subjects.STATE, view.state(time.time()))
            await asyncio.sleep(0.05)
        await _until(lambda: len(seen_history) >= 2, timeout=2)
        await controller.wait_idle()
        assert concurrency[0] == 1  # never two commands in hand for one executor
        assert 1 <= len(received) < 8  # plans for a busy executor were dropped, not queued
        assert all(r.ok for r in controller.results)
        assert seen_history == sorted(seen_history) and seen_history[0] == 0
        assert controller.latest is not None and controller.latest.executors[0].executor == "x"
        await controller.stop()
        await ctl_bus.close()
        await side.close()

    asyncio.run(scenario())
