"""The admin side of morphing: `GET /v1/cluster` and `POST /v1/cluster/morph`.

An operator (or a benchmark) morphs the cluster by hand through the gateway instead of the bus, so that
one authenticated HTTP endpoint is enough to drive it; the commands go out through the same CommandSender
as the controller's (shared/commands.py), so they get the same sequence numbers, retries and audit events.
The gateway answers only once the executors applied them, and waits a bounded moment for the monitor's
view to catch up so that the `executors` and `instances` it returns already show the change (the monitor
lags the executors by a few hundred milliseconds).

Two kinds of body share the endpoint, told apart by `action`:
- `{"executor", "action": "quantize"|"restore", "layers": count, "bits"}` swaps layer bits (MorphServe) on one
  executor or on every live one (`"*"`);
- `{"action": "replicate"|"migrate"|"evict", "instance", "layers": [a, b], "to", "from"}` and
  `{"action": "batch", "instance", "max_num_seqs"}` are CoCoServe's operations on one instance, sent to its
  leader (DESIGN.md, "Instances across executors"). `to` may be an executor serving alone in the leader's world:
  it gets a `join` beside the leader's command, joins the instance for those layers and leaves it once its last
  replica is evicted (fabric/enlist.py). A standalone executor is the one-member instance `i-<executor>`
  (shared/core/plans.alone), or the `--executors N` plan's one-member instance.
- `{"action": "tp_merge", "executors": [..]}` merges executors serving alone in one world into a TP2/TP4
  instance (AMOEBAs; every one of them takes its part), and `{"action": "tp_split", "instance"}` splits such
  an instance back. A merge by hand is held ADMIN_MERGE_HOLD_S before the controller may split it back on
  its own (it does once nothing running needs it merged).
A body that is not well formed is a 400 naming the field, an id that names nothing a 404, and a morph an
executor refuses a 409 with its reason (the executor then changed nothing).

GET /v1/cluster shows the instances beside the executors, in the plan shape shared/core/plans.py reads, so that a
`--plan` file can be written from what a running cluster shows. Each instance also carries `replicas`, the
executors computing each layer (1 for a TP instance's sharded layers), derived from its placement so that
CoCoServe's replication shows at a glance; it is no part of a plan and is to be dropped when one is read back.
"""

import asyncio
import time
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from services.gateway import tp_merges
from services.gateway.openai_api import ApiError, bad_request
from shared.commands import CommandSender
from shared.core.plans import alone, alone_id, leads
from shared.core.roles import join_refusal
from shared.messages import (BatchArgs, ClusterState, CommandArgs, CommandResult, EvictArgs, InstancePlan, JoinArgs,
                             MigrateArgs, QuantizeArgs, ReplicateArgs, RestoreArgs, TpSplitArgs)

ALL = "*"
# Swapping layers waits for a forward-pass boundary and may relocate KV blocks; a busy CPU executor
# can take seconds. A retry reuses the seq, so it is only for "no responders" (an executor restarting).
COMMAND_TIMEOUT_S = 30.0
COMMAND_RETRIES = 1
FRESH_VIEW_WAIT_S = 2.0
_POLL_S = 0.05
_NO_ANSWER = "no answer after"  # CommandSender's error for a command that never got a reply
# The upper bound of counts and layer indices only keeps them encodable on the bus; the executor refuses
# more than it has.
MAX_COUNT = 1 << 16
_REASON = "by hand, through the gateway's admin API"
ADMIN_MERGE_HOLD_S = 60.0


class MorphRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    executor: StrictStr = Field(min_length=1, description='an executor id, or "*" for every live executor')
    action: Literal["quantize", "restore"]
    layers: StrictInt = Field(ge=1, le=MAX_COUNT,
                              description="how many layers: quantize takes the next ones in the executor's swap "
                                          "order, restore the most recently quantized first")
    bits: Literal[4, 8] | None = Field(None, description="required for quantize; restore returns to full "
                                                         "precision and takes no bits")


LayerIndex = Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)]
MemberId = Annotated[StrictStr, Field(min_length=1, description="an executor id, a member of the instance")]
TargetId = Annotated[StrictStr, Field(min_length=1, description="an executor id: a member of the instance, or an "
                                                                 "executor serving alone in its world, which joins it")]


class InstanceMorph(BaseModel):
    """A CoCoServe operation on one instance, sent to its leader."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    action: str
    instance: StrictStr = Field(min_length=1, description="an instance id, as GET /v1/cluster lists them, or "
                                                          "i-<executor> for a standalone executor")

    def members_named(self) -> dict[str, str]:
        """The executors the body names, by field: each must be a member of the instance."""
        return {}


class LayerRangeMorph(InstanceMorph):
    layers: list[LayerIndex] = Field(min_length=2, max_length=2,
                                     description="the decoder layers [a, b], both included, a <= b")


class ReplicateMorph(LayerRangeMorph):
    """Add a replica of layers [a, b] on `to`, which then takes a share of their batch rows."""
    action: Literal["replicate"]
    to: TargetId

    def members_named(self) -> dict[str, str]:
        return {"to": self.to}


class MigrateMorph(LayerRangeMorph):
    """Move layers [a, b], with their live KV, from member `from` to `to`."""
    action: Literal["migrate"]
    source: MemberId = Field(alias="from")
    to: TargetId

    def members_named(self) -> dict[str, str]:
        return {"from": self.source, "to": self.to}


class EvictMorph(LayerRangeMorph):
    """Drop member `from`'s replica of layers [a, b]; another replica of each layer must remain."""
    action: Literal["evict"]
    source: MemberId = Field(alias="from")

    def members_named(self) -> dict[str, str]:
        return {"from": self.source}


class BatchMorph(InstanceMorph):
    """Cap the sequences the instance runs at once; running ones go on."""
    action: Literal["batch"]
    max_num_seqs: StrictInt = Field(ge=1, le=MAX_COUNT, description="the most sequences it runs at once")


class TpSplitMorph(InstanceMorph):
    """Split an instance tp_merge formed back into executors serving alone (AMOEBAs)."""
    action: Literal["tp_split"]


class TpMergeMorph(BaseModel):
    """Merge executors serving alone into one TP instance: 2, or 4 consecutive ranks; the first leads."""
    model_config = ConfigDict(extra="forbid")
    action: Literal["tp_merge"]
    executors: list[MemberId] = Field(min_length=2, max_length=4)


# action -> (the body it takes, the command its leader gets)
INSTANCE_ACTIONS: dict[str, tuple[type[InstanceMorph], type[CommandArgs]]] = {
    "replicate": (ReplicateMorph, ReplicateArgs), "migrate": (MigrateMorph, MigrateArgs),
    "evict": (EvictMorph, EvictArgs), "batch": (BatchMorph, BatchArgs), "tp_split": (TpSplitMorph, TpSplitArgs)}
ACTIONS = ("quantize", "restore", *INSTANCE_ACTIONS, "tp_merge")
# The bodies the endpoint takes, for the published schema: exactly one matches a valid body.
MORPH_BODIES = (MorphRequest, *(body for body, _ in INSTANCE_ACTIONS.values()), TpMergeMorph)


def parse_morph(body) -> MorphRequest | InstanceMorph | TpMergeMorph:
    """Validate a decoded JSON body, raising ApiError(400) with the offending field as `param`."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    action = body.get("action")
    if "action" not in body and "executor" not in body:  # which other fields it needs depends on the action
        raise bad_request(f"Missing required parameter: 'action' (one of {', '.join(ACTIONS)})", "action")
    if "action" in body and action not in ACTIONS:
        raise bad_request(f"Invalid value for 'action': must be one of {', '.join(ACTIONS)}", "action")
    if action in INSTANCE_ACTIONS:
        return _parse_instance_morph(body, INSTANCE_ACTIONS[action][0])
    if action == "tp_merge":
        req = _parse_instance_morph(body, TpMergeMorph)
        if len(set(req.executors)) != len(req.executors) or len(req.executors) == 3:
            raise bad_request(f"Invalid value for 'executors': 2 or 4 distinct executors, got {req.executors}",
                              "executors")
        return req
    return _parse_bits_morph(body)


def _parse_bits_morph(body: dict) -> MorphRequest:
    for name in body:
        if name not in MorphRequest.model_fields:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
    # Literal[4, 8] alone would take 8.0 and True-like values; bits must be a JSON integer.
    if body.get("bits") is not None and (not isinstance(body["bits"], int) or isinstance(body["bits"], bool)):
        raise bad_request("Invalid value for 'bits': must be 4 or 8", "bits")
    req = _validated(MorphRequest, body)
    if req.action == "quantize" and req.bits is None:
        raise bad_request("Missing required parameter: 'bits' (4 or 8) for quantize", "bits")
    if req.action == "restore" and req.bits is not None:
        raise bad_request("restore returns layers to full precision and takes no 'bits'", "bits")
    return req


def _parse_instance_morph(body: dict, model: type[BaseModel]):
    takes = [field.alias or name for name, field in model.model_fields.items()]
    known = {field.alias or name for m in MORPH_BODIES for name, field in m.model_fields.items()}
    for name in body:
        if name not in takes:
            if name in known:  # a field of another action: say what this one takes instead
                raise bad_request(f"'{body['action']}' takes no '{name}' (it takes {', '.join(takes)})", name)
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
    req = _validated(model, body)
    if isinstance(req, LayerRangeMorph) and req.layers[0] > req.layers[1]:
        raise bad_request(f"Invalid value for 'layers': expected [a, b] with a <= b, got {req.layers}", "layers")
    if isinstance(req, MigrateMorph) and req.source == req.to:
        raise bad_request(f"Invalid value for 'to': migrate moves layers to another member, and 'from' is "
                          f"{req.source!r} too", "to")
    return req


def _validated(model: type[BaseModel], body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        if err["type"] == "missing":
            raise bad_request(f"Missing required parameter: '{param}'", param) from exc
        raise bad_request(f"Invalid value for '{param}': {err['msg']}", param) from exc


def cluster_body(state: ClusterState | None) -> dict:
    """The body of GET /v1/cluster."""
    return {"executors": cluster_view(state), "instances": instances_view(state)}


def cluster_view(state: ClusterState | None) -> list[dict]:
    """The body of GET /v1/cluster's `executors`. `instance` is None for a standalone executor (no plan),
    which leads itself; `max_num_seqs` is a leader's batch cap (0 on a follower), `slo` its requests'
    latencies over the monitor's SLO window."""
    return [{"id": e.executor, "alive": e.alive, "suspect": e.suspect, "restarts": e.restarts,
             "model": e.telemetry.model, "draining": e.telemetry.draining,
             "layers": e.telemetry.layers, "swap_order": e.telemetry.swap_order,
             "block_size": e.telemetry.block_size, "kv": e.telemetry.kv.model_dump(),
             "running": e.telemetry.running, "waiting": e.telemetry.waiting,
             "preemptions": e.telemetry.preemptions,
             "instance": e.telemetry.plan.id if e.telemetry.plan else None,
             "role": "leader" if leads(e) else "follower",
             "max_num_seqs": e.telemetry.max_num_seqs, "slo": e.slo.model_dump()}
            for e in (state.executors if state else [])]


def instances_view(state: ClusterState | None) -> list[dict]:
    """The body of GET /v1/cluster's `instances`: the plans of the live leaders, as the monitor read them,
    each with its derived `replicas` per layer."""
    return [{**plan.model_dump(), "replicas": replicas(plan)} for plan in (state.instances if state else [])]


def replicas(plan: InstancePlan) -> list[int]:
    """How many executors compute each layer, each a whole copy: a TP instance's shards make one."""
    return [len(layer.placement) if plan.tp == 1 else 1 for layer in plan.layers]


def _targets(state: ClusterState | None, executor: str) -> list[str]:
    live = [e.executor for e in (state.executors if state else []) if e.alive]
    if executor == ALL:
        if not live:
            raise ApiError(503, "no executor is available", "server_error", None, "no_executor")
        return live
    if executor not in live:
        known = any(e.executor == executor for e in (state.executors if state else []))
        why = "is not alive" if known else "does not exist"
        raise ApiError(404, f"The executor `{executor}` {why}", "invalid_request_error", "executor",
                       "executor_not_found")
    return [executor]


def _instance(state: ClusterState | None, instance: str) -> InstancePlan:
    """The instance's plan as the monitor shows it; a standalone executor's is the one-member plan of alone()."""
    plans = state.instances if state else []
    executors = state.executors if state else []
    found = next((plan for plan in plans if plan.id == instance), None)
    if found is not None:
        return found
    for e in executors:
        if e.telemetry.plan is None and alone_id(e.executor) == instance:
            if not e.alive:
                raise ApiError(404, f"The instance `{instance}` does not serve: its executor `{e.executor}` is not "
                                    f"alive", "invalid_request_error", "instance", "instance_not_found")
            return alone(e.executor, len(e.telemetry.layers))
    led = any(e.telemetry.plan is not None and e.telemetry.plan.id == instance for e in executors)
    why = "has no live leader" if led else "does not exist"
    raise ApiError(404, f"The instance `{instance}` {why}", "invalid_request_error", "instance",
                   "instance_not_found")


def _newcomer(state: ClusterState | None, plan: InstancePlan, req: InstanceMorph) -> str | None:
    """The live executor outside the instance that a replicate or migrate brings in (it joins the instance); 409
    where it cannot join, None where the operation brings in nobody or names an executor that is not alive."""
    to = getattr(req, "to", None)
    if not isinstance(req, (ReplicateMorph, MigrateMorph)) or to in plan.members:
        return None
    executors = {e.executor: e for e in (state.executors if state else [])}
    candidate, leader = executors.get(to), executors.get(plan.leader)
    if candidate is None or leader is None or not candidate.alive:
        return None
    if (why := join_refusal(candidate, leader)) is not None:
        raise ApiError(409, f"{req.action} onto `{to}`: {why}", "invalid_request_error", "to", "morph_refused")
    return to


def _check_members(plan: InstancePlan, req: InstanceMorph, newcomer: str | None) -> None:
    for param, executor in req.members_named().items():
        if executor not in plan.members and executor != newcomer:
            raise ApiError(404, f"The executor `{executor}` is not a member of instance `{plan.id}` (its members: "
                                f"{', '.join(plan.members)})", "invalid_request_error", param, "executor_not_found")
    if isinstance(req, TpSplitMorph):
        if not plan.merged:
            raise ApiError(409, f"instance `{plan.id}` was not formed by tp_merge: it has nothing to split back "
                                f"into", "invalid_request_error", None, "morph_refused")
        return
    if plan.merged:
        raise ApiError(409, f"instance `{plan.id}` is a TP merge: it takes only tp_split", "invalid_request_error",
                       None, "morph_refused")
    if len(plan.members) == 1 and newcomer is None and not isinstance(req, BatchMorph):
        raise ApiError(409, f"instance `{plan.id}` has one member, {plan.leader}, holding the only copy of every "
                            f"layer: there is no other member to {req.action} layers from, so it takes `batch`, "
                            f"and `replicate` or `migrate` onto an executor serving alone",
                       "invalid_request_error", None, "morph_refused")


def _raise_unless_applied(action: str, results: list[CommandResult]) -> None:
    """503 when no executor answered, 409 with their reasons when every one refused."""
    if any(r.ok for r in results):
        return
    errors = "; ".join(f"{r.executor}: {r.error}" for r in results)
    if all((r.error or "").startswith(_NO_ANSWER) for r in results):
        raise ApiError(503, f"no executor answered the {action} command: {errors}", "server_error", None,
                       "executor_unreachable")
    raise ApiError(409, errors, "invalid_request_error", None, "morph_refused")


async def _wait_fresh(dispatcher, results: list[CommandResult]) -> None:
    """Until the monitor's view shows each applied command's layer bits, and then one later report of
    each executor (its KV ledger is snapshotted just after the layers change), or the time is up."""
    want = {r.executor: r.state.get("layers") for r in results if r.ok}
    deadline = time.monotonic() + FRESH_VIEW_WAIT_S
    seen_at: dict[str, float] = {}
    while want and time.monotonic() < deadline:
        now = {e.executor: e.telemetry for e in (dispatcher.state.executors if dispatcher.state else [])}
        for executor, layers in want.items():
            t = now.get(executor)
            if t is not None and executor not in seen_at and t.layers == layers:
                seen_at[executor] = t.time
        if len(seen_at) == len(want) and all(e in now and now[e].time > seen_at[e] for e in want):
            return
        await asyncio.sleep(_POLL_S)


def _shows(req: InstanceMorph, before: InstancePlan, result: CommandResult) -> Callable[[ClusterState], bool]:
    """Whether a cluster view shows what the leader applied: its batch cap, or the plan it answered with
    (when it answered none, any plan other than the one before)."""
    if isinstance(req, BatchMorph):
        return lambda state: any(e.executor == before.leader and e.telemetry.max_num_seqs == req.max_num_seqs
                                 for e in state.executors)
    if isinstance(req, TpSplitMorph):  # every member serves alone again
        return lambda state: not any(e.executor in before.members and e.telemetry.plan is not None
                                     and e.telemetry.plan.id == before.id for e in state.executors)
    applied = result.state.get("plan")

    def shows(state: ClusterState) -> bool:
        now = next((plan for plan in state.instances if plan.id == before.id), None)
        return now is not None and now != before and (applied is None or now.model_dump() == applied)
    return shows


async def _wait_shown(dispatcher, shows: Callable[[ClusterState], bool]) -> None:
    deadline = time.monotonic() + FRESH_VIEW_WAIT_S
    while time.monotonic() < deadline and not (dispatcher.state is not None and shows(dispatcher.state)):
        await asyncio.sleep(_POLL_S)


def _answer(dispatcher, results: list[CommandResult]) -> dict:
    return {"results": [{"executor": r.executor, "ok": r.ok, "error": r.error, "state": r.state} for r in results],
            "executors": cluster_view(dispatcher.state), "instances": instances_view(dispatcher.state)}


async def morph(dispatcher, sender: CommandSender, body) -> dict:
    """Apply one morph request; the response body, or ApiError when nothing was applied."""
    req = parse_morph(body)
    if isinstance(req, TpMergeMorph):
        return await _merge(dispatcher, sender, req)
    if isinstance(req, InstanceMorph):
        return await _morph_instance(dispatcher, sender, req)
    targets = _targets(dispatcher.state, req.executor)
    args = (QuantizeArgs(layers=req.layers, bits=req.bits) if req.action == "quantize"
            else RestoreArgs(layers=req.layers))
    results = await asyncio.gather(*(sender.send(e, args, _REASON) for e in targets))
    _raise_unless_applied(req.action, results)
    await _wait_fresh(dispatcher, results)
    return _answer(dispatcher, results)


async def _morph_instance(dispatcher, sender: CommandSender, req: InstanceMorph) -> dict:
    plan = _instance(dispatcher.state, req.instance)
    newcomer = _newcomer(dispatcher.state, plan, req)
    _check_members(plan, req, newcomer)
    args = INSTANCE_ACTIONS[req.action][1].model_validate(req.model_dump(by_alias=True, exclude={"action"}))
    sends = [sender.send(plan.leader, args, _REASON)]
    if newcomer is not None:  # both take their part at once: the join meets in their collectives
        sends.append(sender.send(newcomer, JoinArgs(instance=plan.id, leader=plan.leader), _REASON))
    result, *joined = await asyncio.gather(*sends)
    if not result.ok:
        _raise_unless_applied(req.action, [result, *(r for r in joined if not r.ok)])
    await _wait_shown(dispatcher, _shows(req, plan, result))
    return _answer(dispatcher, [result, *joined])


async def _merge(dispatcher, sender: CommandSender, req: TpMergeMorph) -> dict:
    for executor in req.executors:
        _targets(dispatcher.state, executor)  # 404 for one that is not alive
    if (why := tp_merges.merge_refusal(dispatcher.state, req.executors)) is not None:
        raise ApiError(409, why, "invalid_request_error", None, "morph_refused")
    results = await tp_merges.send_merge(sender, req.executors, _REASON, ADMIN_MERGE_HOLD_S)
    if not all(r.ok for r in results):
        _raise_unless_applied(req.action, [r for r in results if not r.ok])
    await _wait_shown(dispatcher, tp_merges.shown(tp_merges.merged_id(req.executors), req.executors))
    return _answer(dispatcher, results)
