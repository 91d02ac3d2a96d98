"""`morphling profile --speedup`: the speed-up model's coefficients, fitted from a real engine and a real hop
between two processes, written as the JSON the controller loads."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.tools.profile.speedup import Line, fit_line
from tests.checkpoints import write_tiny_llama3

ROOT = Path(__file__).resolve().parents[2]
SIZES = [1, 8, 32]
HOP_TOKENS = [1, 64, 512]


def morphling(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)


def test_fit_line_recovers_a_line():
    line = fit_line([(1, 5.0), (2, 7.0), (4, 11.0), (8, 19.0)])
    assert line.intercept == pytest.approx(3.0) and line.slope == pytest.approx(2.0)


def test_fit_line_never_goes_negative():
    # Falling times (noise at sizes that cost the same) fit a flat line at their mean, not a negative slope.
    assert fit_line([(1, 3.0), (2, 2.0), (3, 1.0)]) == Line(pytest.approx(2.0), 0.0)
    # A line that would cross zero below x = 1 goes through the origin instead of a negative intercept.
    through = fit_line([(1, 1.0), (2, 3.0), (3, 5.0)])
    assert through.intercept == 0.0 and through.slope == pytest.approx((1 + 6 + 15) / (1 + 4 + 9))


def test_fit_line_needs_two_sizes():
    with pytest.raises(ValueError, match="two different x"):
        fit_line([(4, 1.0), (4, 1.2)])


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """The real command on a tiny checkpoint: its JSON, its stdout and where it wrote."""
    tmp = tmp_path_factory.mktemp("speedup")
    model = write_tiny_llama3(tmp / "model")
    out = tmp / "results" / "speedup.json"
    result = morphling("profile", "--speedup", "--model", str(model), "--memory-budget", "4MiB", "--threads", "1",
                       "--sizes", ",".join(map(str, SIZES)), "--hop-tokens", ",".join(map(str, HOP_TOKENS)),
                       "--context", "8", "--repeats", "3", "--out", str(out))
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text()), result.stdout, out


def test_profile_has_the_shape_the_controller_loads(profiled):
    record, _, _ = profiled
    assert record["kind"] == "speedup-profile"
    assert record["model"].endswith("model") and record["device"] == "cpu" and record["threads"] == 1
    # the tiny Llama 3: 4 layers, hidden 64, float32 on CPU
    assert (record["num_layers"], record["hidden_size"], record["dtype_bytes"]) == (4, 64, 4)
    assert set(record["layer"]) == {"intercept_s", "per_token_s"}
    assert set(record["hop"]) == set(record["all_reduce"]) == {"intercept_s", "per_byte_s"}
    assert set(record["step_overhead"]) == {"intercept_s", "per_token_s"}
    assert [t for t, _ in record["samples"]["layer"]] == SIZES
    assert [t for t, _ in record["samples"]["step"]] == SIZES
    assert [b for b, _ in record["samples"]["hop"]] == [t * 64 * 4 for t in HOP_TOKENS]
    assert [b for b, _ in record["samples"]["all_reduce"]] == [t * 64 * 4 for t in HOP_TOKENS]


def test_fitted_costs_are_positive_and_never_fall(profiled):
    # The tiny model's layers are too small for their time to grow above the noise of a shared CPU from 1
    # to 32 sequences, so growth is only asked of the lines: no coefficient below zero, every cost above it.
    record, _, _ = profiled
    for name in ("layer", "hop", "all_reduce", "step_overhead"):
        assert all(value >= 0 for value in record[name].values()), (name, record[name])
    assert all(seconds > 0 for name in ("layer", "hop", "all_reduce") for _, seconds in record["samples"][name])
    layer = Line(record["layer"]["intercept_s"], record["layer"]["per_token_s"])
    hop = Line(record["hop"]["intercept_s"], record["hop"]["per_byte_s"])
    assert 0 < layer.at(SIZES[0]) <= layer.at(SIZES[-1]) and 0 < hop.at(64) <= hop.at(64 * 4 * HOP_TOKENS[-1])


def test_each_line_is_the_fit_of_its_samples(profiled):
    record, _, _ = profiled
    for name, slope in (("layer", "per_token_s"), ("hop", "per_byte_s"), ("all_reduce", "per_byte_s"),
                        ("step_overhead", "per_token_s")):
        line = fit_line(record["samples"]["step" if name == "step_overhead" else name])
        assert (record[name]["intercept_s"], record[name][slope]) == (pytest.approx(line.intercept),
                                                                      pytest.approx(line.slope))


def test_prints_a_table_and_writes_a_chart_beside_the_json(profiled):
    _, stdout, out = profiled
    batches, hops = stdout.split("hop µs")
    assert [int(r[0]) for r in map(str.split, batches.splitlines()) if len(r) == 4 and r[0].isdigit()] == SIZES
    assert [int(r[0]) for r in map(str.split, hops.splitlines()) if len(r) == 4 and r[0].isdigit()] == HOP_TOKENS
    assert all(f"{name}:" in stdout for name in ("layer", "hop", "all-reduce", "step overhead"))
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


def test_profile_help_names_the_speedup_flag():
    plain, speedup = morphling("profile", "--help"), morphling("profile", "--speedup", "--help")
    assert plain.returncode == 0 and "--speedup" in plain.stdout
    assert speedup.returncode == 0 and "--hop-tokens" in speedup.stdout
