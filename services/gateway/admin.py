"""The admin side of morphing: `GET /v1/cluster` and `POST /v1/cluster/morph`.

An operator (or a benchmark) quantizes and restores layers by hand through the gateway instead of
the bus, so that one authenticated HTTP endpoint is enough to drive the cluster; the commands go out
through the same CommandSender as the controller's (shared/commands.py), so they get the same
sequence numbers, retries and audit events. The gateway answers only once the executors applied
them, and waits a bounded moment for the monitor's view to catch up so that the `executors` it returns already show
the change (the monitor lags the executors by a few hundred milliseconds).

GET /v1/cluster shows the instances (DESIGN.md, "Instances across executors") beside the executors, in the
plan shape shared/plans.py reads, so that a `--plan` file can be written from what a running cluster shows.
"""

import asyncio
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from services.gateway.openai_api import ApiError, bad_request
from services.gateway.router import leads
from shared.commands import CommandSender
from shared.messages import ClusterState, CommandResult, QuantizeArgs, RestoreArgs

ALL = "*"
# Swapping layers waits for a forward-pass boundary and may relocate KV blocks; a busy CPU executor
# can take seconds. A retry reuses the seq, so it is only for "no responders" (an executor restarting).
COMMAND_TIMEOUT_S = 30.0
COMMAND_RETRIES = 1
FRESH_VIEW_WAIT_S = 2.0
_POLL_S = 0.05
_NO_ANSWER = "no answer after"  # CommandSender's error for a command that never got a reply


class MorphRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    executor: StrictStr = Field(min_length=1, description='an executor id, or "*" for every live executor')
    action: Literal["quantize", "restore"]
    # The upper bound only keeps the count encodable on the bus; the executor refuses more than it has.
    layers: StrictInt = Field(ge=1, le=1 << 16,
                              description="how many layers: quantize takes the next ones in the executor's swap "
                                          "order, restore the most recently quantized first")
    bits: Literal[4, 8] | None = Field(None, description="required for quantize; restore returns to full "
                                                         "precision and takes no bits")


def parse_morph(body) -> MorphRequest:
    """Validate a decoded JSON body, raising ApiError(400) with the offending field as `param`."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in body:
        if name not in MorphRequest.model_fields:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
    # Literal[4, 8] alone would take 8.0 and True-like values; bits must be a JSON integer.
    if body.get("bits") is not None and (not isinstance(body["bits"], int) or isinstance(body["bits"], bool)):
        raise bad_request("Invalid value for 'bits': must be 4 or 8", "bits")
    try:
        req = MorphRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        if err["type"] == "missing":
            raise bad_request(f"Missing required parameter: '{param}'", param) from exc
        raise bad_request(f"Invalid value for '{param}': {err['msg']}", param) from exc
    if req.action == "quantize" and req.bits is None:
        raise bad_request("Missing required parameter: 'bits' (4 or 8) for quantize", "bits")
    if req.action == "restore" and req.bits is not None:
        raise bad_request("restore returns layers to full precision and takes no 'bits'", "bits")
    return req


def cluster_body(state: ClusterState | None) -> dict:
    """The body of GET /v1/cluster."""
    return {"executors": cluster_view(state), "instances": instances_view(state)}


def cluster_view(state: ClusterState | None) -> list[dict]:
    """The body of GET /v1/cluster's `executors`. `instance` is None for a standalone executor (no plan),
    which leads itself."""
    return [{"id": e.executor, "alive": e.alive, "suspect": e.suspect, "restarts": e.restarts,
             "model": e.telemetry.model, "draining": e.telemetry.draining,
             "layers": e.telemetry.layers, "swap_order": e.telemetry.swap_order,
             "block_size": e.telemetry.block_size, "kv": e.telemetry.kv.model_dump(),
             "running": e.telemetry.running, "waiting": e.telemetry.waiting,
             "preemptions": e.telemetry.preemptions,
             "instance": e.telemetry.plan.id if e.telemetry.plan else None,
             "role": "leader" if leads(e) else "follower"}
            for e in (state.executors if state else [])]


def instances_view(state: ClusterState | None) -> list[dict]:
    """The body of GET /v1/cluster's `instances`: the plans of the live leaders, as the monitor read them."""
    return [plan.model_dump() for plan in (state.instances if state else [])]


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


async def morph(dispatcher, sender: CommandSender, body) -> dict:
    """Apply one morph request; the response body, or ApiError when nothing was applied."""
    req = parse_morph(body)
    targets = _targets(dispatcher.state, req.executor)
    args = (QuantizeArgs(layers=req.layers, bits=req.bits) if req.action == "quantize"
            else RestoreArgs(layers=req.layers))
    results = await asyncio.gather(*(sender.send(e, args, "by hand, through the gateway's admin API")
                                     for e in targets))
    if not any(r.ok for r in results):
        errors = "; ".join(f"{r.executor}: {r.error}" for r in results)
        if all((r.error or "").startswith(_NO_ANSWER) for r in results):
            raise ApiError(503, f"no executor answered the {req.action} command: {errors}", "server_error", None,
                           "executor_unreachable")
        raise ApiError(409, errors, "invalid_request_error", None, "morph_refused")
    await _wait_fresh(dispatcher, results)
    return {"results": [{"executor": r.executor, "ok": r.ok, "error": r.error, "state": r.state} for r in results],
            "executors": cluster_view(dispatcher.state)}
