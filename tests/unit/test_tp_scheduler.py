"""AMOEBAs' transformation-aware scheduler and its round-robin and least-load-first baselines (§3.3, Fig. 12),
on plain instance views: where a request goes, which instances merge for it, when it is refused, and when a
merged instance drains and splits."""

from hypothesis import given
from hypothesis import strategies as st

from shared.core.tp_scheduler import (Instance, Member, Merge, Refuse, Route, SchedulerState, capacity, decide,
                                 heads_per_rank, split_due)

BS = 16
# The default model's 3 KV heads: a TP1 member stores 3 units a block, TP2 members 2 and 1, TP4 impossible
# without replication, so these views use 4 KV heads: 4 units a block at TP1, 2 at TP2, 1 at TP4.
HEADS = 4
UNITS = {1: 400, 2: 560, 4: 640}  # each executor's KV units at each degree: a wider cut frees more slot pages


def member(name: str) -> Member:
    return Member(name, dict(UNITS))


def tp1(i: int, used: int = 0, load: int = 0, accepting: bool = True) -> Instance:
    cap = capacity((member(f"exec{i}"),), HEADS)
    return Instance(f"i{i}", 1, (member(f"exec{i}"),), HEADS, BS, cap - used, used, load, accepting=accepting)


def merged(name: str, execs: list[int], used: int = 0, load: int = 0, longest: int = 0) -> Instance:
    members = tuple(member(f"exec{i}") for i in execs)
    cap = capacity(members, HEADS)
    return Instance(name, len(execs), members, HEADS, BS, cap - used, used, load, longest)


def aligned(members: tuple[str, ...]) -> bool:
    return len({int(m[4:]) // 4 for m in members}) == 1 if len(members) == 4 else True


def test_capacity_counts_units_per_head_each_member_stores():
    assert heads_per_rank(3, 2) == [2, 1] and heads_per_rank(4, 4) == [1] * 4 and heads_per_rank(2, 4) == [1] * 4
    assert capacity((member("exec0"),), HEADS) == 100  # 400 units, 4 a block
    assert capacity((member("exec0"), member("exec1")), HEADS) == 280  # 560 units, 2 a block, on each
    assert capacity(tuple(member(f"exec{i}") for i in range(4)), HEADS) == 640
    uneven = (Member("exec0", {2: 300}), Member("exec1", {2: 300}))
    assert capacity(uneven, 3) == 150  # exec0 stores 2 of the 3 heads: it runs out first


def test_a_request_that_fits_goes_to_the_least_loaded_instance_that_holds_it():
    cluster = [tp1(0, used=90, load=1), tp1(1, used=10, load=3), tp1(2, used=20, load=2)]
    assert decide(15 * BS, cluster) == Route("i2")  # i0 has less load but only 10 blocks free
    assert decide(15 * BS, cluster[1:2] + [tp1(2, load=3)]) == Route("i2")  # equal load: more free blocks


def test_long_requests_prefer_an_instance_already_merged():
    cluster = [tp1(0), merged("m1", [1, 2], used=20, load=5), tp1(3)]
    assert decide(120 * BS, cluster) == Route("m1")  # beyond any TP1 instance's whole KV
    assert decide(8 * BS, cluster) == Route("i0")  # a short one goes by load


def test_when_none_holds_it_the_least_loaded_pair_of_one_degree_merges():
    cluster = [tp1(0, load=4), tp1(1, load=1), tp1(2, load=2), tp1(3, load=3)]
    assert decide(150 * BS, cluster) == Merge(("i1", "i2"), 2)
    # Beyond a TP2 instance but within a TP4: the step is still x2; the next decision steps again.
    assert decide(400 * BS, cluster) == Merge(("i1", "i2"), 2)
    assert decide(400 * BS, [merged("m0", [0, 1]), merged("m1", [2, 3], load=1)], allowed=aligned) == Merge(
        ("m0", "m1"), 4)


def test_a_request_no_instance_the_cluster_can_form_holds_is_refused():
    cluster = [tp1(i) for i in range(4)]
    decision = decide(700 * BS, cluster, allowed=aligned)
    assert isinstance(decision, Refuse) and decision.never and "needs 700 KV blocks" in decision.reason
    # Executors 2-5 are not an aligned quad: only pairs form, and a pair holds 280 blocks.
    assert decide(400 * BS, [tp1(i) for i in range(2, 6)], allowed=aligned).never
    draining = [tp1(i, accepting=False) for i in range(2)]
    assert not decide(200 * BS, draining).never  # not now, but once they split


def test_a_draining_instance_takes_no_new_request():
    cluster = [tp1(0), merged("m1", [1, 2], load=0)]
    cluster[1] = Instance("m1", 2, cluster[1].members, HEADS, BS, 280, 0, 0, accepting=False)
    assert decide(8 * BS, cluster) == Route("i0")


def test_the_baselines_pick_by_turn_or_load_and_merge_the_chosen_one_with_a_peer():
    cluster = [tp1(0, load=2), tp1(1, load=0), tp1(2, load=1)]
    state = SchedulerState()
    assert [decide(BS, cluster, "rr", state=state) for _ in range(4)] == [Route("i0"), Route("i1"), Route("i2"),
                                                                          Route("i0")]
    assert decide(BS, cluster, "llf") == Route("i1")
    assert decide(150 * BS, cluster, "rr", state=SchedulerState()) == Merge(("i0", "i1"), 2)  # i0's turn
    assert decide(150 * BS, cluster, "llf") == Merge(("i1", "i2"), 2)


def test_a_merged_instance_drains_once_nothing_needs_it_then_splits_when_half_free():
    assert split_due(merged("m", [0, 1], used=200, longest=150)) is None  # a long request still runs
    assert split_due(merged("m", [0, 1], used=200, longest=20)) == "drain"
    assert split_due(merged("m", [0, 1], used=100, longest=20)) == "split"  # 180 of 280 blocks free
    assert split_due(tp1(0)) is None


@st.composite
def clusters(draw):
    instances, execs = [], 0
    for k in range(draw(st.integers(1, 6))):
        tp = draw(st.sampled_from([1, 1, 2, 4]))
        members = tuple(member(f"exec{execs + r}") for r in range(tp))
        execs += tp
        cap = capacity(members, HEADS)
        used = draw(st.integers(0, cap))
        instances.append(Instance(f"i{k}", tp, members, HEADS, BS, cap - used, used, draw(st.integers(0, 9)),
                                  accepting=draw(st.booleans())))
    return instances


@given(clusters(), st.integers(1, 1000 * BS), st.sampled_from(["amoebas", "rr", "llf"]))
def test_every_decision_is_one_the_cluster_can_carry_out(cluster, tokens, strategy):
    need = -(-tokens // BS)
    by_id = {i.id: i for i in cluster}
    decision = decide(tokens, cluster, strategy, allowed=aligned)
    if isinstance(decision, Route):
        chosen = by_id[decision.instance]
        assert chosen.accepting and chosen.blocks_free >= need
    elif isinstance(decision, Merge):
        parts = [by_id[i] for i in decision.instances]
        assert len(parts) == 2 and parts[0].tp == parts[1].tp and decision.tp == 2 * parts[0].tp <= 4
        assert all(p.accepting for p in parts) and aligned(tuple(m.executor for p in parts for m in p.members))
        assert not any(i.accepting and i.blocks_free >= need for i in cluster) or strategy != "amoebas"
    else:
        assert strategy != "amoebas" or not any(i.accepting and i.blocks_free >= need for i in cluster)
        # For good only when nothing the cluster could form holds it even empty: a single instance, or a pair.
        holds = any(capacity(i.members, HEADS) >= need for i in cluster) or any(
            capacity(a.members + b.members, HEADS) >= need for a in cluster for b in cluster
            if a.id < b.id and a.tp == b.tp == 1 and aligned((a.members[0].executor, b.members[0].executor)))
        assert not (decision.never and holds)
