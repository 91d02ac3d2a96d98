"""Correctness tests for the fused decode kernels (add + RMSNorm, SiLU-mul, RoPE + K/V write).

The Triton kernels run under TRITON_INTERPRET=1 (set in tests/conftest.py) on CPU tensors and are compared with
the torch references, which are the CPU path and are themselves checked against the engine's plain torch
formulas. The engine is compared token for token with transformers, so in bfloat16 the kernels must round
exactly where torch does: the tests require equal bits, and show on the same data that rounding once, in
float32, would not give them. Two float32 values cannot be reproduced to the bit, and only they get slack: the
RMSNorm's sum of squares (its order is the reduction's, not torch's) and exp (numpy's and torch's differ in the
last bit). Each shifts a float32 value by a few ulps, which moves its bfloat16 rounding only when it lies that
close to a rounding boundary; there one bfloat16 ulp is allowed, and equal bits everywhere else.
"""

import pytest
import torch
import torch.nn.functional as F

from morphling_kernels.fused import (
    _HAS_TRITON,
    add_rms_norm,
    add_rms_norm_ref,
    add_rms_norm_triton,
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
    rope_write_kv,
    rope_write_kv_ref,
    rope_write_kv_triton,
    silu_mul,
    silu_mul_ref,
    silu_mul_triton,
)

needs_triton = pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")

EPS = 1e-6
LAYER = 1
NUM_LAYERS = 3
# float32 results differ from torch's by a few ulps at most (see the module docstring).
F32 = dict(rtol=1e-6, atol=1e-6)


def near_bf16_boundary(v32: torch.Tensor, rel: float) -> torch.Tensor:
    """Where a relative error of `rel` in float32 `v32` could change its rounding to bfloat16."""
    return (v32 * (1 + rel)).to(torch.bfloat16) != (v32 * (1 - rel)).to(torch.bfloat16)


def assert_bits_except_near(out, ref, ambiguous):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(out[~ambiguous], ref[~ambiguous])
    diff = (out.float() - ref.float()).abs()[ambiguous]
    assert (diff <= ref.float().abs()[ambiguous] * 2.0**-7).all()


# ---------------------------------------------------------------- add + RMSNorm


def engine_rms_norm(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def norm_case(rows, hidden, dtype, seed, exact_sums=False):
    gen = torch.Generator().manual_seed(seed)
    if exact_sums:
        # Multiples of 1/8 up to 2: sums, squares and the sum of squares are exact in float32 in any order,
        # so the statistic is torch's to the bit and every rounding after it must match too.
        x, res = (torch.randint(-16, 17, (rows, hidden), generator=gen) / 8 for _ in range(2))
    else:
        x, res = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    weight = 1 + 0.3 * torch.randn(hidden, generator=gen)
    return x.to(dtype), res.to(dtype), weight.to(dtype)


def normalised_f32(s):
    s32 = s.float()
    return s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_refs_are_the_engine_formula(dtype):
    x, res, weight = norm_case(5, 96, dtype, seed=1)
    copies = [x.clone(), res.clone()]
    normed, new_res = add_rms_norm_ref(x, res, weight, EPS)
    assert torch.equal(new_res, x + res)
    assert torch.equal(normed, engine_rms_norm(x + res, weight, EPS))
    assert torch.equal(rms_norm_ref(x, weight, EPS), engine_rms_norm(x, weight, EPS))
    assert torch.equal(x, copies[0]) and torch.equal(res, copies[1])
    # The dispatchers take the reference on CPU tensors.
    assert torch.equal(add_rms_norm(x, res, weight, EPS)[0], normed)
    assert torch.equal(rms_norm(x, weight, EPS), engine_rms_norm(x, weight, EPS))


@needs_triton
@pytest.mark.parametrize("hidden", [96, 576, 128])
def test_add_rms_norm_triton_float32(hidden):
    x, res, weight = norm_case(5, hidden, torch.float32, seed=2)
    copies = [x.clone(), res.clone()]
    normed, new_res = add_rms_norm_triton(x, res, weight, EPS)
    ref_normed, ref_res = add_rms_norm_ref(x, res, weight, EPS)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(normed, ref_normed, **F32)
    torch.testing.assert_close(rms_norm_triton(x, weight, EPS), rms_norm_ref(x, weight, EPS), **F32)
    assert torch.equal(x, copies[0]) and torch.equal(res, copies[1])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [96, 576])
def test_add_rms_norm_triton_rounds_as_torch(hidden, dtype):
    x, res, weight = norm_case(6, hidden, dtype, seed=3, exact_sums=True)
    normed, new_res = add_rms_norm_triton(x, res, weight, EPS)
    ref_normed, ref_res = add_rms_norm_ref(x, res, weight, EPS)
    assert torch.equal(new_res, ref_res)
    assert torch.equal(normed, ref_normed)
    assert torch.equal(rms_norm_triton(x, weight, EPS), rms_norm_ref(x, weight, EPS))
    if dtype != torch.float32:  # rounding once, skipping the cast of the normalised value, would not match
        once = (weight.float() * normalised_f32(ref_res)).to(dtype)
        assert not torch.equal(once, ref_normed)


@needs_triton
@pytest.mark.parametrize("hidden", [96, 576])
def test_add_rms_norm_triton_bfloat16_random(hidden):
    x, res, weight = norm_case(8, hidden, torch.bfloat16, seed=4)
    normed, new_res = add_rms_norm_triton(x, res, weight, EPS)
    ref_normed, ref_res = add_rms_norm_ref(x, res, weight, EPS)
    assert torch.equal(new_res, ref_res)
    # A float32 sum of a few hundred squares in another order is off by a few ulps: allow 4e-6.
    assert_bits_except_near(normed, ref_normed, near_bf16_boundary(normalised_f32(ref_res), 4e-6))


@needs_triton
def test_rms_norm_triton_strided_rows_and_no_rows():
    wide = torch.randn(4, 200, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x, res = wide[:, :96], wide[:, 100:196]  # rows of a wider buffer, as a split of a fused output
    weight = torch.ones(96, dtype=torch.bfloat16)
    normed, new_res = add_rms_norm_triton(x, res, weight, EPS)
    ref_normed, ref_res = add_rms_norm_ref(x, res, weight, EPS)
    assert torch.equal(new_res, ref_res)
    assert_bits_except_near(normed, ref_normed, near_bf16_boundary(normalised_f32(ref_res), 4e-6))

    empty = torch.empty(0, 96, dtype=torch.bfloat16)
    for impl in (add_rms_norm_triton, add_rms_norm_ref):
        normed, new_res = impl(empty, empty, weight, EPS)
        assert normed.shape == new_res.shape == (0, 96)
    assert rms_norm_triton(empty, weight, EPS).shape == (0, 96)


# ---------------------------------------------------------------- SiLU-mul


def gate_up_case(rows, pieces, width, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(rows, pieces * 2 * width, generator=gen)).to(dtype)


def silu_f32(gate_up, width):
    g = gate_up.unflatten(-1, (-1, 2, width))
    return F.silu(g[..., 0, :].float()).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_ref_is_the_engine_formula(dtype):
    width, pieces = 24, 3
    gate_up = gate_up_case(4, pieces, width, dtype, seed=6)
    act = silu_mul_ref(gate_up, width)
    assert act.shape == (4, pieces * width) and act.dtype == dtype
    # The layout spelled out: piece p's gate channels, then its up channels.
    for p in range(pieces):
        gate = gate_up[:, 2 * p * width:(2 * p + 1) * width]
        up = gate_up[:, (2 * p + 1) * width:(2 * p + 2) * width]
        assert torch.equal(act[:, p * width:(p + 1) * width], F.silu(gate) * up)
    assert torch.equal(silu_mul(gate_up, width), act)


@needs_triton
@pytest.mark.parametrize("pieces,width", [(1, 96), (3, 96), (2, 576)])
def test_silu_mul_triton_float32(pieces, width):
    gate_up = gate_up_case(3, pieces, width, torch.float32, seed=7)
    torch.testing.assert_close(silu_mul_triton(gate_up, width), silu_mul_ref(gate_up, width), **F32)


@needs_triton
@pytest.mark.parametrize("pieces,width", [(1, 96), (3, 96), (2, 576)])
def test_silu_mul_triton_bfloat16(pieces, width):
    gate_up = gate_up_case(3, pieces, width, torch.bfloat16, seed=8)
    copy = gate_up.clone()
    out, ref = silu_mul_triton(gate_up, width), silu_mul_ref(gate_up, width)
    # exp may differ from torch's in the last bits: allow 1e-6 on the float32 silu.
    assert_bits_except_near(out, ref, near_bf16_boundary(silu_f32(gate_up, width), 1e-6))
    assert torch.equal(gate_up, copy)
    g = gate_up.unflatten(-1, (-1, 2, width))
    once = (silu_f32(gate_up, width) * g[..., 1, :].float().flatten(-2)).to(torch.bfloat16)
    assert not torch.equal(once, ref)


@needs_triton
def test_silu_mul_triton_leading_dims_strided_rows_and_no_rows():
    width = 40
    wide = gate_up_case(6, 2, width, torch.bfloat16, seed=9)
    gate_up = torch.cat([wide, wide], dim=-1)[:, : 4 * width].view(2, 3, 4 * width)  # strided rows, 3-D
    out, ref = silu_mul_triton(gate_up, width), silu_mul_ref(gate_up, width)
    assert out.shape == (2, 3, 2 * width)
    assert_bits_except_near(out, ref, near_bf16_boundary(silu_f32(gate_up, width), 1e-6))
    assert silu_mul_triton(torch.empty(0, 4 * width), width).shape == (0, 2 * width)


# ---------------------------------------------------------------- RoPE + K/V write


def engine_rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def make_cache(num_pages, num_kv_heads, block_size, head_dim, dtype, gen):
    """A random arena view with gaps between pages, as the engine's is."""
    page_numel = num_kv_heads * NUM_LAYERS * 2 * block_size * head_dim
    raw = torch.randn(num_pages, page_numel + 13, generator=gen).to(dtype)
    return raw[:, 5:5 + page_numel].view(num_pages, num_kv_heads, NUM_LAYERS, 2, block_size, head_dim)


def rope_case(n, heads, head_dim, dtype, seed, cache_dtype=None, block_size=8, num_pages=6):
    """q, k, v as views of one fused qkv output, the engine's cos/sin table rows, and an arena."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(n, num_heads, head_dim), k.view(n, num_kv_heads, head_dim), v.view(n, num_kv_heads, head_dim)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.randint(0, 4096, (n,), generator=gen).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    kv_cache = make_cache(num_pages, num_kv_heads, block_size, head_dim, cache_dtype or dtype, gen)
    slots = torch.randperm(num_pages * block_size, generator=gen)[:n]
    if n > 4:
        slots[[1, 4]] = -1
    return q, k, v, cos, sin, kv_cache, slots


def expected_cache(k_rot, v, kv_cache, slots):
    expected = kv_cache.clone()
    block_size = kv_cache.shape[4]
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, :, LAYER, 0, slot % block_size] = k_rot[i]
            expected[slot // block_size, :, LAYER, 1, slot % block_size] = v[i]
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_ref_is_the_engine_formula(dtype):
    q, k, v, cos, sin, kv_cache, slots = rope_case(7, (6, 2), 32, dtype, seed=10)
    copies = [q.clone(), k.clone(), v.clone()]
    q_rot, k_rot = engine_rotate(q, cos, sin), engine_rotate(k, cos, sin)
    expected = expected_cache(k_rot, v, kv_cache, slots)
    out = rope_write_kv(q, k, v, cos, sin, kv_cache, LAYER, slots)
    assert torch.equal(out[0], q_rot) and torch.equal(out[1], k_rot)
    assert torch.equal(kv_cache, expected)  # padding rows and the other layers untouched too
    assert all(torch.equal(t, c) for t, c in zip((q, k, v), copies))


@needs_triton
@pytest.mark.parametrize(
    "heads,head_dim,dtype,cache_dtype",
    [((6, 2), 64, torch.bfloat16, None), ((6, 2), 64, torch.float32, None), ((4, 4), 96, torch.bfloat16, None),
     ((8, 1), 32, torch.float16, None), ((6, 2), 64, torch.float32, torch.bfloat16)],
    ids=["gqa-bf16", "gqa-f32", "mha-96-bf16", "mqa-f16", "f32-into-bf16-cache"],
)
@pytest.mark.parametrize("cos_dims", [3, 2])
def test_rope_write_kv_triton_matches_ref_bit_for_bit(heads, head_dim, dtype, cache_dtype, cos_dims):
    q, k, v, cos, sin, kv_cache, slots = rope_case(7, heads, head_dim, dtype, seed=11, cache_dtype=cache_dtype)
    assert not q.is_contiguous() and not k.is_contiguous()
    if cos_dims == 2:
        cos, sin = cos[:, 0], sin[:, 0]
    ref_cache = kv_cache.clone()
    q_ref, k_ref = rope_write_kv_ref(q, k, v, cos, sin, ref_cache, LAYER, slots)
    q_rot, k_rot = rope_write_kv_triton(q, k, v, cos, sin, kv_cache, LAYER, slots)
    assert torch.equal(q_rot, q_ref) and torch.equal(k_rot, k_ref)
    assert torch.equal(kv_cache, ref_cache)
    if dtype == torch.bfloat16:  # one float32 rounding of the whole rotation would not match
        c, s = cos.float().view(7, 1, -1), sin.float().view(7, 1, -1)
        rotated = torch.cat((-q[..., head_dim // 2:], q[..., :head_dim // 2]), dim=-1).float()
        assert not torch.equal((q.float() * c + rotated * s).to(dtype), q_ref)


@needs_triton
def test_rope_write_kv_triton_padding_and_no_rows():
    q, k, v, cos, sin, kv_cache, slots = rope_case(5, (6, 2), 64, torch.bfloat16, seed=12)
    before = kv_cache.clone()
    q_rot, k_rot = rope_write_kv_triton(q, k, v, cos, sin, kv_cache, LAYER, torch.full_like(slots, -1))
    assert torch.equal(kv_cache, before)
    assert torch.equal(q_rot, engine_rotate(q, cos, sin)) and torch.equal(k_rot, engine_rotate(k, cos, sin))

    q, k, v, cos, sin, kv_cache, slots = rope_case(0, (6, 2), 64, torch.bfloat16, seed=13)
    before = kv_cache.clone()
    for impl in (rope_write_kv_triton, rope_write_kv_ref):
        q_rot, k_rot = impl(q, k, v, cos, sin, kv_cache, LAYER, slots)
        assert q_rot.shape == (0, 6, 64) and k_rot.shape == (0, 2, 64)
        assert torch.equal(kv_cache, before)
