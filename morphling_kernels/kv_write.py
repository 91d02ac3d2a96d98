"""Scatter freshly computed K/V rows into the paged KV arena.

Every forward step produces K/V for a handful of new tokens; they must land in
the page/offset the block manager assigned them (the "slot") for one layer.
The arena view is ``kv_cache[num_pages, num_kv_heads, num_layers, 2, block_size,
head_dim]``, a strided view into a shared byte buffer, so nothing here assumes
contiguity beyond the strides.  A negative slot marks a padding row that must
not be written (batches are padded to fixed shapes).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # CPU-only installs run the torch path.
    _HAS_TRITON = False


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``/``v`` ``[N, num_kv_heads, head_dim]`` into ``kv_cache`` in place."""
    block_size = kv_cache.shape[4]
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    # Filtering costs a copy, so only pay it when padding is actually present.
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    if slots.numel() == 0:
        return
    pages = slots // block_size
    offsets = slots % block_size
    layer_cache = kv_cache[:, :, layer]  # [P, kvh, 2, bs, hd], still a view
    # Two advanced indices separated by a slice put the token dim first, so the
    # indexed region is [N, kvh, hd] and matches k/v without any permute.
    layer_cache[:, :, 0][pages, :, offsets] = k.to(kv_cache.dtype)
    layer_cache[:, :, 1][pages, :, offsets] = v.to(kv_cache.dtype)


if _HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(
        k_ptr,
        v_ptr,
        cache_ptr,
        slot_ptr,
        num_heads,
        head_dim,
        block_size,
        stride_kn,
        stride_kh,
        stride_kd,
        stride_vn,
        stride_vh,
        stride_vd,
        stride_cp,
        stride_ch,
        stride_ckv,
        stride_ct,
        stride_cd,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        # A padding row writes zero heads.  Folding that into the head bound
        # (rather than and-ing a scalar bool into the tile mask) avoids the
        # interpreter promoting the mask to int32, which it then rejects.
        heads_to_write = tl.where(slot >= 0, num_heads, 0)
        page = slot // block_size
        offset = slot % block_size

        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < heads_to_write) & (d[None, :] < head_dim)

        k = tl.load(
            k_ptr + token * stride_kn + h[:, None] * stride_kh + d[None, :] * stride_kd,
            mask=mask,
        )
        v = tl.load(
            v_ptr + token * stride_vn + h[:, None] * stride_vh + d[None, :] * stride_vd,
            mask=mask,
        )
        # page is int64: arenas can exceed 2**31 elements.
        dst = page * stride_cp + offset * stride_ct + h[:, None] * stride_ch + d[None, :] * stride_cd
        tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(cache_ptr + stride_ckv + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of :func:`write_kv_ref`: one program per token."""
    n_tokens, num_heads, head_dim = k.shape
    if n_tokens == 0:
        return
    # Selecting the layer on the host folds its offset into the base pointer.
    layer_cache = kv_cache[:, :, layer]  # [P, kvh, 2, bs, hd]
    _write_kv_kernel[(n_tokens,)](
        k,
        v,
        layer_cache,
        slot_mapping,
        num_heads,
        head_dim,
        kv_cache.shape[4],
        *k.stride(),
        *v.stride(),
        *layer_cache.stride(),
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """Write K/V into the cache with Triton on CUDA, torch indexing elsewhere."""
    if _HAS_TRITON and kv_cache.is_cuda:
        write_kv_triton(k, v, kv_cache, layer, slot_mapping)
    else:
        write_kv_ref(k, v, kv_cache, layer, slot_mapping)
