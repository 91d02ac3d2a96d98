"""The only code that touches nats-py: connect, publish, subscribe, request/reply, JetStream streams.

Bodies are MessagePack of a pydantic message; headers carry W3C trace context. Connections reconnect
forever, so a restarted nats-server is survived without restarting the service. A body that does not
decode, has another schema version or fails validation is logged and dropped: a bad message never
takes a service down.

A lost connection is reported (`disconnected_since`, `on_outage`), so that a service can give up on
what waits for the bus once it has been gone too long, rather than hang until it returns.

Streams only keep what plain publishes put on their subjects: publishers never know whether anything
is kept, so a server without JetStream costs the history, never the publish.
"""

import asyncio
import logging
import math
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TypeVar

import msgpack
import nats
from nats.aio.msg import Msg
from nats.errors import (ConnectionClosedError, ConnectionDrainingError, ConnectionReconnectingError,
                         MaxPayloadError, NoRespondersError, NoServersError, OutboundBufferLimitError)
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy, DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError
from opentelemetry import context as otel_context
from pydantic import ValidationError

from shared.errors import InvalidRequestError
from shared.messages import SCHEMA_VERSION, Message
from shared.telemetry import extract_context, inject_headers

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)
T = TypeVar("T")


class BusError(Exception):
    """The bus could not do what was asked of `subject` (a subject, or a stream's name): a request got no
    answer (nobody listens, or the answer came too late), or a stream could not be made or read."""

    def __init__(self, subject: str, problem: str):
        super().__init__(f"{subject}: {problem}")
        self.subject = subject
        self.problem = problem


class NoResponders(BusError):
    """Nobody subscribes to the subject of a request: the server said so at once."""


class ReplyTimeout(BusError):
    """A request was delivered (somebody subscribes) but its answer did not come within `timeout` seconds."""

    def __init__(self, subject: str, timeout: float):
        super().__init__(subject, f"no reply within {timeout:.1f} s")
        self.timeout = timeout


class BusUnavailable(BusError):
    """The connection is down (nats-py is reconnecting) or closed, and this send or request cannot wait
    for it: the reconnect buffer is full, the connection is closed, or the caller asked not to wait."""


class PayloadTooLarge(BusError):
    """A message (body and headers) larger than the server's max_payload: sending it would make the server
    close the whole connection, so it is refused here. `size` is None where only nats-py noticed."""

    def __init__(self, subject: str, size: int | None, limit: int | None):
        super().__init__(subject, f"a message of {size if size is not None else 'too many'} bytes exceeds the "
                                  f"bus's max_payload{f' of {limit} bytes' if limit is not None else ''}")
        self.size = size
        self.limit = limit


class BadMessage(Exception):
    """A body that is not a valid message of the expected kind. `body` is what decoded of it (a map,
    when it got that far) and `param` the field a range rule refused, so that a receiver can still
    answer a request it cannot serve."""

    def __init__(self, problem: str, body: object = None, param: str | None = None):
        super().__init__(problem)
        self.problem = problem
        self.body = body
        self.param = param


class StreamError(BusError):
    """A JetStream stream could not be created, updated or read; `subject` names the stream."""


class JetStreamOff(StreamError):
    """The server answers nothing on the JetStream API: it runs without JetStream (no -js), or its
    JetStream is not up yet."""


class NoSuchStream(StreamError):
    """JetStream is on, but nobody created the stream."""


JS_API_TIMEOUT_S = 5.0  # nats-py's default; a JetStream cluster may take this long to place a stream


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
    return validate(unpack(data), model)


def unpack(data: bytes) -> dict:
    """The body as a map of this schema version, not yet validated as any message."""
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise BadMessage(f"not MessagePack: {exc}") from exc
    if not isinstance(body, dict):
        raise BadMessage(f"body is a {type(body).__name__}, not a map")
    if body.get("v") != SCHEMA_VERSION:
        raise BadMessage(f"schema version {body.get('v')!r}, expected {SCHEMA_VERSION}", body)
    return body


def validate(body: dict, model: type[M]) -> M:
    """An unpacked body as a `model`, or BadMessage."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(part) for part in err["loc"])
        raise BadMessage(f"not a valid {model.__name__}: {exc.error_count()} error(s), first at {where}: "
                         f"{err['msg']}", body, str(err["loc"][-1]) if err["loc"] else None) from exc
    except InvalidRequestError as exc:  # a range rule of a part, e.g. SamplingOptions
        raise BadMessage(f"not a valid {model.__name__}: {exc.message}", body, exc.param) from exc


@dataclass
class Incoming:
    """A received message with its trace context and, for requests, a way to answer."""
    subject: str
    message: Message
    trace_context: otel_context.Context
    _msg: Msg
    max_payload: int | None = None  # of the connection it came on, for the error of a reply too large

    @property
    def size(self) -> int:
        """The body's bytes on the wire."""
        return len(self._msg.data)

    @property
    def can_reply(self) -> bool:
        return bool(self._msg.reply)

    async def reply(self, answer: Message) -> None:
        with sending(self._msg.reply, self.max_payload):
            await self._msg.respond(encode(answer))


@contextmanager
def sending(subject: str, limit: int | None):
    """nats-py's errors of a send, as BusErrors that say what a caller can do about them."""
    try:
        yield
    except MaxPayloadError as exc:
        raise PayloadTooLarge(subject, None, limit) from exc
    except OutboundBufferLimitError as exc:
        raise BusUnavailable(subject, "disconnected, and the buffer of sends kept for the reconnect is full") \
            from exc
    except ConnectionReconnectingError as exc:
        raise BusUnavailable(subject, "the connection is reconnecting") from exc
    except (ConnectionClosedError, ConnectionDrainingError) as exc:
        raise BusUnavailable(subject, "the connection is closed or closing") from exc


def header_bytes(headers: dict[str, str] | None) -> int:
    """What `headers` add to a message on the wire (NATS/1.0 framing): the server counts them against
    max_payload together with the body."""
    if not headers:
        return 0
    return len(b"NATS/1.0\r\n\r\n") + sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())


Handler = Callable[[Incoming], Awaitable[None]]
# For a request that does not decode: the answer that refuses it, or None to leave it unanswered.
Refusal = Callable[[BadMessage], Message | None]


async def unsubscribe(subscription) -> None:
    """Stop a subscription from Bus.subscribe; with the connection already gone there is nothing to undo."""
    try:
        await subscription.unsubscribe()
    except Exception as exc:  # nats-py raises several unrelated types on a closed connection
        log.debug("unsubscribe failed: %s", exc)


Outage = Callable[[float], None]  # called with how long the connection has been gone, in seconds


class Bus:
    def __init__(self, nc: nats.NATS, name: str):
        self._nc = nc
        self.name = name
        # time.monotonic() when the connection was lost; None while connected (or closed on purpose).
        self.disconnected_since: float | None = None
        self._down = asyncio.Event()  # set while disconnected, for requests that give up then
        self._outage_watchers: list[tuple[float, Outage]] = []
        self._outage_timers: list[asyncio.TimerHandle] = []

    @classmethod
    async def connect(cls, url: str, name: str, first_attempt_timeout: float = 30.0) -> "Bus":
        """Connect, retrying until `first_attempt_timeout`; afterwards reconnect forever."""
        async def on_error(exc: Exception) -> None:
            # While reconnecting, nats-py reports every failed attempt, four a second: the disconnect, the
            # outage and the return are what is worth a warning then.
            reconnecting = bus is not None and bus.disconnected_since is not None and isinstance(exc, OSError)
            log.log(logging.DEBUG if reconnecting else logging.WARNING, "bus %s: %s", name, exc)

        bus: Bus | None = None

        async def on_disconnect() -> None:
            # Bus.close ends in a disconnect too: only a lost connection is worth a warning, or an outage.
            if bus is not None and not bus._nc.is_closed:
                log.warning("bus %s: disconnected from %s", name, url)
                bus._went_down()

        async def on_reconnect() -> None:
            log.info("bus %s: reconnected to %s", name, url)
            if bus is not None:
                bus._came_back()

        # With unlimited reconnects nats-py also retries the first connection forever: bound it here.
        try:
            nc = await asyncio.wait_for(
                nats.connect(servers=[url], name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.25,
                             connect_timeout=2, ping_interval=5, max_outstanding_pings=2, error_cb=on_error,
                             disconnected_cb=on_disconnect, reconnected_cb=on_reconnect),
                timeout=first_attempt_timeout)
        except (NoServersError, OSError, asyncio.TimeoutError) as exc:
            raise BusError(url, f"cannot connect within {first_attempt_timeout:.0f} s: {exc!r}") from exc
        bus = cls(nc, name)  # from now on the callbacks above report to it
        return bus

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

    @property
    def max_payload(self) -> int:
        """The largest message (body and headers) the server takes, as it announced on connecting."""
        return self._nc.max_payload

    def on_outage(self, after_s: float, callback: Outage) -> None:
        """Call `callback` once per outage, when the connection has been gone `after_s` seconds without
        coming back: the cue to give up on whatever waits for the bus (from the next disconnect on)."""
        self._outage_watchers.append((after_s, callback))

    def _went_down(self) -> None:
        if self.disconnected_since is not None:
            return
        self.disconnected_since = time.monotonic()
        self._down.set()
        loop = asyncio.get_running_loop()
        self._outage_timers = [loop.call_later(after_s, self._outage, after_s, callback)
                               for after_s, callback in self._outage_watchers]

    def _outage(self, after_s: float, callback: Outage) -> None:
        log.warning("bus %s: gone for %.1f s", self.name, after_s)
        try:
            callback(after_s)
        except Exception:  # one watcher's bug must not keep the others from hearing of the outage
            log.exception("bus %s: an outage callback failed", self.name)

    def _came_back(self) -> None:
        self._stop_outage_timers()
        if self.disconnected_since is not None:
            log.info("bus %s: back after %.1f s", self.name, time.monotonic() - self.disconnected_since)
        self.disconnected_since = None
        self._down.clear()

    def _stop_outage_timers(self) -> None:
        for timer in self._outage_timers:
            timer.cancel()
        self._outage_timers = []

    def _outgoing(self, subject: str, data: bytes, ctx: otel_context.Context | None
                  ) -> tuple[bytes, dict[str, str] | None]:
        headers = inject_headers(ctx) or None
        size = len(data) + header_bytes(headers)
        if size > self.max_payload:
            raise PayloadTooLarge(subject, size, self.max_payload)
        return data, headers

    async def publish(self, subject: str, message: Message, ctx: otel_context.Context | None = None) -> None:
        """Send `message`. While reconnecting, nats-py keeps it for the reconnect until its buffer is full;
        then, and on a closed connection, BusUnavailable. PayloadTooLarge for a message the server would
        refuse."""
        await self._send(subject, encode(message), ctx)

    async def publish_body(self, subject: str, body: dict) -> None:
        """Send a message's body as its model_dump(mode="json") has it, for a sender that has it already
        (`publish` otherwise); as `publish`, with no trace context."""
        await self._send(subject, msgpack.packb(body, use_bin_type=True), None)

    async def _send(self, subject: str, data: bytes, ctx: otel_context.Context | None) -> None:
        data, headers = self._outgoing(subject, data, ctx)
        with sending(subject, self.max_payload):
            await self._nc.publish(subject, data, headers=headers)

    async def request(self, subject: str, message: Message, reply_model: type[R], timeout: float,
                      ctx: otel_context.Context | None = None, give_up_on_disconnect: bool = False) -> R:
        """Send `message` and wait for its answer: NoResponders, ReplyTimeout, PayloadTooLarge or
        BusUnavailable when none comes. With `give_up_on_disconnect`, a connection that is down, or drops
        before the answer, ends the wait at once (BusUnavailable) instead of the request waiting out its
        timeout for a reconnect."""
        data, headers = self._outgoing(subject, encode(message), ctx)
        try:
            with sending(subject, self.max_payload):
                call = self._nc.request(subject, data, timeout=timeout, headers=headers)
                msg = await (self._unless_disconnected(subject, call) if give_up_on_disconnect else call)
        except NoRespondersError as exc:
            raise NoResponders(subject, "no responders") from exc
        except NatsTimeout as exc:
            raise ReplyTimeout(subject, timeout) from exc
        try:
            return decode(msg.data, reply_model)
        except BadMessage as exc:
            raise BusError(subject, f"bad reply: {exc}") from exc

    async def subscribe(self, subject: str, model: type[Message], handler: Handler, queue: str = "",
                        refuse: Refusal | None = None):
        """Call `handler` for each valid message on `subject`; bad ones are logged and dropped, and a bad
        request is answered with `refuse`'s message when it gives one (so its sender hears why at once
        instead of waiting out a timeout)."""
        async def receive(msg: Msg) -> None:
            try:
                message = decode(msg.data, model)
            except BadMessage as exc:
                log.warning("dropped a message on %s: %s", msg.subject, exc)
                if refuse is not None and msg.reply:
                    try:
                        answer = refuse(exc)
                        if answer is not None:
                            await msg.respond(encode(answer))
                    except Exception:
                        log.exception("refusing a bad request on %s failed", msg.subject)
                return
            try:
                await handler(Incoming(msg.subject, message, extract_context(msg.headers), msg, self.max_payload))
            except Exception:  # a handler bug must not kill the subscription
                log.exception("handler for %s failed", msg.subject)

        return await self._nc.subscribe(subject, queue=queue, cb=receive)

    async def subscribe_bodies(self, subject: str, handler: Callable[[str, dict], None]):
        """Call `handler(subject, body)` for each message on `subject` with its body unpacked but not validated
        (`validate` does that): for a receiver that keeps only the latest of many messages and validates the
        one it uses. A body that does not unpack is logged and dropped."""
        async def receive(msg: Msg) -> None:
            try:
                body = unpack(msg.data)
            except BadMessage as exc:
                log.warning("dropped a message on %s: %s", msg.subject, exc)
                return
            try:
                handler(msg.subject, body)
            except Exception:  # a handler bug must not kill the subscription
                log.exception("handler for %s failed", msg.subject)

        return await self._nc.subscribe(subject, cb=receive)

    async def ensure_stream(self, name: str, subjects: list[str], max_age_s: float, max_bytes: int) -> bool:
        """Have JetStream keep what is published on `subjects` in stream `name`, for `max_age_s` and up to
        `max_bytes`, dropping the oldest first. Creates the stream, or brings an existing one's subjects
        and limits to these, so calling it at every start is safe; settings an operator gave the stream
        otherwise (replicas, placement) are kept. False where the server runs without JetStream."""
        wanted = {"subjects": list(subjects), "max_age": max_age_s, "max_bytes": max_bytes,
                  "discard": DiscardPolicy.OLD}
        try:
            info = await self._jetstream_call(name, "look up", self._js.stream_info(name))
        except JetStreamOff:
            return False
        except NoSuchStream:
            await self._jetstream_call(name, "create", self._js.add_stream(
                StreamConfig(name=name, storage=StorageType.FILE, **wanted)))
            return True
        if not _has_settings(info.config, wanted):
            await self._jetstream_call(name, "update", self._js.update_stream(info.config.evolve(**wanted)))
            log.info("stream %s: subjects and limits updated", name)
        return True

    async def replay(self, stream: str, subject: str, model: type[M], since: float,
                     follow: bool = False) -> AsyncIterator[M]:
        """The valid messages `stream` keeps on `subject`, oldest first, from those the server stored at
        `since` (seconds since the epoch) on. Without `follow` it ends once it has caught up with what
        the stream held when asked; with it, it waits for new ones for good.
        Raises JetStreamOff, NoSuchStream or another StreamError."""
        # An ordered consumer: ephemeral, unacknowledged, and re-created by nats-py at the next sequence
        # if a message goes missing, so the history is read whole and once.
        sub = await self._jetstream_call(stream, "read", self._js.subscribe(
            subject, stream=stream, ordered_consumer=True, deliver_policy=DeliverPolicy.BY_START_TIME,
            config=ConsumerConfig(opt_start_time=datetime.fromtimestamp(since, timezone.utc))))
        try:
            if not follow:
                info = await self._jetstream_call(stream, "read", sub.consumer_info())
                # Nothing at all to deliver: no message will come to say "none pending", so caught up now.
                if info.num_pending == 0 and info.delivered.consumer_seq == 0:
                    return
            while True:
                msg = await sub.next_msg(timeout=None)
                try:
                    message = decode(msg.data, model)
                except BadMessage as exc:
                    log.warning("skipped stream %s message %d: %s", stream, msg.metadata.sequence.stream, exc)
                else:
                    yield message
                # The count the server sent with this message of those still to come.
                if not follow and msg.metadata.num_pending == 0:
                    return
        finally:
            await unsubscribe(sub)

    @property
    def _js(self) -> JetStreamContext:
        return self._nc.jetstream(timeout=JS_API_TIMEOUT_S)

    async def _jetstream_call(self, stream: str, action: str, call: Awaitable[T]) -> T:
        """Await a JetStream API call, its nats-py errors turned into StreamErrors that say what failed."""
        name = f"stream {stream}"
        try:
            return await call
        except ServiceUnavailableError as exc:
            raise JetStreamOff(name, f"cannot {action}: no JetStream on the server") from exc
        except NotFoundError as exc:
            raise NoSuchStream(name, f"cannot {action}: no such stream") from exc
        except APIError as exc:
            raise StreamError(name, f"cannot {action}: {exc.description} (JetStream error {exc.err_code})") from exc
        except NatsTimeout as exc:
            # A user without permission on $JS.API.> gets no answer at all, only a timeout.
            raise StreamError(name, f"cannot {action}: no answer from the JetStream API within "
                                    f"{JS_API_TIMEOUT_S:.0f} s (may this user publish on $JS.API.>?)") from exc

    async def _unless_disconnected(self, subject: str, call: Awaitable[Msg]) -> Msg:
        if self.disconnected_since is not None:
            call.close()
            raise BusUnavailable(subject, "not connected")
        answer, down = asyncio.ensure_future(call), asyncio.ensure_future(self._down.wait())
        try:
            await asyncio.wait({answer, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            if not answer.done():  # the connection dropped, or our caller was cancelled
                answer.cancel()
        if not answer.done():
            raise BusUnavailable(subject, "the connection dropped before the answer came")
        return answer.result()

    async def flush(self, timeout: float = 2.0) -> None:
        await self._nc.flush(timeout=timeout)

    async def close(self, timeout: float | None = None) -> None:
        """Drain (deliver what is in flight, then disconnect); after `timeout` seconds, or with the
        connection down (nothing could be delivered), just disconnect."""
        self._stop_outage_timers()  # no outage to report once closing was asked for
        if self._nc.is_closed:
            return
        if not self._nc.is_connected:
            await self._nc.close()
            return
        try:
            await asyncio.wait_for(self._nc.drain(), timeout)
        except asyncio.TimeoutError:
            await self._nc.close()


def _has_settings(config: StreamConfig, wanted: dict) -> bool:
    # max_age travels in nanoseconds and comes back as float seconds: compared with a tolerance.
    return all(math.isclose(getattr(config, k) or 0.0, v) if k == "max_age" else getattr(config, k) == v
               for k, v in wanted.items())
