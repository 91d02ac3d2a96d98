"""Decode-time attention over the paged KV arena.

During decode every sequence contributes exactly one query token, and its K/V
history is scattered over pages named by its block table.  The torch reference
is not just a test oracle: it is the CPU production path, so it gathers only the
pages actually needed, does GQA by grouping query heads instead of replicating
K/V, runs torch's fused SDPA, and takes its gather plan (page rows, padding
mask) from the caller, who builds it once a step for every layer.  The Triton
kernel runs one program per (sequence, kv head) and streams the pages with an
online softmax.

A batch of few sequences gives that grid too few programs to keep a GPU's memory
busy: at batch 1 an 8-kv-head model runs 8 programs for the whole context. So
when the grid is small and the context long, the context is split as well
(flash-decoding): one program per (sequence, kv head, partition) writes its
partial softmax state (running max, sum and unnormalised output), and a second
kernel merges a sequence's partitions (`partition_tokens`).

Contract with the engine: every page a block table names, padding entries included,
holds finite values (pages are zeroed when allocated, and padding entries repeat one
of the sequence's own pages). The reference masks scores past a context length to
-inf and relies on that contract, since a zero weight times NaN would still be NaN;
zeroing the gathered V instead would cost a full extra pass per layer. The Triton
kernel never loads masked positions at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # CPU-only installs run the torch path.
    _HAS_TRITON = False


@dataclass(frozen=True)
class DecodeGather:
    """What every layer's decode attention over one group of sequences shares, built once a step: the rows of
    their pages in the arena's (page, kv head) view, and which gathered positions lie within each context."""

    rows: torch.Tensor  # [B * kvh * blocks] int64, sequence-major, then kv head, then block
    blocks: int
    max_context: int
    valid: torch.Tensor | None  # [B, 1, 1, max_context] bool, True = attend; None: no sequence is padded


def decode_gather(block_tables: torch.Tensor, context_lens: torch.Tensor, num_kv_heads: int,
                  block_size: int) -> DecodeGather:
    """The gather plan of a decode group over an arena of `num_kv_heads` heads and `block_size` tokens a page."""
    # Gathering the full table width would waste work on padding blocks.
    max_ctx = int(context_lens.max())
    blocks = (max_ctx + block_size - 1) // block_size
    tables = block_tables[:, :blocks].long()
    heads = torch.arange(num_kv_heads, device=tables.device)
    rows = (tables[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
    valid = None
    if int(context_lens.min()) < max_ctx:
        positions = torch.arange(max_ctx, device=tables.device)
        valid = (positions[None, :] < context_lens.to(tables.device).long()[:, None])[:, None, None, :]
    return DecodeGather(rows, blocks, max_ctx, valid)


def paged_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    gather: DecodeGather | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, num_heads, head_dim]`` over each sequence's paged context; ``gather``: the
    group's :func:`decode_gather`, which a step shares across its layers (built here when None)."""
    batch, num_heads, head_dim = q.shape
    num_pages, num_kv_heads, block_size = kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    plan = gather or decode_gather(block_tables, context_lens, num_kv_heads, block_size)

    # In the arena, (page, kv_head) merge into one dimension whose rows are a block's K (or V) for one
    # head: index_select then copies whole contiguous rows, ~15x faster than advanced indexing of the
    # strided view, and lands directly in [B, kvh, T, hd].
    shape = (batch, num_kv_heads, plan.blocks * block_size, head_dim)

    def take(kv: int) -> torch.Tensor:
        flat = kv_cache[:, :, layer, kv].reshape(num_pages * num_kv_heads, -1)
        return flat.index_select(0, plan.rows).view(shape)[:, :, :plan.max_context].to(q.dtype)

    # GQA without replicating K/V: a kv head's group of query heads are the query rows of its attention, which
    # torch's fused SDPA runs (in float32 accumulation) with the padding masked.
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(qg, take(0), take(1), attn_mask=plan.valid, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


if _HAS_TRITON:

    @triton.jit
    def _attend_blocks(q, head_base, table_row, ctx, first, last, t, d, d_mask, stride_tn, stride_cp, stride_ckv,
                       stride_ct, stride_cd, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        """Online softmax of the (scaled) query group `q` over the sequence's blocks [first, last): its running
        max, sum and unnormalised output. Both decode kernels stream their pages through it."""
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
        for blk in range(first, last):
            page = tl.load(table_row + blk * stride_tn).to(tl.int64)
            pos = blk * BLOCK_SIZE + t
            t_mask = (t < BLOCK_SIZE) & (pos < ctx)
            offs = page * stride_cp + t[:, None] * stride_ct + d[None, :] * stride_cd
            kv_mask = t_mask[:, None] & d_mask[None, :]
            # Masked loads keep garbage past the context out of the math entirely.
            k = tl.load(head_base + offs, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(head_base + stride_ckv + offs, mask=kv_mask, other=0.0).to(tl.float32)

            # Groups can be 1..8 wide, below tl.dot's 16-row minimum, so the
            # products are done as broadcast-multiply-reduce.
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_T]
            s = tl.where(t_mask[None, :], s, float("-inf"))

            # A non-empty range starts inside the context, so its first block has a finite score: m_new is
            # finite from the first iteration on and exp() never sees inf-inf.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        return m_i, l_i, acc


if _HAS_TRITON:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        cache_ptr,
        table_ptr,
        ctx_ptr,
        out_ptr,
        scale,
        head_dim,
        stride_qb,
        stride_qh,
        stride_qd,
        stride_cp,
        stride_ch,
        stride_ckv,
        stride_ct,
        stride_cd,
        stride_tb,
        stride_tn,
        stride_ob,
        stride_oh,
        stride_od,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        ctx = tl.load(ctx_ptr + seq)

        g = tl.arange(0, GROUP_PAD)
        t = tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)
        g_mask = g < GROUP
        d_mask = d < head_dim
        heads = kv_head * GROUP + g

        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        # Folding the scale into q once is cheaper than scaling every score.
        q = q * scale

        m_i, l_i, acc = _attend_blocks(q, cache_ptr + kv_head * stride_ch, table_ptr + seq * stride_tb, ctx, 0,
                                       tl.cdiv(ctx, BLOCK_SIZE), t, d, d_mask, stride_tn, stride_cp, stride_ckv,
                                       stride_ct, stride_cd, GROUP_PAD, BLOCK_SIZE, BLOCK_D)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )


if _HAS_TRITON:

    @triton.jit
    def _paged_decode_partition_kernel(
        q_ptr,
        cache_ptr,
        table_ptr,
        ctx_ptr,
        acc_ptr,
        ml_ptr,
        scale,
        head_dim,
        stride_qb,
        stride_qh,
        stride_qd,
        stride_cp,
        stride_ch,
        stride_ckv,
        stride_ct,
        stride_cd,
        stride_tb,
        stride_tn,
        stride_ab,
        stride_ah,
        stride_ap,
        stride_ad,
        stride_mb,
        stride_mh,
        stride_mp,
        stride_m2,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PART_BLOCKS: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        part = tl.program_id(2)
        ctx = tl.load(ctx_ptr + seq)
        first = part * PART_BLOCKS
        last = tl.minimum(first + PART_BLOCKS, tl.cdiv(ctx, BLOCK_SIZE))
        if first < last:  # a partition past this sequence's context has nothing to do, and is never merged
            g = tl.arange(0, GROUP_PAD)
            t = tl.arange(0, BLOCK_T)
            d = tl.arange(0, BLOCK_D)
            g_mask = g < GROUP
            d_mask = d < head_dim
            heads = kv_head * GROUP + g
            q = tl.load(
                q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :],
                other=0.0,
            ).to(tl.float32) * scale

            m_i, l_i, acc = _attend_blocks(q, cache_ptr + kv_head * stride_ch, table_ptr + seq * stride_tb, ctx,
                                           first, last, t, d, d_mask, stride_tn, stride_cp, stride_ckv, stride_ct,
                                           stride_cd, GROUP_PAD, BLOCK_SIZE, BLOCK_D)

            row = seq * stride_ab + heads * stride_ah + part * stride_ap
            tl.store(acc_ptr + row[:, None] + d[None, :] * stride_ad, acc, mask=g_mask[:, None] & d_mask[None, :])
            state = ml_ptr + seq * stride_mb + heads * stride_mh + part * stride_mp
            tl.store(state, m_i, mask=g_mask)
            tl.store(state + stride_m2, l_i, mask=g_mask)

    @triton.jit
    def _paged_decode_merge_kernel(
        ctx_ptr,
        acc_ptr,
        ml_ptr,
        out_ptr,
        head_dim,
        stride_ab,
        stride_ah,
        stride_ap,
        stride_ad,
        stride_mb,
        stride_mh,
        stride_mp,
        stride_m2,
        stride_ob,
        stride_oh,
        stride_od,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PART_TOKENS: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        ctx = tl.load(ctx_ptr + seq)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, BLOCK_D)
        g_mask = g < GROUP
        mask = g_mask[:, None] & (d < head_dim)[None, :]
        heads = kv_head * GROUP + g

        m_all = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_all = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
        # Every partition merged here holds at least one token, so its max is finite and exp() never sees
        # inf - inf; padding rows read a max of 0 and a sum of 1 and are never stored.
        for part in range(0, tl.cdiv(ctx, PART_TOKENS)):
            state = ml_ptr + seq * stride_mb + heads * stride_mh + part * stride_mp
            m = tl.load(state, mask=g_mask, other=0.0)
            total = tl.load(state + stride_m2, mask=g_mask, other=1.0)
            a = tl.load(acc_ptr + (seq * stride_ab + heads * stride_ah + part * stride_ap)[:, None]
                        + d[None, :] * stride_ad, mask=mask, other=0.0)
            m_new = tl.maximum(m_all, m)
            alpha = tl.exp(m_all - m_new)
            beta = tl.exp(m - m_new)
            l_all = l_all * alpha + total * beta
            acc = acc * alpha[:, None] + a * beta[:, None]
            m_all = m_new

        out = acc / l_all[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=mask)


# Tokens of context one program of a split streams, in blocks. Small, so that a context of a few thousand tokens
# gives a small grid a few programs per multiprocessor (decode attention is bound by memory, and a GPU keeps its
# memory busy only with many loads in flight: issue 15 measured 11-20 GB/s with 8 programs streaming a whole
# 4096-token context); and the same whatever the context, so that a sequence is cut at the same places whether
# its step runs eagerly or replays a graph, and both give the same bits.
PARTITION_BLOCKS = 4


def partition_tokens(batch: int, num_kv_heads: int, max_ctx: int, block_size: int,
                     device: torch.device) -> int | None:
    """Tokens of context one program streams when the context is split (flash-decoding), or None when the
    (sequence, kv head) grid fills the device by itself or no context is longer than one partition."""
    units = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    partition = PARTITION_BLOCKS * block_size
    return partition if batch * num_kv_heads < 2 * units and max_ctx > partition else None


def paged_decode_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context: int | None = None,
    partition: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`paged_decode_attention_ref`. `max_context` bounds `context_lens` without
    reading them (a CUDA graph cannot wait for the device); None reads them. `partition` splits the context
    into partitions of that many tokens (a multiple of the block size) whatever the grid; None decides by
    :func:`partition_tokens`."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    # Selecting the layer on the host folds its offset into the base pointer.
    layer_cache = kv_cache[:, :, layer]  # [P, kvh, 2, bs, hd]
    max_ctx = int(context_lens.max()) if max_context is None else max_context
    if partition is None:
        partition = partition_tokens(batch, num_kv_heads, max_ctx, block_size, q.device)
    if partition is not None:
        return _split_decode(q, layer_cache, block_tables, context_lens, scale, out, partition, max_ctx)
    _paged_decode_kernel[(batch, num_kv_heads)](
        q,
        layer_cache,
        block_tables,
        context_lens,
        out,
        float(scale),
        head_dim,
        *q.stride(),
        *layer_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_SIZE=block_size,
        BLOCK_T=triton.next_power_of_2(block_size),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out


def _split_decode(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float, out: torch.Tensor, partition: int,
                  max_ctx: int) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = layer_cache.shape[1], layer_cache.shape[3]
    if partition % block_size:
        raise ValueError(f"a partition of {partition} tokens is not a whole number of {block_size}-token blocks")
    group = num_heads // num_kv_heads
    parts = triton.cdiv(max_ctx, partition)  # partitions past a sequence's context return at once
    acc = torch.empty(batch, num_heads, parts, head_dim, dtype=torch.float32, device=q.device)
    state = torch.empty(batch, num_heads, parts, 2, dtype=torch.float32, device=q.device)  # max, sum
    common = dict(GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_D=triton.next_power_of_2(head_dim))
    _paged_decode_partition_kernel[(batch, num_kv_heads, parts)](
        q, layer_cache, block_tables, context_lens, acc, state, float(scale), head_dim,
        *q.stride(), *layer_cache.stride(), *block_tables.stride(), *acc.stride(), *state.stride(),
        BLOCK_SIZE=block_size, BLOCK_T=triton.next_power_of_2(block_size),
        PART_BLOCKS=partition // block_size, **common)
    _paged_decode_merge_kernel[(batch, num_kv_heads)](
        context_lens, acc, state, out, head_dim, *acc.stride(), *state.stride(), *out.stride(),
        PART_TOKENS=partition, **common)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context: int | None = None,
    gather: DecodeGather | None = None,
) -> torch.Tensor:
    """Decode attention with Triton on CUDA, the batched torch path elsewhere (`max_context`: see Triton's;
    `gather`: the reference's, on CPU)."""
    if _HAS_TRITON and q.is_cuda:
        return paged_decode_attention_triton(q, kv_cache, layer, block_tables, context_lens, scale, max_context)
    return paged_decode_attention_ref(q, kv_cache, layer, block_tables, context_lens, scale, gather)
