"""The executors' process group: who is in it, the subgroups instances use, and what a dead peer becomes.

Every executor of a deployment joins one torch.distributed world at start (gloo on CPU; gloo for the step
metadata plus NCCL for tensors on CUDA). Creating a group is collective over the whole world, so every
group an instance may ever use (every pair, for hops and replicas; aligned pairs and quads, for TP2 and
TP4; and each planned instance's member set) is created here, at start, by every rank in one order.

Every group carries the timeout: a peer that is gone closes its connections and the waiting call raises at
once; a peer that hangs raises after the timeout. Either way the caller gets FabricError, never a hang.
`close()` destroys the world so that our connections close too and every peer still waiting on us raises
at once: the failure spreads through the instance in milliseconds instead of one timeout per member.
"""

import contextlib
import datetime
import itertools
import logging
import os
from dataclasses import dataclass

import torch.distributed as dist

from shared.core.errors import EngineError
from shared.messages import InstancePlan

log = logging.getLogger(__name__)


class FabricError(EngineError):
    """A collective with the instance's other members failed (a peer died or hung): the instance is broken."""


class LeaderLeft(FabricError):
    """The instance's leader ended it (a LEAVE step): nothing failed, but there is nothing left to follow."""


@dataclass(frozen=True)
class WorldSettings:
    url: str  # tcp://HOST:PORT of the TCP store rank 0 hosts
    rank: int
    size: int
    timeout_s: float = 30.0

    @classmethod
    def from_args(cls, url: str | None, rank: int | None, size: int | None, timeout_s: float
                  ) -> "WorldSettings | None":
        """The settings given by flags, else by MORPHLING_DIST_URL/RANK/WORLD_SIZE; None for a world of one."""
        url = url or os.environ.get("MORPHLING_DIST_URL")
        rank = rank if rank is not None else int(os.environ.get("MORPHLING_RANK", "0"))
        size = size if size is not None else int(os.environ.get("MORPHLING_WORLD_SIZE", "1"))
        if size <= 1:
            return None
        if not url:
            raise ValueError(f"a world of {size} executors needs --dist-url (or MORPHLING_DIST_URL)")
        if not 0 <= rank < size:
            raise ValueError(f"--rank {rank} is outside a world of {size}")
        return cls(url, rank, size, timeout_s)


def backend_for(device: str) -> str:
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


class World:
    def __init__(self, settings: WorldSettings, names: list[str]):
        self.settings = settings
        self.names = names  # executor id of each rank
        self._groups: dict[tuple[int, ...], object] = {}

    @classmethod
    def join(cls, settings: WorldSettings, executor_id: str, device: str) -> "World":
        """Rendezvous with every other executor (blocks until all have arrived, or the timeout)."""
        backend = backend_for(device)
        log.info("executor %s: joining a world of %d as rank %d at %s", executor_id, settings.size, settings.rank,
                 settings.url)
        try:
            dist.init_process_group(backend, init_method=settings.url, rank=settings.rank,
                                    world_size=settings.size, timeout=cls._timeout(settings))
            names: list[str | None] = [None] * settings.size
            dist.all_gather_object(names, executor_id)
        except (RuntimeError, ValueError) as exc:
            raise FabricError(f"joining the world at {settings.url} failed: {exc}") from exc
        if len(set(names)) != len(names):
            raise FabricError(f"two executors of the world share an id: {names}")
        return cls(settings, names)

    @staticmethod
    def _timeout(settings: WorldSettings) -> datetime.timedelta:
        return datetime.timedelta(seconds=settings.timeout_s)

    def create_groups(self, plans: list[InstancePlan]) -> None:
        """Every subgroup an instance may use; all ranks must call this with the same plans."""
        size = self.settings.size
        wanted = {tuple(p) for p in itertools.combinations(range(size), 2)}
        wanted |= {tuple(range(i, i + 4)) for i in range(0, size - 3, 4)}
        wanted |= {tuple(sorted(self.names.index(m) for m in plan.members)) for plan in plans if len(plan.members) > 1}
        try:
            for ranks in sorted(wanted, key=lambda r: (len(r), r)):
                self._groups[ranks] = dist.new_group(list(ranks), timeout=self._timeout(self.settings))
        except RuntimeError as exc:
            raise FabricError(f"creating the world's subgroups failed: {exc}") from exc

    def rank_of(self, executor: str) -> int:
        return self.names.index(executor)

    def in_member_order(self, members: list[str] | tuple[str, ...], gathered: list) -> list:
        """What a collective over group(members) gathered (one entry per group rank: the members in world rank
        order) put back in `members`' own order."""
        by_rank = sorted(members, key=self.rank_of)
        return [gathered[by_rank.index(m)] for m in members]

    def group(self, members: list[str] | tuple[str, ...]):
        """The subgroup of exactly these executors (created at start)."""
        return self._groups[tuple(sorted(self.rank_of(m) for m in members))]

    def close(self) -> None:
        """Leave the world for good: our connections close, so peers waiting on us fail at once."""
        self._groups.clear()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken world may refuse a clean teardown; it is left either way
                log.debug("destroying the process group failed", exc_info=True)


@contextlib.contextmanager
def checked(what: str):
    """Run collectives, turning their failure into FabricError naming what was being done."""
    try:
        yield
    except RuntimeError as exc:
        raise FabricError(f"{what}: {exc}") from exc
