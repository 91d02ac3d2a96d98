"""The gateways an executor runs requests for, by their heartbeats: one that restarted (a new incarnation) or went
silent for GATEWAY_SILENCE_S is gone, and nobody will read its requests' tokens, so they are cancelled instead of
holding batch slots and KV to their last token (shared/core/liveness.py has the rule)."""

import asyncio
import logging
import time

from services.executor.worker import EngineWorker
from shared import subjects
from shared.bus import Bus, Incoming, unsubscribe
from shared.core.liveness import Heartbeats
from shared.messages import GATEWAY_HEARTBEAT_S, GATEWAY_SILENCE_S, GatewayHeartbeat

log = logging.getLogger(__name__)


class GatewayWatch:
    def __init__(self, worker: EngineWorker):
        self.worker = worker
        self._heard = Heartbeats(GATEWAY_SILENCE_S)
        self._sub = None
        self._task: asyncio.Task | None = None

    async def start(self, bus: Bus) -> None:
        self._sub = await bus.subscribe(subjects.GATEWAYS, GatewayHeartbeat, self._on_beat)
        self._task = asyncio.create_task(self._sweep(bus), name=f"{self.worker.executor}-gateways")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sub is not None:
            await unsubscribe(self._sub)

    async def _on_beat(self, incoming: Incoming) -> None:
        beat = incoming.message
        known = beat.gateway in self._heard
        if self._heard.heard(beat.gateway, beat.incarnation, time.monotonic()) and known:
            log.info("executor %s: gateway %s restarted", self.worker.executor, beat.gateway)
            self.worker.drop_gateway(beat.gateway, admitted_before=time.time())

    async def _sweep(self, bus: Bus) -> None:
        while True:
            await asyncio.sleep(GATEWAY_HEARTBEAT_S)
            # While our bus is down the bus outage's own rule (--bus-outage) decides.
            for gateway in self._heard.look(time.monotonic(), GATEWAY_HEARTBEAT_S, bus.connected):
                log.info("executor %s: gateway %s silent for %g s", self.worker.executor, gateway, GATEWAY_SILENCE_S)
                self.worker.drop_gateway(gateway)
