"""shared.bus over a real nats-server that goes away: outages are reported after their bound, a
request waiting on a dropped connection ends at once, and a message the server would refuse is refused
here without costing the connection."""

import asyncio
import time

import pytest

from shared.bus import Bus, BusUnavailable, PayloadTooLarge
from shared.messages import Cancel, Event
from tests.nats_server import until_routed

SUBJECT = "morphling.test.outage"


def test_an_outage_is_reported_once_after_its_bound_and_a_blip_never(nats_server):
    async def scenario():
        bus = await Bus.connect(nats_server.url, "outage")
        reports: list[tuple[float, float]] = []
        bus.on_outage(1.0, lambda seconds: reports.append((seconds, time.monotonic())))
        assert bus.connected and bus.disconnected_since is None

        nats_server.restart()  # a blip: back well within the bound
        await until(lambda: bus.connected)
        await asyncio.sleep(1.5)
        assert reports == [] and bus.disconnected_since is None

        nats_server.proc.kill()
        killed = time.monotonic()
        await until(lambda: bus.disconnected_since is not None)
        await until(lambda: reports, timeout=5)
        [(seconds, when)] = reports
        assert seconds == 1.0 and when - killed >= 1.0  # told once the bound has passed, not before

        nats_server.start()
        await until(lambda: bus.connected, timeout=10)
        assert bus.disconnected_since is None and len(reports) == 1
        await bus.close()

    asyncio.run(scenario())


def test_a_request_gives_up_when_the_connection_drops_and_while_it_is_down(nats_server):
    async def scenario():
        bus = await Bus.connect(nats_server.url, "requester")
        listener = await Bus.connect(nats_server.url, "silent")
        await listener.subscribe(SUBJECT, Cancel, lambda incoming: asyncio.sleep(0))  # hears, never answers
        await listener.flush()
        await until_routed(bus, SUBJECT)

        waiting = asyncio.create_task(bus.request(SUBJECT, Cancel(request_id="r"), Cancel, timeout=30,
                                                  give_up_on_disconnect=True))
        await asyncio.sleep(0.3)
        nats_server.proc.kill()
        started = time.monotonic()
        with pytest.raises(BusUnavailable):
            await asyncio.wait_for(waiting, 10)
        assert time.monotonic() - started < 3  # the drop ended it, not its 30 s timeout

        started = time.monotonic()
        with pytest.raises(BusUnavailable, match="not connected"):
            await bus.request(SUBJECT, Cancel(request_id="r2"), Cancel, timeout=30, give_up_on_disconnect=True)
        assert time.monotonic() - started < 10  # it gave up on the disconnect, not after its 30 s timeout
        nats_server.start()
        await until(lambda: bus.connected and listener.connected, timeout=10)
        await bus.close()
        await listener.close()

    asyncio.run(scenario())


def test_a_message_over_max_payload_is_refused_and_the_connection_stays(nats_server):
    async def scenario():
        bus = await Bus.connect(nats_server.url, "big")
        got: list[Event] = []

        async def on_event(incoming):
            got.append(incoming.message)

        await bus.subscribe(SUBJECT, Event, on_event)
        await bus.flush()
        big = Event(kind="test", source="t", time=0.0, data={"blob": "x" * bus.max_payload})
        with pytest.raises(PayloadTooLarge) as err:
            await bus.publish(SUBJECT, big)
        assert err.value.limit == bus.max_payload and err.value.size > bus.max_payload
        with pytest.raises(PayloadTooLarge):
            await bus.request(SUBJECT, big, Event, timeout=1)
        # Had it been sent, the server would have closed the connection: it is still up and in use.
        await bus.publish(SUBJECT, Event(kind="test", source="t", time=0.0))
        await until(lambda: got)
        assert bus.connected
        await bus.close()

    asyncio.run(scenario())


async def until(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
