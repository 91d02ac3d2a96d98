"""Correctness tests for the KV-cache and attention kernels.

The Triton kernels run under TRITON_INTERPRET=1 (set in tests/conftest.py) on
CPU tensors and are compared with the torch references; the references are in
turn checked against naive float64 loops written here, so a bug shared by both
implementations still gets caught.  The cache is built the way the engine
builds it: a strided view into a larger buffer with non-KV gaps between pages.
Pages no sequence owns are filled with NaN, so a kernel that follows a wrong
page id fails loudly; slots past a context inside an owned block hold random
garbage (NaN, too, for prefill), so a kernel that lets them through fails too.
"""

import math

import pytest
import torch

from morphling_kernels.block_copy import copy_blocks, copy_blocks_ref, copy_blocks_triton
from morphling_kernels.kv_write import write_kv, write_kv_ref, write_kv_triton
from morphling_kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from morphling_kernels.prefill_attention import gather_kv, prefill_attention

ATOL = 1e-5
RTOL = 1e-4
NUM_LAYERS = 3
LAYER = 1

HEAD_CONFIGS = [(9, 3), (4, 4), (8, 1), (32, 8)]
HEAD_DIMS = [64, 32, 48]
BLOCK_SIZES = [16, 8]


def make_cache(num_pages, num_kv_heads, block_size, head_dim, gen, fill=None):
    """A random KV arena view whose pages are separated by gaps, like the real one."""
    page_numel = num_kv_heads * NUM_LAYERS * 2 * block_size * head_dim
    raw = torch.randn(num_pages, page_numel + 13, generator=gen)
    view = raw[:, 5 : 5 + page_numel].view(num_pages, num_kv_heads, NUM_LAYERS, 2, block_size, head_dim)
    if fill is not None:
        view.fill_(fill)
    assert not view.is_contiguous()
    return view


def build_sequences(context_lens, num_pages, block_size, max_blocks, gen):
    """Block tables with shuffled, disjoint pages; padding entries repeat the sequence's first page,
    as the engine's runner pads them."""
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    for b, ctx in enumerate(context_lens):
        n = math.ceil(ctx / block_size)
        tables[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
        tables[b, n:] = tables[b, 0]
    return tables


def poison_unowned(kv_cache, tables, context_lens, block_size, tails=True):
    """NaN every slot of LAYER that no sequence's context covers.

    With tails=False, slots past a context inside an owned block keep their finite garbage: the engine
    zeroes pages when it allocates them, and the decode reference relies on finite values there.
    """
    owned = torch.zeros(kv_cache.shape[0], block_size, dtype=torch.bool)
    for b, ctx in enumerate(context_lens):
        for pos in range(ctx):
            owned[tables[b, pos // block_size], pos % block_size] = True
        if not tails:
            owned[tables[b, : math.ceil(ctx / block_size)].long()] = True
    layer_cache = kv_cache[:, :, LAYER]  # [P, kvh, 2, bs, hd]
    mask = ~owned[:, None, None, :, None]
    layer_cache.copy_(layer_cache.masked_fill(mask, float("nan")))


def naive_decode(q, kv_cache, tables, context_lens, scale):
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        ctx = int(context_lens[b])
        pages = [int(tables[b, p // block_size]) for p in range(ctx)]
        offs = [p % block_size for p in range(ctx)]
        for h in range(num_heads):
            kvh = h // group
            k = torch.stack([kv_cache[pg, kvh, LAYER, 0, o] for pg, o in zip(pages, offs)]).double()
            v = torch.stack([kv_cache[pg, kvh, LAYER, 1, o] for pg, o in zip(pages, offs)]).double()
            probs = torch.softmax(k @ q[b, h].double() * scale, dim=0)
            out[b, h] = probs @ v
    return out


def decode_case(heads, head_dim, block_size, context_lens, seed):
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil(c / block_size) for c in context_lens) + 2
    num_pages = sum(math.ceil(c / block_size) for c in context_lens) + 5
    kv_cache = make_cache(num_pages, num_kv_heads, block_size, head_dim, gen)
    tables = build_sequences(context_lens, num_pages, block_size, max_blocks, gen)
    poison_unowned(kv_cache, tables, context_lens, block_size, tails=False)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    return q, kv_cache, tables, ctx, 1.0 / math.sqrt(head_dim)


def contexts_for(block_size):
    return [1, block_size, block_size + 1, 97]


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEAD_CONFIGS)
def test_decode_ref_matches_naive(heads, head_dim, block_size):
    q, kv_cache, tables, ctx, scale = decode_case(heads, head_dim, block_size, contexts_for(block_size), seed=1)
    out = paged_decode_attention_ref(q, kv_cache, LAYER, tables, ctx, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = naive_decode(q, kv_cache, tables, ctx, scale)
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEAD_CONFIGS)
def test_decode_triton_matches_ref(heads, head_dim, block_size):
    q, kv_cache, tables, ctx, scale = decode_case(heads, head_dim, block_size, contexts_for(block_size), seed=2)
    expected = paged_decode_attention_ref(q, kv_cache, LAYER, tables, ctx, scale)
    out = paged_decode_attention_triton(q, kv_cache, LAYER, tables, ctx, scale)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_decode_ref_large_batch_and_dispatch():
    gen = torch.Generator().manual_seed(3)
    context_lens = torch.randint(1, 300, (16,), generator=gen).tolist()
    q, kv_cache, tables, ctx, scale = decode_case((8, 2), 32, 16, context_lens, seed=3)
    out = paged_decode_attention(q, kv_cache, LAYER, tables, ctx, scale)
    expected = naive_decode(q, kv_cache, tables, ctx, scale)
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=RTOL)


def test_decode_triton_non_contiguous_query():
    # q sliced out of a fused qkv projection has a non-unit head stride.
    q, kv_cache, tables, ctx, scale = decode_case((4, 2), 32, 8, [5, 30], seed=4)
    fused = torch.randn(q.shape[0], q.shape[1] * 3, q.shape[2])
    fused[:, : q.shape[1]] = q
    q_view = fused[:, : q.shape[1]]
    assert not q_view.is_contiguous()
    out = paged_decode_attention_triton(q_view, kv_cache, LAYER, tables, ctx, scale)
    expected = paged_decode_attention_ref(q, kv_cache, LAYER, tables, ctx, scale)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------- write_kv


def write_case(seed, n_tokens=7, num_kv_heads=3, head_dim=48, block_size=8, num_pages=6):
    gen = torch.Generator().manual_seed(seed)
    kv_cache = make_cache(num_pages, num_kv_heads, block_size, head_dim, gen)
    k = torch.randn(n_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(n_tokens, num_kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_pages * block_size, generator=gen)[:n_tokens]
    slots[[1, 4]] = -1
    return k, v, kv_cache, slots.to(torch.int64)


def expected_after_write(k, v, kv_cache, slots):
    expected = kv_cache.clone()
    block_size = kv_cache.shape[4]
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        expected[slot // block_size, :, LAYER, 0, slot % block_size] = k[i]
        expected[slot // block_size, :, LAYER, 1, slot % block_size] = v[i]
    return expected


@pytest.mark.parametrize("impl", [write_kv_ref, write_kv_triton, write_kv], ids=["ref", "triton", "dispatch"])
def test_write_kv(impl):
    k, v, kv_cache, slots = write_case(seed=5)
    expected = expected_after_write(k, v, kv_cache, slots)
    impl(k, v, kv_cache, LAYER, slots)
    # Exact equality also proves padding rows and other layers were untouched.
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("impl", [write_kv_ref, write_kv_triton], ids=["ref", "triton"])
def test_write_kv_all_padding_is_noop(impl):
    k, v, kv_cache, slots = write_case(seed=6)
    before = kv_cache.clone()
    impl(k, v, kv_cache, LAYER, torch.full_like(slots, -1))
    assert torch.equal(kv_cache, before)


# ---------------------------------------------------------------- copy_blocks


@pytest.mark.parametrize("impl", [copy_blocks_ref, copy_blocks_triton, copy_blocks], ids=["ref", "triton", "dispatch"])
def test_copy_blocks(impl):
    gen = torch.Generator().manual_seed(7)
    kv_cache = make_cache(10, 2, 8, 48, gen)
    src = torch.tensor([3, 7, 0], dtype=torch.int64)
    dst = torch.tensor([5, 1, 9], dtype=torch.int64)
    expected = kv_cache.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        expected[d] = kv_cache[s]
    impl(kv_cache, src, dst)
    assert torch.equal(kv_cache, expected)


# ---------------------------------------------------------------- prefill


def naive_causal(q, k_full, v_full, context_start, scale):
    """q [C, H, hd]; k_full/v_full [context_start + C, kvh, hd]."""
    chunk, num_heads, head_dim = q.shape
    group = num_heads // k_full.shape[1]
    out = torch.empty(chunk, num_heads, head_dim, dtype=torch.float64)
    for i in range(chunk):
        visible = context_start + i + 1
        for h in range(num_heads):
            k = k_full[:visible, h // group].double()
            v = v_full[:visible, h // group].double()
            probs = torch.softmax(k @ q[i, h].double() * scale, dim=0)
            out[i, h] = probs @ v
    return out


def prefill_case(heads, head_dim, block_size, total_len, seed):
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    n_blocks = math.ceil(total_len / block_size)
    kv_cache = make_cache(n_blocks + 4, num_kv_heads, block_size, head_dim, gen)
    table = build_sequences([total_len], n_blocks + 4, block_size, n_blocks + 1, gen)[0]
    poison_unowned(kv_cache, table[None], [total_len], block_size)
    k_full = torch.randn(total_len, num_kv_heads, head_dim, generator=gen)
    v_full = torch.randn(total_len, num_kv_heads, head_dim, generator=gen)
    positions = torch.arange(total_len)
    slots = table.long()[positions // block_size] * block_size + positions % block_size
    write_kv_ref(k_full, v_full, kv_cache, LAYER, slots)
    q = torch.randn(total_len, num_heads, head_dim, generator=gen)
    return q, k_full, v_full, kv_cache, table, 1.0 / math.sqrt(head_dim)


@pytest.mark.parametrize(
    "context_start,chunk",
    [(0, 37), (0, 1), (24, 13), (17, 1), (40, 16)],
    ids=["first-chunk", "first-single", "second-chunk", "single-token", "block-aligned"],
)
@pytest.mark.parametrize("heads", HEAD_CONFIGS)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (48, 8)])
def test_prefill_matches_naive(heads, head_dim, block_size, context_start, chunk):
    total = context_start + chunk
    q, k_full, v_full, kv_cache, table, scale = prefill_case(heads, head_dim, block_size, total, seed=8)
    qc = q[context_start:]
    out = prefill_attention(
        qc, k_full[context_start:], v_full[context_start:], kv_cache, LAYER, table, context_start, scale
    )
    assert out.shape == qc.shape
    expected = naive_causal(qc, k_full, v_full, context_start, scale)
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=RTOL)


def test_gather_kv_roundtrip():
    q, k_full, v_full, kv_cache, table, _ = prefill_case((4, 2), 48, 8, 29, seed=9)
    for length in (1, 8, 9, 29):
        k, v = gather_kv(kv_cache, LAYER, table, length)
        assert k.shape == (2, length, 48)
        assert torch.equal(k, k_full[:length].transpose(0, 1))
        assert torch.equal(v, v_full[:length].transpose(0, 1))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("partition_blocks", [1, 3])
def test_decode_split_over_the_context_matches_ref(heads, block_size, partition_blocks):
    # Partitions of 1 and 3 blocks: every context below spans several, and the short ones leave programs
    # past their end with nothing to do.
    q, kv_cache, tables, ctx, scale = decode_case(heads, 32, block_size, [1, block_size + 1, 97, 300], seed=7)
    expected = paged_decode_attention_ref(q, kv_cache, LAYER, tables, ctx, scale)
    out = paged_decode_attention_triton(q, kv_cache, LAYER, tables, ctx, scale,
                                        partition=partition_blocks * block_size)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_the_context_is_split_only_when_the_grid_is_small_and_the_context_long():
    from morphling_kernels.paged_attention import PARTITION_BLOCKS, partition_tokens

    cpu = torch.device("cpu")  # one unit: a grid of 2 (sequence, kv head) programs fills it
    size = PARTITION_BLOCKS * 16
    assert partition_tokens(1, 2, 4096, 16, cpu) is None
    assert partition_tokens(1, 1, 4096, 16, cpu) == size
    assert partition_tokens(1, 1, size, 16, cpu) is None  # one partition would hold it all
    with pytest.raises(ValueError, match="whole number"):
        q, kv_cache, tables, ctx, scale = decode_case((4, 2), 32, 16, [40], seed=8)
        paged_decode_attention_triton(q, kv_cache, LAYER, tables, ctx, scale, partition=20)


def test_a_context_within_one_partition_gives_the_same_bits_split_or_not():
    # Eager steps attend over their groups' own longest context and graphs over max_model_len; a sequence shorter
    # than one partition is then attended whole in one and as the only partition of a split in the other.
    q, kv_cache, tables, ctx, scale = decode_case((8, 2), 32, 16, [5, 16, 33, 64], seed=11)
    whole = paged_decode_attention_triton(q, kv_cache, LAYER, tables, ctx, scale)
    split = paged_decode_attention_triton(q, kv_cache, LAYER, tables, ctx, scale, max_context=1024, partition=64)
    assert torch.equal(whole, split)


@pytest.mark.parametrize("partition", [None, 16])
def test_decode_with_a_context_bound_reads_no_lengths_and_ignores_padding_rows(partition):
    # A CUDA graph passes a bound on the contexts (max_model_len) instead of the lengths' maximum, and pads its
    # batch with rows of no context: the real rows come out as without the bound.
    q, kv_cache, tables, ctx, scale = decode_case((6, 2), 32, 16, [1, 17, 97], seed=10)
    expected = paged_decode_attention_ref(q, kv_cache, LAYER, tables, ctx, scale)
    padded_q = torch.cat([q, torch.randn(2, *q.shape[1:])])
    padded_tables = torch.cat([tables, torch.zeros(2, tables.shape[1], dtype=tables.dtype)])
    padded_ctx = torch.cat([ctx, torch.zeros(2, dtype=ctx.dtype)])
    out = paged_decode_attention_triton(padded_q, kv_cache, LAYER, padded_tables, padded_ctx, scale,
                                        max_context=tables.shape[1] * 16, partition=partition)
    torch.testing.assert_close(out[:3], expected, atol=ATOL, rtol=RTOL)
