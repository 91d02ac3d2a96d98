"""W4A16 linear: packed 4-bit weights with per-group scale and zero point, 16/32-bit activations.

The weight is ``packed`` uint8 ``[out, in // 2]`` holding two codes a byte (low
nibble = even input index), with ``scale`` and ``zero`` ``[out, in // group]``
and ``w ≈ (code - zero) * scale`` (see ``services/executor/engine/morphing/quant.py``).

The torch reference unpacks with two bit operations over the whole tensor,
dequantises with the group's scale and zero broadcast over the group, and calls
``F.linear``.

On CPU the engine stores INT4 layers in the layout of torch's CPU int4 kernel
(``torch._weight_int4pack_mm_for_cpu``; ``quant.to_cpu_int4pack``) wherever
that kernel takes the shape, and runs it with bfloat16 activations: over the
default model's linears it was 5.3-6.5x faster than float32 at 1-4 rows,
3.4x at 16, 1.8x at 64 and 1.4x at 256 (docs/benchmarks.md), where the
reference is slower than float32 at every row count. With float32 activations the kernel
was slower than float32's GEMM, so it is not used that way.

On CUDA the weight stays packed in memory (a quarter of bf16's bytes, which is
what bounds decode) and is unpacked in registers:

* Each K chunk of ``BLOCK_K`` inputs loads ``BLOCK_K / 2`` packed bytes per
  output.  Their low and high nibbles are the even and odd inputs, so the
  activation chunk is split the same way and the two halves are multiplied
  separately; no interleaving shuffle is needed.
* ``BLOCK_K`` is a power of two dividing the group size (64 unless tuned),
  so a chunk never straddles a group and needs one scale and one zero per output.
* Decode (few rows) is a split-K GEMV with broadcast-multiply-reduce, as in
  ``morphling_kernels/w8a16.py``; prefill is a tiled GEMM on ``tl.dot``, which may split
  K too.  A group size whose power-of-two part is below 32 would give ``tl.dot``
  an operand narrower than 16, so such (unusual) weights run the GEMV kernel for
  prefill too.  Tiles, split and path are timed on the GPU itself, as for W8A16
  (``morphling_kernels/tuning.py``); a chunk may span 64, 128 or 256 inputs of one group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from morphling_kernels.tuning import choose, rows_bucket
from morphling_kernels.w8a16 import _split_k, launch_candidates, partials

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


def block_ks(group_size: int) -> tuple[int, ...]:
    """Chunk widths that never straddle a group, the default first: powers of two dividing the group."""
    widest = group_size & -group_size
    return (_block_k(group_size), *(bk for bk in (128, 256) if bk <= widest))


if _HAS_TRITON:
    from morphling_kernels.w8a16 import gemv_sum

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
        # In int64: a prefill's rows times the outputs can pass 2**31 (131k tokens x 28,672 of gate/up).
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        n_mask = rn < N

        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_begin = pid_k * chunks_per_split * BLOCK_K
        k_end = tl.minimum(k_begin + chunks_per_split * BLOCK_K, K)
        exact: tl.constexpr = x_ptr.dtype.element_ty == tl.float32
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
            acc += gemv_sum(x_even, lo, exact)
            acc += gemv_sum(x_odd, hi, exact)

        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
            # Only the first split adds the bias, or the fold would count it once per split.
            acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
        tl.store(
            out_ptr + pid_k.to(tl.int64) * stride_os + rm[:, None] * stride_om + rn[None, :] * stride_on,
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
        # In int64: a prefill's rows times the outputs can pass 2**31 (131k tokens x 28,672 of gate/up).
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        n_mask = rn < N

        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_begin = pid_k * chunks_per_split * BLOCK_K
        k_end = tl.minimum(k_begin + chunks_per_split * BLOCK_K, K)
        for k0 in range(k_begin, k_end, BLOCK_K):
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
            bias = tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
            acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
        tl.store(
            out_ptr + pid_k.to(tl.int64) * stride_os + rm[:, None] * stride_om + rn[None, :] * stride_on,
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
    config: tuple | None = None,
) -> torch.Tensor:
    """Triton version of :func:`w4a16_linear_ref`. ``config``: one of ``launch_candidates`` (morphling_kernels/w8a16.py)
    for :func:`block_ks`; None takes the tuned one (morphling_kernels/tuning.py)."""
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

    def launch(cfg: tuple) -> None:
        _w4a16_launch(cfg, x2, packed, scale, zero, group_size, bias, out)

    if config is None:
        rows, widths = rows_bucket(m), block_ks(group_size)
        # tl.dot wants operands at least 16 wide: chunks narrower than 32 inputs (16 bytes) take the GEMV only
        config = choose("w4a16", (n_out, k, group_size, rows, bias is not None),
                        lambda: launch_candidates(rows, widths, gemm=widths[0] >= 32), launch, x.device)
    launch(config)
    return out.view(*lead, n_out)


def _w4a16_launch(config: tuple, x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                  group_size: int, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    (m, k), n_out = x2.shape, packed.shape[0]
    bias_arg = bias if bias is not None else scale  # bound but never read without HAS_BIAS
    if config[0] == "gemv":
        _, block_n, block_k, per_sm = config
        block_m = min(triton.next_power_of_2(m), 16)
        kernel = _w4a16_gemv_kernel
    else:
        _, block_m, block_n, block_k, per_sm = config
        kernel = _w4a16_gemm_kernel
    m_blocks, n_blocks = triton.cdiv(m, block_m), triton.cdiv(n_out, block_n)
    splits, per_split = _split_k(x2.device, m_blocks * n_blocks, k // block_k, per_sm)
    dest = partials(out, splits)
    kernel[(m_blocks, n_blocks, splits)](
        x2, packed, scale, zero, bias_arg, dest, m, n_out, k, group_size, per_split, *x2.stride(), *packed.stride(),
        *scale.stride(), *zero.stride(), *dest.stride(),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    if splits > 1:
        out.copy_(dest.sum(dim=0))


def w4a16_linear_cpu_packed(
    x: torch.Tensor,
    packed: torch.Tensor,
    sz: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`w4a16_linear_ref` for a weight in torch's CPU int4 layout (``packed`` ``[out, in // 2]``, ``sz``
    ``[in // group, out, 2]``, from ``quant.to_cpu_int4pack``), the activations in bfloat16; the result in
    ``x``'s dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    # Both contiguous: the kernel refuses a strided activation but reads a narrowed sz as if dense, silently.
    a = x.reshape(-1, k).to(torch.bfloat16).contiguous()
    y = torch._weight_int4pack_mm_for_cpu(a, packed, k // sz.shape[0], sz.contiguous()).to(x.dtype)
    if bias is not None:
        y.add_(bias.to(x.dtype))
    return y.view(*lead, packed.shape[0])


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
