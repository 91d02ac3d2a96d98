"""`morphling eval ppl` and `morphling profile`: sane perplexity, exact restore, the paper's greedy swap order,
and a start-up that profiles a model once."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.executor.engine.engine import LLMEngine
from services.executor.engine.model.decoder import ForwardBatch, PrefillChunk, rms_norm
from services.executor.engine.morphing import importance as profiling
from services.executor.engine.morphing.importance import (
    DEFAULT_PROFILE, MDS_STRIDE, WEIGHTS, MissingCorpusError, decoder_layer, fingerprint, load_tokens, profile,
    swap_order_for,
)
from services.executor.engine.morphing.simulated import PROJECTIONS, SimulatedQuantization
from services.executor.engine.morphing.variants import DEFAULT_CORPUS
from services.tools import evaluate as evaluation
from services.tools.evaluate import evaluate, markdown_table, perplexity, table
from shared.config import EngineConfig
from tests.checkpoints import write_tiny_llama3, write_tiny_qwen2

ROOT = Path(__file__).resolve().parents[2]
SLICE = 1024
WINDOW = 512
CALIBRATION = [list(range(5, 69)), list(range(100, 140))]  # two windows of unequal length, tiny vocabulary


@pytest.fixture(scope="module")
def smol():
    return LLMEngine(EngineConfig(memory_budget=600 << 20, max_model_len=WINDOW), progress=False)


@pytest.fixture(scope="module")
def tokens(smol):
    if not DEFAULT_CORPUS.exists():
        pytest.skip(f"no corpus at {DEFAULT_CORPUS}")
    return load_tokens(smol, DEFAULT_CORPUS, SLICE)


@pytest.fixture(scope="module")
def full_ppl(smol, tokens):
    return perplexity(smol, tokens, WINDOW)


def tiny(writer, tmp_path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(writer(tmp_path / "model")), memory_budget=4 << 20, block_size=8,
                                  max_model_len=128), progress=False)


def test_perplexity_of_the_default_model_is_sane(tokens, full_ppl):
    assert len(tokens) == SLICE
    print(f"SmolLM2-135M, first {SLICE} wikitext-2 test tokens: ppl {full_ppl:.3f}")
    assert math.isfinite(full_ppl) and 1 < full_ppl < 100


def test_k0_is_the_unmodified_model_and_quantized_layers_are_restored_bit_for_bit(smol, tokens, full_ppl):
    quant = SimulatedQuantization(smol)
    layers = [0, 13, 29]
    before = {i: {n: smol.model.layers[i][n].clone() for n in PROJECTIONS} for i in layers}
    assert evaluate(smol, quant, tokens[:WINDOW], WINDOW, [], 4) == perplexity(smol, tokens[:WINDOW], WINDOW)
    quantized = evaluate(smol, quant, tokens[:WINDOW], WINDOW, layers, 4)
    assert quantized != perplexity(smol, tokens[:WINDOW], WINDOW)  # the swap really changed the weights
    for i in layers:
        for name in PROJECTIONS:
            assert torch.equal(smol.model.layers[i][name], before[i][name]), (i, name)
    assert smol.arena.ledger.snapshot().pages_kv_used == 0  # the windows' KV pages went back
    assert perplexity(smol, tokens, WINDOW) == full_ppl


def test_int8_on_every_layer_stays_within_a_few_percent(smol, tokens, full_ppl):
    quant = SimulatedQuantization(smol)
    ppl = evaluate(smol, quant, tokens, WINDOW, list(range(smol.model_config.num_layers)), 8)
    print(f"INT8 on all layers: ppl {ppl:.3f} vs {full_ppl:.3f}")
    assert abs(ppl / full_ppl - 1) < 0.03


def engine_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Every row's logits from the engine's own forward pass, one prefill chunk in KV pages."""
    bs, ledger, n = engine.config.block_size, engine.arena.ledger, len(ids)
    pages = [ledger.allocate() for _ in range(-(-n // bs))]
    try:
        slots = torch.tensor([pages[p // bs] * bs + p % bs for p in range(n)])
        batch = ForwardBatch(torch.tensor(ids), torch.arange(n), slots, [],
                             [PrefillChunk(0, n, torch.tensor(pages, dtype=torch.int32), 0)], torch.arange(n))
        with torch.inference_mode():
            return engine.model.forward(batch).float()
    finally:
        for page in pages:
            ledger.decref(page)


def token_mean_cosine(pairs) -> float:
    cosines = torch.cat([F.cosine_similarity(a, b, dim=-1) for a, b in pairs])
    return float(cosines.mean())


@pytest.mark.parametrize("writer", [write_tiny_llama3, write_tiny_qwen2])
def test_profile_layer_walk_reproduces_the_engine_forward(writer, tmp_path):
    engine = tiny(writer, tmp_path)
    model, ids = engine.model, list(range(3, 60))
    expected = engine_logits(engine, ids)
    with torch.inference_mode():
        n = len(ids)
        x = F.embedding(torch.tensor(ids), model.embed_tokens)
        cos, sin = model.cos[:n].unsqueeze(1), model.sin[:n].unsqueeze(1)
        for i in range(model.cfg.num_layers):
            x = decoder_layer(model, i, x, cos, sin)
        got = F.linear(rms_norm(x, model.norm, model.cfg.rms_norm_eps), model.lm_head).float()
    torch.testing.assert_close(got, expected)


def test_profile_orders_every_layer_with_similarities_in_range_and_restores_the_weights(tmp_path):
    engine = tiny(write_tiny_llama3, tmp_path)
    before = [{n: w[n].clone() for n in PROJECTIONS} for w in engine.model.layers]
    result = profile(engine, CALIBRATION)
    num_layers = engine.model_config.num_layers
    assert sorted(result["order"]) == list(range(num_layers))
    assert [s["layer"] for s in result["steps"]] == result["order"]
    similarities = result["lts"] + result["lrs"] + [m for s in result["steps"] for m in s["mds"].values()]
    assert len(similarities) == 2 * num_layers + num_layers * (num_layers + 1) // 2
    assert all(-1 - 1e-6 <= s <= 1 + 1e-6 for s in similarities)
    assert all(torch.equal(w[n], b[n]) for w, b in zip(engine.model.layers, before) for n in PROJECTIONS)


def brute_force_lis(engine: LLMEngine, quantized: list[int]) -> dict[int, float]:
    """LIS of every layer not in `quantized`, given those quantized: LTS and LRS from a plain layer walk,
    MDS from whole forward passes of the engine, nothing reused between candidates."""
    model, num_layers = engine.model, engine.model_config.num_layers
    quant = SimulatedQuantization(engine)
    lts, lrs = [], []
    walks = []
    with torch.inference_mode():
        for ids in CALIBRATION:
            cos, sin = model.cos[:len(ids)].unsqueeze(1), model.sin[:len(ids)].unsqueeze(1)
            xs = [F.embedding(torch.tensor(ids), model.embed_tokens)]
            for i in range(num_layers):
                xs.append(decoder_layer(model, i, xs[i], cos, sin))
            walks.append((xs, cos, sin))
        for i in range(num_layers):
            lts.append(token_mean_cosine((xs[i + 1], xs[i]) for xs, _, _ in walks))
            quant.apply([i], 4)
            lrs.append(token_mean_cosine((xs[i + 1], decoder_layer(model, i, xs[i], cos, sin))
                                         for xs, cos, sin in walks))
            quant.restore()
    quant.apply(quantized, 4)
    try:
        reference = [engine_logits(engine, ids)[::MDS_STRIDE] for ids in CALIBRATION]
        lis = {}
        for j in (j for j in range(num_layers) if j not in quantized):
            quant.apply([j], 4)
            mds = token_mean_cosine(zip(reference, (engine_logits(engine, ids)[::MDS_STRIDE] for ids in CALIBRATION)))
            quant.restore([j])
            lis[j] = WEIGHTS["lts"] * lts[j] + WEIGHTS["lrs"] * lrs[j] + WEIGHTS["mds"] * mds
    finally:
        quant.restore()
    return lis


@pytest.mark.parametrize("writer", [write_tiny_llama3, write_tiny_qwen2])
def test_greedy_profile_picks_the_brute_force_argmax_of_lis_at_every_step(writer, tmp_path):
    engine = tiny(writer, tmp_path)
    result = profile(engine, CALIBRATION)
    for step, chosen in enumerate(result["order"]):
        lis = brute_force_lis(engine, result["order"][:step])
        assert chosen == max(lis, key=lis.get), (step, lis)
        assert result["steps"][step]["lis"] == pytest.approx(lis[chosen], abs=1e-5)


def test_lrs_is_local_to_its_layer_while_mds_sees_the_whole_model(tmp_path):
    engine = tiny(write_tiny_llama3, tmp_path)
    before = profile(engine, CALIBRATION)
    with torch.no_grad():
        engine.model.layers[3]["down_proj"].mul_(3)  # only the last layer changes
    after = profile(engine, CALIBRATION)
    assert after["lrs"][:3] == before["lrs"][:3] and after["lts"][:3] == before["lts"][:3]
    assert after["lrs"][3] != before["lrs"][3]
    # quantizing layer 0 alone reaches the logits through layer 3, so its model-level score moves
    assert after["steps"][0]["mds"][0] != pytest.approx(before["steps"][0]["mds"][0], abs=1e-6)


@pytest.fixture
def counted_passes(monkeypatch):
    """How many decoder-layer passes the profiler ran since the fixture started."""
    passes = []
    real = profiling.decoder_layer

    def counting(*args):
        passes.append(1)
        return real(*args)

    monkeypatch.setattr(profiling, "decoder_layer", counting)
    return passes


def startup_order(engine: LLMEngine, tmp_path: Path, corpus: Path = DEFAULT_CORPUS,
                  shipped: Path | None = None) -> list[int]:
    return swap_order_for(engine, corpus, tmp_path / "cache", progress=False, max_tokens=256, window=128,
                          shipped=shipped or tmp_path / "no-shipped-profile.json")


def test_startup_profiles_a_model_once_then_reads_its_cache(tmp_path, counted_passes):
    engine = tiny(write_tiny_llama3, tmp_path)
    first = startup_order(engine, tmp_path)
    assert counted_passes and sorted(first) == [0, 1, 2, 3]
    cached = tmp_path / "cache" / f"{fingerprint(engine)}.json"
    assert list(cached.parent.iterdir()) == [cached]  # no temporary file left behind
    assert cached.stat().st_mode & 0o777 == 0o644
    record = json.loads(cached.read_text())
    assert record["order"] == first and record["tokens"] == 256 and len(record["steps"]) == 4
    counted_passes.clear()
    assert startup_order(engine, tmp_path, corpus=tmp_path / "gone.txt") == first
    assert not counted_passes


@pytest.mark.parametrize("same_model", [True, False])
def test_startup_uses_a_shipped_profile_only_for_its_own_model(tmp_path, counted_passes, same_model):
    engine = tiny(write_tiny_llama3, tmp_path)
    shipped = tmp_path / "shipped.json"
    key = fingerprint(engine) if same_model else "another-model"
    shipped.write_text(json.dumps({"order": [2, 0, 3, 1], "model_fingerprint": key}))
    order = startup_order(engine, tmp_path, shipped=shipped)
    if same_model:
        assert order == [2, 0, 3, 1] and not counted_passes
    else:
        assert counted_passes and order == json.loads((tmp_path / "cache" / f"{fingerprint(engine)}.json")
                                                      .read_text())["order"]


def test_startup_without_a_corpus_raises_a_typed_error_and_caches_nothing(tmp_path):
    engine = tiny(write_tiny_llama3, tmp_path)
    with pytest.raises(MissingCorpusError) as raised:
        startup_order(engine, tmp_path, corpus=tmp_path / "gone.txt")
    assert raised.value.corpus == tmp_path / "gone.txt" and "gone.txt" in str(raised.value)
    assert not (tmp_path / "cache").exists()


def test_the_shipped_profile_is_the_default_models_greedy_profile(smol, tmp_path):
    shipped = json.loads(DEFAULT_PROFILE.read_text())
    assert shipped["algorithm"].startswith("greedy")
    # a start-up of the default model needs neither the corpus nor a pass of its own
    assert swap_order_for(smol, tmp_path / "gone.txt", tmp_path, progress=False) == shipped["order"]


def test_table_measures_a_set_of_layers_once_and_averages_random_runs(tmp_path, monkeypatch):
    engine = tiny(write_tiny_llama3, tmp_path)
    measured = []

    def fake_evaluate(engine, quant, tokens, window, layers, bits):
        measured.append((bits, sorted(layers)))
        return 10.0 + len(layers) + (3 in layers)

    monkeypatch.setattr(evaluation, "evaluate", fake_evaluate)
    orders = {"lis": [[1, 0, 2, 3]], "front": [[0, 1, 2, 3]], "random": [[3, 0, 1, 2], [2, 0, 1, 3]]}
    rows = table(engine, SimulatedQuantization(engine), [], 8, orders, [0, 2, 4], [4])
    # K=0 and K=4 once for every order, {0, 1} once for lis and front alike
    assert sorted(measured) == [(4, []), (4, [0, 1]), (4, [0, 1, 2, 3]), (4, [0, 2]), (4, [0, 3])]
    random_k2 = next(r for r in rows if r["order"] == "random" and r["k"] == 2)
    assert random_k2["ppl"] == 12.5 and [r["ppl"] for r in random_k2["runs"]] == [13.0, 12.0]
    assert "| int4 | random | 10.00 | 12.50 (12.00–13.00) | 15.00 |" in markdown_table(rows)


@pytest.mark.parametrize("command, flag", [("eval", "--order"), ("eval", "--compare"), ("profile", "--max-tokens")])
def test_cli_help(command, flag):
    args = [command, "ppl", "--help"] if command == "eval" else [command, "--help"]
    result = subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert flag in result.stdout
