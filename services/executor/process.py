"""The executor process: flags, meeting its peers, and what this executor is in its instance.

With `--world-size` above 1 it hosts a rendezvous and meets the world's executors over the bus (`join_fabric`,
peers.py); `start_role` reads the instance plans (`--tp`, `--plan`, else every executor alone) and builds this
executor's part: the service of an engine that holds the whole model or leads an instance (service.py), or a
follower (follower.py). A restarted executor whose plan's members already serve serves alone (plans.start_plan).
When the instance breaks, the process rebuilds itself as a TP1 instance of its own, still a peer that merges.

`--static-bits 8|4` quantizes every decoder layer once, after the engine loads and before the
executor serves: the static INT8/INT4 baselines that morphing is measured against. It goes through
the same swapper as the controller's commands, so the freed slot tails become KV pages exactly as
they do under morphing, and the baselines differ from morphing only in when the bits change.
"""

import argparse
import asyncio
import logging
import os
from dataclasses import replace

from services.executor.service import ExecutorService
from shared.bus import Bus, BusError, stop_on_signals
from shared.config import EngineConfig, ExecutorConfig, parse_size, read_swap_order, seconds
from shared.core.errors import EngineError
from shared.core.plans import (FULL_BITS, INSTANCE_PREFIX, PlanError, alone, instance_plans, quantized_layers,
                                start_plan)
from shared.messages import InstancePlan
from shared.telemetry import setup_tracing

log = logging.getLogger(__name__)


def apply_static_bits(engine, executor_id: str, plan: InstancePlan) -> None:
    """Quantize the decoder layers to the bits `plan` gives them before serving (--static-bits, or a plan
    file); 16 (FULL_BITS) means the dtype as loaded, whatever its width (float32 on CPU)."""
    for bits, layers in quantized_layers(plan).items():
        before = engine.arena.ledger.snapshot()
        report = engine.swapper.set_bits(layers, bits)
        after = engine.arena.ledger.snapshot()
        log.info("executor %s: static INT%d: %d layers quantized in %.1f s, %d KV pages gained (%d -> %d, "
                 "%d more tokens)", executor_id, bits, len(report.layers), report.seconds, report.pages_released,
                 before.pages_kv, after.pages_kv, report.pages_released * engine.config.block_size)


def swap_order(engine, choice: str) -> list[int]:
    """The order count-based quantize commands and the controller take layers in: "auto" is the model's
    LIS profile (shipped for the default model, else cached, else profiled now on WikiText-2), "front"
    is front to back, anything else a `morphling profile` JSON file."""
    from services.executor.engine.morphing.swapper import SwapError
    from services.executor.engine.morphing.importance import MissingCorpusError, swap_order_for

    if choice == "front":
        return list(range(engine.model_config.num_layers))
    if choice != "auto":
        try:
            return list(read_swap_order(choice))
        except ValueError as exc:
            raise SwapError(str(exc)) from exc
    try:
        return swap_order_for(engine)
    except MissingCorpusError as exc:
        log.warning("no layer-importance profile (%s): layers are quantized front to back", exc)
        return list(range(engine.model_config.num_layers))


def _parse_args(argv: list[str]) -> argparse.Namespace:
    d = EngineConfig()
    p = argparse.ArgumentParser(prog="morphling executor", description="serve one model on one device")
    p.add_argument("--nats", default=ExecutorConfig.nats_url, help="NATS URL (default %(default)s)")
    p.add_argument("--id", default=ExecutorConfig.executor_id, help="executor id (default %(default)s)")
    p.add_argument("--model", default=d.model, help="'default', a Hugging Face directory or a .gguf file")
    p.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N (default %(default)s)")
    p.add_argument("--memory-budget", type=parse_size, default=d.memory_budget, help="page arena size, e.g. 1GiB")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-waiting", type=int, default=d.max_waiting)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--static-bits", type=int, default=FULL_BITS, choices=(FULL_BITS, 8, 4),
                   help="bits of every decoder layer, fixed from the start: 8 or 4 are the static "
                        "baselines, 16 is full precision as loaded (default %(default)s)")
    p.add_argument("--swap-order", default="auto", metavar="auto|front|PATH",
                   help="the order layers are quantized in: auto, the model's LIS profile (computed and cached "
                        "at the first start when none ships for it); front, front to back; or a `morphling "
                        "profile` JSON file (default %(default)s)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run every step eagerly instead of replaying captured decode graphs")
    p.add_argument("--lazy-variants", action="store_true",
                   help="build the INT8/INT4 layer variants at the first swap instead of at start (tests)")
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may take to finish at shutdown (default %(default)s)")
    p.add_argument("--bus-outage", type=seconds(), default=ExecutorConfig.bus_outage_s, metavar="SECONDS",
                   help="abort every request in flight once the bus has been gone this long (default %(default)s)")
    p.add_argument("--max-queue-wait", type=seconds(allow_zero=True), default=ExecutorConfig.max_queue_wait_s,
                   metavar="SECONDS",
                   help="refuse a request (queue_full) whose predicted wait in the queue is longer; 0: no bound "
                        "(default %(default)s)")
    p.add_argument("--latency-profile", default="auto", metavar="auto|none|PATH",
                   help="a `morphling profile --latency` JSON measured for this model on this device: telemetry "
                        "then reports a layer's seconds at each width over its recent steps, and the controller "
                        "quantizes for a queue only where fewer bits are faster; auto: the profile shipped for "
                        "this kind of device where it was measured on this model's layers (the default model on "
                        "CPU), else none (default %(default)s)")
    world = p.add_argument_group("instances across executors", "without a world of several executors, this "
                                 "executor serves the whole model alone")
    world.add_argument("--rank", type=int, default=_env_int("MORPHLING_RANK"),
                       help="this executor's place in the world's start-time order (default $MORPHLING_RANK, else 0)")
    world.add_argument("--world-size", type=int, default=_env_int("MORPHLING_WORLD_SIZE"),
                       help="executors the start-time plans are made for; above 1, this executor meets them over "
                            "the bus first (default $MORPHLING_WORLD_SIZE, else 1)")
    world.add_argument("--join", action="store_true", default=os.environ.get("MORPHLING_JOIN") == "1",
                       help="be a peer of the world's executors of this model (they may merge with it) without a "
                            "start-time plan: what an executor added to a running "
                            "deployment does (default: $MORPHLING_JOIN=1)")
    world.add_argument("--advertise-host", default=os.environ.get("MORPHLING_ADVERTISE_HOST") or "127.0.0.1",
                       help="the address peers reach this executor's rendezvous at (default "
                            "$MORPHLING_ADVERTISE_HOST, else %(default)s)")
    world.add_argument("--dist-timeout", type=seconds(), default=30.0, metavar="SECONDS",
                       help="how long any collective waits for a peer before the instance is called broken "
                            "(default %(default)s)")
    shape = world.add_mutually_exclusive_group()
    shape.add_argument("--tp", type=int, default=_env_int("MORPHLING_TP"),
                       help="tensor-parallel degree: consecutive ranks form instances of this many (default "
                            "$MORPHLING_TP, else 1)")
    shape.add_argument("--plan", default=os.environ.get("MORPHLING_PLAN") or None,
                       help="a JSON file of instance plans (default $MORPHLING_PLAN)")
    world.add_argument("--instance-prefix", default=os.environ.get("MORPHLING_INSTANCE_PREFIX") or INSTANCE_PREFIX,
                       help="what the world's instances are named before their number, where the plan names none: "
                            "each world sharing the bus needs its own (default $MORPHLING_INSTANCE_PREFIX, else "
                            "%(default)s)")
    p.add_argument("--threads", type=int, help="torch threads of this executor (default: torch's own choice)")
    return p.parse_args(argv)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def main(argv: list[str]) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("executor")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine_config = replace(EngineConfig(), model=args.model, device=args.device, memory_budget=args.memory_budget,
                            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                            max_waiting=args.max_waiting, block_size=args.block_size,
                            prepare_variants=not args.lazy_variants, cuda_graphs=not args.enforce_eager)
    config = ExecutorConfig(executor_id=args.id, nats_url=args.nats, engine=engine_config,
                            bus_outage_s=args.bus_outage, max_queue_wait_s=args.max_queue_wait,
                            latency_profile=args.latency_profile)
    from services.executor.fabric.world import FabricError

    async def serve() -> int:
        bus, directory = None, None
        try:
            if args.join or (args.world_size or 1) > 1:
                # The peers are met over the bus, so it comes first; the engine loads once they are there.
                bus = await Bus.connect(config.nats_url, f"executor-{config.executor_id}")
                directory = await join_fabric(args, config, bus)
                role = await asyncio.to_thread(start_role, args, config, directory.world,
                                               set(directory.serving_peers))
            else:
                role = start_role(args, config)
                bus = await Bus.connect(config.nats_url, f"executor-{config.executor_id}")
        except (EngineError, PlanError, ValueError) as exc:  # FabricError is an EngineError
            log.error("executor %s cannot start: %s", config.executor_id, exc)
            if bus is not None:
                await bus.close()
            return 1
        world = directory.world if directory is not None else None
        stopping = stop_on_signals()
        await role.start(bus)
        if directory is not None:
            directory.serving = True
            await directory.announce()
        while True:
            waits = [asyncio.create_task(stopping.wait()), asyncio.create_task(role.broken.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in waits:
                task.cancel()
            if stopping.is_set():
                break
            # A member is gone: its instance's groups are closed; serve the whole model alone, still a peer.
            log.warning("executor %s: its instance is broken; serving alone as a TP1 instance", config.executor_id)
            await role.stop(0.0)
            role = None
            try:
                role = await asyncio.to_thread(alone_in_world, args, config, world)
            except EngineError as exc:
                log.error("executor %s cannot serve alone: %s", config.executor_id, exc)
                raise FabricError(str(exc)) from exc
            await role.start(bus)
        log.info("executor %s: stopping; no new requests", config.executor_id)
        await role.stop(args.drain_timeout)
        if directory is not None:
            await directory.stop()
            world.close()
        await bus.close()
        return 0

    try:
        return asyncio.run(serve())
    except (BusError, FabricError) as exc:
        log.error("executor %s: %s", config.executor_id, exc)
        return 1


async def join_fabric(args: argparse.Namespace, config: ExecutorConfig, bus: Bus):
    """Host this executor's rendezvous, announce it, and wait for the start-time world's ranks to announce
    theirs (a restarted executor finds them there already)."""
    from services.executor.fabric.world import FabricError, World
    from services.executor.peers import PeerDirectory
    from shared.config import served_model_name

    size = args.world_size or 1
    if size > 1 and not 0 <= (args.rank or 0) < size:
        raise ValueError(f"--rank {args.rank} is outside a world of {size}")
    world = World.host(config.executor_id, args.rank or 0, args.advertise_host, config.engine.device,
                       args.dist_timeout)
    directory = PeerDirectory(world, args.instance_prefix, served_model_name(config.engine.model))
    await directory.start(bus)
    log.info("executor %s: rendezvous at %s; waiting for the %d executors of the world", config.executor_id,
             world.me.rendezvous, size)
    try:
        await directory.wait_for_ranks(size, args.dist_timeout)
    except FabricError:
        await directory.stop()
        world.close()
        raise
    return directory


def start_role(args: argparse.Namespace, config: ExecutorConfig, world=None, serving: set[str] = frozenset()):
    """Find our instance in `world` (when there is one) and build what we are in it: the service of an engine
    (alone, or leading an instance) or a follower. `serving`: the peers that already serve (we restarted)."""
    from services.executor.engine.engine import LLMEngine, model_len
    from services.executor.engine.model.loader import load_checkpoint

    if world is None:
        if args.tp not in (None, 1) or args.plan:
            raise PlanError("--tp above 1 and --plan need a world of executors: --world-size and --rank")
        return solo_role(args, config)
    if (args.world_size or 1) <= 1:  # a peer that joined (--join): no start-time plan waits for it
        if args.tp not in (None, 1) or args.plan:
            raise PlanError("--tp above 1 and --plan are start-time plans of a world: they need --world-size")
        return alone_in_world(args, config, world)
    checkpoint = load_checkpoint(config.engine.model)
    num_layers = checkpoint.config.num_layers
    names = world.names[:args.world_size]
    plans = instance_plans(names, num_layers, args.tp, args.plan, args.static_bits, args.instance_prefix)
    plan = start_plan(plans, config.executor_id, serving, num_layers, args.static_bits)
    if len(plan.members) == 1:
        return alone_in_world(args, config, world, plan)
    from services.executor.fabric.member import InstanceMember, Seat

    seat = Seat(world, plan, config.executor_id)
    if plan.leader == config.executor_id:
        from services.executor.fabric.leader import seated

        return ExecutorService(config, LLMEngine(config.engine, progress=False, place=seated(seat, config.engine)),
                               plan)
    from services.executor.engine.engine import DTYPES
    from services.executor.follower import FollowerService

    max_model_len = model_len(config.engine, checkpoint.config)
    member = InstanceMember(seat, config.engine, checkpoint, DTYPES[config.engine.resolved_dtype()], max_model_len,
                            progress=False)
    return FollowerService(config, member, max_model_len)


def alone_in_world(args: argparse.Namespace, config: ExecutorConfig, world, plan: InstancePlan | None = None
                   ) -> "ExecutorService":
    """An executor that holds the whole model as a peer of `world`: alone, it needs to hold only one block of
    its own, as a TP merge holds the longest sequence."""
    config = replace(config, engine=replace(config.engine, min_kv_tokens=config.engine.block_size))
    service = solo_role(args, config, plan, world)
    cluster_check(service.engine, max(args.world_size or 1, len(world.names)))
    return service


def solo_role(args: argparse.Namespace, config: ExecutorConfig, plan: InstancePlan | None = None,
              world=None) -> "ExecutorService":
    """An executor that holds the whole model: `plan` is its TP1 instance in `world`, else one of its own."""
    from services.executor.engine.engine import LLMEngine

    engine = LLMEngine(config.engine, progress=False)
    plan = plan or alone(config.executor_id, engine.model_config.num_layers, args.static_bits)
    service = ExecutorService(config, engine, plan, world)
    # Before the worker thread starts, so the engine is still ours alone; the profile reads the
    # full-precision weights, so it comes before any static quantization.
    engine.swapper.swap_order = swap_order(engine, args.swap_order)
    log.info("executor %s: swap order %s", config.executor_id, engine.swapper.swap_order)
    apply_static_bits(engine, config.executor_id, plan)
    return service


def cluster_check(engine, world_size: int) -> None:
    """An executor alone in a world starts when the widest TP instance the world can merge it into holds one
    sequence of max_model_len (each peer taken to hold what it does, as `morphling up` starts them alike);
    MemoryBudgetError otherwise."""
    from shared.core.errors import MemoryBudgetError
    from services.executor.fabric.merge import kv_units
    from shared.core.tp_scheduler import MAX_TP, Member, capacity

    size, kv_heads = engine.config.block_size, engine.model_config.num_kv_heads
    need = -(-(engine.max_model_len - 1) // size)
    degrees = [k for k in (1, 2, MAX_TP) if k <= world_size]
    units = kv_units(engine.model, engine.arena, degrees)
    holds = {k: capacity((Member("peer", units),) * k, kv_heads) for k in degrees}
    if max(holds.values()) < need:
        held = ", ".join(f"{blocks} at TP{k}" for k, blocks in holds.items())
        raise MemoryBudgetError(f"one sequence of {engine.max_model_len} tokens needs {need} KV blocks, but an "
                                f"instance of this world's executors holds at most {held}: raise --memory-budget "
                                f"or lower --max-model-len")
    log.info("KV blocks an instance holds, by TP degree: %s (one sequence of max_model_len: %d)", holds, need)
