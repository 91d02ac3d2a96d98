"""Copy whole KV pages inside the arena.

Copy-on-write (a forked sequence about to write into a shared last block) and
KV relocation (compacting pages so weights can grow into the freed space) both
reduce to "copy page src[i] onto page dst[i]" for every layer and head at once,
which is what a page holds.  Pages are strided views into a byte buffer, so the
Triton kernel walks each page through its strides rather than as flat memory.

Precondition for the Triton path: destination pages are distinct and none of
them is also a source in the same call, because pairs run concurrently.  The
torch path reads all sources before writing, so it tolerates overlap.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # CPU-only installs run the torch path.
    _HAS_TRITON = False

# Elements per Triton program; a power of two as tl.arange requires.
_CHUNK = 1024


def copy_blocks_ref(kv_cache: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """Copy ``kv_cache[src_pages[i]]`` onto ``kv_cache[dst_pages[i]]`` in place."""
    if src_pages.numel() == 0:
        return
    kv_cache[dst_pages.long()] = kv_cache[src_pages.long()]


if _HAS_TRITON:

    @triton.jit
    def _copy_blocks_kernel(
        cache_ptr,
        src_ptr,
        dst_ptr,
        page_numel,
        dim1,
        dim2,
        dim3,
        dim4,
        stride_p,
        stride0,
        stride1,
        stride2,
        stride3,
        stride4,
        CHUNK: tl.constexpr,
    ):
        pair = tl.program_id(0)
        chunk = tl.program_id(1)
        src = tl.load(src_ptr + pair).to(tl.int64)
        dst = tl.load(dst_ptr + pair).to(tl.int64)

        # Unravel a flat in-page index into the 5 page coordinates so any
        # stride layout of the arena view is honoured.
        idx = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = idx < page_numel
        rem = idx
        i4 = rem % dim4
        rem = rem // dim4
        i3 = rem % dim3
        rem = rem // dim3
        i2 = rem % dim2
        rem = rem // dim2
        i1 = rem % dim1
        i0 = rem // dim1
        offs = (
            i0.to(tl.int64) * stride0
            + i1.to(tl.int64) * stride1
            + i2.to(tl.int64) * stride2
            + i3.to(tl.int64) * stride3
            + i4.to(tl.int64) * stride4
        )
        vals = tl.load(cache_ptr + src * stride_p + offs, mask=mask)
        tl.store(cache_ptr + dst * stride_p + offs, vals, mask=mask)


def copy_blocks_triton(
    kv_cache: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
) -> None:
    """Triton version of :func:`copy_blocks_ref`: one program per (pair, page chunk)."""
    n_pairs = src_pages.numel()
    if n_pairs == 0:
        return
    page_shape = kv_cache.shape[1:]
    page_numel = 1
    for size in page_shape:
        page_numel *= size
    grid = (n_pairs, triton.cdiv(page_numel, _CHUNK))
    _copy_blocks_kernel[grid](
        kv_cache,
        src_pages,
        dst_pages,
        page_numel,
        *page_shape[1:],
        *kv_cache.stride(),
        CHUNK=_CHUNK,
    )


def copy_blocks(kv_cache: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """Copy pages with Triton on CUDA, torch indexing elsewhere."""
    if _HAS_TRITON and kv_cache.is_cuda:
        copy_blocks_triton(kv_cache, src_pages, dst_pages)
    else:
        copy_blocks_ref(kv_cache, src_pages, dst_pages)
