"""Which replica computes which rows of a step, for a range of layers held by several members (CoCoServe §3.1).

The batch is scattered at the first replicated layer and gathered after the last. A request's KV for those
layers lives only on the replica that computed its first chunk there, so a request keeps its replica for
as long as it lives (its forked completions with it: they share its prompt pages); a new one goes to the
replica with the fewest tokens in the step so far. Pure, so that the property tests drive it directly.
"""


def assign_replicas(step: list[tuple[str, int]], replicas: tuple[str, ...], sticky: dict[str, str]
                    ) -> dict[str, str]:
    """Replica of every request in `step` ((request id, tokens this step), in batch order): its entry in
    `sticky` if it has one, else the least loaded replica (ties to the earlier in `replicas`)."""
    load = dict.fromkeys(replicas, 0)
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
