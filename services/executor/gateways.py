"""The gateways an executor runs requests for, by their heartbeats: one that restarted (a new incarnation) is gone,
and nobody will read its earlier requests' tokens, so they are cancelled instead of holding batch slots and KV to
their last token (shared/core/liveness.py keeps the incarnations). Silence alone cancels nothing: a stalled
executor wakes to beats still unread in its socket, and a request must not die of its own executor's stall."""

import logging
import time

from services.executor.worker import EngineWorker
from shared import subjects
from shared.bus import Bus, Incoming, unsubscribe
from shared.core.liveness import Heartbeats
from shared.messages import GatewayHeartbeat

log = logging.getLogger(__name__)


class GatewayWatch:
    def __init__(self, worker: EngineWorker):
        self.worker = worker
        self._heard = Heartbeats(silence_s=float("inf"))  # incarnations only (module docstring)
        self._sub = None

    async def start(self, bus: Bus) -> None:
        self._sub = await bus.subscribe(subjects.GATEWAYS, GatewayHeartbeat, self._on_beat)

    async def stop(self) -> None:
        if self._sub is not None:
            await unsubscribe(self._sub)

    async def _on_beat(self, incoming: Incoming) -> None:
        beat = incoming.message
        known = beat.gateway in self._heard
        if self._heard.heard(beat.gateway, beat.incarnation, time.monotonic()) and known:
            log.info("executor %s: gateway %s restarted", self.worker.executor, beat.gateway)
            self.worker.drop_gateway(beat.gateway, admitted_before=time.time())
