"""The only code that touches nats-py: connect, publish, subscribe, request/reply, JetStream streams.

Bodies are MessagePack of a pydantic message; headers carry W3C trace context. Connections reconnect
forever, so a restarted nats-server is survived without restarting the service. A body that does not
decode, has another schema version or fails validation is logged and dropped: a bad message never
takes a service down.

Streams only keep what plain publishes put on their subjects: publishers never know whether anything
is kept, so a server without JetStream costs the history, never the publish.
"""

import asyncio
import logging
import math
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TypeVar

import msgpack
import nats
from nats.aio.msg import Msg
from nats.errors import NoRespondersError, NoServersError
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
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise BadMessage(f"not MessagePack: {exc}") from exc
    if not isinstance(body, dict):
        raise BadMessage(f"body is a {type(body).__name__}, not a map")
    if body.get("v") != SCHEMA_VERSION:
        raise BadMessage(f"schema version {body.get('v')!r}, expected {SCHEMA_VERSION}", body)
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

    @property
    def can_reply(self) -> bool:
        return bool(self._msg.reply)

    async def reply(self, answer: Message) -> None:
        await self._msg.respond(encode(answer))


Handler = Callable[[Incoming], Awaitable[None]]
# For a request that does not decode: the answer that refuses it, or None to leave it unanswered.
Refusal = Callable[[BadMessage], Message | None]


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

        nc: nats.NATS | None = None

        async def on_disconnect() -> None:
            # Bus.close ends in a disconnect too: only a lost connection is worth a warning.
            if nc is None or not nc.is_closed:
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
                await handler(Incoming(msg.subject, message, extract_context(msg.headers), msg))
            except Exception:  # a handler bug must not kill the subscription
                log.exception("handler for %s failed", msg.subject)

        return await self._nc.subscribe(subject, queue=queue, cb=receive)

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

    async def flush(self, timeout: float = 2.0) -> None:
        await self._nc.flush(timeout=timeout)

    async def close(self, timeout: float | None = None) -> None:
        """Drain (deliver what is in flight, then disconnect); after `timeout` seconds just disconnect."""
        if self._nc.is_closed:
            return
        try:
            await asyncio.wait_for(self._nc.drain(), timeout)
        except asyncio.TimeoutError:
            await self._nc.close()


def _has_settings(config: StreamConfig, wanted: dict) -> bool:
    # max_age travels in nanoseconds and comes back as float seconds: compared with a tolerance.
    return all(math.isclose(getattr(config, k) or 0.0, v) if k == "max_age" else getattr(config, k) == v
               for k, v in wanted.items())
