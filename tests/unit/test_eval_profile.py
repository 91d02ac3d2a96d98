"""`morphling eval ppl` and `morphling profile`: sane perplexity, exact restore, a valid swap order."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.executor.engine.engine import LLMEngine
from services.executor.tools.evaluate import (
    DEFAULT_CORPUS, PROJECTIONS, SimulatedQuantization, evaluate, load_tokens, perplexity, swap_order,
)
from services.executor.engine.model.decoder import ForwardBatch, PrefillChunk, rms_norm
from services.executor.tools.profile import decoder_layer, profile
from shared.config import EngineConfig
from tests.checkpoints import write_tiny_llama3, write_tiny_qwen2

ROOT = Path(__file__).resolve().parents[2]
SLICE = 1024
WINDOW = 512


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


@pytest.mark.parametrize("writer", [write_tiny_llama3, write_tiny_qwen2])
def test_profile_layer_walk_reproduces_the_engine_forward(writer, tmp_path):
    engine = tiny(writer, tmp_path)
    model, ids = engine.model, list(range(3, 60))
    pages = [engine.arena.ledger.allocate() for _ in range(-(-len(ids) // 8))]
    n = len(ids)
    slots = torch.tensor([pages[p // 8] * 8 + p % 8 for p in range(n)])
    batch = ForwardBatch(torch.tensor(ids), torch.arange(n), slots, [],
                         [PrefillChunk(0, n, torch.tensor(pages, dtype=torch.int32), 0)], torch.arange(n))
    expected = model.forward(batch)
    with torch.inference_mode():
        x = F.embedding(torch.tensor(ids), model.embed_tokens)
        cos, sin = model.cos[:n].unsqueeze(1), model.sin[:n].unsqueeze(1)
        for i in range(model.cfg.num_layers):
            x = decoder_layer(model, i, x, cos, sin)
        got = F.linear(rms_norm(x, model.norm, model.cfg.rms_norm_eps), model.lm_head).float()
    torch.testing.assert_close(got, expected)


def test_profile_orders_every_layer_with_similarities_in_range(tmp_path):
    engine = tiny(write_tiny_llama3, tmp_path)
    before = [w["qkv_proj"].clone() for w in engine.model.layers]
    result = profile(engine, [list(range(5, 69)), list(range(100, 140))])
    num_layers = engine.model_config.num_layers
    assert sorted(result["order"]) == list(range(num_layers))
    for name in ("lts", "lrs", "mds"):
        assert len(result[name]) == num_layers and all(-1 - 1e-6 <= s <= 1 + 1e-6 for s in result[name])
    scores = [result["scores"][i] for i in result["order"]]
    assert all(-1 - 1e-6 <= s <= 1 + 1e-6 for s in scores) and scores == sorted(scores, reverse=True)
    assert all(torch.equal(w["qkv_proj"], b) for w, b in zip(engine.model.layers, before))


def test_swap_orders_are_permutations(tmp_path):
    profile_path = tmp_path / "p.json"
    profile_path.write_text('{"order": [2, 0, 3, 1]}')
    assert swap_order("front", 4) == [0, 1, 2, 3]
    assert swap_order("back", 4) == [3, 2, 1, 0]
    assert sorted(swap_order("random", 4, seed=1)) == [0, 1, 2, 3]
    assert swap_order("random", 4, seed=1) == swap_order("random", 4, seed=1)
    assert swap_order("lis", 4, profile_path) == [2, 0, 3, 1]
    with pytest.raises(SystemExit):
        swap_order("lis", 5, profile_path)


@pytest.mark.parametrize("command, flag", [("eval", "--order"), ("profile", "--max-tokens")])
def test_cli_help(command, flag):
    args = [command, "ppl", "--help"] if command == "eval" else [command, "--help"]
    result = subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert flag in result.stdout
