"""Which replica computes which rows of a step, for a range of layers held by several members (CoCoServe §3.1).

The batch is scattered at the first replicated layer and gathered after the last. A request's KV for those
layers lives only on the replica that computed its first chunk there, so a request keeps its replica for
as long as it lives (its forked completions with it: they share its prompt pages); a new one goes to the
replica with the fewest tokens in the step so far. When an operation changes the plan, `reassign` says
which replica each request has afterwards and which KV rows move for that. Pure, so that the property
tests drive it directly.
"""

from collections import Counter
from dataclasses import dataclass

from shared.core.plans import Segment


def assign_replicas(step: list[tuple[str, int]], replicas: tuple[str, ...], sticky: dict[str, str],
                    load: dict[str, int] | None = None) -> dict[str, str]:
    """Replica of every request in `step` ((request id, tokens this step), in batch order): its entry in
    `sticky` if it has one, else the least loaded replica (ties to the earlier in `replicas`). `load`: tokens
    the replicas have in the step besides `step`'s, each kept by its replica (a simulated decode batch's, counted
    by replica); none by default."""
    load = dict.fromkeys(replicas, 0) if load is None else dict(load)
    owner: dict[str, str] = {}
    for request_id, tokens in step:
        if sticky.get(request_id) in load:
            owner[request_id] = sticky[request_id]
            load[owner[request_id]] += tokens
    for request_id, tokens in step:
        if request_id not in owner:
            owner[request_id] = min(replicas, key=lambda r: load[r])
            load[owner[request_id]] += tokens
    return owner


def rows_by_replica(chunk_rows: list[range], chunk_owners: list[str], replicas: tuple[str, ...]
                    ) -> dict[str, list[int]]:
    """The batch rows each replica computes: the rows of the chunks it owns, in batch order."""
    rows: dict[str, list[int]] = {r: [] for r in replicas}
    for span, owner in zip(chunk_rows, chunk_owners):
        rows[owner].extend(span)
    return rows


@dataclass(frozen=True)
class KvMove:
    """KV rows of `layers` in `blocks` that go from member `src` to member `dst`."""
    src: str
    dst: str
    layers: tuple[int, ...]
    blocks: tuple[int, ...]


def reassign(old: list[Segment], new: list[Segment], sticky: dict[int, dict[str, str]],
             blocks: dict[str, set[int]]) -> tuple[dict[int, dict[str, str]], list[KvMove]]:
    """A reshape's effect on where KV lives: the replica of every request (with KV, in `blocks`) for each
    replicated segment of `new`, and the KV rows that must move for it.

    A request keeps, for a new replicated range, the replica that already holds most of its layers there
    (a new replica takes only requests that arrive after it: their KV starts there); a request whose
    replicas are all gone goes to the replica with the fewest requests. Layers that one member computes
    hold every request's KV on that member."""
    def old_owner(request: str, layer: int) -> str | None:
        index = next(i for i, s in enumerate(old) if s.start <= layer < s.stop)
        placement = old[index].placement
        return placement[0] if len(placement) == 1 else sticky.get(index, {}).get(request)

    new_sticky: dict[int, dict[str, str]] = {}
    rows: dict[tuple[str, str, tuple[int, ...]], set[int]] = {}
    for index, segment in enumerate(new):
        layers = range(segment.start, segment.stop)
        owners: dict[str, str] = {}
        load = dict.fromkeys(segment.placement, 0)
        for request in sorted(blocks):
            if len(segment.placement) == 1:
                owners[request] = segment.placement[0]
                continue
            votes = Counter(o for o in (old_owner(request, i) for i in layers) if o in load)
            owner = (max(segment.placement, key=lambda m: votes[m]) if votes
                     else min(segment.placement, key=lambda m: load[m]))
            owners[request] = owner
            load[owner] += 1
        if len(segment.placement) > 1:
            new_sticky[index] = owners
        for request, owner in owners.items():
            moving = tuple(i for i in layers if old_owner(request, i) not in (None, owner))
            by_src: dict[str, list[int]] = {}
            for i in moving:
                by_src.setdefault(old_owner(request, i), []).append(i)
            for src, src_layers in by_src.items():
                rows.setdefault((src, owner, tuple(src_layers)), set()).update(blocks[request])
    moves = [KvMove(src, dst, layers, tuple(sorted(b))) for (src, dst, layers), b in rows.items() if b]
    return new_sticky, moves
