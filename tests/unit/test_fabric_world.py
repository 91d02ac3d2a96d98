"""Where an executor finds its world: flags first, then the environment compose sets; bad settings are
refused before anything waits on a rendezvous."""

import pytest

from services.executor.fabric.world import WorldSettings


def test_flags_win_over_the_environment_and_a_world_of_one_is_none(monkeypatch):
    monkeypatch.setenv("MORPHLING_DIST_URL", "tcp://executor-0:29500")
    monkeypatch.setenv("MORPHLING_RANK", "1")
    monkeypatch.setenv("MORPHLING_WORLD_SIZE", "2")
    assert WorldSettings.from_args(None, None, None, 30.0) == WorldSettings("tcp://executor-0:29500", 1, 2, 30.0)
    assert WorldSettings.from_args("tcp://127.0.0.1:1", 0, 4, 5.0) == WorldSettings("tcp://127.0.0.1:1", 0, 4, 5.0)
    assert WorldSettings.from_args(None, None, 1, 30.0) is None


def test_a_world_without_an_address_or_with_a_rank_outside_it_is_refused(monkeypatch):
    monkeypatch.delenv("MORPHLING_DIST_URL", raising=False)
    with pytest.raises(ValueError, match="a world of 2 executors needs --dist-url"):
        WorldSettings.from_args(None, 0, 2, 30.0)
    with pytest.raises(ValueError, match="--rank 2 is outside a world of 2"):
        WorldSettings.from_args("tcp://127.0.0.1:1", 2, 2, 30.0)
