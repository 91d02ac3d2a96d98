"""The heartbeat rule peers and gateways are kept by: a restart is news, silence past the bound forgets, one
never heard from is never called gone, and an outage of our own bus counts as nobody's silence."""

from hypothesis import given
from hypothesis import strategies as st

from shared.core.liveness import Heartbeats

NAMES = st.sampled_from(["gw0", "gw1", "exec0"])
EVENTS = st.lists(st.tuples(NAMES, st.sampled_from(["a", "b"]), st.floats(0, 5)), max_size=30)


@given(EVENTS, st.floats(0.5, 3))
def test_news_and_silence_follow_the_beats(events, silence):
    beats, now = Heartbeats(silence), 0.0
    model: dict[str, tuple[str, float]] = {}
    for name, incarnation, wait in events:
        now += wait
        gone = beats.silent(now)
        assert sorted(gone) == sorted(n for n, (_, t) in model.items() if now - t > silence)
        for n in gone:
            del model[n]
        news = beats.heard(name, incarnation, now)
        assert news == (name not in model or model[name][0] != incarnation)
        model[name] = (incarnation, now)
        assert all(n in beats and beats.incarnation(n) == i for n, (i, _) in model.items())


def test_an_outage_of_our_own_is_nobodys_silence_and_the_unknown_are_never_gone():
    beats = Heartbeats(3.0)
    beats.heard("gw0", "a", 0.0)
    beats.refresh(10.0)  # our bus was down until now
    assert beats.silent(12.0) == []
    assert beats.silent(13.5) == ["gw0"] and "gw0" not in beats
    assert beats.silent(100.0) == [] and "nobody" not in beats
    assert beats.heard("gw0", "a", 101.0)  # heard again after being forgotten: news


def test_a_late_look_is_our_own_stall_and_forgets_nobody():
    beats = Heartbeats(3.0)
    beats.heard("gw0", "a", 0.0)
    assert beats.look(1.0, every_s=1.0) == []
    assert beats.look(5.0, every_s=1.0) == []  # we were stopped 4 s: the beats wait unread
    assert beats.look(6.0, every_s=1.0) == [] and "gw0" in beats
    assert beats.look(9.5, every_s=1.0, hearing=False) == []  # our bus is down
    assert [beats.look(t, every_s=1.0) for t in (10.0, 11.0, 12.0, 13.0)] == [[], [], [], ["gw0"]]
