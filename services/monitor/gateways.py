"""The gateways the monitor hears beat: one silent for dead_after, as an executor would be, is gone for good, and the
monitor says so (GatewayGone) so that the executors cancel its requests rather than run them to their last token
for nobody (a gateway that restarts is caught sooner, by each executor: executor/gateways.py).

The monitor judges, not each executor: a stalled executor wakes to beats still unread in its socket, and its own
silence must not end the streams of a gateway that lives. The monitor's own stall or bus outage counts as no one's
silence (Heartbeats.look)."""

import asyncio
import logging
import time

from shared import subjects
from shared.bus import Bus, BusError, Incoming, unsubscribe
from shared.core.liveness import Heartbeats
from shared.messages import GATEWAY_HEARTBEAT_S, Event, GatewayGone, GatewayHeartbeat

log = logging.getLogger(__name__)


class GatewayJudge:
    def __init__(self, dead_after_s: float):
        self._heard = Heartbeats(dead_after_s)
        self._sub = None
        self._task: asyncio.Task | None = None

    async def start(self, bus: Bus) -> None:
        self._sub = await bus.subscribe(subjects.GATEWAYS, GatewayHeartbeat, self._on_beat)
        self._task = asyncio.create_task(self._judge(bus), name="monitor-gateways")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sub is not None:
            await unsubscribe(self._sub)

    async def _on_beat(self, incoming: Incoming) -> None:
        beat = incoming.message
        if self._heard.heard(beat.gateway, beat.incarnation, time.monotonic()):
            log.info("gateway %s is up", beat.gateway)

    async def _judge(self, bus: Bus) -> None:
        while True:
            await asyncio.sleep(GATEWAY_HEARTBEAT_S)
            for gateway in self._heard.look(time.monotonic(), GATEWAY_HEARTBEAT_S, bus.connected):
                log.warning("gateway %s is silent for %g s: gone", gateway, self._heard.silence_s)
                try:
                    await bus.publish(subjects.GATEWAYS_GONE, GatewayGone(gateway=gateway))
                    await bus.publish(subjects.EVENTS, Event(kind="gateway_down", source="monitor", time=time.time(),
                                                             data={"gateway": gateway}))
                except BusError as exc:  # mid-reconnect: the judging goes on, and a later beat makes it news again
                    log.warning("saying gateway %s is gone failed: %s", gateway, exc)
