"""The KV head plans of a TP merge and split (AMOEBAs §3.1), on simulated members whose every head unit holds a
label: after the plan's moves each member holds exactly its heads of every block (a gather would give the
same), no unit is booked twice, the freed bubbles are reused, and a split puts every block whole into one
page of the member that serves it, back in its old page where it can."""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services.executor.fabric.kv_heads import KvPlanError, MergePlan, plan_merge, plan_split
from services.executor.fabric.shards import head_shards


def label(block, head):
    return f"{block}/h{head}"


def apply(memories, moves, copies=()):
    """Every source read first, then every write: the order the runtime keeps."""
    read = [(m, memories[m.src][m.src_unit]) for m in [*moves, *copies]]
    for m, value in read:
        memories[m.dst][m.dst_unit] = value


@st.composite
def clusters(draw):
    kv, tp = draw(st.sampled_from([(1, 2), (2, 2), (3, 2), (4, 2), (4, 4), (2, 4), (8, 4)]))
    group = draw(st.integers(1, 2)) * (tp // kv if tp > kv else 1)
    heads = [s.kv for s in head_shards(kv * group, kv, tp)]
    members = []
    for r in range(tp):
        pages = draw(st.integers(4, 14))
        slots = set(draw(st.lists(st.integers(0, pages - 1), max_size=3)))
        rest = [p for p in range(pages) if p not in slots]
        live = draw(st.lists(st.sampled_from(rest), unique=True, max_size=len(rest) // 3))
        members.append(dict(pages=pages, slots=slots, live=live, free=[p for p in rest if p not in live]))
    return kv, heads, members


def merged(kv, heads, members):
    blocks = [{f"m{r}b{i}": page for i, page in enumerate(m["live"])} for r, m in enumerate(members)]
    memories = [{} for _ in members]
    for r, own in enumerate(blocks):
        for block, page in own.items():
            for h in range(kv):
                memories[r][page * kv + h] = label(block, h)
    plan = plan_merge(kv, heads, blocks, [m["free"] for m in members])
    apply(memories, plan.moves)
    return blocks, memories, plan


def check_merged(kv, heads, members, blocks, memories, plan: MergePlan):
    every = {b for own in blocks for b in own}
    for r, m in enumerate(members):
        assert set(plan.units[r]) == every
        used = [u for us in plan.units[r].values() for u in us]
        assert len(used) == len(set(used)) == len(every) * len(heads[r])
        slot_units = {p * kv + h for p in m["slots"] for h in range(kv)}
        assert not set(used) & (plan.free_units[r] | slot_units)
        assert set(used) | plan.free_units[r] | slot_units == set(range(m["pages"] * kv))  # nothing lost
        for block, us in plan.units[r].items():
            assert [memories[r][u] for u in us] == [label(block, h) for h in heads[r]]
        for block, page in blocks[r].items():  # own heads of own blocks stayed where they were
            assert plan.units[r][block] == tuple(page * kv + h for h in heads[r])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=clusters(), data=st.data())
def test_merge_then_split_keeps_every_head_of_every_block(cluster, data):
    kv, heads, members = cluster
    try:
        blocks, memories, plan = merged(kv, heads, members)
    except KvPlanError as exc:
        assert "tp_merge: member" in str(exc) and "free head units" in str(exc)
        event("the merge did not fit")
        return
    check_merged(kv, heads, members, blocks, memories, plan)

    every = sorted({b for own in blocks for b in own})
    target = {b: data.draw(st.integers(0, len(members) - 1)) for b in every}
    home = {b: (r, page) for r, own in enumerate(blocks) for b, page in own.items()}
    reserved = [set(data.draw(st.lists(st.sampled_from(m["free"]), unique=True, max_size=2)) if m["free"] else ())
                for m in members]
    try:
        split = plan_split(kv, heads, plan.units, plan.free_units, target, home, reserved)
    except KvPlanError as exc:
        assert "tp_split: member" in str(exc) and "whole free KV pages" in str(exc)
        event("the split did not fit")
        return
    event("split with copies into fresh pages" if split.copies else "split moving heads only" if split.moves
          else "nothing to move")
    apply(memories, split.moves, split.copies)
    for r, m in enumerate(members):
        mine = [b for b in every if target[b] == r]
        assert set(split.pages[r]) == set(mine)
        pages = list(split.pages[r].values())
        assert len(pages) == len(set(pages)) and not set(pages) & (m["slots"] | set(reserved[r]) | split.free_pages[r])
        for block, page in split.pages[r].items():
            assert [memories[r][page * kv + h] for h in range(kv)] == [label(block, h) for h in range(kv)]
        assert set(pages) | split.free_pages[r] | m["slots"] == set(range(m["pages"]))  # every page whole again


@settings(max_examples=60, deadline=None)
@given(cluster=clusters())
def test_a_split_straight_after_a_merge_sends_each_block_home_in_place(cluster):
    kv, heads, members = cluster
    try:
        blocks, memories, plan = merged(kv, heads, members)
    except KvPlanError:
        return
    home = {b: (r, page) for r, own in enumerate(blocks) for b, page in own.items()}
    target = {b: r for b, (r, _) in home.items()}
    split = plan_split(kv, heads, plan.units, plan.free_units, target, home, [set() for _ in members])
    assert not split.copies  # nothing copied inside a member: every block is back in its own page
    assert all(split.pages[r] == blocks[r] for r in range(len(members)))
    assert len(split.moves) == sum(len(own) * (kv - len(heads[r])) for r, own in enumerate(blocks))


def test_the_default_models_uneven_tp2_merge_fills_the_bubbles_before_a_whole_page():
    # 3 KV heads, TP2: exec0 keeps heads 0-1 of its blocks (pages 0, 1), exec1 head 2; each has page 2 free.
    plan = plan_merge(3, [range(0, 2), range(2, 3)], [{"a": 0, "b": 1}, {"c": 0, "d": 1}], [[2], [2]])
    assert plan.units[0] == {"a": (0, 1), "b": (3, 4), "c": (2, 5), "d": (6, 7)}  # c in the two bubbles
    assert plan.units[1] == {"c": (2,), "d": (5,), "a": (0,), "b": (1,)}
    assert plan.free_units == [{8}, {3, 4, 6, 7, 8}]


def test_a_merge_that_does_not_fit_says_who_and_by_how_much():
    with pytest.raises(KvPlanError, match="tp_merge: exec0 needs 4 free head units .* has 2"):
        plan_merge(3, [range(0, 2), range(2, 3)], [{"a": 0, "b": 1}, {"c": 0, "d": 1}], [[], []],
                   names=["exec0", "exec1"])
