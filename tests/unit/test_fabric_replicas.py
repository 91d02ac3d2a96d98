"""Row splitting for replicated layers: every row computed once, a request never leaves its replica."""

from hypothesis import given
from hypothesis import strategies as st

from shared.core.replicas import assign_replicas, rows_by_replica

REPLICAS = ("exec0", "exec1", "exec2")


@st.composite
def steps(draw):
    """Several steps over a pool of requests: (request id, tokens) in batch order, each request once per step."""
    pool = [f"r{i}" for i in range(draw(st.integers(1, 12)))]
    out = []
    for _ in range(draw(st.integers(1, 6))):
        ids = draw(st.lists(st.sampled_from(pool), unique=True, min_size=1))
        out.append([(rid, draw(st.integers(1, 64))) for rid in ids])
    return out


@given(steps(), st.integers(2, 3))
def test_requests_keep_their_replica_and_every_row_is_computed_once(history, count):
    replicas = REPLICAS[:count]
    sticky: dict[str, str] = {}
    for step in history:
        owners = assign_replicas(step, replicas, sticky)
        assert set(owners) == {rid for rid, _ in step}
        for rid, replica in owners.items():
            assert replica in replicas
            assert sticky.get(rid, replica) == replica  # once placed, always there
        sticky.update(owners)
        spans, row = [], 0
        for _, tokens in step:
            spans.append(range(row, row + tokens))
            row += tokens
        rows = rows_by_replica(spans, [owners[rid] for rid, _ in step], replicas)
        assert sorted(r for rs in rows.values() for r in rs) == list(range(row))
        for rs in rows.values():
            assert rs == sorted(rs)  # batch order inside each replica's part


@given(st.lists(st.integers(1, 64), min_size=1, max_size=20), st.integers(2, 3))
def test_new_requests_balance_the_tokens_within_one_request(tokens, count):
    replicas = REPLICAS[:count]
    step = [(f"r{i}", t) for i, t in enumerate(tokens)]
    owners = assign_replicas(step, replicas, {})
    load = {r: sum(t for rid, t in step if owners[rid] == r) for r in replicas}
    assert max(load.values()) - min(load.values()) <= max(tokens)


def test_a_sticky_request_whose_replica_is_not_in_the_range_is_placed_anew():
    owners = assign_replicas([("a", 4), ("b", 4)], ("exec0", "exec1"), {"a": "exec1", "b": "exec9"})
    assert owners == {"a": "exec1", "b": "exec0"}
