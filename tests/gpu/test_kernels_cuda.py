"""The Triton kernels compiled for the GPU, on the shapes the engine gives them, against their torch
references on the same CUDA tensors (the interpreter runs the same kernels on the CPU in tests/unit)."""

import pytest
import torch

from morphling_kernels.block_copy import copy_blocks_ref, copy_blocks_triton
from morphling_kernels.kv_write import write_kv_ref, write_kv_triton
from morphling_kernels.paged_attention import paged_decode_attention_ref, paged_decode_attention_triton
from morphling_kernels.w4a16 import w4a16_linear_ref, w4a16_linear_triton
from morphling_kernels.w8a16 import w8a16_linear_ref, w8a16_linear_triton
from services.executor.engine.morphing.quant import quantize_int4, quantize_int8

CUDA = "cuda"
LAYERS = 2
LAYER = 1


def arena(pages: int, kv_heads: int, block: int, head_dim: int, dtype, gen) -> torch.Tensor:
    return torch.randn(pages, kv_heads, LAYERS, 2, block, head_dim, generator=gen, device=CUDA).to(dtype)


def shuffled_tables(contexts: list[int], block: int, pages: int, gen) -> torch.Tensor:
    """Block tables naming distinct pages in a random order, padded with a page of the sequence itself."""
    need = [-(-c // block) for c in contexts]
    order = torch.randperm(pages, generator=gen, device=CUDA)[:sum(need)]
    width = max(need)
    tables, start = [], 0
    for n in need:
        row = order[start:start + n]
        tables.append(torch.cat([row, row[:1].repeat(width - n)]))
        start += n
    return torch.stack(tables).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contexts", [[4096], [1, 17, 300, 4096], [700] * 64], ids=["b1", "mixed", "b64"])
@pytest.mark.parametrize("split", [None, 512, 64])
def test_paged_decode_attention(dtype, contexts, split):
    gen = torch.Generator(device=CUDA).manual_seed(0)
    block, kv_heads, heads, head_dim = 16, 8, 32, 128
    pages = sum(-(-c // block) for c in contexts) + 8
    cache = arena(pages, kv_heads, block, head_dim, dtype, gen)
    tables = shuffled_tables(contexts, block, pages, gen)
    ctx = torch.tensor(contexts, dtype=torch.int32, device=CUDA)
    q = torch.randn(len(contexts), heads, head_dim, generator=gen, device=CUDA).to(dtype)
    expected = paged_decode_attention_ref(q.float(), cache.float(), LAYER, tables, ctx, 0.088)
    out = paged_decode_attention_triton(q, cache, LAYER, tables, ctx, 0.088, partition=split)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    bounded = paged_decode_attention_triton(q, cache, LAYER, tables, ctx, 0.088, max_context=tables.shape[1] * block,
                                            partition=split)
    torch.testing.assert_close(bounded, out, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_and_block_copy_are_exact(dtype):
    gen = torch.Generator(device=CUDA).manual_seed(1)
    cache = arena(40, 8, 16, 128, dtype, gen)
    k, v = (torch.randn(37, 8, 128, generator=gen, device=CUDA).to(dtype) for _ in range(2))
    slots = torch.randperm(40 * 16, generator=gen, device=CUDA)[:37]
    slots[::5] = -1  # padding rows write nothing
    expected = cache.clone()
    write_kv_ref(k, v, expected, LAYER, slots)
    write_kv_triton(k, v, cache, LAYER, slots)
    assert torch.equal(cache, expected)
    src, dst = torch.tensor([1, 5, 9], device=CUDA), torch.tensor([30, 31, 2], device=CUDA)
    copy_blocks_ref(expected, src, dst)
    copy_blocks_triton(cache, src, dst)
    assert torch.equal(cache, expected)


SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1000, 576)]  # out x in: the 8B shapes, and an odd one


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 200])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_bit_linears(rows, shape, dtype):
    gen = torch.Generator(device=CUDA).manual_seed(2)
    out, inp = shape
    w = torch.randn(out, inp, generator=gen, device=CUDA) * 0.02
    x = torch.randn(rows, inp, generator=gen, device=CUDA).to(dtype)
    bias = torch.randn(out, generator=gen, device=CUDA).to(dtype)
    q8 = quantize_int8(w)
    expected = w8a16_linear_ref(x.float(), q8.qweight, q8.scale.float(), bias.float())
    got = w8a16_linear_triton(x, q8.qweight, q8.scale.to(dtype), bias)
    assert_matches(got, expected, dtype)
    group = 64 if inp % 128 else 128
    q4 = quantize_int4(w, group)
    expected = w4a16_linear_ref(x.float(), q4.packed, q4.scale.float(), q4.zero.float(), group, bias.float())
    got = w4a16_linear_triton(x, q4.packed, q4.scale.to(dtype), q4.zero.to(dtype), group, bias)
    assert_matches(got, expected, dtype)


def test_low_bit_linears_whose_output_passes_two_to_the_31_elements():
    """A 131k-token prefill through gate/up writes 3.8e9 outputs: offsets past int32 must land where they
    should (they once faulted with an illegal address). The last rows, past the line, against the reference
    given the same bf16 scales: with one group of 128 inputs their rounding alone is a 1% error."""
    bf16 = torch.bfloat16
    gen = torch.Generator(device=CUDA).manual_seed(3)
    out, inp = 28672, 128
    rows = 2**31 // out + 64
    w = torch.randn(out, inp, generator=gen, device=CUDA) * 0.02
    x = torch.randn(rows, inp, generator=gen, device=CUDA).to(bf16)
    tail = x[-64:].float()
    q8 = quantize_int8(w)
    scale = q8.scale.to(bf16)
    got = w8a16_linear_triton(x, q8.qweight, scale)[-64:]
    assert_matches(got, w8a16_linear_ref(tail, q8.qweight, scale.float()), bf16)
    del got
    q4 = quantize_int4(w, 128)
    scale, zero = q4.scale.to(bf16), q4.zero.to(bf16)
    got = w4a16_linear_triton(x, q4.packed, scale, zero, 128)[-64:]
    assert_matches(got, w4a16_linear_ref(tail, q4.packed, scale.float(), zero.float(), 128), bf16)


def assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype) -> None:
    # bf16 output rounds each value to 8 bits of mantissa; sums over K add error relative to the row's size
    rel = (got.float() - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert rel.max() <= (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {rel.max():.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_round_as_torch_does(dtype):
    # Rounded where torch rounds (fused.py): RoPE gives torch's bits; RMSNorm sums its squares in another
    # order and SiLU's exp may differ in its last bit, so they may differ by an ulp where a value sits on a rounding
    # boundary: rarely, in bf16.
    from morphling_kernels.fused import (add_rms_norm_ref, add_rms_norm_triton, rope_write_kv_ref, rope_write_kv_triton,
                               silu_mul_ref, silu_mul_triton)

    gen = torch.Generator(device=CUDA).manual_seed(3)
    x, res = (torch.randn(64, 4096, generator=gen, device=CUDA).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(4096, generator=gen, device=CUDA)).to(dtype)
    (normed, summed), (want_normed, want_summed) = (add_rms_norm_triton(x, res, weight, 1e-5),
                                                    add_rms_norm_ref(x, res, weight, 1e-5))
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(normed, want_normed, atol=0, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6)
    if dtype == torch.bfloat16:  # in float32 an ulp of the row's scale moves every value of the row
        assert (normed != want_normed).float().mean() < 1e-3
    gate_up = torch.randn(64, 2 * 3 * 4800, generator=gen, device=CUDA).to(dtype)
    act, want_act = silu_mul_triton(gate_up, 4800), silu_mul_ref(gate_up, 4800)
    torch.testing.assert_close(act, want_act, atol=0, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6)
    if dtype == torch.bfloat16:
        assert (act != want_act).float().mean() < 1e-3
    qkv = torch.randn(37, (32 + 2 * 8) * 128, generator=gen, device=CUDA).to(dtype)
    q, k, v = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    q, k, v = q.view(37, 32, 128), k.view(37, 8, 128), v.view(37, 8, 128)
    angles = torch.rand(37, 1, 128, generator=gen, device=CUDA) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cache = arena(40, 8, 16, 128, dtype, gen)
    want_cache = cache.clone()
    slots = torch.randperm(40 * 16, generator=gen, device=CUDA)[:37]
    slots[::6] = -1
    got = rope_write_kv_triton(q, k, v, cos, sin, cache, LAYER, slots)
    want = rope_write_kv_ref(q, k, v, cos, sin, want_cache, LAYER, slots)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(cache, want_cache)


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_every_configuration_the_tuner_may_pick_in_bfloat16(rows):
    # The interpreter cannot check tl.dot in bf16 (tests/unit runs the candidates in fp32 only), and any
    # candidate may win the tuning on some GPU.
    from morphling_kernels.tuning import rows_bucket
    from morphling_kernels.w4a16 import block_ks
    from morphling_kernels.w8a16 import W8_BLOCK_KS, launch_candidates

    gen = torch.Generator(device=CUDA).manual_seed(4)
    w = torch.randn(1000, 2048, generator=gen, device=CUDA) * 0.02
    x = torch.randn(rows, 2048, generator=gen, device=CUDA).to(torch.bfloat16)
    q8, q4 = quantize_int8(w), quantize_int4(w, 128)
    want8 = w8a16_linear_ref(x.float(), q8.qweight, q8.scale.float())
    want4 = w4a16_linear_ref(x.float(), q4.packed, q4.scale.float(), q4.zero.float(), 128)
    for config in launch_candidates(rows_bucket(rows), W8_BLOCK_KS):
        assert_matches(w8a16_linear_triton(x, q8.qweight, q8.scale.bfloat16(), config=config), want8, torch.bfloat16)
    for config in launch_candidates(rows_bucket(rows), block_ks(128)):
        got = w4a16_linear_triton(x, q4.packed, q4.scale.bfloat16(), q4.zero.bfloat16(), 128, config=config)
        assert_matches(got, want4, torch.bfloat16)
