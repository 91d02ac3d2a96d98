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


def choose_executor(state: ClusterState | None, exclude: set[str], model: str, strategy: str = "amoebas",
                    turn: int = 0) -> str | None:
    """The least-loaded serving executor for `model`: the smallest share of its KV pages in use (instances
    differ in size: quantized layers free pages, a TP merge holds several executors' KV), then the shortest
    queue; ties go to the lowest id so that the choice is deterministic. One suspect of a stall comes last:
    it may be gone, but when it is all there is, asking it (its admission times out, or it has woken up)
    beats refusing outright. None when there is none.

    AMOEBAs' baselines order the candidates otherwise: "rr" round-robin from the `turn`-th, "llf" the fewest
    requests running and waiting first."""
    candidates = sorted((e for e in serving(state, model) if e.executor not in exclude), key=lambda e: e.executor)
    if not candidates:
        return None
    if strategy == "rr":
        start = turn % len(candidates)
        return min(candidates[start:] + candidates[:start], key=lambda e: e.suspect).executor
    if strategy == "llf":
        return min(candidates, key=lambda e: (e.suspect, e.telemetry.running + e.telemetry.waiting,
                                              e.executor)).executor
    best = min(candidates, key=lambda e: (e.suspect, kv_in_use(e), e.telemetry.waiting, e.executor))
    return best.executor


def kv_in_use(e: ExecutorState) -> float:
    kv = e.telemetry.kv
    return kv.pages_used / (kv.pages_used + kv.pages_free) if kv.pages_used + kv.pages_free else 1.0
