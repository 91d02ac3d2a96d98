"""`morphling up`'s side of `morphling scale`: executors added to a running deployment, and removed from it.

An added executor joins the world as a peer (`--join`: it serves alone, and its peers may merge with it); `scale`
answers once its telemetry is on the bus. A removed one, the newest first, is drained
(it admits nothing more and the gateways route around it), waited for until it runs nothing, then stopped, so
that no request is lost; `up` then no longer restarts it.

The bus side runs in a thread of its own with its own event loop; what touches the process table goes to `up`'s
main loop (`run_pending`), which owns it.
"""

import asyncio
import concurrent.futures
import logging
import queue
import re
import threading
import time
from collections.abc import Callable

from shared import subjects
from shared.bus import Bus, Incoming
from shared.commands import CommandSender
from shared.messages import DrainArgs, ExecutorTelemetry, ScaleReply, ScaleRequest

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 600.0  # a removed executor's requests may take this long to finish
SERVING_TIMEOUT_S = 300.0  # an added one loads the model in this


def scale_plan(current: list[str], target: int) -> tuple[list[str], list[str]]:
    """The executors to add (numbered on from the highest) and to remove (the highest first) to have `target`."""
    numbers = sorted(int(re.fullmatch(r"exec(\d+)", name)[1]) for name in current)
    if target >= len(numbers):
        top = numbers[-1] if numbers else -1
        return [f"exec{top + 1 + i}" for i in range(target - len(numbers))], []
    return [], [f"exec{n}" for n in reversed(numbers[target:])]


class ScaleService:
    def __init__(self, nats_url: str, executors: Callable[[], list[str]], start: Callable[[str], None],
                 retire: Callable[[str], None]):
        """`executors`, `start` and `retire` are called in up's main loop (run_pending), never in this thread."""
        self.nats_url = nats_url
        self._executors, self._start, self._retire = executors, start, retire
        self._calls: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="scale", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(30)

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(timeout=5)

    def run_pending(self) -> None:
        """Carry out what the bus side asked of the process table (up's main loop calls this)."""
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    async def _in_main(self, fn: Callable[[], object]):
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, future))
        return await asyncio.wrap_future(future)

    async def _serve(self) -> None:
        self._loop, self._stopped = asyncio.get_running_loop(), asyncio.Event()
        bus = await Bus.connect(self.nats_url, "morphling-up")
        self._bus, self._sender = bus, CommandSender(bus, "morphling-up", 10.0, 2)
        self._lock = asyncio.Lock()
        self._latest: dict[str, ExecutorTelemetry] = {}

        async def on_telemetry(incoming: Incoming) -> None:
            self._latest[incoming.message.executor] = incoming.message

        await bus.subscribe(subjects.TELEMETRY_ALL, ExecutorTelemetry, on_telemetry)
        await bus.subscribe(subjects.SCALE, ScaleRequest, self._on_scale)
        await bus.flush()
        self._ready.set()
        await self._stopped.wait()
        await bus.close()

    async def _on_scale(self, incoming: Incoming) -> None:
        async with self._lock:  # one change of size at a time
            started = time.monotonic()
            try:
                add, remove = scale_plan(await self._in_main(self._executors), incoming.message.executors)
                for name in add:
                    self._latest.pop(name, None)
                    await self._in_main(lambda n=name: self._start(n))
                await asyncio.gather(*(self._remove(name) for name in remove))
                for name in add:
                    await self._until(lambda n=name: n in self._latest, SERVING_TIMEOUT_S, f"{name} to serve")
                reply = ScaleReply(ok=True, executors=await self._in_main(self._executors), added=add,
                                   removed=remove, seconds=time.monotonic() - started)
            except Exception as exc:
                log.exception("scaling to %d executors failed", incoming.message.executors)
                reply = ScaleReply(ok=False, executors=await self._in_main(self._executors), error=str(exc),
                                   seconds=time.monotonic() - started)
            await incoming.reply(reply)

    async def _remove(self, name: str) -> None:
        result = await self._sender.send(name, DrainArgs(), reason="morphling scale: removing it")
        if not result.ok:
            raise RuntimeError(f"{name} did not drain: {result.error}")
        await self._until(lambda: self._idle(name), DRAIN_TIMEOUT_S, f"{name}'s requests to finish")
        await self._in_main(lambda: self._retire(name))

    def _idle(self, name: str) -> bool:
        t = self._latest.get(name)
        return t is not None and t.draining and t.running == 0 and t.waiting == 0

    @staticmethod
    async def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:g} s for {what}")
            await asyncio.sleep(0.2)
