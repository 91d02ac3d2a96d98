"""W4A16 linear: packed 4-bit weights with per-group scale and zero point, 16/32-bit activations.

The weight is ``packed`` uint8 ``[out, in // 2]`` holding two codes a byte (low
nibble = even input index), with ``scale`` and ``zero`` ``[out, in // group]``
and ``w ≈ (code - zero) * scale`` (see ``services/executor/engine/quant.py``).

The torch reference is the CPU production path, not only a test oracle: it
unpacks with two bit operations over the whole tensor, dequantises with the
group's scale and zero broadcast over the group, and calls ``F.linear``.

On CUDA the weight stays packed in memory (a quarter of bf16's bytes, which is
what bounds decode) and is unpacked in registers:

* Each K chunk of ``BLOCK_K`` inputs loads ``BLOCK_K / 2`` packed bytes per
  output.  Their low and high nibbles are the even and odd inputs, so the
  activation chunk is split the same way and the two halves are multiplied
  separately; no interleaving shuffle is needed.
* ``BLOCK_K`` is the largest power of two dividing the group size (at most 64),
  so a chunk never straddles a group and needs one scale and one zero per output.
* Decode (few rows) is a split-K GEMV with broadcast-multiply-reduce, as in
  ``kernels/w8a16.py``; prefill is a tiled GEMM on ``tl.dot``.  A group size
  whose power-of-two part is below 32 would give ``tl.dot`` an operand narrower
  than 16, so such (unusual) weights run the GEMV kernel for prefill too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.w8a16 import DECODE_MAX_ROWS, _gemv_block_n, _split_k

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # CPU-only installs run the torch path.
    _HAS_TRITON = False


def w4a16_linear_ref(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ dequantize(packed, scale, zero).T + bias`` for ``x`` ``[..., in]``, in ``x``'s dtype."""
    n_out, half = packed.shape
    n_groups = half * 2 // group_size
    # [out, in/2, 2] puts each byte's low code right before its high one, which is the input order.
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(n_out, n_groups, group_size)
    # Dequantising in at least float32 keeps a half-precision zero point from rounding (code - zero);
    # only the finished weight is cast to the activation dtype.
    compute = torch.promote_types(scale.dtype, torch.float32)
    w = codes.to(compute)
    w.sub_(zero.to(compute)[..., None]).mul_(scale.to(compute)[..., None])
    w = w.view(n_out, n_groups * group_size).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def _block_k(group_size: int) -> int:
    # Largest power of two dividing the group: chunks then tile groups exactly.
    return min(64, group_size & -group_size)


if _HAS_TRITON:

    @triton.jit
    def _dequant_chunk(p_ptr, s_ptr, z_ptr, rn, n_mask, k0, group_size, stride_pn, stride_pk, stride_sn,
                       stride_sg, stride_zn, stride_zg, HALF_K: tl.constexpr):
        """Float32 weights ``[HALF_K, BLOCK_N]`` of the even and of the odd inputs of chunk ``k0``."""
        rh = tl.arange(0, HALF_K)
        pk = tl.load(
            p_ptr + (k0 // 2 + rh)[:, None] * stride_pk + rn[None, :] * stride_pn,
            mask=n_mask[None, :],
            other=0,
        )
        g = k0 // group_size
        scale = tl.load(s_ptr + rn * stride_sn + g * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + rn * stride_zn + g * stride_zg, mask=n_mask, other=0.0).to(tl.float32)
        lo = ((pk & 0x0F).to(tl.float32) - zero[None, :]) * scale[None, :]
        hi = ((pk >> 4).to(tl.float32) - zero[None, :]) * scale[None, :]
        return lo, hi

    @triton.jit
    def _w4a16_gemv_kernel(
        x_ptr,
        p_ptr,
        s_ptr,
        z_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        K,
        group_size,
        chunks_per_split,
        stride_xm,
        stride_xk,
        stride_pn,
        stride_pk,
        stride_sn,
        stride_sg,
        stride_zn,
        stride_zg,
        stride_os,
        stride_om,
        stride_on,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        n_mask = rn < N

        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_begin = pid_k * chunks_per_split * BLOCK_K
        k_end = tl.minimum(k_begin + chunks_per_split * BLOCK_K, K)
        # K is a whole number of groups, hence of chunks: no K mask.
        for k0 in range(k_begin, k_end, BLOCK_K):
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :] * stride_xk,
                mask=m_mask[:, None],
                other=0.0,
            ).to(tl.float32)
            # One contiguous load, then split into the inputs the low and the high nibbles multiply.
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
            lo, hi = _dequant_chunk(p_ptr, s_ptr, z_ptr, rn, n_mask, k0, group_size, stride_pn, stride_pk,
                                    stride_sn, stride_sg, stride_zn, stride_zg, BLOCK_K // 2)
            acc += tl.sum(x_even[:, :, None] * lo[None, :, :], axis=1)
            acc += tl.sum(x_odd[:, :, None] * hi[None, :, :], axis=1)

        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
            # Only the first split adds the bias, or the fold would count it once per split.
            acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
        tl.store(
            out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :] * stride_on,
            acc.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & n_mask[None, :],
        )

    @triton.jit
    def _w4a16_gemm_kernel(
        x_ptr,
        p_ptr,
        s_ptr,
        z_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        K,
        group_size,
        stride_xm,
        stride_xk,
        stride_pn,
        stride_pk,
        stride_sn,
        stride_sg,
        stride_zn,
        stride_zg,
        stride_om,
        stride_on,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        n_mask = rn < N

        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :] * stride_xk,
                mask=m_mask[:, None],
                other=0.0,
            )
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
            lo, hi = _dequant_chunk(p_ptr, s_ptr, z_ptr, rn, n_mask, k0, group_size, stride_pn, stride_pk,
                                    stride_sn, stride_sg, stride_zn, stride_zg, BLOCK_K // 2)
            # The dequantised tile is rounded to the activation dtype so 16-bit inputs use the tensor cores;
            # ieee keeps float32 activations off TF32, matching torch's default float32 matmul.
            acc = tl.dot(x_even, lo.to(x.dtype), acc, input_precision="ieee")
            acc = tl.dot(x_odd, hi.to(x.dtype), acc, input_precision="ieee")

        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on,
            acc.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & n_mask[None, :],
        )


def w4a16_linear_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`w4a16_linear_ref`."""
    n_out, half = packed.shape
    k = half * 2
    if x.shape[-1] != k:
        raise ValueError(f"activation width {x.shape[-1]} does not match the weight's {k}")
    if k % group_size or group_size % 2 or scale.shape != (n_out, k // group_size) or zero.shape != scale.shape:
        raise ValueError(f"scale/zero {tuple(scale.shape)}/{tuple(zero.shape)} do not fit groups of {group_size}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n_out)
    bias_arg = bias if bias is not None else scale  # bound but never read without HAS_BIAS
    block_k = _block_k(group_size)
    common = (*packed.stride(), *scale.stride(), *zero.stride())

    if m <= DECODE_MAX_ROWS or block_k < 32:
        block_m = min(triton.next_power_of_2(m), DECODE_MAX_ROWS)
        block_n = _gemv_block_n(block_m)
        m_blocks, n_blocks = triton.cdiv(m, block_m), triton.cdiv(n_out, block_n)
        splits, per_split = _split_k(x.device, m_blocks * n_blocks, k // block_k)
        dest = out if splits == 1 else torch.empty(splits, m, n_out, dtype=torch.float32, device=x.device)
        dest3 = dest.view(splits, m, n_out)
        _w4a16_gemv_kernel[(m_blocks, n_blocks, splits)](
            x2,
            packed,
            scale,
            zero,
            bias_arg,
            dest3,
            m,
            n_out,
            k,
            group_size,
            per_split,
            *x2.stride(),
            *common,
            *dest3.stride(),
            HAS_BIAS=bias is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
        if splits > 1:
            out.copy_(dest.sum(dim=0))
        return out.view(*lead, n_out)

    block_m = 64 if m >= 64 else 32
    block_n = 64
    _w4a16_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n_out, block_n))](
        x2,
        packed,
        scale,
        zero,
        bias_arg,
        out,
        m,
        n_out,
        k,
        group_size,
        *x2.stride(),
        *common,
        *out.stride(),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.view(*lead, n_out)


def w4a16_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A16 linear with Triton on CUDA, the torch path elsewhere."""
    if _HAS_TRITON and x.is_cuda:
        return w4a16_linear_triton(x, packed, scale, zero, group_size, bias)
    return w4a16_linear_ref(x, packed, scale, zero, group_size, bias)
