"""The only code that touches nats-py: connect, publish, subscribe, request/reply.

Bodies are MessagePack of a pydantic message; headers carry W3C trace context. Connections reconnect
forever, so a restarted nats-server is survived without restarting the service. A body that does not
decode, has another schema version or fails validation is logged and dropped: a bad message never
takes a service down.
"""

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import msgpack
import nats
from nats.aio.msg import Msg
from nats.errors import NoRespondersError, NoServersError
from nats.errors import TimeoutError as NatsTimeout
from opentelemetry import context as otel_context
from pydantic import ValidationError

from shared.errors import InvalidRequestError
from shared.messages import SCHEMA_VERSION, Message
from shared.telemetry import extract_context, inject_headers

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)


class BusError(Exception):
    """A request got no answer: nobody listens on the subject, or the answer came too late."""

    def __init__(self, subject: str, problem: str):
        super().__init__(f"{subject}: {problem}")
        self.subject = subject
        self.problem = problem


class BadMessage(Exception):
    pass


def stop_on_signals() -> asyncio.Event:
    """An event that SIGTERM or SIGINT sets: a process's cue to stop cleanly (call inside the loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def encode(message: Message) -> bytes:
    return msgpack.packb(message.model_dump(mode="json"), use_bin_type=True)


def decode(data: bytes, model: type[M]) -> M:
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise BadMessage(f"not MessagePack: {exc}") from exc
    if not isinstance(body, dict):
        raise BadMessage(f"body is a {type(body).__name__}, not a map")
    if body.get("v") != SCHEMA_VERSION:
        raise BadMessage(f"schema version {body.get('v')!r}, expected {SCHEMA_VERSION}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise BadMessage(f"not a valid {model.__name__}: {exc.error_count()} error(s): {exc.errors()[0]['msg']}") \
            from exc
    except InvalidRequestError as exc:  # a range rule of a part, e.g. SamplingOptions
        raise BadMessage(f"not a valid {model.__name__}: {exc.param}: {exc.message}") from exc


@dataclass
class Incoming:
    """A received message with its trace context and, for requests, a way to answer."""
    subject: str
    message: Message
    trace_context: otel_context.Context
    _msg: Msg

    @property
    def can_reply(self) -> bool:
        return bool(self._msg.reply)

    async def reply(self, answer: Message) -> None:
        await self._msg.respond(encode(answer))


Handler = Callable[[Incoming], Awaitable[None]]


async def unsubscribe(subscription) -> None:
    """Stop a subscription from Bus.subscribe; with the connection already gone there is nothing to undo."""
    try:
        await subscription.unsubscribe()
    except Exception as exc:  # nats-py raises several unrelated types on a closed connection
        log.debug("unsubscribe failed: %s", exc)


class Bus:
    def __init__(self, nc: nats.NATS, name: str):
        self._nc = nc
        self.name = name

    @classmethod
    async def connect(cls, url: str, name: str, first_attempt_timeout: float = 30.0) -> "Bus":
        """Connect, retrying until `first_attempt_timeout`; afterwards reconnect forever."""
        async def on_error(exc: Exception) -> None:
            log.warning("bus %s: %s", name, exc)

        async def on_disconnect() -> None:
            log.warning("bus %s: disconnected from %s", name, url)

        async def on_reconnect() -> None:
            log.info("bus %s: reconnected to %s", name, url)

        # With unlimited reconnects nats-py also retries the first connection forever: bound it here.
        try:
            nc = await asyncio.wait_for(
                nats.connect(servers=[url], name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.25,
                             connect_timeout=2, ping_interval=5, max_outstanding_pings=2, error_cb=on_error,
                             disconnected_cb=on_disconnect, reconnected_cb=on_reconnect),
                timeout=first_attempt_timeout)
        except (NoServersError, OSError, asyncio.TimeoutError) as exc:
            raise BusError(url, f"cannot connect within {first_attempt_timeout:.0f} s: {exc!r}") from exc
        return cls(nc, name)

    @classmethod
    async def connect_unless(cls, stop: asyncio.Event, url: str, name: str) -> "Bus | None":
        """Connect, or None if `stop` is set first: connecting can take long (the server may not be up
        yet), and a signal must end that wait too."""
        stopping = asyncio.create_task(stop.wait())
        connecting = asyncio.create_task(cls.connect(url, name))
        await asyncio.wait({stopping, connecting}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not connecting.done():
            connecting.cancel()
            return None
        return connecting.result()

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    async def publish(self, subject: str, message: Message, ctx: otel_context.Context | None = None) -> None:
        await self._nc.publish(subject, encode(message), headers=inject_headers(ctx) or None)

    async def request(self, subject: str, message: Message, reply_model: type[R], timeout: float,
                      ctx: otel_context.Context | None = None) -> R:
        try:
            msg = await self._nc.request(subject, encode(message), timeout=timeout,
                                         headers=inject_headers(ctx) or None)
        except NoRespondersError as exc:
            raise BusError(subject, "no responders") from exc
        except NatsTimeout as exc:
            raise BusError(subject, f"no reply within {timeout:.1f} s") from exc
        try:
            return decode(msg.data, reply_model)
        except BadMessage as exc:
            raise BusError(subject, f"bad reply: {exc}") from exc

    async def subscribe(self, subject: str, model: type[Message], handler: Handler, queue: str = ""):
        """Call `handler` for each valid message on `subject`; bad ones are logged and dropped."""
        async def receive(msg: Msg) -> None:
            try:
                message = decode(msg.data, model)
            except BadMessage as exc:
                log.warning("dropped a message on %s: %s", msg.subject, exc)
                return
            try:
                await handler(Incoming(msg.subject, message, extract_context(msg.headers), msg))
            except Exception:  # a handler bug must not kill the subscription
                log.exception("handler for %s failed", msg.subject)

        return await self._nc.subscribe(subject, queue=queue, cb=receive)

    async def flush(self, timeout: float = 2.0) -> None:
        await self._nc.flush(timeout=timeout)

    async def close(self) -> None:
        if not self._nc.is_closed:
            await self._nc.drain()
