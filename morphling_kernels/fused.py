"""Fused element-wise ops of the decode step: residual add + RMSNorm, SiLU-gated FFN activation, and RoPE with
the K/V write into the paged arena.

At decode every one of these is a memory-bound pass over a few rows, so each unfused torch op costs a kernel
launch and a round trip through global memory; fused, each becomes one launch that reads its inputs once.

The engine is checked token for token against Hugging Face transformers, so the kernels round exactly where torch
does: every intermediate that torch materialises in the serving dtype is rounded to that dtype here too (to
nearest even), products and sums are otherwise done in float32 as torch's kernels do internally, and launches
disable fp fusion, which would turn a product and a sum into one fma with one rounding fewer. What torch leaves
to the device (how a mean divides, which exp and rsqrt it calls) follows torch's kernel for the device the
tensors are on. What cannot be matched is the order of the RMSNorm's sum of squares, and, under the
interpreter, the last bit of exp (numpy's, not torch's).

The torch references are the CPU path, not just test oracles.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from morphling_kernels.kv_write import write_kv_ref

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    _HAS_TRITON = True
except ImportError:  # CPU-only installs run the torch path.
    _HAS_TRITON = False

# The interpreter cannot call libdevice, so it gets torch's CPU math even on CUDA tensors.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[..., hidden]`` as transformers computes it: float32 statistics, the normalised value
    rounded to ``x``'s dtype before the weight multiplies it."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, the sum rounded to the serving dtype before it is normalised."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


def silu_mul_ref(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """``silu(gate) * up`` of the FFN's fused projection ``[..., pieces * 2 * width]`` (per piece, ``width`` gate
    channels then ``width`` up channels), as ``[..., pieces * width]``."""
    g = gate_up.unflatten(-1, (-1, 2, width))
    return (F.silu(g[..., 0, :]) * g[..., 1, :]).flatten(-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it (rotate_half), each product rounded to the dtype before the sum."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_write_kv_ref(q, k, v, cos, sin, kv_cache, layer, slot_mapping):
    """Rotate ``q`` ``[N, num_heads, head_dim]`` and ``k`` ``[N, num_kv_heads, head_dim]`` by ``cos``/``sin``
    (``[N, 1, head_dim]`` or ``[N, head_dim]``), write the rotated K and ``v`` at ``slot_mapping`` of ``layer``
    in ``kv_cache``, and return ``(q_rot, k_rot)``."""
    if cos.dim() == 2:  # [N, head_dim] would broadcast against the heads dimension, not the tokens one
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_rot, k_rot = rotate(q, cos, sin), rotate(k, cos, sin)
    write_kv_ref(k_rot, v, kv_cache, layer, slot_mapping)
    return q_rot, k_rot


if _HAS_TRITON:

    @triton.jit
    def _round(x, DTYPE: tl.constexpr):
        """float32 ``x`` rounded to nearest even in ``DTYPE``. The interpreter truncates float32 -> bfloat16
        casts, so bfloat16 is rounded by hand, the way torch's CPU conversion does, on every backend."""
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = tl.where(x != x, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(DTYPE)

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, inv_hidden, eps,
                         stride_xr, stride_xc, stride_rr, stride_rc, stride_w, stride_or, stride_oc, stride_sr,
                         stride_sc,
                         HAS_RESIDUAL: tl.constexpr, TORCH_CUDA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        mask = c < hidden
        x = tl.load(x_ptr + row * stride_xr + c * stride_xc, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_rr + c * stride_rc, mask=mask, other=0.0).to(tl.float32)
            s = _round(x + r, res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_sr + c * stride_sc, s, mask=mask)
            x = s.to(tl.float32)
        total = tl.sum(x * x, axis=0)
        if TORCH_CUDA:
            # torch's CUDA mean multiplies by the float32 1/n and its rsqrt is CUDA's rsqrtf.
            rstd = libdevice.rsqrt(total * inv_hidden + eps)
        else:
            # torch's CPU mean divides the sum by n and its rsqrt is 1/sqrt, as is the interpreter's.
            rstd = tl.rsqrt(total / hidden + eps)
        normed = _round(x * rstd, x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + c * stride_w, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_or + c * stride_oc, _round(w * normed, out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, width, stride_gr, stride_gc, stride_or, stride_oc,
                         TORCH_CUDA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < n_cols
        # Output channel c is channel c % width of piece c // width, whose gate sits width channels further
        # on in the [pieces, 2, width] layout for each piece before it.
        gate_col = c + (c // width) * width
        base = gu_ptr + row * stride_gr
        g = tl.load(base + gate_col * stride_gc, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(base + (gate_col + width) * stride_gc, mask=mask, other=0.0).to(tl.float32)
        if TORCH_CUDA:
            e = libdevice.exp(-g)  # torch's CUDA silu calls CUDA's expf; tl.exp is a cruder ex2.approx
        else:
            e = tl.exp(-g)
        # torch's silu is x / (1 + exp(-x)) with an IEEE division, which plain `/` is not on CUDA.
        act = _round(tl.math.div_rn(g, 1.0 + e), out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_or + c * stride_oc, _round(act * u, out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_heads(src, stride_h, stride_d, dst, stride_dh, stride_dd, n_heads, head_dim, cos, sin, d, partner,
                    sign, BLOCK_H: tl.constexpr):
        """Rotate one token's heads from ``src`` into ``dst``; returns the rotated tile and its mask."""
        h = tl.arange(0, BLOCK_H)[:, None]
        mask = (h < n_heads) & (d[None, :] < head_dim)
        x = tl.load(src + h * stride_h + d[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(src + h * stride_h + partner[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
        out_ty = dst.dtype.element_ty
        # torch rounds each product to the dtype before it adds them.
        a = _round(x * cos[None, :], out_ty).to(tl.float32)
        b = _round(sign[None, :] * xp * sin[None, :], out_ty).to(tl.float32)
        rot = _round(a + b, out_ty)
        tl.store(dst + h * stride_dh + d[None, :] * stride_dd, rot, mask=mask)
        return rot

    @triton.jit
    def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, cache_ptr, slot_ptr,
                              num_heads, num_kv_heads, head_dim, half, block_size,
                              stride_qn, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd,
                              stride_vn, stride_vh, stride_vd, stride_cosn, stride_cosd, stride_sinn, stride_sind,
                              stride_qon, stride_qoh, stride_qod, stride_kon, stride_koh, stride_kod,
                              stride_cp, stride_ch, stride_ckv, stride_ct, stride_cd,
                              BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_dim
        # rotate_half: the first (head_dim - half) channels take the negated upper half, the rest the lower.
        first = head_dim - half
        partner = tl.where(d < first, d + half, d - first)
        sign = tl.where(d < first, -1.0, 1.0)
        cos = tl.load(cos_ptr + token * stride_cosn + d * stride_cosd, mask=d_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_sinn + d * stride_sind, mask=d_mask, other=0.0).to(tl.float32)

        _rope_heads(q_ptr + token * stride_qn, stride_qh, stride_qd, q_out_ptr + token * stride_qon, stride_qoh,
                    stride_qod, num_heads, head_dim, cos, sin, d, partner, sign, BLOCK_HQ)
        k_rot = _rope_heads(k_ptr + token * stride_kn, stride_kh, stride_kd, k_out_ptr + token * stride_kon,
                            stride_koh, stride_kod, num_kv_heads, head_dim, cos, sin, d, partner, sign, BLOCK_HK)

        slot = tl.load(slot_ptr + token).to(tl.int64)
        # As in kv_write: a padding row writes zero heads, folded into the head bound.
        heads_to_write = tl.where(slot >= 0, num_kv_heads, 0)
        h = tl.arange(0, BLOCK_HK)[:, None]
        mask = (h < heads_to_write) & d_mask[None, :]
        v = tl.load(v_ptr + token * stride_vn + h * stride_vh + d[None, :] * stride_vd, mask=mask, other=0.0)
        # page is int64: arenas can exceed 2**31 elements.
        page, offset = slot // block_size, slot % block_size
        dst = page * stride_cp + offset * stride_ct + h * stride_ch + d[None, :] * stride_cd
        cache_ty = cache_ptr.dtype.element_ty
        tl.store(cache_ptr + dst, _round(k_rot.to(tl.float32), cache_ty), mask=mask)
        tl.store(cache_ptr + stride_ckv + dst, _round(v.to(tl.float32), cache_ty), mask=mask)


def _torch_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and not _INTERPRETED


def _norm_triton(x, residual, weight, eps):
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if residual is None:  # the kernel then neither reads nor writes the residual pointers
        res2 = new_res = x2
    elif residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm wants x and residual in one dtype, got {x.dtype} and {residual.dtype}")
    else:
        res2 = residual.reshape(-1, hidden)
        new_res = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    # torch's CUDA mean scales by float32(1) / float32(n), which a Python double could round differently.
    inv_hidden = float(np.float32(1) / np.float32(hidden))
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, new_res, hidden, inv_hidden, eps, *x2.stride(), *res2.stride(), weight.stride(0),
            *out.stride(), *new_res.stride(), HAS_RESIDUAL=residual is not None, TORCH_CUDA=_torch_cuda(x),
            BLOCK=triton.next_power_of_2(hidden), enable_fp_fusion=False,
        )
    return out.view(x.shape), new_res.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of :func:`rms_norm_ref`: one program per row."""
    return _norm_triton(x, None, weight, eps)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`add_rms_norm_ref`: one program per row, ``x`` and ``residual`` in one dtype."""
    return _norm_triton(x, residual, weight, eps)


def silu_mul_triton(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """Triton version of :func:`silu_mul_ref`: one program per (row, block of output channels)."""
    n_cols = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, gate_up.shape[-1])
    out = torch.empty(gu.shape[0], n_cols, dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(max(n_cols, 1)), 1024)
    if out.numel() > 0:
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(n_cols, block))](
            gu, out, n_cols, width, *gu.stride(), *out.stride(), TORCH_CUDA=_torch_cuda(gate_up), BLOCK=block,
            enable_fp_fusion=False,
        )
    return out.view(*gate_up.shape[:-1], n_cols)


def rope_write_kv_triton(q, k, v, cos, sin, kv_cache, layer, slot_mapping):
    """Triton version of :func:`rope_write_kv_ref`: one program per token does all its heads."""
    n_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    cos, sin = cos.reshape(n_tokens, head_dim), sin.reshape(n_tokens, head_dim)
    q_rot = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype), device=q.device)
    k_rot = torch.empty(k.shape, dtype=torch.promote_types(k.dtype, cos.dtype), device=k.device)
    if n_tokens == 0:
        return q_rot, k_rot
    layer_cache = kv_cache[:, :, layer]  # [P, kvh, 2, bs, hd]; selecting the layer folds it into the base pointer
    _rope_write_kv_kernel[(n_tokens,)](
        q, k, v, cos, sin, q_rot, k_rot, layer_cache, slot_mapping,
        num_heads, num_kv_heads, head_dim, head_dim // 2, kv_cache.shape[4],
        *q.stride(), *k.stride(), *v.stride(), *cos.stride(), *sin.stride(), *q_rot.stride(), *k_rot.stride(),
        *layer_cache.stride(),
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), enable_fp_fusion=False,
    )
    return q_rot, k_rot


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with Triton on CUDA, torch elsewhere."""
    if _HAS_TRITON and x.is_cuda:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` with Triton on CUDA, torch elsewhere."""
    if _HAS_TRITON and x.is_cuda:
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """The FFN's ``silu(gate) * up`` with Triton on CUDA, torch elsewhere."""
    if _HAS_TRITON and gate_up.is_cuda:
        return silu_mul_triton(gate_up, width)
    return silu_mul_ref(gate_up, width)


def rope_write_kv(q, k, v, cos, sin, kv_cache, layer, slot_mapping):
    """RoPE on ``q``/``k`` and the K/V write into the arena with Triton on CUDA, torch elsewhere."""
    if _HAS_TRITON and kv_cache.is_cuda:
        return rope_write_kv_triton(q, k, v, cos, sin, kv_cache, layer, slot_mapping)
    return rope_write_kv_ref(q, k, v, cos, sin, kv_cache, layer, slot_mapping)
