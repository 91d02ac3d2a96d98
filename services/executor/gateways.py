"""The gateways an executor runs requests for: nobody reads the tokens of a gateway that is gone, so its requests are
cancelled instead of holding batch slots and KV to their last token. One that restarted is heard here (a new
incarnation of its heartbeat: shared/core/liveness.py keeps them), and its earlier requests go; one that died for
good the monitor says is gone (GatewayGone), and all of them go. Silence heard here cancels nothing: a stalled
executor wakes to beats still unread in its socket, and a request must not die of its own executor's stall."""

import logging
import time

from services.executor.worker import EngineWorker
from shared import subjects
from shared.bus import Bus, Incoming, unsubscribe
from shared.core.liveness import Heartbeats
from shared.messages import GatewayGone, GatewayHeartbeat

log = logging.getLogger(__name__)


class GatewayWatch:
    def __init__(self, worker: EngineWorker):
        self.worker = worker
        self._heard = Heartbeats(silence_s=float("inf"))  # incarnations only (module docstring)
        self._subs = []

    async def start(self, bus: Bus) -> None:
        self._subs = [await bus.subscribe(subjects.GATEWAYS, GatewayHeartbeat, self._on_beat),
                      await bus.subscribe(subjects.GATEWAYS_GONE, GatewayGone, self._on_gone)]

    async def stop(self) -> None:
        for sub in self._subs:
            await unsubscribe(sub)

    async def _on_beat(self, incoming: Incoming) -> None:
        beat = incoming.message
        known = beat.gateway in self._heard
        if self._heard.heard(beat.gateway, beat.incarnation, time.monotonic()) and known:
            log.info("executor %s: gateway %s restarted", self.worker.executor, beat.gateway)
            self.worker.drop_gateway(beat.gateway, admitted_before=time.time())

    async def _on_gone(self, incoming: Incoming) -> None:
        self.worker.drop_gateway(incoming.message.gateway, admitted_before=time.time())
