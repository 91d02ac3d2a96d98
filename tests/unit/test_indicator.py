"""`morphling profile --indicator`: SplitQuant's variance indicator ω against an independent computation from the
checkpoint through transformers, how it scales with the weights, and the JSON it writes and validates."""

import json
import re

import pytest
import torch

from services.executor.engine.engine import LLMEngine
from services.executor.engine.morphing.importance import decoder_layer
from services.executor.engine.morphing.variants import DEFAULT_CORPUS
from services.tools.profile import lis as profiling
from services.tools.profile.indicator import (
    KIND, IndicatorError, layer_with_inputs, load_omega, omega, operator_terms,
)
from shared.config import EngineConfig
from tests.checkpoints import write_tiny_llama_8kv

CALIBRATION = [list(range(5, 69)), list(range(100, 140))]  # two windows of unequal length, tiny vocabulary
LAYERS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # intermediate 200 in 4 pieces of 50, each padded to 64: padding that must not count
    return write_tiny_llama_8kv(tmp_path_factory.mktemp("indicator") / "tiny")


def engine(checkpoint) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(checkpoint), memory_budget=8 << 20, block_size=8, max_model_len=256),
                     progress=False)


def independent_terms(checkpoint, layer: int) -> dict[str, dict[str, dict[int, float]]]:
    """Each linear's term of ω_{layer,b} by rounding, from transformers' own forward pass over the checkpoint's
    separate (unfused, unpadded) weights, with the quantizers' scales written out here."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    block = model.model.layers[layer]
    inputs: dict[str, list[torch.Tensor]] = {}
    modules = {"qkv_proj": block.self_attn.q_proj, "o_proj": block.self_attn.o_proj,
               "gate_up_proj": block.mlp.gate_proj, "down_proj": block.mlp.down_proj}
    hooks = [m.register_forward_hook(lambda _m, args, _out, name=name: inputs.setdefault(name, []).append(args[0]))
             for name, m in modules.items()]
    with torch.no_grad():
        for ids in CALIBRATION:
            model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()

    def weight(name: str) -> torch.Tensor:
        if name == "qkv_proj":
            a = block.self_attn
            return torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().double()
        if name == "gate_up_proj":
            return torch.cat([block.mlp.gate_proj.weight, block.mlp.up_proj.weight]).detach().double()
        return modules[name].weight.detach().double()

    def energy(w: torch.Tensor, bits: int, name: str) -> float:
        if bits == 8:  # symmetric, one scale per output row shared by all its inputs
            return float(w.shape[1] * ((w.abs().amax(1) / 127) ** 2).sum())
        if name == "down_proj":  # each 50-wide piece is one 64-wide group of our layout: 14 zeros take part
            total = 0.0
            for piece in w.split(50, dim=1):
                hi, lo = piece.amax(1).clamp_min(0), piece.amin(1).clamp_max(0)
                total += float(50 * (((hi - lo) / 15) ** 2).sum())
            return total
        groups = w.view(w.shape[0], -1, 128)  # 128 inputs: one group a row
        return float(128 * (((groups.amax(-1) - groups.amin(-1)) / 15) ** 2).sum())

    terms: dict[str, dict[str, dict[int, float]]] = {"deterministic": {}, "stochastic": {}}
    for name in modules:
        x = torch.cat([t.reshape(-1) for t in inputs[name]]).double()
        g = {"deterministic": x.var(unbiased=False) / 4, "stochastic": (x.mean() ** 2 + x.var(unbiased=False)) / 6}
        for rounding in terms:
            terms[rounding][name] = {b: energy(weight(name), b, name) * float(g[rounding]) for b in (8, 4)}
    return terms


@pytest.mark.parametrize("rounding", ["deterministic", "stochastic"])
def test_every_term_matches_an_independent_computation_from_the_checkpoint(checkpoint, rounding):
    ours = operator_terms(engine(checkpoint), CALIBRATION, (8, 4), rounding)[1]
    theirs = independent_terms(checkpoint, 1)[rounding]
    for name in theirs:
        for bits in (8, 4):
            assert ours[name][bits] == pytest.approx(theirs[name][bits], rel=1e-4), (name, bits)


def test_fewer_bits_perturb_more_and_every_layer_is_perturbed(checkpoint):
    omegas = omega(engine(checkpoint), CALIBRATION)
    assert sorted(omegas) == [4, 8] and all(len(v) == LAYERS for v in omegas.values())
    for i in range(LAYERS):
        assert omegas[4][i] > omegas[8][i] > 0, i


def test_doubling_a_weight_quadruples_its_term_and_changes_nothing_upstream(checkpoint):
    eng = engine(checkpoint)
    before = operator_terms(eng, CALIBRATION)
    eng.model.layers[1]["down_proj"].mul_(2)  # scales double exactly; down_proj's own input is upstream of it
    after = operator_terms(eng, CALIBRATION)
    assert after[0] == before[0]
    for name in ("qkv_proj", "o_proj", "gate_up_proj"):
        assert after[1][name] == before[1][name], name
    for bits in (8, 4):
        assert after[1]["down_proj"][bits] == pytest.approx(4 * before[1]["down_proj"][bits], rel=1e-12)
    assert after[2] != before[2]  # the layers after it read what it changed


def test_the_layer_run_by_hand_is_the_profiles_decoder_layer(checkpoint):
    model = engine(checkpoint).model
    ids = CALIBRATION[0]
    x = model.embed(torch.tensor(ids))
    cos, sin = model.cos[:len(ids)].unsqueeze(1), model.sin[:len(ids)].unsqueeze(1)
    seen = []
    with torch.inference_mode():
        ours = layer_with_inputs(model, 2, x, cos, sin, lambda name, _x: seen.append(name))
        assert torch.equal(ours, decoder_layer(model, 2, x, cos, sin))
    assert seen == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def cli(checkpoint, out, *extra: str) -> dict:
    if not DEFAULT_CORPUS.exists():
        pytest.skip(f"no corpus at {DEFAULT_CORPUS}")
    return profiling.main(["--indicator", "--model", str(checkpoint), "--memory-budget", "8MiB", "--window", "128",
                           "--calib-tokens", "256", "--out", str(out), *extra])


def test_the_cli_writes_what_load_omega_reads(checkpoint, tmp_path):
    out = tmp_path / "omega.json"
    record = cli(checkpoint, out, "--rounding", "stochastic")
    assert record["kind"] == KIND and record["validation"] is None and record["rounding"] == "stochastic"
    assert record["calibration"] | {"corpus": None} == dict(corpus=None, tokens=256, window=128, windows=2)
    assert load_omega(out, num_layers=LAYERS) == {8: record["omega"]["8"], 4: record["omega"]["4"]}
    assert not out.with_suffix(".png").exists()


def test_validate_ranks_omega_against_perplexity_on_held_out_tokens(checkpoint, tmp_path):
    out = tmp_path / "omega.json"
    record = cli(checkpoint, out, "--bits", "4,8", "--validate", "--eval-tokens", "256")
    validation = json.loads(out.read_text())["validation"]
    assert validation["skip_tokens"] == 256 and validation["tokens"] == 256
    for bits in ("4", "8"):
        assert len(validation["delta_ppl"][bits]) == LAYERS
        assert validation["delta_ppl"][bits] == pytest.approx([p - validation["ppl_full"]
                                                               for p in validation["ppl"][bits]])
        assert -1 <= validation["spearman"][bits]["rho"] <= 1
    assert validation["spearman"]["overall"]["n"] == 2 * LAYERS and -1 <= validation["spearman"]["overall"]["rho"] <= 1
    assert record["bits"] == [4, 8] and out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("edit, field", [
    (lambda r: r.update(kind="speedup-profile"), "kind"),
    (lambda r: r["omega"]["4"].pop(), "omega.4"),
    (lambda r: r["omega"]["8"].__setitem__(2, -1.0), "omega.8[2]"),
    (lambda r: r.update(bits=[8, 3]), "bits"),
    (lambda r: r["omega"].pop("8"), "omega"),
])
def test_load_omega_names_the_file_and_the_field_it_refuses(tmp_path, edit, field):
    record = dict(kind=KIND, num_layers=3, bits=[8, 4], omega={"8": [0.1, 0.2, 0.3], "4": [1.0, 2.0, 3.0]})
    path = tmp_path / "omega.json"
    path.write_text(json.dumps(record))
    assert load_omega(path) == {8: [0.1, 0.2, 0.3], 4: [1.0, 2.0, 3.0]}
    with pytest.raises(IndicatorError, match="num_layers"):
        load_omega(path, num_layers=30)
    edit(record)
    path.write_text(json.dumps(record))
    with pytest.raises(IndicatorError, match=re.escape(f"{path}: {field}:")):
        load_omega(path)
    with pytest.raises(IndicatorError, match="not found"):
        load_omega(tmp_path / "missing.json")
