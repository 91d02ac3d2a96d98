"""Which commands each role takes (shared/core/roles.py), written out here kind by kind, and the words of a refusal."""

import pytest

from shared.core.roles import Role, join_refusal, refusal, role_of
from tests.unit.test_router import executor

KINDS = ("ping", "drain", "quantize", "restore", "replicate", "migrate", "evict", "batch", "tp_merge", "tp_split",
         "join")
TAKES = {
    Role.ALONE: {"ping", "drain", "quantize", "restore", "replicate", "migrate", "evict", "batch", "tp_merge", "join"},
    Role.LEADER: {"ping", "drain", "quantize", "restore", "replicate", "migrate", "evict", "batch", "tp_merge"},
    Role.MERGED: {"ping", "drain", "tp_merge", "tp_split"},
    Role.MEMBER: {"ping", "drain"},
}


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("kind", KINDS)
def test_each_role_takes_the_commands_written_here_and_refuses_the_rest(role, kind):
    why = refusal(role, kind, "exec1", "i0", "exec0")
    assert (why is None) == (kind in TAKES[role]), why


def test_a_refusal_says_where_to_go_instead():
    assert refusal(Role.MEMBER, "quantize", "exec1", "i0", "exec0") == \
        "exec1 is a member of instance i0, which morphs as a whole: send it to its leader exec0"
    assert refusal(Role.MERGED, "restore", "exec0", "tp-exec0-exec1", "exec0").endswith("restore it after its split")
    assert "nothing to split back into" in refusal(Role.ALONE, "tp_split", "exec0")


@pytest.mark.parametrize("in_instance, leads, merged, role", [
    (False, True, False, Role.ALONE), (True, True, False, Role.LEADER), (True, True, True, Role.MERGED),
    (True, False, False, Role.MEMBER), (True, False, True, Role.MEMBER)])
def test_the_role_follows_from_the_instance_and_who_leads_it(in_instance, leads, merged, role):
    assert role_of(in_instance, leads, merged) is role


def test_every_command_kind_is_written_out_above():
    from shared.messages import COMMAND_ARGS

    assert set(KINDS) == set(COMMAND_ARGS)


def _in_world(e, world=("exec0", "exec1")):
    return e.model_copy(update={"telemetry": e.telemetry.model_copy(update={"world": list(world)})})


def test_an_executor_serving_alone_in_the_leaders_world_may_join_its_instance_and_no_other():
    from shared.core.plans import alone, tp_plans

    leader = _in_world(executor("exec0"))
    assert join_refusal(_in_world(executor("exec1")), leader) is None
    assert join_refusal(_in_world(executor("exec1", plan=alone("exec1", 4))), leader) is None  # `up`'s i1
    (pair,) = tp_plans(["exec1", "exec2"], 2, 4)
    refused = {
        "is not alive": executor("exec1", alive=False),
        "in instance tp0 already": executor("exec1", plan=pair.model_copy(update={"id": "tp0"})),
        "is draining": executor("exec1", draining=True),
        "serves other, not m": executor("exec1", model="other"),
    }
    for why, candidate in refused.items():
        assert why in join_refusal(_in_world(candidate), leader)
    assert "no peers of one world" in join_refusal(_in_world(executor("exec2"), ("exec2",)), leader)
