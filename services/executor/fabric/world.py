"""The executors an executor can form instances with, and the process groups it forms with them on demand.

There is no global torch.distributed world. Each executor hosts a TCP store (its rendezvous) and knows its
peers by a `Peer` record: name, start-time rank, rendezvous address and incarnation (new at every process
start). The service learns them from the bus (services/executor/peers.py); a tool or a test that starts a
fixed set of processes meets at one store instead (`World.join`). A group of any set of peers is formed the
first time its members call `group(members)`, at the store of its first member, under a key naming every
member's incarnation: a restarted executor forms new groups with everyone, nothing of its old life in them.

Every group carries the timeout: a peer that is gone closes its connections and the waiting call raises at
once; a peer that hangs raises after the timeout. Either way the caller gets FabricError, never a hang.
`drop(members)` closes the groups among those members, so that every peer still waiting on us raises at once:
a failure spreads through the instance in milliseconds, and the other instances of the executor are untouched.
"""

import contextlib
import datetime
import gc
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shared.core.errors import EngineError

log = logging.getLogger(__name__)


class FabricError(EngineError):
    """A collective with the instance's other members failed (a peer died or hung): the instance is broken."""


class LeaderLeft(FabricError):
    """The instance's leader ended it (a LEAVE step): nothing failed, but there is nothing left to follow."""


@dataclass(frozen=True)
class WorldSettings:
    """A fixed set of processes meeting at one store (tools, tests): rank 0 hosts it at `url`."""
    url: str  # tcp://HOST:PORT
    rank: int
    size: int
    timeout_s: float = 30.0


@dataclass(frozen=True)
class Peer:
    name: str
    rank: int  # its place in the start-time order (--rank); those that join later come after, by name
    rendezvous: str  # HOST:PORT of the store it hosts
    incarnation: str

    @property
    def order(self) -> tuple[int, str]:
        return self.rank, self.name


@dataclass
class _Formed:
    pg: object
    incarnations: tuple[str, ...]


def new_incarnation() -> str:
    return uuid.uuid4().hex[:12]


class World:
    def __init__(self, me: Peer, device: str, timeout_s: float, store: dist.TCPStore,
                 peers: list[Peer] = ()):
        self.me, self.device, self.timeout_s = me, device, timeout_s
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {me.name: me}
        self._stores: dict[str, dist.Store] = {me.rendezvous: store}
        self._groups: dict[tuple[str, ...], _Formed] = {}
        # Groups of these members, in these incarnations, dropped so far: a restarted member starts them afresh.
        self._generation: dict[tuple[tuple[str, ...], tuple[str, ...]], int] = {}
        for peer in peers:
            self.admit(peer)

    # --- who is in it -----------------------------------------------------------------------------
    @classmethod
    def host(cls, name: str, rank: int, advertise: str, device: str, timeout_s: float) -> "World":
        """This executor's side of the fabric: a store of its own on a free port, advertised at `advertise`."""
        store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=_delta(timeout_s))
        return cls(Peer(name, rank, f"{advertise}:{store.port}", new_incarnation()), device, timeout_s, store)

    @classmethod
    def join(cls, settings: WorldSettings, executor_id: str, device: str) -> "World":
        """Meet the other `settings.size - 1` processes at rank 0's store (blocks until all have come, or the
        timeout); every group is then formed at that store."""
        host, port = settings.url.removeprefix("tcp://").rsplit(":", 1)
        try:
            store = dist.TCPStore(host, int(port), is_master=settings.rank == 0, wait_for_workers=False,
                                  timeout=_delta(settings.timeout_s))
            me = Peer(executor_id, settings.rank, f"{host}:{port}", new_incarnation())
            store.set(f"peer/{settings.rank}", f"{me.name} {me.incarnation}")
            peers = []
            for rank in range(settings.size):
                name, incarnation = store.get(f"peer/{rank}").decode().split()
                peers.append(Peer(name, rank, me.rendezvous, incarnation))
        except (RuntimeError, ValueError) as exc:  # DistStoreError is a RuntimeError
            raise FabricError(f"meeting the world at {settings.url} failed: {exc}") from exc
        if len({p.name for p in peers}) != len(peers):
            raise FabricError(f"two executors of the world share an id: {[p.name for p in peers]}")
        return cls(me, device, settings.timeout_s, store, peers)

    def admit(self, peer: Peer) -> bool:
        """Take `peer` in (or its new incarnation); whether anything changed."""
        with self._lock:
            if self._peers.get(peer.name) == peer:
                return False
            self._peers[peer.name] = peer
        log.info("executor %s: peer %s (incarnation %s) at %s", self.me.name, peer.name, peer.incarnation,
                 peer.rendezvous)
        return True

    def forget(self, name: str) -> None:
        """`name` is gone: it is offered for no new instance (the groups it was in break on their own)."""
        with self._lock:
            if name != self.me.name:
                self._peers.pop(name, None)

    @property
    def names(self) -> list[str]:
        """Every peer, this executor too, in start-time order."""
        with self._lock:
            return [p.name for p in sorted(self._peers.values(), key=lambda p: p.order)]

    def peer(self, name: str) -> Peer | None:
        with self._lock:
            return self._peers.get(name)

    def rank_of(self, executor: str) -> int:
        return self.names.index(executor)

    def ordered(self, members: list[str] | tuple[str, ...]) -> tuple[str, ...]:
        """`members` in world order: the order of their ranks in group(members)."""
        return tuple(sorted(members, key=self.rank_of))

    def group_rank(self, members: list[str] | tuple[str, ...], executor: str) -> int:
        return self.ordered(members).index(executor)

    def in_member_order(self, members: list[str] | tuple[str, ...], gathered: list) -> list:
        """What a collective over group(members) gathered (one entry per group rank: the members in world
        order) put back in `members`' own order."""
        by_rank = self.ordered(members)
        return [gathered[by_rank.index(m)] for m in members]

    # --- groups -----------------------------------------------------------------------------------
    def group(self, members: list[str] | tuple[str, ...]):
        """The process group of exactly these executors, formed now if it is not yet (every member must
        call this at the same point of its program, as for any collective)."""
        with self._lock:
            missing = [m for m in members if m not in self._peers]
            if missing:
                raise FabricError(f"executors {missing} are not peers of {self.me.name}")
            key = tuple(sorted(members, key=lambda m: self._peers[m].order))
            peers = [self._peers[m] for m in key]
            incarnations = tuple(p.incarnation for p in peers)
            formed = self._groups.get(key)
            generation = self._generation.get((key, incarnations), 0)
        if formed is not None and formed.incarnations == incarnations:
            return formed.pg
        start = time.perf_counter()
        name = "/".join(f"{p.name}@{p.incarnation}" for p in peers)
        prefix = dist.PrefixStore(f"group/{name}/{generation}", self._store_at(peers[0].rendezvous))
        with checked(f"forming the group of {list(key)}"):
            pg = _process_group(prefix, key.index(self.me.name), len(key), self.device, self.timeout_s)
        seconds = time.perf_counter() - start
        with self._lock:
            self._groups[key] = _Formed(pg, incarnations)
        log.info("executor %s: formed the group of %s in %.3f s", self.me.name, list(key), seconds)
        return pg

    def drop(self, members: list[str] | tuple[str, ...]) -> None:
        """Close every group among `members` (its connections too, so that peers waiting on us fail at once);
        the next group() of the same members forms a new one."""
        inside = set(members)
        with self._lock:
            gone = [k for k in self._groups if set(k) <= inside]
            for key in gone:
                dropped = (key, self._groups.pop(key).incarnations)
                self._generation[dropped] = self._generation.get(dropped, 0) + 1
        if gone:
            gc.collect()  # a group's connections close when the last reference to it goes

    def close(self) -> None:
        """Leave for good: every group closes."""
        with self._lock:
            self._groups.clear()
            self._stores.clear()
        gc.collect()

    def _store_at(self, rendezvous: str) -> dist.Store:
        with self._lock:
            store = self._stores.get(rendezvous)
        if store is None:
            host, port = rendezvous.rsplit(":", 1)
            with checked(f"reaching the rendezvous at {rendezvous}"):
                store = dist.TCPStore(host, int(port), is_master=False, timeout=_delta(self.timeout_s))
            with self._lock:
                self._stores[rendezvous] = store
        return store


def _process_group(store: dist.Store, rank: int, size: int, device: str, timeout_s: float):
    """A process group over `store` that no global state knows of (what vLLM's stateless groups do): gloo for
    CPU tensors, and on CUDA NCCL for the device's."""
    timeout = _delta(timeout_s)
    pg = dist.ProcessGroup(store, rank, size)
    # Each backend under a prefix of its own, as torch's own groups of several backends are.
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, size, timeout)
    gloo._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)  # objects travel as CPU tensors
    if device.startswith("cuda"):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", store), rank, size, options)
        nccl._set_sequence_number_for_group()
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
    return pg


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@contextlib.contextmanager
def checked(what: str):
    """Run collectives, turning their failure into FabricError naming what was being done."""
    try:
        yield
    except RuntimeError as exc:
        raise FabricError(f"{what}: {exc}") from exc
