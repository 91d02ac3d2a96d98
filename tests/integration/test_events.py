"""The event stream end to end: a real nats-server with JetStream, a real monitor that creates the stream,
real audit events from a CommandSender, and `morphling events` run as a user runs it."""

import asyncio
import json
import logging
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import nats
import pytest

from services.monitor.service import MonitorService
from shared import subjects
from shared.bus import Bus
from shared.commands import CommandSender
from shared.config import EventStreamConfig, MonitorConfig
from shared.messages import ClusterState, Command, CommandResult, Event, PingArgs, QuantizeArgs, RestoreArgs
from shared.net import free_port
from tests.nats_server import NatsServer
from tests.unit.test_monitor_aggregate import telemetry

ROOT = Path(__file__).resolve().parents[2]
STREAM = EventStreamConfig().name


@pytest.fixture
def js_server(tmp_path):
    server = NatsServer(None, "-js", "-sd", str(tmp_path / "jetstream")).start()
    yield server
    server.stop()


def events_cli(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "events", "--nats", url, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)


def lines(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


async def _executor(bus: Bus, executor: str) -> None:
    """A stand-in executor: quantizes anything, has nothing to restore."""
    async def answer(incoming):
        cmd: Command = incoming.message
        refused = cmd.kind == "restore"
        await incoming.reply(CommandResult(seq=cmd.seq, issuer=cmd.issuer, executor=executor, kind=cmd.kind,
                                           ok=not refused, error="no quantized layer to restore" if refused else None))

    await bus.subscribe(subjects.command(executor), Command, answer)
    await bus.flush()


async def _until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def _sender(url: str) -> tuple[Bus, CommandSender]:
    bus = await Bus.connect(url, "ctl")
    await _executor(bus, "exec0")
    return bus, CommandSender(bus, "ctl0", timeout_s=0.5, retries=1)


def test_events_shows_commands_and_executor_changes_in_order_with_their_reasons(js_server):
    config = MonitorConfig(nats_url=js_server.url, publish_interval_s=0.1, dead_after_s=1.0)

    async def scenario():
        monitor_bus = await Bus.connect(js_server.url, "monitor")
        monitor = MonitorService(config)
        await monitor.start(monitor_bus)
        bus, sender = await _sender(js_server.url)
        seen: list[Event] = []

        async def on_event(incoming):
            seen.append(incoming.message)

        await bus.subscribe(subjects.EVENTS, Event, on_event)

        async def heartbeats():
            while True:
                await bus.publish(subjects.telemetry("exec0"), telemetry("exec0", time.time()))
                await asyncio.sleep(0.05)

        beating = asyncio.create_task(heartbeats())
        await _until(lambda: any(e.kind == "executor_up" for e in seen), timeout=3)
        assert (await sender.send("exec0", QuantizeArgs(layers=[0, 1], bits=8), "kv 0.93 above 0.90")).ok
        assert not (await sender.send("exec0", RestoreArgs(layers=1), "calm for 5 windows")).ok
        assert not (await sender.send("exec9", PingArgs(), "is exec9 back?")).ok
        beating.cancel()
        await _until(lambda: any(e.kind == "executor_down" for e in seen), timeout=3)
        await monitor.stop()
        await monitor_bus.close()
        await bus.close()

    asyncio.run(scenario())

    shown = lines(events_cli(js_server.url, "--since", "10m"))
    assert [line.split()[1:3] for line in shown] == [["monitor", "executor_up"], ["ctl0", "command"],
                                                     ["ctl0", "command"], ["ctl0", "command"],
                                                     ["monitor", "executor_down"]]
    assert shown[0].endswith("executor_up    exec0")
    assert "exec0 quantize layers=[0,1] bits=8 -> ok in " in shown[1]
    assert shown[1].endswith(" ms; reason: kv 0.93 above 0.90")
    assert "exec0 restore layers=1 -> FAILED (no quantized layer to restore)" in shown[2]
    assert shown[2].endswith("reason: calm for 5 windows")
    assert "exec9 ping -> FAILED (no answer after 2 attempt(s): no responders" in shown[3]
    assert shown[3].endswith("reason: is exec9 back?")
    datetime.fromisoformat(shown[0].split()[0])  # a local ISO time leads each line

    as_json = [json.loads(line) for line in lines(events_cli(js_server.url, "--since", "10m", "--json"))]
    assert [e["kind"] for e in as_json] == ["executor_up", "command", "command", "command", "executor_down"]
    assert [e["data"].get("reason") for e in as_json[1:4]] == ["kv 0.93 above 0.90", "calm for 5 windows",
                                                               "is exec9 back?"]
    assert as_json[1]["data"]["args"] == {"layers": [0, 1], "bits": 8} and as_json[1]["data"]["attempts"] == 1
    assert as_json[0]["time"] <= as_json[1]["time"] <= as_json[4]["time"]

    commands_to_exec0 = lines(events_cli(js_server.url, "--kind", "command", "--executor", "exec0"))
    assert [line.split()[4] for line in commands_to_exec0] == ["quantize", "restore"]
    none = events_cli(js_server.url, "--kind", "morph_started")
    assert none.returncode == 0 and none.stdout == "" and "no matching events since " in none.stderr


def test_since_skips_older_events_and_the_stream_outlives_a_monitor_restart(js_server, caplog):
    no_stream = events_cli(js_server.url)
    assert no_stream.returncode == 1 and no_stream.stdout == ""
    assert f"events are not kept: the NATS server at {js_server.url} has JetStream but no stream {STREAM}" \
        in no_stream.stderr and "restart" in no_stream.stderr

    async def with_monitor(config: MonitorConfig, reasons: list[str], pause_s: float = 0.0) -> float:
        """Run a monitor while commands go out with `reasons`; returns a time between the first and the rest."""
        monitor_bus = await Bus.connect(js_server.url, "monitor")
        monitor = MonitorService(config)
        await monitor.start(monitor_bus)
        bus, sender = await _sender(js_server.url)
        await sender.send("exec0", PingArgs(), reasons[0])
        await asyncio.sleep(pause_s)
        between = time.time()
        await asyncio.sleep(pause_s)
        for reason in reasons[1:]:
            await sender.send("exec0", PingArgs(), reason)
        await monitor.stop()
        await monitor_bus.close()
        await bus.close()
        return between

    with caplog.at_level(logging.INFO, logger="services.monitor.service"):
        between = asyncio.run(with_monitor(MonitorConfig(nats_url=js_server.url), ["early", "late"], pause_s=0.3))
    since = datetime.fromtimestamp(between).isoformat(timespec="milliseconds")
    assert [line.rsplit("reason: ", 1)[1] for line in lines(events_cli(js_server.url, "--since", since))] == ["late"]

    shorter = EventStreamConfig(max_age_s=3600.0, max_bytes=1 << 20)
    with caplog.at_level(logging.INFO, logger="services.monitor.service"):
        asyncio.run(with_monitor(MonitorConfig(nats_url=js_server.url, events=shorter), ["after the restart"]))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert sum(f"kept in stream {STREAM}" in r.getMessage() for r in caplog.records) == 2
    shown = lines(events_cli(js_server.url, "--since", "10m"))
    assert [line.rsplit("reason: ", 1)[1] for line in shown] == ["early", "late", "after the restart"]

    async def stream_config():
        nc = await nats.connect(js_server.url)
        info = await nc.jetstream().stream_info(STREAM)
        await nc.close()
        return info.config

    kept = asyncio.run(stream_config())  # the restarted monitor's limits replaced the first one's
    assert (kept.max_age, kept.max_bytes, kept.subjects) == (3600.0, 1 << 20, [subjects.EVENTS])


def test_follow_prints_new_events_as_they_come_until_interrupted(js_server):
    async def send(reason: str, with_monitor: bool = False) -> None:
        bus, sender = await _sender(js_server.url)
        monitor = MonitorService(MonitorConfig(nats_url=js_server.url))
        if with_monitor:  # it creates the stream and is not needed afterwards
            await monitor.start(bus)
        await sender.send("exec0", PingArgs(), reason)
        await monitor.stop()
        await bus.close()

    asyncio.run(send("before following", with_monitor=True))
    cli = subprocess.Popen([sys.executable, "-m", "services.cli", "events", "--nats", js_server.url, "--follow"],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    printed: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [printed.put(line) for line in cli.stdout], daemon=True).start()
    try:
        assert printed.get(timeout=10).rstrip().endswith("reason: before following")
        asyncio.run(send("while following"))
        assert printed.get(timeout=5).rstrip().endswith("reason: while following")
        cli.send_signal(signal.SIGINT)
        assert cli.wait(timeout=5) == 0
    finally:
        cli.kill()


def test_without_jetstream_the_monitor_carries_on_and_events_explains(nats_server, caplog):
    async def scenario():
        monitor_bus = await Bus.connect(nats_server.url, "monitor")
        monitor = MonitorService(MonitorConfig(nats_url=nats_server.url))
        bus, sender = await _sender(nats_server.url)
        seen: list[object] = []

        async def on_message(incoming):
            seen.append(incoming.message)

        await bus.subscribe(subjects.STATE, ClusterState, on_message)
        await bus.subscribe(subjects.EVENTS, Event, on_message)
        await bus.flush()
        await monitor.start(monitor_bus)
        await sender.send("exec0", PingArgs(), "still audited")
        # Nothing keeps the events, but they still go out, and the monitor still publishes the state.
        await _until(lambda: any(isinstance(m, ClusterState) for m in seen), timeout=3)
        await _until(lambda: any(isinstance(m, Event) and m.data.get("reason") == "still audited" for m in seen),
                     timeout=3)
        await monitor.stop()
        await monitor_bus.close()
        await bus.close()

    with caplog.at_level(logging.INFO, logger="services.monitor.service"):
        asyncio.run(scenario())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["monitor: events are not kept: the NATS server runs without JetStream (start nats-server "
                        "with -js to keep them)"]

    result = events_cli(nats_server.url, "--since", "10m")
    assert result.returncode == 1 and result.stdout == ""
    assert f"events are not kept: the NATS server at {nats_server.url} runs without JetStream" in result.stderr
    assert "Start it with -js" in result.stderr


def test_events_without_a_reachable_nats_exits_at_once_with_one_line():
    url = f"nats://127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = events_cli(url)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"morphling events: no NATS server reachable at {url} within 3 s"]
    assert time.monotonic() - started < 15
