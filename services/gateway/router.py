"""Which executor gets the next request: a pure function of the monitor's cluster state.

Pure so that it is tested without a bus and so that the gateway's retry loop (queue full, executor
gone) is just "call again with the failed ones excluded".

Only an instance's leader runs a scheduler (DESIGN.md, "Instances across executors"): its followers
report telemetry too, but a request sent to one would find nobody to take it, so they are never
candidates. An executor without a plan is a standalone one and leads itself.
"""

from shared.messages import ClusterState, ExecutorState
from shared.plans import leads


def serving(state: ClusterState | None, model: str | None = None) -> list[ExecutorState]:
    """Live leaders that accept new work (not draining), optionally only those serving `model`."""
    if state is None:
        return []
    return [e for e in state.executors
            if e.alive and leads(e) and not e.telemetry.draining and (model is None or e.telemetry.model == model)]


def choose_executor(state: ClusterState | None, exclude: set[str], model: str) -> str | None:
    """The serving executor for `model` with the most free KV pages, then the shortest queue; ties go to
    the lowest id so that the choice is deterministic. One suspect of a stall comes last: it may be
    gone, but when it is all there is, asking it (its admission times out, or it has woken up) beats
    refusing outright. None when there is none."""
    candidates = [e for e in serving(state, model) if e.executor not in exclude]
    if not candidates:
        return None
    best = min(candidates, key=lambda e: (e.suspect, -e.telemetry.kv.pages_free, e.telemetry.waiting, e.executor))
    return best.executor
