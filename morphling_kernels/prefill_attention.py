"""Causal attention for one sequence's prefill chunk.

Long prompts are prefilled in chunks.  The first chunk (nothing cached yet)
only needs its own K/V and plain causal attention.  Later chunks must also see
every earlier token, which lives only in the paged KV arena, so the prefix is
gathered from the sequence's block table and the causal mask is shifted by the
number of already-cached tokens.  Both cases go through torch's fused
``scaled_dot_product_attention`` with native GQA, so K/V are never replicated
per query head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(
    kv_cache: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the first ``length`` positions of one sequence as ``(k, v)``, each ``[kvh, length, hd]``."""
    num_pages, num_kv_heads, block_size = kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[4]
    head_dim = kv_cache.shape[5]
    n_blocks = (length + block_size - 1) // block_size
    pages = block_table[:n_blocks].long()
    # (page, kv_head) rows are contiguous blocks in the arena: index_select copies whole rows, and ordering
    # them head-major lands the gather directly in [kvh, T, hd].
    rows = (pages[None, :] * num_kv_heads + torch.arange(num_kv_heads, device=pages.device)[:, None]).reshape(-1)

    def take(kv: int) -> torch.Tensor:
        flat = kv_cache[:, :, layer, kv].reshape(num_pages * num_kv_heads, -1).index_select(0, rows)
        return flat.view(num_kv_heads, n_blocks * block_size, head_dim)[:, :length]

    return take(0), take(1)


def prefill_attention(
    q: torch.Tensor,
    k_chunk: torch.Tensor,
    v_chunk: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    context_start: int,
    scale: float,
) -> torch.Tensor:
    """Attention of a chunk ``q`` ``[C, num_heads, hd]`` at absolute positions ``context_start + i``."""
    chunk = q.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, C, hd]
    if context_start == 0:
        # The chunk is the whole visible context: skip the cache round trip.
        k = k_chunk.transpose(0, 1).unsqueeze(0)
        v = v_chunk.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            qh, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        total = context_start + chunk
        k, v = gather_kv(kv_cache, layer, block_table, total)
        # is_causal aligns the diagonal top-left, which is wrong when the keys
        # start context_start tokens before the queries, hence an explicit mask.
        rows = torch.arange(chunk, device=q.device)[:, None] + context_start
        cols = torch.arange(total, device=q.device)[None, :]
        mask = cols <= rows  # [C, total], True = may attend
        out = F.scaled_dot_product_attention(
            qh,
            k.unsqueeze(0).to(q.dtype),
            v.unsqueeze(0).to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
    return out.squeeze(0).transpose(0, 1).contiguous()
