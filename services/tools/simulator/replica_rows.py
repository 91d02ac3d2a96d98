"""A decode batch's members counted by replica, for every replicated segment of a CoCoServe instance.

A replicated segment's rows go to its replicas request by request (fabric/replicas.assign_replicas), and a
request keeps its replica while it lives: so, as the batch keeps the sum of its members' contexts as one
number (decode_batch.py), each replica's share of a step is two: how many members it decodes and the sum of
their tokens computed less the step their tokens were last written at, constant while they stay. Counted as
members join and leave the batch (instance.py times its steps from them). Every member has its replica: the
step of its first chunk gave it one, and a reshape gives one to every request holding KV (replicas.reassign).
"""

from shared.core.scheduling.sequence import Sequence


class ReplicaRows:
    def __init__(self, parts: list, sticky: dict[int, dict[str, str]]):
        """`parts`: the instance's segments with their bits (instance._parts), `sticky`: its replica of every
        request by replicated segment, which the instance's steps keep."""
        self.segments = [(index, sticky.setdefault(index, {})) for index, (segment, _) in enumerate(parts)
                         if len(segment.placement) > 1]
        # segment -> replica -> [members it decodes, their tokens computed less the step last written, summed]
        self.counts: dict[int, dict[str, list[int]]] = {
            index: {m: [0, 0] for m in parts[index][0].placement} for index, _ in self.segments}

    def joined(self, seq: Sequence, drift: int) -> None:
        """`seq` joins, its tokens computed less the step they were last written at `drift`."""
        self._count(seq, drift, 1)

    def left(self, seq: Sequence, drift: int) -> None:
        self._count(seq, drift, -1)

    def _count(self, seq: Sequence, drift: int, sign: int) -> None:
        for index, sticky in self.segments:
            row = self.counts[index][sticky[seq.request_id]]
            row[0] += sign
            row[1] += sign * drift
