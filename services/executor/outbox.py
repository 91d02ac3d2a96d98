"""The executor's one way out: what the engine thread sends leaves in the order it was queued.

A request's Admission reply must be written before its first TokenBatch, and each request's deltas
in step order, so every send of the engine thread, and the admission answers the loop gives, go
through this one queue, drained by one task on the asyncio loop. The queue is bounded with
backpressure on the engine: when `limit` sends are queued and unsent, `put` waits until the bus
catches up, so a slow bus slows generation instead of growing memory, and nothing is dropped or
reordered. At stop the engine thread is never made to wait (the bus may be what is stuck), and what
is still queued gets `flush_timeout_s` to leave.

While the bus is down, nats-py keeps sends for the reconnect until its buffer is full and then refuses
them (BusError): those are dropped, the outbox goes on, and the loss is logged once per run of
failures rather than once per message, which would flood the log for the whole outage.
"""

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

from shared.bus import BusError

log = logging.getLogger(__name__)

Send = Callable[[], Awaitable[None]]


class Outbox:
    def __init__(self, name: str, limit: int, flush_timeout_s: float):
        self.name, self.limit, self.flush_timeout_s = name, limit, flush_timeout_s
        # Unbounded as a queue: `put` bounds it, and the publisher's stop marker must always fit.
        self._queue: asyncio.Queue[Send | None] = asyncio.Queue()
        self._room = threading.Condition()  # guards the two fields below; the engine thread waits on it
        self._unsent = 0  # sends queued and not yet done
        self._closing = False  # set at stop: from then on the engine thread never waits for room
        self._loop: asyncio.AbstractEventLoop | None = None
        self._publisher: asyncio.Task | None = None
        self._lost = 0  # sends the bus refused since the last one it took

    def start(self) -> None:
        """Start sending (on the running loop)."""
        self._loop = asyncio.get_running_loop()
        self._publisher = asyncio.create_task(self._publish_all(), name=f"{self.name}-publisher")

    def put(self, send: Send) -> None:
        """From the engine thread only (it may block): queue `send` behind everything queued before it,
        first waiting while `limit` sends are unsent."""
        with self._room:
            self._room.wait_for(lambda: self._unsent < self.limit or self._closing)
            self._unsent += 1
        self._loop.call_soon_threadsafe(self._queue.put_nowait, send)

    def put_nowait(self, send: Send) -> None:
        """From the asyncio loop, which must never wait here (it runs the publisher that makes room): queue
        `send` behind everything queued before it. The loop sends one answer per message it took, so the
        bus's own pace bounds these."""
        with self._room:
            self._unsent += 1
        self._queue.put_nowait(send)

    def stop_waiting(self) -> None:
        """From now on `put` never blocks: the last sends of a stopping engine must not wait for a bus
        that may be what is stuck."""
        with self._room:
            self._closing = True
            self._room.notify_all()

    async def finish(self) -> None:
        """Send what is queued, for at most flush_timeout_s, then stop the publisher."""
        await self._queue.put(None)
        await asyncio.wait({self._publisher}, timeout=self.flush_timeout_s)
        if not self._publisher.done():
            log.warning("%s: %d messages still unsent after %.1f s; dropping them", self.name, self._unsent,
                        self.flush_timeout_s)
            self._publisher.cancel()
        await asyncio.gather(self._publisher, return_exceptions=True)

    async def _publish_all(self) -> None:
        while (send := await self._queue.get()) is not None:
            try:
                await send()
            except BusError as exc:
                if not self._lost:
                    log.warning("%s: the bus refused a send (%s); dropping sends until it takes them again",
                                self.name, exc.problem)
                self._lost += 1
            except Exception:  # one lost message must not hold back the ones behind it
                log.exception("%s: sending failed", self.name)
            else:
                if self._lost:
                    log.warning("%s: the bus takes sends again; %d were dropped", self.name, self._lost)
                    self._lost = 0
            with self._room:
                self._unsent -= 1
                self._room.notify()
