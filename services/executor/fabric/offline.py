"""One instance across several local processes without the bus: `bench-engine --executors N` and tests.

This process is rank 0 and leads; ranks 1..N-1 are spawned processes that follow it until it leaves the
world. The instance runs exactly as under `morphling up` (the same world, plans, members and step
protocol), minus NATS: the leader is an LLMEngine driven directly.
"""

import logging
import multiprocessing
from contextlib import contextmanager
from dataclasses import dataclass

from services.executor.engine.engine import DTYPES, LLMEngine, model_len
from services.executor.engine.model.loader import load_checkpoint
from services.executor.fabric.leader import seated
from services.executor.fabric.member import InstanceMember, Seat
from services.executor.fabric.world import FabricError, World, WorldSettings
from shared.config import EngineConfig
from shared.core.plans import instance_plans, plan_of
from shared.messages import InstancePlan
from shared.net import free_port

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    executors: int
    tp: int = 1
    plan_file: str | None = None

    def plans(self, names: list[str], num_layers: int) -> list[InstancePlan]:
        return instance_plans(names, num_layers, self.tp, self.plan_file)


def _join(config: EngineConfig, shape: Shape, url: str, rank: int, timeout_s: float):
    settings = WorldSettings(url, rank, shape.executors, timeout_s)
    world = World.join(settings, f"exec{rank}", config.device)
    checkpoint = load_checkpoint(config.model)
    plans = shape.plans(world.names, checkpoint.config.num_layers)
    return world, checkpoint, plan_of(plans, f"exec{rank}")


def _follow(config: EngineConfig, shape: Shape, url: str, rank: int, timeout_s: float, threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    world, checkpoint, plan = _join(config, shape, url, rank, timeout_s)
    if plan.leader == f"exec{rank}":  # another instance's leader: nobody drives it here
        world.close()
        return
    member = InstanceMember(Seat(world, plan, f"exec{rank}"), config, checkpoint, DTYPES[config.resolved_dtype()],
                            model_len(config, checkpoint.config), progress=False)
    try:
        while True:
            member.follow_one()
    except FabricError:  # the leader left: the run is over
        world.close()


@contextmanager
def instance_engine(config: EngineConfig, shape: Shape, timeout_s: float = 60.0, threads: int | None = None):
    """An LLMEngine leading an instance of `shape` whose followers are spawned processes (exec0 leads)."""
    if shape.executors == 1:
        yield LLMEngine(config, progress=False)
        return
    url = f"tcp://127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_follow, args=(config, shape, url, rank, timeout_s, threads), daemon=True)
             for rank in range(1, shape.executors)]
    for p in procs:
        p.start()
    world, engine = None, None
    try:
        if threads:
            import torch

            torch.set_num_threads(threads)
        world, _, plan = _join(config, shape, url, 0, timeout_s)
        if plan.leader != "exec0" or len(plan.members) == 1:
            raise ValueError(f"exec0 must lead an instance of several executors; its plan is {plan}")
        engine = LLMEngine(config, progress=False, place=seated(Seat(world, plan, "exec0"), config))
        yield engine
    finally:
        if engine is not None and not engine.member.broken:
            engine.member.leave()
        if world is not None:
            world.close()
        for p in procs:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.kill()
