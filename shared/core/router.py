"""Which executor gets the next request: a pure function of the monitor's cluster state and of what the
gateway sent since each executor's last report (Unreported).

Pure so that it is tested without a bus and so that the gateway's retry loop (queue full, executor
gone) is just "call again with the failed ones excluded".

Only an instance's leader runs a scheduler (DESIGN.md, "Instances across executors"): its followers
report telemetry too, but a request sent to one would find nobody to take it, so they are never
candidates. An executor without a plan is a standalone one and leads itself.
"""

import heapq
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from shared.core.plans import leads
from shared.messages import ClusterState, ExecutorState


@dataclass(frozen=True)
class Sent:
    """What a gateway sent one executor that the executor's telemetry in the state it routes on does not show."""
    requests: int = 0
    pages: int = 0  # KV pages their prompts take
    full: bool = False  # it refused one for a full queue: a report after that refusal says when it has room


NOTHING_SENT = Sent()
NONE_SENT: Mapping[str, Sent] = MappingProxyType({})


class Unreported:
    """The requests a gateway sent since each executor's last report. The monitor publishes a few states a
    second; between two of them every arrival would go to the one executor that looked least loaded, and at
    hundreds of requests a second (a fleet's gateway, the simulator's thousand executors) that one executor's
    queue overflows while the rest idle. Counting what was sent since keeps the choice spread. A request whose
    admission is still on its way counts as sent from the moment it is asked (`asking`): requests that arrive
    together are all routed before the first answer comes back, and counted only once admitted, they had all
    gone to the same executor. A refusal for a full queue counts too: the state still shows the room the
    executor had, and every arrival until the next one would be offered to it first and refused again (eleven
    refusals an arrival, in a thousand-executor fleet past its capacity: each a round trip on the bus)."""

    def __init__(self) -> None:
        self._sent: dict[str, list[tuple[float, int]]] = {}  # executor -> (sent at, its prompt's pages)
        self._asking: dict[str, int] = {}  # executor -> admissions asked of it and not answered yet
        self._refused: dict[str, float] = {}  # executor -> when it last refused for a full queue
        self._totals: dict[str, Sent] = {}  # what view() shows, kept as sending goes: it is asked per request
        self._view = MappingProxyType(self._totals)  # one per state: the router keeps its heap while it grows

    def add(self, executor: str, sent_at: float, pages: int) -> None:
        """A request admitted by `executor` at `sent_at` in the same moment it was routed (the simulator's)."""
        self._sent.setdefault(executor, []).append((sent_at, pages))
        self._count(executor, 1, pages)

    def asking(self, executor: str) -> None:
        """An admission is on its way to `executor`: counted as a request sent, whatever reports come meanwhile,
        until admitted() or not_admitted()."""
        self._asking[executor] = self._asking.get(executor, 0) + 1
        self._count(executor, 1, 0)

    def admitted(self, executor: str, at: float, pages: int) -> None:
        """The admission asked of `executor` was accepted at `at`: sent, as add() counts it."""
        self._answered(executor)
        self._sent.setdefault(executor, []).append((at, pages))
        self._count(executor, 0, pages)

    def not_admitted(self, executor: str) -> None:
        """The admission asked of `executor` was refused, or no answer came: nothing was sent it."""
        self._answered(executor)
        self._count(executor, -1, 0)
        # Routing keeps a heap that only a rising load may leave stale (_least_loaded): a new view rebuilds it.
        self._view = MappingProxyType(self._totals)

    def refused(self, executor: str, at: float) -> None:
        """`executor` refused a request at `at` for a full queue: it is asked last until it reports after that."""
        self._refused[executor] = at
        if not self._totals.get(executor, NOTHING_SENT).full:
            self._count(executor, 0, 0, full=True)

    def _answered(self, executor: str) -> None:
        if (asking := self._asking[executor] - 1) == 0:
            del self._asking[executor]
        else:
            self._asking[executor] = asking

    def _count(self, executor: str, requests: int, pages: int, full: bool = False) -> None:
        before = self._totals.get(executor, NOTHING_SENT)
        self._totals[executor] = Sent(before.requests + requests, before.pages + pages, before.full or full)

    def forget_reported(self, state: ClusterState) -> None:
        """Drop what each executor's report in `state` already counts: sent before it was taken. Executors
        gone from the state are dropped whole. Times are the senders' and the executors' clocks (time.time())."""
        reported = {e.executor: e.telemetry.time for e in state.executors}
        self._sent = {name: kept for name, sent in self._sent.items() if name in reported
                      and (kept := [(t, pages) for t, pages in sent if t > reported[name]])}
        self._refused = {name: at for name, at in self._refused.items() if name in reported and at > reported[name]}
        self._totals = {name: Sent(len(self._sent.get(name, ())) + self._asking.get(name, 0),
                                   sum(pages for _, pages in self._sent.get(name, ())), name in self._refused)
                        for name in self._sent.keys() | self._asking.keys() | self._refused.keys()}
        self._view = MappingProxyType(self._totals)

    def view(self) -> Mapping[str, Sent]:
        """What was sent each executor, live: the same mapping, only growing, until the next forget_reported."""
        return self._view


def serving(state: ClusterState | None, model: str | None = None) -> list[ExecutorState]:
    """Live leaders that accept new work (not draining), optionally only those serving `model`."""
    if state is None:
        return []
    return [e for e in state.executors
            if e.alive and leads(e) and not e.telemetry.draining and (model is None or e.telemetry.model == model)]


def choose_executor(state: ClusterState | None, exclude: set[str], model: str, strategy: str = "amoebas",
                    turn: int = 0, unreported: Mapping[str, Sent] | None = None) -> str | None:
    """The least-loaded serving executor for `model`: one that refused a request for a full queue since it
    reported after the others, then the shortest queue (its waiting requests and those sent it since it
    reported), then the smallest share of its KV pages in use (instances differ in size: quantized
    layers free pages, a TP merge holds several executors' KV); ties go to the lowest id so that the choice is
    deterministic. The queue comes first because it is what a new request waits behind, and because a prompt
    waiting to be prefilled holds no KV page: ordered by KV first, a report that showed a long queue looked as
    free as an idle executor (docs/benchmarks.md, "The simulator at a thousand executors"). One suspect of a
    stall comes last: it may be gone, but when it is all there is, asking it (its admission times out, or it
    has woken up) beats refusing outright. None when there is none.

    AMOEBAs' baselines order the candidates otherwise: "rr" round-robin from the `turn`-th, "llf" the fewest
    requests running and waiting first. `unreported`: what the caller sent each executor that `state` does not
    show yet (Unreported.view()), counted as queued there."""
    sent = unreported if unreported is not None else NONE_SENT
    if strategy not in ("rr", "llf"):
        return _least_loaded(state, exclude, model, sent)
    candidates = sorted((e for e in serving(state, model) if e.executor not in exclude), key=lambda e: e.executor)
    if not candidates:
        return None
    if strategy == "rr":
        start = turn % len(candidates)
        return min(candidates[start:] + candidates[:start], key=lambda e: e.suspect).executor
    return min(candidates, key=lambda e: (e.suspect, e.telemetry.running + e.telemetry.waiting
                                          + sent.get(e.executor, NOTHING_SENT).requests, e.executor)).executor


def _least_loaded(state: ClusterState | None, exclude: set[str], model: str, sent: Mapping[str, Sent]) -> str | None:
    """The default order without weighing every executor per request: a gateway routing hundreds of requests a
    second over a thousand executors had walked the hundreds sent to since the last state, per request. A send
    or a refusal only raises an executor's load, so a heap of loads weighed earlier is weighed again only at its
    top: there a load weighed before the latest send is stale, and one still current is the least of all.

    The excluded are set aside for the next call with the same `exclude` set, which a request's retry walk only
    grows: a walk past every executor of a fleet whose queues are all full had taken them all off the heap and
    put them back once per executor tried, its square."""
    heap, reported, aside = _loads(state, model, sent)
    if aside[0] is not exclude or len(exclude) < aside[1]:  # another walk's: what it set aside goes back
        if heap:
            for entry in aside[2]:
                heapq.heappush(heap, entry)
        else:  # a walk that refused them all set them aside in the heap's order: already a heap
            heap.extend(aside[2])
        aside[:] = [exclude, 0, []]
    aside[1], skipped, best = len(exclude), aside[2], None
    while heap:
        load, counted = heap[0]
        name = load[-1]
        if (now := sent.get(name, NOTHING_SENT)) is not counted and now != counted:
            heapq.heapreplace(heap, (_weigh(*reported[name], name, now), now))
        elif name in exclude:
            skipped.append(heapq.heappop(heap))
        else:
            best = name
            break
    return best


# [state, what was sent, {model: (a heap of (load, what was sent when weighed), what each reported (suspect,
# queue, KV pages used, free) by id, [the exclude set of the walk that set entries aside, its size then, those
# entries])}]: one state is routed on at a time, and what was sent only grows while it is the same mapping
# (Unreported.view); requests for several models take turns, each model's executors weighed once
_order_cache: list = [None, None, {}]


def _loads(state: ClusterState | None, model: str, sent: Mapping[str, Sent]) -> tuple[list, dict[str, tuple], list]:
    if _order_cache[0] is not state or _order_cache[1] is not sent:
        _order_cache[:] = [state, sent, {}]
    by_model = _order_cache[2]
    if model not in by_model:
        reported = {e.executor: (e.suspect, e.telemetry.waiting, e.telemetry.kv.pages_used, e.telemetry.kv.pages_free)
                    for e in serving(state, model)}
        heap = [(_weigh(*r, name, now), now) for name, r in reported.items()
                for now in [sent.get(name, NOTHING_SENT)]]
        heapq.heapify(heap)
        by_model[model] = heap, reported, [None, 0, []]
    return by_model[model]


def _weigh(suspect: bool, waiting: int, used: int, free: int, name: str, sent: Sent) -> tuple:
    """The order of choice: a suspect of a stall last, one full when last asked next to last, then the shortest
    queue, the least KV in use, the lowest id."""
    return suspect, sent.full, waiting + sent.requests, _kv_share(used, free, sent.pages), name


def kv_in_use(e: ExecutorState, pending_pages: int = 0) -> float:
    """The share of its KV pages in use, counting `pending_pages` more (prompts sent it since it reported)."""
    return _kv_share(e.telemetry.kv.pages_used, e.telemetry.kv.pages_free, pending_pages)


def _kv_share(used: int, free: int, pending: int) -> float:
    total = used + free
    return (used + pending) / total if total else 1.0


def prompt_pages(prompt_tokens: int, block_size: int) -> int:
    """KV pages a prompt of `prompt_tokens` takes once prefilled."""
    return -(-prompt_tokens // max(1, block_size))
