"""The bus wrapper against a real nats-server: round trips, bad messages dropped, reconnection."""

import asyncio

import msgpack
import pytest

from shared.bus import Bus, BusError, encode
from shared.messages import SCHEMA_VERSION, Cancel, Command, CommandResult
from tests.nats_server import until_routed


def test_publish_subscribe_request_reply_and_bad_messages(nats_server):
    async def scenario():
        a = await Bus.connect(nats_server.url, "a")
        b = await Bus.connect(nats_server.url, "b")
        got: list[Cancel] = []

        async def on_cancel(incoming):
            got.append(incoming.message)

        async def on_command(incoming):
            cmd = incoming.message
            await incoming.reply(CommandResult(seq=cmd.seq, issuer=cmd.issuer, executor="x", kind=cmd.kind, ok=True))

        await b.subscribe("t.cancel", Cancel, on_cancel)
        await b.subscribe("t.cmd", Command, on_command)
        await b.flush()
        await until_routed(a, "t.cmd")  # t.cancel, subscribed before it on the same connection, is routed too
        raw = a._nc
        await raw.publish("t.cancel", b"\xc1 not msgpack")
        await raw.publish("t.cancel", msgpack.packb({"v": 99, "request_id": "old"}))
        await raw.publish("t.cancel", msgpack.packb({"v": SCHEMA_VERSION, "request_id": 5, "extra": 1}))
        await a.publish("t.cancel", Cancel(request_id="r1"))
        result = await a.request("t.cmd", Command(seq=3, issuer="ctl", kind="ping"), CommandResult, timeout=2)
        assert result.ok and result.seq == 3
        with pytest.raises(BusError, match="no responders"):
            await a.request("t.nobody", Command(seq=1, issuer="ctl", kind="ping"), CommandResult, timeout=1)
        await asyncio.sleep(0.2)
        assert [c.request_id for c in got] == ["r1"]  # the three bad ones were dropped, the handler survived
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_clients_reconnect_after_a_server_restart(nats_server):
    async def scenario():
        a = await Bus.connect(nats_server.url, "a")
        b = await Bus.connect(nats_server.url, "b")
        got = []

        async def on_cancel(incoming):
            got.append(incoming.message.request_id)

        await b.subscribe("t.cancel", Cancel, on_cancel)
        await b.flush()
        await asyncio.to_thread(nats_server.restart)
        for _ in range(100):  # reconnection takes a moment; keep publishing until it is back
            if got:
                break
            try:
                await a.publish("t.cancel", Cancel(request_id="after-restart"))
            except Exception:
                pass
            await asyncio.sleep(0.1)
        assert "after-restart" in got
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_encode_is_messagepack_with_the_schema_version():
    body = msgpack.unpackb(encode(Cancel(request_id="x")))
    assert body == {"v": SCHEMA_VERSION, "request_id": "x"}


def test_connecting_to_nobody_fails_in_bounded_time():
    from tests.nats_server import free_port

    async def scenario():
        started = asyncio.get_running_loop().time()
        with pytest.raises(BusError, match="cannot connect"):
            await Bus.connect(f"nats://127.0.0.1:{free_port()}", "lonely", first_attempt_timeout=1.0)
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(scenario()) < 5
