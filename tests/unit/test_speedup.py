"""CoCoServe's speed-up model (Eqs. 1–4) against hand-computed values, and the profile the controller loads."""

import json

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from shared.core.speedup import (DEFAULT_PROFILE, Line, SpeedupProfile, SpeedupProfileError,
                                                  Strategy, compute_time, delta, gamma, predict, speedup, speedup_eq4,
                                                  speedup_homogeneous, speedup_with_overhead, transfer_time)

# hidden_size 1 and 1 byte a value: hop bytes = tokens, so hop(t) = 0.1 + 0.01·t by hand.
HAND = SpeedupProfile(model="m", device="cpu", threads=1, num_layers=4, hidden_size=1, dtype_bytes=1,
                      layer=Line(1.0, 0.5), hop=Line(0.1, 0.01), step_overhead=Line(0.5, 0.25))


def profile_dict(**changes) -> dict:
    data = {"kind": "speedup-profile", "model": "default", "device": "cpu", "threads": 1, "num_layers": 30,
            "hidden_size": 576, "dtype_bytes": 4, "layer": {"intercept_s": 0.003, "per_token_s": 9e-05},
            "hop": {"intercept_s": 0.00017, "per_byte_s": 3e-10},
            "step_overhead": {"intercept_s": 0.0, "per_token_s": 0.004},
            "samples": {"layer": [[1, 0.003]], "hop": [[2304, 0.0002]], "step": [[1, 0.009]]},
            "context_tokens": 32, "repeats": 5, "machine": {"cpus": 2}, "date": "2026-11-23", "seconds": 28.1}
    return data | changes


def proportional(per_token: float, per_byte: float, hidden: int = 8) -> SpeedupProfile:
    """The paper's assumption: times proportional to tokens, no intercepts."""
    return SpeedupProfile(model="m", device="cpu", threads=1, num_layers=4, hidden_size=hidden, dtype_bytes=2,
                          layer=Line(0.0, per_token), hop=Line(0.0, per_byte), step_overhead=Line(0.0, 0.0))


def test_a_profile_as_the_profiler_writes_it_loads_and_its_extra_keys_are_ignored(tmp_path):
    path = tmp_path / "speedup.json"
    path.write_text(json.dumps(profile_dict()))
    profile = SpeedupProfile.load(path)
    assert (profile.num_layers, profile.hidden_size, profile.dtype_bytes) == (30, 576, 4)
    assert profile.layer_s(10) == pytest.approx(0.003 + 10 * 9e-05)
    assert profile.hop_s(10) == pytest.approx(0.00017 + 10 * 576 * 4 * 3e-10)  # t tokens of d values
    assert profile.overhead_s(10) == pytest.approx(0.04)
    assert profile.all_reduce is None  # written before the profiler timed all-reduces
    profile = SpeedupProfile.from_dict(profile_dict(all_reduce={"intercept_s": 0.0007, "per_byte_s": 1e-9}))
    assert profile.all_reduce.at(1000) == pytest.approx(0.0007 + 1e-6)


@pytest.mark.parametrize("changes, field", [
    (dict(kind="lis-profile"), "kind"),
    (dict(model=""), "model"),
    (dict(threads=True), "threads"),
    (dict(num_layers=0), "num_layers"),
    (dict(hidden_size="576"), "hidden_size"),
    (dict(layer={"intercept_s": 0.003}), "layer.per_token_s"),
    (dict(hop={"intercept_s": -1.0, "per_byte_s": 0.0}), "hop.intercept_s"),
    (dict(hop=[0.1, 0.2]), "hop"),
    (dict(all_reduce={"intercept_s": 0.001}), "all_reduce.per_byte_s"),
    (dict(step_overhead={"intercept_s": float("nan"), "per_token_s": 0.0}), "step_overhead.intercept_s"),
    (dict(layer={"intercept_s": 0, "per_token_s": 0}), "layer"),
])
def test_a_bad_profile_is_refused_naming_the_file_and_the_field(tmp_path, changes, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(profile_dict(**changes)))
    with pytest.raises(SpeedupProfileError, match=f"{path}: {field}:"):
        SpeedupProfile.load(path)


def test_an_unreadable_profile_is_refused(tmp_path):
    with pytest.raises(SpeedupProfileError, match="cannot read the speed-up profile"):
        SpeedupProfile.load(tmp_path / "missing.json")
    (tmp_path / "torn.json").write_text('{"kind": "speedup-')
    with pytest.raises(SpeedupProfileError, match="cannot read the speed-up profile"):
        SpeedupProfile.load(tmp_path / "torn.json")
    with pytest.raises(SpeedupProfileError, match=r"\(top level\)"):
        SpeedupProfile.from_dict([1, 2])


def test_delta_is_two_transfers_per_replicated_run_over_the_replicated_layers():
    assert delta(Strategy.sequential(4)) == 0.0
    assert delta(Strategy((("a",), ("a", "b"), ("a", "b"), ("a",)))) == 1.0  # one run of 2
    assert delta(Strategy((("a",), ("a", "b"), ("a", "b"), ("a",), ("a", "b")))) == pytest.approx(4 / 3)
    # Neighbours with different copies are two segments of the fabric: two scatters and two gathers.
    assert delta(Strategy((("a", "b"), ("a", "c")))) == 2.0


def test_eq1_to_eq3_by_hand():
    p = Strategy((("a",), ("a", "b"), ("a", "b"), ("a",)))  # P = [1, 2, 2, 1], t = 4 tokens
    # W: layer(4) + layer(2) + layer(2) + layer(4) = 3 + 2 + 2 + 3; W(P0) = 4 * 3
    assert compute_time(p, HAND, 4) == pytest.approx(10.0)
    # T: δ = 1, the replicas' shares of 2 tokens each: hop(2) = 0.12, twice
    assert transfer_time(p, HAND, 4) == pytest.approx(0.24)
    assert speedup(p, HAND, 4) == pytest.approx(12 / 10.24)
    # With the rest of the step (0.5 + 0.25 * 4 = 1.5 s) on both sides
    assert speedup_with_overhead(p, HAND, 4) == pytest.approx(13.5 / 11.74)
    # Eq. 4: γ = δ · hop(4) / layer(4) = 0.14 / 3; Σ 1/p = 3
    g = 0.14 / 3
    assert gamma(p, HAND, 4) == pytest.approx(g)
    assert speedup_eq4(p, HAND, 4) == pytest.approx(1 / (g + (1 - g) / 4 * 3))


@hsettings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=30), st.floats(1, 512))
def test_even_splits_counted_by_copies_are_the_equations_written_out(replicas, tokens):
    """Without `bs`, W(P) and T(P) count layers by their copies; with the even split written out as `bs`, they
    take each layer's slowest copy and move each replica's rows: the same times."""
    p = Strategy.of_replicas(replicas)
    even = [[tokens / r] * r for r in replicas]
    assert compute_time(p, DEFAULT_PROFILE, tokens) == pytest.approx(compute_time(p, DEFAULT_PROFILE, tokens, even))
    assert transfer_time(p, DEFAULT_PROFILE, tokens) == pytest.approx(
        transfer_time(p, DEFAULT_PROFILE, tokens, even))
    assert speedup(Strategy.sequential(len(replicas)), DEFAULT_PROFILE, tokens) == 1.0


def test_uneven_splits_take_the_slowest_copy_and_move_only_the_replicas_rows():
    p = Strategy((("a", "b"),))
    assert compute_time(p, HAND, 4, bs=[[3, 1]]) == pytest.approx(HAND.layer_s(3))
    assert transfer_time(p, HAND, 4, bs=[[3, 1]]) == pytest.approx(2 * HAND.hop_s(1))  # δ = 2 for one layer
    with pytest.raises(ValueError, match="one batch share per copy"):
        compute_time(p, HAND, 4, bs=[[4]])


@hsettings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.floats(0, 1), st.floats(0, 1e-3), st.floats(0, 1e-3), st.floats(0, 1e-8),
       st.integers(1, 512))
def test_the_sequential_strategy_has_speedup_one(n, a, b, h0, h1, tokens):
    profile = SpeedupProfile(model="m", device="cpu", threads=1, num_layers=n, hidden_size=64, dtype_bytes=2,
                             layer=Line(a, b + 1e-6), hop=Line(h0, h1), step_overhead=Line(a, b))
    p0 = Strategy.sequential(n)
    for equation in ("eq3", "eq4"):
        assert predict(p0, profile, tokens, equation) == pytest.approx(1.0)
    assert speedup_with_overhead(p0, profile, tokens) == pytest.approx(1.0)
    assert speedup_homogeneous([1] * n, 0.7) == pytest.approx(1.0)


@pytest.mark.parametrize("n", [1, 4, 30])
def test_all_layers_replicated_without_bound_tend_to_one_over_gamma(n):
    g = 0.05
    assert speedup_homogeneous([10 ** 12] * n, g) == pytest.approx(1 / g)
    # Eq. 3 on the paper's proportional times: one run of n layers has δ = 2/n, so γ = (2/n)·hop/layer,
    # here 0.1 whatever n (a hop of 16 tokens moves 16 * 8 values of 2 bytes; a layer takes 16 ms).
    profile = proportional(per_token=1e-3, per_byte=0.05 * n * 0.016 / 256)
    errors = []
    for p in (10, 100, 1000, 10000):
        strategy = Strategy.of_replicas([p] * n)
        assert gamma(strategy, profile, 16) == pytest.approx(2 / n * profile.hop_s(16) / profile.layer_s(16))
        errors.append(abs(speedup(strategy, profile, 16) * gamma(strategy, profile, 16) - 1))
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-2


@hsettings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=24), st.floats(1e-6, 1e-2), st.floats(1e-9, 1e-4),
       st.integers(1, 256))
def test_eq4_is_eq3_for_even_splits_on_proportional_times(replicas, per_token, per_byte, tokens):
    profile = proportional(per_token, per_byte)
    p = Strategy.of_replicas(replicas)
    assert speedup_eq4(p, profile, tokens) == pytest.approx(speedup(p, profile, tokens), rel=1e-9)


def test_a_contiguous_run_of_replicas_beats_the_same_replicas_scattered():
    contiguous = Strategy.sequential(8).with_replicas([2, 3, 4, 5], "b")
    scattered = Strategy.sequential(8).with_replicas([0, 2, 4, 6], "b")
    for equation in ("eq3", "eq4"):
        assert predict(contiguous, DEFAULT_PROFILE, 32, equation) > predict(scattered, DEFAULT_PROFILE, 32, equation)


def test_intercepts_make_eq3_more_modest_than_eq4():
    # Half a batch does not take half the time when a layer has a fixed cost: only Eq. 3 sees it.
    p = Strategy.of_replicas([2] * 30)
    assert 1.0 < speedup(p, DEFAULT_PROFILE, 64) < speedup_eq4(p, DEFAULT_PROFILE, 64) < 2.0


def test_strategies_refuse_nonsense():
    with pytest.raises(ValueError):
        Strategy((("a", "a"),))
    with pytest.raises(ValueError):
        Strategy.of_replicas([1, 0])
    with pytest.raises(ValueError, match="equation"):
        predict(Strategy.sequential(2), DEFAULT_PROFILE, 1, "eq5")
