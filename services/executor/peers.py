"""An executor's place in its fabric, kept over the bus: it announces itself (its rendezvous, whether it serves
yet) every PEER_HEARTBEAT_S, takes in every executor of the same world and model that announces, and forgets
one silent for PEER_SILENCE_S. So a peer that died is offered for no new instance, and a restarted one (a new
incarnation) is met again as a full peer, with groups formed afresh (fabric/world.py)."""

import asyncio
import logging
import time

from services.executor.fabric.world import FabricError, Peer, World
from shared import subjects
from shared.bus import Bus, BusError, Incoming, unsubscribe
from shared.core.liveness import Heartbeats
from shared.messages import PeerAnnouncement

log = logging.getLogger(__name__)

PEER_HEARTBEAT_S = 1.0
PEER_SILENCE_S = 5.0  # several heartbeats: one lost message, or a slow second, forgets nobody


class PeerDirectory:
    def __init__(self, world: World, name: str, model: str):
        self.world, self.name, self.model = world, name, model
        self.serving = False  # this executor's role has started
        self.serving_peers: set[str] = set()  # the peers that said their role had started
        self._heard = Heartbeats(PEER_SILENCE_S)
        self._bus: Bus | None = None
        self._sub = None
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    async def start(self, bus: Bus) -> None:
        self._bus = bus
        self._sub = await bus.subscribe(subjects.PEERS, PeerAnnouncement, self._on_peer)
        await self.announce()
        self._task = asyncio.create_task(self._heartbeat(), name=f"{self.world.me.name}-peers")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sub is not None:
            await unsubscribe(self._sub)

    async def announce(self) -> None:
        me = self.world.me
        try:
            await self._bus.publish(subjects.PEERS, PeerAnnouncement(
                executor=me.name, incarnation=me.incarnation, rank=me.rank, rendezvous=me.rendezvous,
                model=self.model, world=self.name, serving=self.serving))
        except BusError:  # down: the next heartbeat is what counts
            pass

    async def wait_for_ranks(self, size: int, timeout_s: float) -> None:
        """Until the executors of ranks 0 .. size-1 have all announced themselves (the start-time plan's world);
        FabricError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (missing := self._missing(size)) and time.monotonic() < deadline:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                break
        if missing:
            raise FabricError(f"ranks {missing} of a world of {size} did not announce themselves within "
                              f"{timeout_s:g} s (peers so far: {self.world.names})")

    def _missing(self, size: int) -> list[int]:
        ranks = {self.world.peer(name).rank for name in self.world.names}
        return [r for r in range(size) if r not in ranks]

    async def _on_peer(self, incoming: Incoming) -> None:
        peer = incoming.message
        if peer.executor == self.world.me.name or (peer.world, peer.model) != (self.name, self.model):
            return
        self._heard.heard(peer.executor, peer.incarnation, time.monotonic())
        (self.serving_peers.add if peer.serving else self.serving_peers.discard)(peer.executor)
        if self.world.admit(Peer(peer.executor, peer.rank, peer.rendezvous, peer.incarnation)):
            self._changed.set()
            await self.announce()  # a newcomer hears of us at once, not at our next heartbeat

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(PEER_HEARTBEAT_S)
            await self.announce()
            for name in self._heard.look(time.monotonic(), PEER_HEARTBEAT_S, self._bus.connected):
                log.info("executor %s: peer %s silent for %g s: forgotten", self.world.me.name, name, PEER_SILENCE_S)
                self.serving_peers.discard(name)
                self.world.forget(name)
