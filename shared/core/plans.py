"""Instance plans: which executors serve one model copy together, and where each decoder layer runs.

One shape everywhere (a `--plan` file, GET /v1/cluster's `instances`, the planner's output):
`{"instances": [{"id", "leader", "members", "tp", "layers": [{"placement": [...], "bits": 16}, ...]}]}`.
In a TP instance (tp > 1) every layer is sharded over all members; in a TP1 instance a layer's placement
names the one member that computes it, or several replicas that split the batch rows between them. A TP1
member may compute nothing at first: a spare that CoCoServe's operations (`reshaped`) give layers later.
Pure: the executors, up and the tests check plans here, before any process group or model exists.
"""

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from shared.messages import EvictArgs, ExecutorState, InstancePlan, LayerPlan, MigrateArgs, ReplicateArgs

FULL_BITS = 16
# Every layer stores its FFN in this many pieces (the executor's decoder.layer_layout), so that a merge or a
# split of tensor parallelism cuts it in place: a TP degree must divide it.
FFN_PIECES = 4
# What a world's instances are named before their number. The monitor keys instances by id, so several worlds
# sharing one bus (instance groups, docs/deployment.md) each need their own.
INSTANCE_PREFIX = "i"


class PlanError(ValueError):
    """A plan that cannot be served; the message names the field (`instances[1].layers[3].placement`)."""


def alone_id(executor: str) -> str:
    return f"i-{executor}"


def alone(executor: str, num_layers: int, bits: int = FULL_BITS) -> InstancePlan:
    """The TP1 instance of an executor outside any world (or left alone by its world's failure)."""
    return InstancePlan(id=alone_id(executor), leader=executor, members=[executor],
                        layers=[LayerPlan(placement=[executor], bits=bits) for _ in range(num_layers)])


def tp_plans(executors: list[str], tp: int, num_layers: int, bits: int = FULL_BITS,
             prefix: str = INSTANCE_PREFIX) -> list[InstancePlan]:
    """`--tp K` (K = 1: `--executors N` alone): consecutive executors form N/K instances of TP degree K,
    every layer at `bits` (`--static-bits`), named `prefix`0, `prefix`1, ..."""
    if tp < 1 or len(executors) % tp:
        raise PlanError(f"--tp {tp} must divide the {len(executors)} executors into equal instances")
    if FFN_PIECES % tp:
        raise PlanError(f"--tp {tp} must divide the FFN's {FFN_PIECES} pieces (TP 1, 2 or 4)")
    plans = []
    for i in range(0, len(executors), tp):
        members = executors[i:i + tp]
        plans.append(InstancePlan(id=f"{prefix}{i // tp}", leader=members[0], members=members, tp=tp,
                                  layers=[LayerPlan(placement=list(members), bits=bits) for _ in range(num_layers)]))
    return plans


def instance_plans(executors: list[str], num_layers: int, tp: int | None = None, plan_file: str | Path | None = None,
                   bits: int = FULL_BITS, prefix: str = INSTANCE_PREFIX) -> list[InstancePlan]:
    """The plans a world of `executors` serves: a plan file's, else `--tp` (1 by default) at `bits`; instances
    the plan leaves unnamed are named `prefix` and their number."""
    if plan_file:
        return read_plan_file(plan_file, executors, num_layers, prefix)
    return tp_plans(executors, tp or 1, num_layers, bits, prefix)


def read_plan_file(path: str | Path, executors: list[str], num_layers: int | None,
                   prefix: str = INSTANCE_PREFIX) -> list[InstancePlan]:
    """The plans of a JSON file, `id` and `leader` filled in where left out, checked against the world
    (and against the model's depth, unless `num_layers` is None: `up` checks before any model is read)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read the plan file {path}: {exc}") from exc
    return parse_plans(data, executors, num_layers, prefix)


def parse_plans(data: object, executors: list[str], num_layers: int | None,
                prefix: str = INSTANCE_PREFIX) -> list[InstancePlan]:
    if not isinstance(data, dict) or not isinstance(data.get("instances"), list) or not data["instances"]:
        raise PlanError('instances: expected {"instances": [an instance plan, ...]}')
    plans = []
    for i, raw in enumerate(data["instances"]):
        where = f"instances[{i}]"
        if not isinstance(raw, dict):
            raise PlanError(f"{where}: expected an object")
        members = raw.get("members")
        if not isinstance(members, list) or not members:
            raise PlanError(f"{where}.members: expected a list of executor ids")
        # `replicas` is derived (GET /v1/cluster shows it): a plan written from a running cluster drops it here.
        filled = {"id": f"{prefix}{i}", "leader": members[0], **{k: v for k, v in raw.items() if k != "replicas"}}
        try:
            plans.append(InstancePlan.model_validate(filled))
        except ValidationError as exc:
            err = exc.errors()[0]
            field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
            raise PlanError(f"{where}{field}: {err['msg']}") from None
    check_plans(plans, executors, num_layers)
    return plans


def check_plans(plans: list[InstancePlan], executors: list[str], num_layers: int | None) -> None:
    """Raise PlanError unless every executor serves in exactly one instance that can run as written."""
    seen: dict[str, str] = {}
    ids: set[str] = set()
    for i, plan in enumerate(plans):
        where = f"instances[{i}]"
        if plan.id in ids:
            raise PlanError(f"{where}.id: {plan.id!r} names two instances")
        ids.add(plan.id)
        if len(set(plan.members)) != len(plan.members):
            raise PlanError(f"{where}.members: an executor is named twice")
        for m in plan.members:
            if m not in executors:
                raise PlanError(f"{where}.members: {m!r} is not an executor (the executors are {executors})")
            if m in seen:
                raise PlanError(f"{where}.members: {m!r} is already a member of instance {seen[m]!r}")
            seen[m] = plan.id
        if plan.leader not in plan.members:
            raise PlanError(f"{where}.leader: {plan.leader!r} is not one of its members")
        if plan.tp not in (1, len(plan.members)):
            raise PlanError(f"{where}.tp: {plan.tp} must be 1 or the number of members ({len(plan.members)})")
        if FFN_PIECES % plan.tp:
            raise PlanError(f"{where}.tp: {plan.tp} must divide the FFN's {FFN_PIECES} pieces (TP 1, 2 or 4)")
        if num_layers is not None and len(plan.layers) != num_layers:
            raise PlanError(f"{where}.layers: the model has {num_layers} decoder layers, the plan lists "
                            f"{len(plan.layers)}")
        for j, layer in enumerate(plan.layers):
            _check_layer(f"{where}.layers[{j}].placement", plan, layer)
    missing = [e for e in executors if e not in seen]
    if missing:
        raise PlanError(f"instances: executor {missing[0]!r} is in no instance")


def _check_layer(where: str, plan: InstancePlan, layer: LayerPlan) -> None:
    if len(set(layer.placement)) != len(layer.placement):
        raise PlanError(f"{where}: an executor is named twice")
    if any(m not in plan.members for m in layer.placement):
        outsider = next(m for m in layer.placement if m not in plan.members)
        raise PlanError(f"{where}: {outsider!r} is not a member of the instance")
    if plan.tp > 1 and sorted(layer.placement) != sorted(plan.members):
        raise PlanError(f"{where}: a TP{plan.tp} instance shards every layer over all its members")


class OperationRefused(PlanError):
    """An operation that the instance's plan does not allow (a layer not there, a member not in it)."""


def reshaped(plan: InstancePlan, op: ReplicateArgs | MigrateArgs | EvictArgs) -> InstancePlan:
    """The plan after a CoCoServe operation on layers [a, b]; OperationRefused says why one cannot apply.
    A migration to a member that already has a replica of a layer leaves that layer on it alone."""
    if op.instance != plan.id:
        raise OperationRefused(f"this executor leads instance {plan.id!r}, not {op.instance!r}")
    if plan.tp > 1:
        raise OperationRefused(f"instance {plan.id} is TP{plan.tp}: its layers are sharded over every member, "
                               f"so they cannot be replicated, migrated or evicted one by one")
    if plan.slots == "placed" and not isinstance(op, EvictArgs):
        raise OperationRefused(f"instance {plan.id} was planned with slots for its placed layers only (a SplitQuant "
                               f"plan): a member has no room kept for another layer, so layers cannot be replicated "
                               f"or migrated")
    if op.layers[1] >= len(plan.layers):
        raise OperationRefused(f"layers [{op.layers[0]}, {op.layers[1]}]: the model has {len(plan.layers)} "
                               f"decoder layers (0 to {len(plan.layers) - 1})")
    for who in (getattr(op, "to", None), getattr(op, "source", None)):
        if who is not None and who not in plan.members:
            raise OperationRefused(f"{who!r} is not a member of instance {plan.id} (members: {plan.members})")
    layers = [layer.model_copy(deep=True) for layer in plan.layers]
    for i in op.span:
        placement = layers[i].placement
        if isinstance(op, ReplicateArgs):
            if op.to in placement:
                raise OperationRefused(f"layer {i} is already on {op.to}")
            placement.append(op.to)
        elif isinstance(op, MigrateArgs):
            if op.source == op.to:
                raise OperationRefused(f"migrate needs two different members, got {op.source!r} twice")
            if op.source not in placement:
                raise OperationRefused(f"layer {i} is not on {op.source} (it is on {placement})")
            placement.remove(op.source)
            if op.to not in placement:
                placement.append(op.to)
        else:
            if op.source not in placement:
                raise OperationRefused(f"layer {i} has no replica on {op.source} (it is on {placement})")
            if len(placement) == 1:
                raise OperationRefused(f"layer {i} is only on {op.source}: evicting its last copy would lose it; "
                                       f"migrate it instead")
            placement.remove(op.source)
    return plan.model_copy(update={"layers": layers})


def with_bits(plan: InstancePlan, layers: int | list[int], bits: int) -> InstancePlan:
    """The plan with `layers` at `bits` on every member that computes them (MorphServe's swap, taken by an
    instance as a whole). A count takes layers front to back: quantizing, the first wider than `bits`;
    restoring (FULL_BITS), the last quantized first. OperationRefused says why it cannot apply."""
    current = [layer.bits for layer in plan.layers]
    if isinstance(layers, int):
        candidates = ([i for i in reversed(range(len(current))) if current[i] != FULL_BITS] if bits == FULL_BITS
                      else [i for i in range(len(current)) if current[i] > bits])
        if not 1 <= layers <= len(candidates):
            raise OperationRefused(f"layers must be between 1 and {len(candidates)} here, got {layers}")
        layers = candidates[:layers]
    bad = [i for i in layers if not 0 <= i < len(current)]
    if bad or len(set(layers)) != len(layers):
        raise OperationRefused(f"layer indices must be distinct and in [0, {len(current)}): {layers}")
    new = [layer.model_copy(update={"bits": bits}) if i in layers else layer for i, layer in enumerate(plan.layers)]
    return plan.model_copy(update={"layers": new})


def leads(es: ExecutorState) -> bool:
    """Whether it leads its instance: the one executor of the instance that takes requests and commands
    (an executor outside any world leads itself)."""
    plan = es.telemetry.plan
    return plan is None or plan.leader == es.executor


def plan_of(plans: list[InstancePlan], executor: str) -> InstancePlan:
    return next(p for p in plans if executor in p.members)


def start_plan(plans: list[InstancePlan], executor: str, serving: Collection[str], num_layers: int,
               bits: int = FULL_BITS) -> InstancePlan:
    """The instance `executor` starts in: its planned one, unless another of its members already serves. That
    is a restart: the members went on alone when it died, so it too serves alone, a peer they may merge with."""
    plan = plan_of(plans, executor)
    if any(m != executor and m in serving for m in plan.members):
        return alone(executor, num_layers, bits)
    return plan


@dataclass(frozen=True)
class Segment:
    """A run of consecutive layers computed by the same executors."""
    start: int
    stop: int
    placement: tuple[str, ...]


def segments(plan: InstancePlan) -> list[Segment]:
    out: list[Segment] = []
    for index, layer in enumerate(plan.layers):
        placement = tuple(layer.placement)
        if out and out[-1].placement == placement and out[-1].stop == index:
            out[-1] = Segment(out[-1].start, index + 1, placement)
        else:
            out.append(Segment(index, index + 1, placement))
    return out


def layers_on(plan: InstancePlan, executor: str) -> list[int]:
    """The decoder layers `executor` holds weights (and computes KV) for."""
    return [i for i, layer in enumerate(plan.layers) if executor in layer.placement]


def quantized_layers(plan: InstancePlan, held: Collection[int] | None = None) -> dict[int, list[int]]:
    """Bits -> the decoder layers (of `held`, every one by default) the plan does not keep at full precision:
    what to quantize before serving."""
    out: dict[int, list[int]] = {}
    for index, layer in enumerate(plan.layers):
        if layer.bits != FULL_BITS and (held is None or index in held):
            out.setdefault(layer.bits, []).append(index)
    return out


def plans_json(plans: list[InstancePlan]) -> dict:
    return {"instances": [p.model_dump() for p in plans]}
