"""Which commands each role takes (shared/core/roles.py), written out here kind by kind, and the words of a refusal."""

import pytest

from shared.core.roles import Role, refusal, role_of

KINDS = ("ping", "drain", "quantize", "restore", "replicate", "migrate", "evict", "batch", "tp_merge", "tp_split")
TAKES = {
    Role.ALONE: {"ping", "drain", "quantize", "restore", "replicate", "migrate", "evict", "batch", "tp_merge"},
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
