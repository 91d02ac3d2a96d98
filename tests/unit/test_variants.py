"""The layer-variant store: exact formats, a disk cache that round-trips and misses when it should, a host
cap that holds, and AWQ scaling that pays for itself on the activations it was calibrated on."""

import json

import pytest
import torch

from services.executor.engine.engine import LLMEngine
from services.executor.engine.model.decoder import LINEARS
from services.executor.engine.morphing import variants
from services.executor.engine.morphing.quant import (Int4Weight, Int8Weight, cpu_int4pack_codes,
                                                     cpu_int4pack_dequantize, int4_group, quantize_int4, quantize_int8)
from services.executor.engine.morphing.variants import VariantStore, calibration_windows, trace_linear_inputs
from shared.config import EngineConfig
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama3(tmp_path_factory.mktemp("tiny") / "model")


def engine(tiny_dir, cache, **kw) -> LLMEngine:
    cfg = dict(model=str(tiny_dir), memory_budget=4 << 20, block_size=8, max_model_len=128,
               variant_cache_dir=str(cache), prepare_variants=False) | kw
    return LLMEngine(EngineConfig(**cfg), progress=False)


def int4_codes(v: dict, name: str) -> torch.Tensor:
    """A variant's INT4 codes of linear `name` as ``[out, in]``, whichever packing holds them."""
    q = v[f"{name}.q"]
    if f"{name}.sz" not in v:
        return torch.stack((q & 0x0F, q >> 4), dim=-1).reshape(q.shape[0], -1)
    return torch.cat([cpu_int4pack_codes(p) for p in q], dim=1) if q.dim() == 3 else cpu_int4pack_codes(q)


def int4_dequantized(v: dict, name: str) -> torch.Tensor:
    """The float32 ``[out, in]`` weight a variant's INT4 linear `name` computes with, whichever packing holds it."""
    q = v[f"{name}.q"]
    if f"{name}.sz" not in v:
        return Int4Weight(q, v[f"{name}.scale"], v[f"{name}.zero"], q.shape[1] * 2 // v[f"{name}.scale"].shape[1]
                          ).dequantize().float()
    sz = v[f"{name}.sz"]
    if q.dim() == 3:  # down_proj's matrix per FFN piece
        return torch.cat([cpu_int4pack_dequantize(p, s) for p, s in zip(q, sz)], dim=1)
    return cpu_int4pack_dequantize(q, sz)


def test_variants_equal_direct_quantization_bit_for_bit(tiny_dir, tmp_path):
    model = engine(tiny_dir, tmp_path).model
    assert model.int4_packing == "torch-cpu"
    store = VariantStore(model, "fp", cache_dir=tmp_path)
    store.prepare(progress=False)
    for i, slot in enumerate(model.layers):
        assert all(torch.equal(store.full(i)[k], v) for k, v in slot.items())
        v8, v4 = store.get(i, 8), store.get(i, 4)
        for name in LINEARS:
            group = int4_group(model.ffn_width if name == "down_proj" else slot[name].shape[1])  # whole pieces
            q8, q4 = quantize_int8(slot[name]), quantize_int4(slot[name], group)
            assert torch.equal(v8[f"{name}.q"], q8.qweight) and torch.equal(v8[f"{name}.scale"], q8.scale)
            # the codes bit for bit in either packing; torch's CPU layout rounds scale and zero to bfloat16
            assert f"{name}.sz" in v4 and torch.equal(int4_codes(v4, name), q4.unpack())
            torch.testing.assert_close(int4_dequantized(v4, name), q4.dequantize(), rtol=0, atol=3e-2 * float(
                q4.scale.max()) + 1e-2 * float(slot[name].abs().max()))
        assert torch.equal(v4["input_norm"], slot["input_norm"]) and torch.equal(v8["post_attn_norm"],
                                                                                slot["post_attn_norm"])
    assert store.held_bytes == store.total_bytes


def test_the_disk_cache_round_trips_without_quantizing(tiny_dir, tmp_path, monkeypatch):
    model = engine(tiny_dir, tmp_path).model
    first = VariantStore(model, "fp", cache_dir=tmp_path)
    first.prepare(progress=False)
    assert first.counters["quantized"] == 4
    files = sorted(p.name for p in first.dir.iterdir())
    assert files[-1] == "manifest.json" and len(files) == 1 + 4 * 3 and files[0] == "layer000-fp.safetensors"
    assert json.loads((first.dir / "manifest.json").read_text())["key"] == first.key

    def refuse(*args, **kwargs):
        raise AssertionError("a cache hit must not quantize")

    monkeypatch.setattr(variants, "quantize_int8", refuse)
    monkeypatch.setattr(variants, "quantize_int4", refuse)
    second = VariantStore(model, "fp", cache_dir=tmp_path)
    second.prepare(progress=False)
    assert second.counters == dict(quantized=0, loaded=12, on_demand=0)
    for i in range(4):
        for bits in (8, 4):
            a, b = first.get(i, bits), second.get(i, bits)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("change", [dict(fingerprint="other"), dict(bits=(4,)), dict(awq=True)])
def test_a_changed_fingerprint_or_setting_misses_the_cache(tiny_dir, tmp_path, change):
    eng = engine(tiny_dir, tmp_path)
    VariantStore(eng.model, "fp", cache_dir=tmp_path).prepare(progress=False)
    kw = dict(fingerprint="fp", cache_dir=tmp_path) | change
    if kw.get("awq"):
        kw["calibration"] = calibration_windows(eng.tokenizer, max_tokens=256, window=128)
    other = VariantStore(eng.model, **kw)
    other.prepare(progress=False)
    assert other.counters["quantized"] == 4 and other.counters["loaded"] == 0
    assert len(list(tmp_path.iterdir())) == 2  # both stay cached, side by side


def test_the_host_cap_is_respected_and_the_rest_comes_from_disk(tiny_dir, tmp_path):
    model = engine(tiny_dir, tmp_path).model
    full = VariantStore(model, "fp", cache_dir=tmp_path)
    full.prepare(progress=False)
    cap = full.entry_bytes[8] + full.entry_bytes[4] + full.entry_bytes[32] // 2  # one layer's variants, no more
    for _ in range(2):  # building, then loading from the cache
        store = VariantStore(model, "fp", cache_dir=tmp_path, host_cap_bytes=cap, order=[2, 0, 1, 3])
        store.prepare(progress=False)
        # first fit in swap order: layer 2's variants, its full precision does not fit, layer 0's variants
        assert store.held_bytes <= cap and set(store._held) == {(2, 8), (2, 4), (0, 8), (0, 4)}
        for i in range(4):
            a, b, fa, fb = full.get(i, 4), store.get(i, 4), full.full(i), store.full(i)
            assert all(torch.equal(a[k], b[k]) for k in a) and all(torch.equal(fa[k], fb[k]) for k in fa)
        assert store.counters["on_demand"] == 2 + 4 and store.held_bytes <= cap
        tmp_path = tmp_path / "again"
    nothing = VariantStore(model, "fp", cache_dir=tmp_path, host_cap_bytes=0)
    nothing.prepare(progress=False)
    assert nothing.held_bytes == 0 and torch.equal(nothing.get(1, 8)["o_proj.q"], full.get(1, 8)["o_proj.q"])
    with pytest.raises(ValueError, match="disk cache"):
        VariantStore(model, None, host_cap_bytes=cap)


def test_swaps_under_a_zero_cap_restore_the_model_exactly(tiny_dir, tmp_path):
    eng = engine(tiny_dir, tmp_path, host_memory_cap=0, prepare_variants=True)
    params = SamplingOptions(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = [c.outputs[0].token_ids for c in eng.generate([list(range(3, 20))], params)]
    eng.swapper.set_bits([0, 1, 2, 3], 8)
    eng.swapper.set_bits([1, 3], 4)
    eng.swapper.restore([0, 1, 2, 3])
    assert [c.outputs[0].token_ids for c in eng.generate([list(range(3, 20))], params)] == before
    assert eng.variants.held_bytes == 0 and eng.variants.counters["on_demand"] == 10


def relative_errors(model, windows, store: VariantStore, bits: int) -> dict[tuple[int, str], float]:
    """||x W^T - x' Wq^T||^2 / ||x W^T||^2 on the calibration activations of qkv_proj and gate_up_proj, x'
    being what the variant's own (possibly scaled) norm makes of the same residual."""
    num, den = {}, {}

    def visit(layer, name, xhat, norm):
        fp = store.full(layer)
        v = store.get(layer, bits)
        norm_name = variants.SCALED[name]
        if bits == 8:
            wq = Int8Weight(v[f"{name}.q"], v[f"{name}.scale"]).dequantize()
        else:
            wq = int4_dequantized(v, name)
        ref = (fp[norm_name] * xhat).float() @ fp[name].float().T
        out = (v[norm_name] * xhat).float() @ wq.float().T
        num[layer, name] = num.get((layer, name), 0.0) + float((ref - out).pow(2).sum())
        den[layer, name] = den.get((layer, name), 0.0) + float(ref.pow(2).sum())

    trace_linear_inputs(model, windows, visit)
    return {k: num[k] / den[k] for k in num}


def test_awq_lowers_int4_error_on_calibration_activations_and_swaps_its_norms(tiny_dir, tmp_path):
    eng = engine(tiny_dir, tmp_path)
    model = eng.model
    gen = torch.Generator().manual_seed(0)
    for w in model.layers:  # real models' activations have a few outlier channels; random weights lack them
        for norm in ("input_norm", "post_attn_norm"):
            w[norm][torch.randperm(w[norm].shape[0], generator=gen)[:4]] *= 20.0
    windows = calibration_windows(eng.tokenizer, max_tokens=512, window=128)
    plain = VariantStore(model, "fp", cache_dir=tmp_path)
    awq = VariantStore(model, "fp", cache_dir=tmp_path, awq=True, calibration=windows)
    awq.prepare(progress=False)
    e_plain, e_awq = relative_errors(model, windows, plain, 4), relative_errors(model, windows, awq, 4)
    assert sum(e_awq.values()) < 0.8 * sum(e_plain.values())
    assert sum(a < p for a, p in zip(e_awq.values(), e_plain.values())) >= 0.75 * len(e_plain)
    v, p = awq.get(0, 4), plain.get(0, 4)
    assert not torch.equal(v["input_norm"], p["input_norm"]) and not torch.equal(v["qkv_proj.q"], p["qkv_proj.q"])
    assert torch.equal(v["o_proj.q"], p["o_proj.q"]) and torch.equal(v["down_proj.q"], p["down_proj.q"])

    eng.swapper = type(eng.swapper)(model, eng.arena, eng.scheduler, awq)
    eng.swapper.set_bits([0], 4)
    assert torch.equal(model.layers[0]["input_norm"], v["input_norm"])
    assert torch.equal(model.layers[0]["post_attn_norm"], v["post_attn_norm"])
    eng.swapper.restore([0])
    assert torch.equal(model.layers[0]["input_norm"], plain.full(0)["input_norm"])
