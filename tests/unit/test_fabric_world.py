"""An executor's peers and the groups it forms with them: the start-time flags from the environment compose
sets, the world's order, and which incarnation a group is formed for."""

import pytest

from services.executor.fabric.world import FabricError, Peer, World
from services.executor.process import _parse_args
from shared.core.plans import alone, instance_plans, start_plan


def test_the_world_flags_come_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("MORPHLING_RANK", "1")
    monkeypatch.setenv("MORPHLING_WORLD_SIZE", "2")
    monkeypatch.setenv("MORPHLING_ADVERTISE_HOST", "executor-1")
    args = _parse_args([])
    assert (args.rank, args.world_size, args.advertise_host) == (1, 2, "executor-1")
    args = _parse_args(["--rank", "0", "--world-size", "4", "--advertise-host", "10.0.0.7"])
    assert (args.rank, args.world_size, args.advertise_host) == (0, 4, "10.0.0.7")


def test_peers_are_in_start_order_and_a_restart_replaces_its_old_life():
    world = World(Peer("exec1", 1, "h:1", "a"), "cpu", 5.0, store=None)
    assert world.admit(Peer("exec10", 10, "h:10", "b"))
    assert world.admit(Peer("exec0", 0, "h:0", "c"))
    assert world.admit(Peer("exec2", 2, "h:2", "d"))
    assert world.names == ["exec0", "exec1", "exec2", "exec10"]  # by rank, not by name
    assert not world.admit(Peer("exec2", 2, "h:2", "d"))  # a heartbeat changes nothing
    assert world.admit(Peer("exec2", 2, "h:2", "e")) and world.peer("exec2").incarnation == "e"
    world.forget("exec10")
    world.forget("exec1")  # never itself
    assert world.names == ["exec0", "exec1", "exec2"]
    with pytest.raises(FabricError, match="not peers"):
        world.group(["exec1", "exec10"])


def test_what_a_collective_gathers_is_put_back_in_the_members_order():
    world = World(Peer("exec0", 0, "h:0", "a"), "cpu", 5.0, store=None,
                  peers=[Peer(f"exec{i}", i, f"h:{i}", "a") for i in range(4)])
    # group(["exec2", "exec0"]) has exec0 as group rank 0: a gather lists exec0's first.
    assert world.group_rank(["exec2", "exec0"], "exec0") == 0
    assert world.in_member_order(["exec2", "exec0"], ["from exec0", "from exec2"]) == ["from exec2", "from exec0"]
    assert world.in_member_order(["exec1", "exec3"], ["a", "b"]) == ["a", "b"]


def test_a_restarted_member_serves_alone_when_its_instance_went_on_without_it():
    plans = instance_plans(["exec0", "exec1", "exec2", "exec3"], 30, tp=2)
    assert start_plan(plans, "exec1", set(), 30) == plans[0]  # a fresh start: the plan
    assert start_plan(plans, "exec1", {"exec2", "exec3"}, 30) == plans[0]  # others' instances do not count
    assert start_plan(plans, "exec1", {"exec0"}, 30, bits=8) == alone("exec1", 30, 8)
