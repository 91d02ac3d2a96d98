"""AMOEBAs' transformation-aware scheduler (§3.3) and the paper's two baselines, as pure functions over what
the cluster state says of each instance.

A new request goes to the least-loaded instance that can hold it; when consecutive requests are long, those
already at a higher TP degree come first (fewer transformations). When none can hold it, the two
least-loaded instances of one TP degree merge (a step of x2: TP1 -> TP2 -> TP4) and the request waits for
the merge: at the lowest degree whose merge holds it, else at the highest degree that can merge at all, so
that the next decision can step again. A request is refused for good only when no instance the cluster
could form holds it even empty (`Refuse.never`); short of room only now, it is refused for now. Once a merged instance runs nothing that needs it merged, it takes no new requests until its KV
is `free_fraction` free, then splits.

The baselines (the paper's Fig. 12) pick an instance round-robin or least-loaded first, whatever its degree;
when it cannot hold the request, it merges with the least-loaded instance of its degree beside it.

Capacity is counted in KV blocks. A member of a TP-k instance stores, per block, one head unit for each KV
head it holds (fabric/kv_heads.py); `Member.kv_units[k]` is how many units it has outside the slots a TP-k
cut leaves, so the instance holds min over members of units // heads of blocks.
"""

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from shared.core.plans import FFN_PIECES, leads
from shared.messages import ClusterState

MAX_TP = FFN_PIECES  # merges step TP1 -> TP2 -> TP4


@dataclass(frozen=True)
class Member:
    executor: str
    kv_units: dict[int, int]  # TP degree -> KV head units it would have as a member of an instance that wide


@dataclass(frozen=True)
class Instance:
    id: str
    tp: int
    members: tuple[Member, ...]  # in rank order
    kv_heads: int  # the model's
    block_size: int
    blocks_free: int
    blocks_used: int
    load: int  # requests running and waiting
    longest: int = 0  # blocks of the longest sequence it runs
    accepting: bool = True  # False while it drains towards a split
    merged: bool = False  # formed by tp_merge: splits back once nothing needs it (split_due)


@dataclass(frozen=True)
class Route:
    instance: str


@dataclass(frozen=True)
class Merge:
    instances: tuple[str, ...]  # merged in this order (the first leads)
    tp: int


@dataclass(frozen=True)
class Refuse:
    reason: str
    never: bool = False  # no instance the cluster can form holds the request (else: not now)


Decision = Route | Merge | Refuse


def world_allows(world: list[str], members: tuple[str, ...] | list[str]) -> bool:
    """Whether `members` can form one instance in the world of executors `world` (in rank order): any two,
    four when they are consecutive ranks from a multiple of four (the subgroups fabric/world.py creates)."""
    if len(set(members)) != len(members) or not set(members) <= set(world):
        return False
    ranks = sorted(world.index(m) for m in members)
    return len(ranks) == 2 or (len(ranks) == MAX_TP and ranks == list(range(ranks[0], ranks[0] + MAX_TP))
                               and ranks[0] % MAX_TP == 0)


def heads_per_rank(kv_heads: int, tp: int) -> list[int]:
    """KV heads each rank of a TP-`tp` instance stores a unit of, per block (fabric/shards.head_shards)."""
    if tp > kv_heads:
        return [1] * tp  # replicated KV heads
    base, extra = divmod(kv_heads, tp)
    return [base + (1 if r < extra else 0) for r in range(tp)]


def capacity(members: tuple[Member, ...], kv_heads: int) -> int:
    """KV blocks an instance of `members` holds at TP len(members) (at TP1, its one member's)."""
    tp = len(members)
    return min(m.kv_units.get(tp, 0) // n for m, n in zip(members, heads_per_rank(kv_heads, tp)))


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


@dataclass
class SchedulerState:
    next_rr: int = 0  # round-robin's next instance


def decide(tokens: int, instances: list[Instance], strategy: str = "amoebas",
           allowed: Callable[[tuple[str, ...]], bool] = lambda members: True,
           state: SchedulerState | None = None) -> Decision:
    """Where a request of `tokens` (prompt plus output) goes, or which instances merge for it first.
    `allowed(members)`: whether those executors can form one instance (the world's groups)."""
    if not instances:
        return Refuse("no instance serves the model")
    state = state or SchedulerState()
    need = blocks_for(tokens, instances[0].block_size)
    open_ = [i for i in instances if i.accepting]
    fits = [i for i in open_ if i.blocks_free >= need]
    if strategy not in ("amoebas", "rr", "llf"):
        raise ValueError(f"unknown scheduling strategy {strategy!r}: amoebas, rr or llf")
    if strategy == "amoebas" and fits:
        long_ = need > max((capacity(i.members, i.kv_heads) for i in instances if i.tp == 1), default=0)
        return Route(min(fits, key=lambda i: (-i.tp if long_ else 0, i.load, -i.blocks_free, i.id)).id)
    if not _reachable(need, instances, allowed):
        return Refuse(f"a request of {tokens} tokens needs {need} KV blocks; no instance this cluster can form "
                      f"holds that many", never=True)
    if not open_:
        return Refuse("every instance is draining towards a split; try again")
    if strategy == "amoebas":
        return _merge_for(need, open_, allowed) or Refuse("no two instances can merge now; try again")
    if strategy == "rr":
        chosen = open_[state.next_rr % len(open_)]
        state.next_rr += 1
    else:
        chosen = min(open_, key=lambda i: (i.load, -i.blocks_free, i.id))
    if chosen.blocks_free >= need:
        return Route(chosen.id)
    peers = sorted((i for i in open_ if i.tp == chosen.tp and i.id != chosen.id
                    and allowed(_members(chosen, i))), key=lambda i: (i.load, i.id))
    if chosen.tp < MAX_TP and peers:
        return Merge((chosen.id, peers[0].id), chosen.tp * 2)
    return _merge_for(need, open_, allowed) or Refuse("no two instances can merge now; try again")


def _members(*instances: Instance) -> tuple[str, ...]:
    return tuple(m.executor for i in instances for m in i.members)


def _merge_for(need: int, open_: list[Instance], allowed) -> Merge | None:
    """The least-loaded pair of one degree whose merge holds `need` more blocks, at the lowest such degree;
    else a pair at the highest degree that can merge (a step towards one that holds it)."""
    best_step = None
    for tp in sorted({i.tp for i in open_ if i.tp < MAX_TP}):
        same = sorted((i for i in open_ if i.tp == tp), key=lambda i: (i.load, i.id))
        pairs = [(a, b) for x, a in enumerate(same) for b in same[x + 1:] if allowed(_members(a, b))]
        for a, b in pairs:
            members = a.members + b.members
            room = capacity(members, a.kv_heads) - a.blocks_used - b.blocks_used
            if room >= need:
                return Merge((a.id, b.id), tp * 2)
        if pairs:
            best_step = Merge((pairs[0][0].id, pairs[0][1].id), tp * 2)
    return best_step


def _reachable(need: int, instances: list[Instance], allowed) -> bool:
    """Whether some instance the cluster could form (its instances merged, up to MAX_TP executors) holds
    `need` blocks when empty: what runs now ends, so a request short of room only now is not refused for ever."""
    for size in range(1, len(instances) + 1):
        for group in itertools.combinations(instances, size):
            members = tuple(m for i in group for m in i.members)
            if len(members) in (1, 2, 4) and (size == 1 or allowed(_members(*group))):
                if capacity(members, group[0].kv_heads) >= need:
                    return True
    return False


def split_due(instance: Instance, free_fraction: float = 0.5) -> str | None:
    """For a merged instance: "drain" once nothing it runs needs it merged (its longest sequence would fit
    each member's own TP1 instance), "split" once it is also `free_fraction` free; else None."""
    if instance.tp == 1:
        return None
    alone = min(capacity((m,), instance.kv_heads) for m in instance.members)
    if instance.longest > alone:
        return None
    total = instance.blocks_free + instance.blocks_used
    return "split" if total and instance.blocks_free >= free_fraction * total else "drain"


def instances_from(state: ClusterState | None, model: str | None = None, free_fraction: float = 0.5
                   ) -> list[Instance]:
    """The instances of the cluster state that serve `model`, as decide() reads them: only those whose
    executors all report their head units (they are in a world); a merged one draining towards its split
    takes no new requests."""
    executors = {e.executor: e for e in (state.executors if state else []) if e.alive}
    out = []
    for e in executors.values():
        t = e.telemetry
        if not leads(e) or t.draining or not t.kv_heads or (model is not None and t.model != model):
            continue
        names = t.plan.members if t.plan is not None else [e.executor]
        if not all(n in executors and executors[n].telemetry.kv_units for n in names):
            continue
        members = tuple(Member(n, {u.tp: u.units for u in executors[n].telemetry.kv_units}) for n in names)
        instance = Instance(t.plan.id if t.plan is not None else e.executor, len(names), members, t.kv_heads,
                            t.block_size, t.kv.pages_free, t.kv.pages_used, t.running + t.waiting, t.longest_blocks)
        merged = t.plan is not None and t.plan.merged
        instance = dataclasses.replace(instance, merged=merged)
        if merged and t.merge_hold_s <= 0 and split_due(instance, free_fraction) is not None:
            instance = dataclasses.replace(instance, accepting=False)
        out.append(instance)
    return sorted(out, key=lambda i: i.id)
