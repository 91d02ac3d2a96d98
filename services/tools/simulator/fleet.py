"""The fleet a simulation runs: which executors, on which devices, serving which model, with which engine limits.

A fleet file is JSON; its fields (the model, the executors by device and count, the engine's limits, the
measured swap, operation and all-reduce lines) are written out in docs/simulator.md ("The fleet file"). Paths in
it are relative to the file.
"""

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from shared.config import EngineConfig
from shared.core.planner.devices import ClusterError, Device
from shared.core.planner.devices import device as read_device
from shared.core.planner.latency import FittedLatency, LatencyError, load_profile
from shared.core.planner.roofline import RooflineLatency
from shared.core.planner.shapes import SHAPES, ModelShape
from shared.core.plans import FULL_BITS, PlanError, tp_plans
from shared.core.speedup import Line, SpeedupProfile, SpeedupProfileError
from shared.messages import InstancePlan

DEFAULT_MODEL = "smollm2-135m"
ENGINE_LIMITS = ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "block_size", "max_model_len")
OPERATIONS = ("replicate", "migrate", "evict", "tp_merge", "tp_split")


class FleetError(ValueError):
    """A fleet file that cannot be simulated; the message names the entry and what is wrong."""


@dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    max_waiting: int = EngineConfig.max_waiting
    block_size: int = EngineConfig.block_size
    max_model_len: int = 0  # 0: the model's own


@dataclass(frozen=True)
class ExecutorSpec:
    id: str
    device: Device
    shape: ModelShape  # the model it serves
    memory: int  # bytes of the arena
    dtype_bytes: int
    latency: FittedLatency | RooflineLatency
    overhead: Line  # seconds of a step outside the decoder layers, over the tokens it computes
    hop: Line = Line(0.0, 0.0)  # seconds to move B bytes to another executor, over B
    all_reduce: Line | None = None  # seconds to sum B bytes across a TP instance's members; None: a hop's
    swap_s: dict[str, float] = field(default_factory=dict)  # measured "quantize"/"restore" seconds per layer
    operation_s: dict[str, Line] = field(default_factory=dict)  # measured seconds of an operation, over its layers
    tp: int = 1  # the TP degree of the instance it starts in (1: it serves alone)
    reports_latency: bool = False  # reports its latency profile's layer seconds (`layer_seconds`)


@dataclass(frozen=True)
class Fleet:
    engine: EngineLimits
    executors: list[ExecutorSpec]
    world_size: int = 0  # executors per world, in order; 0: all in one
    traffic: dict[str, float] = field(default_factory=dict)  # model name -> its weight among the trace's requests

    def worlds(self) -> list[list[str]]:
        """The executors' names, world by world."""
        names = [s.id for s in self.executors]
        size = self.world_size or len(names)
        return [names[i:i + size] for i in range(0, len(names), size)]

    @functools.cached_property
    def ranks(self) -> dict[str, int]:
        """Each executor's place in the file's order: the order of a sample's executors and of events at one
        instant, whichever processes simulated them (cluster.py, shards.py)."""
        return {s.id: i for i, s in enumerate(self.executors)}

    @property
    def models(self) -> dict[str, ModelShape]:
        """The models the fleet serves, by name, in file order."""
        return {s.shape.name: s.shape for s in self.executors}

    @property
    def tp(self) -> int:
        """The largest TP degree its executors start at (1: all serve alone)."""
        return max(s.tp for s in self.executors)

    def start_plans(self, bits: int) -> list[InstancePlan]:
        """The TP instances the executors start in (none where each serves alone): `up --tp`'s, world by world,
        numbered over the fleet."""
        by_id = {s.id: s for s in self.executors}
        plans = []
        for world in self.worlds():
            first = by_id[world[0]]
            if first.tp > 1:
                plans += [plan.model_copy(update={"id": f"i{len(plans) + k}"})
                          for k, plan in enumerate(tp_plans(world, first.tp, first.shape.num_layers, bits))]
        return plans

    def max_model_len(self, shape: ModelShape) -> int:
        return self.engine.max_model_len or shape.max_position_embeddings


def lm_head_overhead(device: Device, shape: ModelShape, dtype_bytes: int) -> Line:
    """The rest of a step on a device without a measured profile: the LM head's weights read once, then its
    FLOPs per sampled token (roofline, as planner/roofline.py models a layer)."""
    weights = shape.vocab_size * shape.hidden_size * dtype_bytes
    per_token = 2 * shape.vocab_size * shape.hidden_size / (device.fp16_flops * 0.6)
    return Line(weights / (device.bandwidth * 0.8), per_token)


def _read_json(path: Path, what: str) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FleetError(f"cannot read the {what} {path}: {exc}") from exc


def _shape(name: object, where: str) -> ModelShape:
    shape = SHAPES.get(DEFAULT_MODEL if name == "default" else name) if isinstance(name, str) else None
    if shape is None:
        raise FleetError(f"{where}: unknown model {name!r}; the shapes are default, {', '.join(SHAPES)}")
    return shape


def _tp(given: object, where: str) -> int:
    if not isinstance(given, int) or isinstance(given, bool) or given < 1:
        raise FleetError(f"{where}: tp must be a positive integer (the TP degree instances start at), got {given!r}")
    return given


def _executor_specs(entry: object, where: str, model: str, tp: int, start: int, base: Path) -> list[ExecutorSpec]:
    """The executors of one entry; `model` and `tp` are the fleet's, unless the entry names its own."""
    if not isinstance(entry, dict):
        raise FleetError(f"{where}: expected {{\"device\": ..., \"count\": ...}}, got {entry!r}")
    unknown = set(entry) - {"device", "count", "memory", "latency_profile", "speedup_profile", "dtype_bytes",
                            "model", "tp", "reports_latency"}
    if unknown:
        raise FleetError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    shape, tp = _shape(entry.get("model", model), where), _tp(entry.get("tp", tp), where)
    given = {"memory": entry["memory"]} if "memory" in entry else {}
    try:  # the planner's devices table, and its reading of a device and its memory
        device = read_device({"name": entry.get("device"), **given}, where)
    except ClusterError as exc:
        raise FleetError(str(exc)) from exc
    count = entry.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise FleetError(f"{where}: count must be a positive integer, got {count!r}")
    dtype_bytes = entry.get("dtype_bytes", 4 if device.name == "cpu" else 2)
    if dtype_bytes not in (2, 4):
        raise FleetError(f"{where}: dtype_bytes must be 2 or 4, got {dtype_bytes!r}")
    # A memory given is the arena; the table's is the device's, which also holds the embeddings and LM head.
    memory = device.memory if given else device.memory - shape.embedding_params * dtype_bytes
    if "latency_profile" in entry:
        try:
            latency = load_profile(base / entry["latency_profile"])
        except (OSError, LatencyError, ValueError, KeyError) as exc:
            raise FleetError(f"{where}: latency_profile: {exc}") from exc
        try:
            latency.check_layers(shape, f"{where}: latency_profile")
        except LatencyError as exc:
            raise FleetError(f"{exc} ({shape.name}'s)") from exc
    elif device.modelled:
        latency = RooflineLatency(device, shape, dtype_bytes)
    else:
        raise FleetError(f"{where}: {device.name} has no datasheet figures to model: give a latency_profile "
                         f"(`morphling profile --latency` measured there)")
    reports_latency = entry.get("reports_latency", False)
    if not isinstance(reports_latency, bool) or (reports_latency and "latency_profile" not in entry):
        raise FleetError(f"{where}: reports_latency must be true or false, and true only with a latency_profile "
                         f"(what the executors report), got {reports_latency!r}")
    if "speedup_profile" in entry:
        path = base / entry["speedup_profile"]
        try:
            profile = SpeedupProfile.from_dict(_read_json(path, "speed-up profile"), str(path))
        except SpeedupProfileError as exc:
            raise FleetError(f"{where}: {exc}") from exc
        overhead, hop, reduce = profile.step_overhead, profile.hop, profile.all_reduce
    elif device.modelled:
        overhead, hop, reduce = lm_head_overhead(device, shape, dtype_bytes), Line(0.0, 1.0 / device.link), None
    else:
        raise FleetError(f"{where}: {device.name} needs a speedup_profile for the rest of a step")
    return [ExecutorSpec(f"exec{start + i}", device, shape, memory, dtype_bytes, latency, overhead, hop,
                         all_reduce=reduce, tp=tp, reports_latency=reports_latency) for i in range(count)]


def _operation_lines(given: object, where: str) -> dict[str, Line]:
    if not isinstance(given, dict) or set(given) - set(OPERATIONS):
        raise FleetError(f"{where}: operation_s takes lines for {', '.join(OPERATIONS)}, got {given!r}")
    return {name: _line(line, "per_layer_s", f"{where}: operation_s.{name}") for name, line in given.items()}


def _line(given: object, slope: str, where: str) -> Line:
    numbers = [given.get(k) for k in ("intercept_s", slope)] if isinstance(given, dict) else [None]
    if set(given if isinstance(given, dict) else ()) != {"intercept_s", slope} or not all(
            isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 0 for n in numbers):
        raise FleetError(f"{where} must be {{\"intercept_s\": s, \"{slope}\": s}} with seconds >= 0, got {given!r}")
    return Line(float(numbers[0]), float(numbers[1]))


def _traffic(given: object, models: dict[str, ModelShape], where: str) -> dict[str, float]:
    """Each model's weight among the trace's requests: the file's, by the names its models go by; one model takes
    them all."""
    if given is None:
        if len(models) > 1:
            raise FleetError(f"{where}: the fleet serves {' and '.join(models)}: give traffic, each model's share of "
                             f"the trace's requests ({{\"{next(iter(models))}\": 1, ...}})")
        return {name: 1.0 for name in models}
    if not isinstance(given, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in given.values()):
        raise FleetError(f"{where}: traffic takes a positive weight per model, got {given!r}")
    weights = {_shape(name, f"{where}: traffic").name: float(w) for name, w in given.items()}
    if set(weights) != set(models) or len(weights) != len(given):
        raise FleetError(f"{where}: traffic names {', '.join(sorted(weights))}; the fleet serves "
                         f"{', '.join(models)}: one weight each")
    return {name: weights[name] for name in models}


def _check_worlds(fleet: Fleet, where: str) -> None:
    """A world serves one model at one TP degree, as `up` starts a host's executors."""
    by_id = {s.id: s for s in fleet.executors}
    for world in fleet.worlds():
        kinds = sorted({(by_id[name].shape.name, by_id[name].tp) for name in world})
        if len(kinds) > 1:
            raise FleetError(f"{where}: the world of {world[0]}-{world[-1]} holds executors of "
                             + " and ".join(f"{model} at TP{tp}" for model, tp in kinds)
                             + ": a world serves one model at one TP degree (see world_size)")


def read_fleet(path: str | Path) -> Fleet:
    path = Path(path)
    data = _read_json(path, "fleet file")
    if not isinstance(data, dict) or not isinstance(data.get("executors"), list) or not data["executors"]:
        raise FleetError(f"{path}: expected {{\"model\": ..., \"executors\": [{{\"device\": ..., \"count\": ...}}]}}")
    unknown = set(data) - {"model", "executors", "engine", "swap_s_per_layer", "operation_s", "all_reduce_s",
                           "world_size", "tp", "traffic"}
    if unknown:
        raise FleetError(f"{path}: unknown field {sorted(unknown)[0]!r}")
    model = data.get("model", "default")
    _shape(model, str(path))
    engine = data.get("engine", {})
    if not isinstance(engine, dict) or set(engine) - set(ENGINE_LIMITS) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in engine.values()):
        raise FleetError(f"{path}: engine takes non-negative integers for {', '.join(ENGINE_LIMITS)}, got {engine!r}")
    limits = EngineLimits(**engine)
    swap = data.get("swap_s_per_layer", {})
    if not isinstance(swap, dict) or set(swap) - {"quantize", "restore"} or not all(
            isinstance(v, (int, float)) and v >= 0 for v in swap.values()):
        raise FleetError(f"{path}: swap_s_per_layer takes quantize and restore seconds, got {swap!r}")
    operations = _operation_lines(data.get("operation_s", {}), str(path))
    reduce = _line(data["all_reduce_s"], "per_byte_s", f"{path}: all_reduce_s") if "all_reduce_s" in data else None
    world_size = data.get("world_size", 0)
    if "world_size" in data and (not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1):
        raise FleetError(f"{path}: world_size must be a positive integer (executors per world), got {world_size!r}")
    tp = _tp(data.get("tp", 1), str(path))
    specs: list[ExecutorSpec] = []
    for i, entry in enumerate(data["executors"]):
        specs += _executor_specs(entry, f"{path}: executors[{i}]", model, tp, len(specs), path.parent)
    unmodelled = sorted({s.device.name for s in specs if s.device.bandwidth <= 0})
    if unmodelled and set(swap) != {"quantize", "restore"}:
        raise FleetError(f"{path}: {', '.join(unmodelled)} has no bandwidth to model a swap with: give "
                         f"swap_s_per_layer (quantize and restore, as measured there)")
    specs = [replace(s, swap_s=dict(swap), operation_s=operations, all_reduce=reduce or s.all_reduce) for s in specs]
    fleet = Fleet(limits, specs, world_size)
    fleet = replace(fleet, traffic=_traffic(data.get("traffic"), fleet.models, str(path)))
    _check_worlds(fleet, str(path))
    try:
        fleet.start_plans(FULL_BITS)
    except PlanError as exc:
        raise FleetError(f"{path}: tp (as `up`'s): {exc}") from exc
    return fleet
