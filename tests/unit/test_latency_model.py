"""SplitQuant's latency cost model: the fit, the FittedLatency the planner asks, and `morphling profile
--latency`, which measures a real engine and writes the profile the model is read from."""

import json

import pytest
import torch
from tqdm import tqdm

from services.executor.engine.engine import LLMEngine
from services.executor.engine.graphs import DecodeGraphs
from services.executor.engine.morphing import variants
from services.tools.profile import latency as profile_latency
from shared.config import EngineConfig
from shared.core.planner.latency import (
    DECODE_FEATURES, PREFILL_FEATURES, FittedLatency, LatencyError, decode_features, fit, fit_error,
    load_profile, prefill_features,
)
from tests.checkpoints import write_tiny_llama_8kv

PREFILL = [2e-4, 5e-5, 1e-6, 3e-7, 2e-10]
DECODE = [1e-4, 2e-5, 4e-9, 1e-8]
SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64,
         "dtype_bytes": 4, "num_layers": 30}


def synthetic(coefficients, features, batches, lengths, noise=0.0, seed=0):
    rng = torch.Generator().manual_seed(seed)
    rows = []
    for v in batches:
        for n in lengths:
            exact = sum(c * f for c, f in zip(coefficients, features(v, n)))
            rows.append((v, n, exact * (1 + noise * float(torch.randn(1, generator=rng)))))
    return rows


def test_fit_recovers_known_coefficients():
    prefill = fit(synthetic(PREFILL, prefill_features, [1, 2, 4, 8], [32, 64, 128, 256]), prefill_features)
    decode = fit(synthetic(DECODE, decode_features, [1, 2, 4, 8], [64, 256, 512]), decode_features)
    assert prefill == pytest.approx(PREFILL, rel=1e-6) and decode == pytest.approx(DECODE, rel=1e-6)


def test_noisy_fit_stays_close_and_never_predicts_a_free_layer():
    rows = synthetic(DECODE, decode_features, [1, 2, 4, 8], [64, 256, 512], noise=0.05)
    coefficients = fit(rows, decode_features)
    error = fit_error(rows, lambda v, c: sum(k * f for k, f in zip(coefficients, decode_features(v, c))))
    assert error["points"] == 12 and error["mean_rel"] < 0.05 and error["max_rel"] < 0.15


def test_a_fit_that_dips_below_zero_between_samples_is_constrained():
    # v·((s − 20)² − 1) µs is positive at every sampled prompt but below zero at s = 20: the exact free fit
    # (a negative v·s term) would promise a negative layer there, so the non-negative one is taken.
    rows = [(v, s, 1e-6 * v * ((s - 20) ** 2 - 1)) for v in (1, 2, 4) for s in (10, 18.5, 30)]
    coefficients = fit(rows, prefill_features)
    assert all(k >= 0 for k in coefficients)
    assert sum(k * f for k, f in zip(coefficients, prefill_features(2, 20))) > 0


def test_fit_refuses_points_that_do_not_determine_the_model():
    # Two prompt lengths cannot pin a term quadratic in s.
    with pytest.raises(LatencyError, match="do not determine 5 coefficients"):
        fit(synthetic(PREFILL, prefill_features, [1, 2, 4], [32, 64]), prefill_features)


def fitted() -> FittedLatency:
    return FittedLatency("cpu", SHAPE, {"prefill": {16: PREFILL, 4: PREFILL}, "decode": {16: DECODE, 4: DECODE}})


def test_fitted_latency_round_trips_through_a_record(tmp_path):
    model = fitted()
    path = tmp_path / "latency.json"
    path.write_text(json.dumps(model.to_profile()))
    loaded = load_profile(path)
    assert loaded == model and loaded.bits == [16, 4] and loaded.source == "measured"
    expected = sum(c * f for c, f in zip(PREFILL, prefill_features(4, 128)))
    assert loaded.prefill(16, 4, 128) == pytest.approx(expected)
    assert loaded.decode(4, 8, 512) == pytest.approx(sum(c * f for c, f in zip(DECODE, decode_features(8, 512))))


def test_unprofiled_bits_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(LatencyError, match="no decode latency at 8 bits: profiled \\[16, 4\\]"):
        fitted().decode(8, 1, 64)
    other = tmp_path / "speedup.json"
    other.write_text(json.dumps({"kind": "speedup-profile"}))
    with pytest.raises(LatencyError, match=f"{other}: not a latency-profile record"):
        load_profile(other)
    with pytest.raises(LatencyError, match="cannot read the latency profile"):
        load_profile(tmp_path / "missing.json")


def test_predictions_are_clamped_above_zero():
    model = FittedLatency("cpu", SHAPE, {"prefill": {16: [-1.0, 0, 0, 0, 0]}, "decode": {16: [-1.0, 0, 0, 0]}})
    assert model.prefill(16, 1, 1) > 0 and model.decode(16, 1, 1) > 0


BATCHES, PROMPTS, CONTEXTS = (1, 6), (8, 32, 64), (16, 400)
DECODE_BATCHES = (1, 3, 6)  # decode's own grid of batches


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """The real command on a tiny checkpoint, two precisions, a small grid: its record and its JSON."""
    tmp = tmp_path_factory.mktemp("latency")
    model = write_tiny_llama_8kv(tmp / "tiny")
    out = tmp / "results" / "latency.json"
    threads = torch.get_num_threads()  # the command sets the process's torch threads
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(variants, "DEFAULT_CACHE_DIR", tmp / "variants")
        try:
            record = profile_latency.main([
                "--model", str(model), "--memory-budget", "24MiB", "--threads", "1", "--bits", "16,4",
                "--batches", ",".join(map(str, BATCHES)), "--prompts", ",".join(map(str, PROMPTS)),
                "--contexts", ",".join(map(str, CONTEXTS)), "--decode-batches", ",".join(map(str, DECODE_BATCHES)),
                "--heldout-decode-batches", "4", "--heldout-batches", "2,3", "--heldout-prompts", "16,48",
                "--heldout-contexts", "64", "--layers-timed", "2", "--repeats", "1", "--decode-repeats", "5",
                "--out", str(out)])
        finally:
            torch.set_num_threads(threads)
    return record, out


def test_a_cpu_profile_times_every_layer_in_turn_and_a_gpu_one_four_unless_told():
    assert profile_latency.layers_timed(30, None, "cpu") == list(range(30))
    assert profile_latency.layers_timed(32, None, "cuda") == [0, 10, 21, 31]
    assert profile_latency.layers_timed(30, 2, "cpu") == [0, 29]


def test_profile_loads_as_a_fitted_latency(profiled):
    record, out = profiled
    written = json.loads(out.read_text())
    assert written["coefficients"] == record["coefficients"] and out.with_suffix(".png").exists()
    assert not out.with_suffix(".partial.json").exists()
    model = load_profile(out)
    assert model.device == "cpu" and model.bits == [16, 4]
    assert model.model == {"hidden_size": 128, "intermediate_size": 200, "num_heads": 16, "num_kv_heads": 8,
                           "head_dim": 16, "dtype_bytes": 4, "num_layers": 4}
    assert record["features"] == {"prefill": list(PREFILL_FEATURES), "decode": list(DECODE_FEATURES)}
    assert len(record["samples"]["prefill"]) == 2 * len(BATCHES) * len(PROMPTS)
    assert len(record["samples"]["decode"]) == 2 * len(DECODE_BATCHES) * len(CONTEXTS)
    assert all(s["seconds"] > 0 for phase in ("prefill", "decode") for s in record["samples"][phase])


def test_fitted_profile_is_the_fit_of_the_times_it_wrote_and_predicts_positive_times(profiled):
    # Whether a bigger decode batch measures slower is a speed claim, for the benchmarks: in this tiny model a
    # layer's fixed cost outweighs its KV reads, and a shared CI machine's noise can order any two points.
    record, out = profiled
    model = load_profile(out)
    for phase, features in (("prefill", prefill_features), ("decode", decode_features)):
        length = "prompt" if phase == "prefill" else "context"
        for bits in (16, 4):
            rows = [(r["batch"], r[length], r["seconds"]) for r in record["samples"][phase] if r["bits"] == bits]
            assert record["coefficients"][phase][str(bits)] == pytest.approx(fit(rows, features))
    for bits in (16, 4):
        assert model.prefill(bits, 1, PROMPTS[0]) > 0 and model.prefill(bits, 3, 100) > 0
        assert model.decode(bits, DECODE_BATCHES[0], CONTEXTS[0]) > 0
        assert model.decode(bits, DECODE_BATCHES[-1], CONTEXTS[-1]) > 0


def test_heldout_error_is_reported_per_phase_and_bits(profiled):
    record, _ = profiled
    assert len(record["heldout"]["prefill"]) == 2 * 2 * 2 and len(record["heldout"]["decode"]) == 2 * 1
    for phase, points in (("prefill", 4), ("decode", 1)):
        for bits in ("16", "4"):
            error = record["fit_error"][phase][bits]
            assert error["points"] == points and 0 <= error["mean_rel"] <= error["max_rel"]


def test_a_run_cut_short_in_decode_keeps_the_prefill_it_measured(tmp_path, monkeypatch):
    """A lent GPU's minutes can run out mid-profile: what the finished phase measured stays on disk."""
    monkeypatch.setattr(variants, "DEFAULT_CACHE_DIR", tmp_path / "variants")

    def cut_short(*args):
        raise TimeoutError("the device's time ran out")

    monkeypatch.setattr(profile_latency, "measure_decode", cut_short)
    out = tmp_path / "latency.json"
    threads = torch.get_num_threads()
    try:
        with pytest.raises(TimeoutError):
            profile_latency.main(["--model", str(write_tiny_llama_8kv(tmp_path / "tiny")), "--memory-budget", "24MiB",
                                  "--threads", "1", "--bits", "16", "--batches", "1,2", "--prompts", "8,16,32",
                                  "--heldout-batches", "3", "--heldout-prompts", "24", "--layers-timed", "1",
                                  "--repeats", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert not out.exists()
    kept = json.loads(out.with_suffix(".partial.json").read_text())
    assert sorted((s["batch"], s["prompt"]) for s in kept["prefill"]) == [(1, 8), (1, 16), (1, 32), (2, 8), (2, 16),
                                                                        (2, 32), (3, 24)]
    assert all(s["seconds"] > 0 and s["bits"] == 16 for s in kept["prefill"])


def test_decode_behind_graphs_is_timed_on_each_layers_replay_at_its_bits_in_the_batchs_bucket(tmp_path, monkeypatch):
    """On CUDA the engine serves decode from graphs, so the profile times their replays: here the graphs'
    eager twins stand in for the captured ones, and every timed play must be the layer, bits and bucket
    (buckets 1, 2, 4, 8) that the engine would replay for that batch."""
    monkeypatch.setattr(variants, "DEFAULT_CACHE_DIR", tmp_path / "variants")
    engine = LLMEngine(EngineConfig(model=str(write_tiny_llama_8kv(tmp_path / "tiny")), memory_budget=24 << 20,
                                    max_num_seqs=8, max_num_batched_tokens=256), progress=False)
    graphs = engine.runner.graphs = DecodeGraphs(engine.model, engine.config.block_size, engine.max_model_len, 8,
                                                 engine.config.variant_bits, capture=False)
    played = []
    play = graphs.play_layer
    monkeypatch.setattr(graphs, "play_layer", lambda static, index, bits: (played.append((static.rows, index, bits)),
                                                                          play(static, index, bits)))
    with tqdm(disable=True) as bar:
        seconds = profile_latency.measure_decode(engine, (16, 4), [(3, 32), (5, 32)], [0, 3], 2, bar)
    assert set(seconds) == {(16, 3, 32), (16, 5, 32), (4, 3, 32), (4, 5, 32)} and min(seconds.values()) > 0
    full = engine.model.full_bits  # what the profile calls 16: float32's on the CPU
    assert sorted(set(played)) == [(rows, index, bits) for rows in (4, 8) for index in (0, 3) for bits in (4, full)]
    assert len(played) == 4 * 2 * 3  # every (bits, batch): an untimed run and two timed ones, over two layers
