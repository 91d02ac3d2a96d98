"""W8A16 linear: int8 weights with one scale per output channel, 16/32-bit activations.

The weight is ``qweight`` int8 ``[out, in]`` and ``scale`` ``[out]`` with
``w ≈ qweight * scale`` (see ``services/executor/engine/quant.py``).  Because the
scale belongs to the output channel it commutes with the sum over inputs, so
every path here multiplies the raw codes with the activations and scales the
``[N, out]`` result instead of materialising a scaled ``[out, in]`` weight.

The torch reference is the CPU production path, not only a test oracle.  On
CUDA two Triton kernels keep the weight int8 in memory and convert it in
registers, which is the point of W8A16: decode is bound by weight bandwidth.

* Decode (few rows): a GEMV.  Rows are below ``tl.dot``'s 16-row minimum, so
  each program multiplies a ``BLOCK_N`` slice of outputs for all rows by
  broadcast-multiply-reduce.  A decode step has too few output blocks to fill
  the GPU, so the K range is split across programs too (split-K); the partial
  sums land in a float32 buffer that one torch ``sum`` folds, which keeps the
  result deterministic, unlike atomics.
* Prefill (many rows): a tiled GEMM that converts each weight tile and feeds
  ``tl.dot``; the weight is read once per row block instead of being
  dequantised to a full-precision copy first.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # CPU-only installs run the torch path.
    _HAS_TRITON = False

# Batches up to this many rows are decode steps and take the GEMV kernel; tl.dot needs 16-row tiles, so
# below that a GEMM tile would be mostly padding.
DECODE_MAX_ROWS = 16


def w8a16_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ (qweight * scale).T + bias`` for ``x`` ``[..., in]``, in ``x``'s dtype."""
    dtype = x.dtype
    if dtype == torch.float16:
        # fp16 tops out at 65504, and the unscaled sums of 127-sized codes can pass it; scale the weight.
        return F.linear(x, qweight.to(dtype) * scale.to(dtype)[:, None], None if bias is None else bias.to(dtype))
    # |code| <= 127 is exact in bf16 and fp32, so the cast loses nothing and the scale can move to the
    # [N, out] output: N*out multiplies instead of out*in.
    y = F.linear(x, qweight.to(dtype))
    y.mul_(scale.to(dtype))
    if bias is not None:
        y.add_(bias.to(dtype))
    return y


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_k(device: torch.device, other_programs: int, chunks: int) -> tuple[int, int]:
    """(splits, chunks per split) so that ``other_programs * splits`` roughly fills the device."""
    if device.type == "cuda":
        target = 2 * _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        # Only the interpreter runs Triton off CUDA; a small target keeps it fast and still splits K.
        target = 8
    splits = max(1, min(chunks, triton.cdiv(target, other_programs)))
    per_split = triton.cdiv(chunks, splits)
    # Rounding per_split up can leave trailing splits empty; drop them.
    return triton.cdiv(chunks, per_split), per_split


def _gemv_block_n(block_m: int) -> int:
    # The broadcast product is BLOCK_M x BLOCK_K x BLOCK_N in registers; narrow the output slice as rows grow.
    return 32 if block_m <= 2 else 16


if _HAS_TRITON:

    @triton.jit
    def _w8a16_gemv_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        K,
        chunks_per_split,
        stride_xm,
        stride_xk,
        stride_qn,
        stride_qk,
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
        for k0 in range(k_begin, k_end, BLOCK_K):
            kk = k0 + rk
            k_mask = kk < K
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            w = tl.load(
                q_ptr + kk[:, None] * stride_qk + rn[None, :] * stride_qn,
                mask=k_mask[:, None] & n_mask[None, :],
                other=0,
            ).to(tl.float32)
            acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)

        # Per-channel scaling is linear, so each split may scale its own partial sum.
        scale = tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc * scale[None, :]
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
    def _w8a16_gemm_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_xk,
        stride_qn,
        stride_qk,
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
            kk = k0 + rk
            k_mask = kk < K
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            q = tl.load(
                q_ptr + kk[:, None] * stride_qk + rn[None, :] * stride_qn,
                mask=k_mask[:, None] & n_mask[None, :],
                other=0,
            )
            # Codes are exact in any activation dtype, so the tensor cores see the raw codes; ieee keeps
            # float32 activations off TF32, matching torch's default float32 matmul.
            acc = tl.dot(x, q.to(x.dtype), acc, input_precision="ieee")

        scale = tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc * scale[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on,
            acc.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & n_mask[None, :],
        )


def w8a16_linear_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`w8a16_linear_ref`."""
    n_out, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"activation width {x.shape[-1]} does not match the weight's {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n_out)
    # The kernels never read the bias pointer without HAS_BIAS, but they need a tensor to bind.
    bias_arg = bias if bias is not None else scale

    if m <= DECODE_MAX_ROWS:
        block_m = triton.next_power_of_2(m)
        block_n, block_k = _gemv_block_n(block_m), 64
        n_blocks = triton.cdiv(n_out, block_n)
        splits, per_split = _split_k(x.device, n_blocks, triton.cdiv(k, block_k))
        # One split writes the result directly; several write float32 partials that are folded below.
        dest = out if splits == 1 else torch.empty(splits, m, n_out, dtype=torch.float32, device=x.device)
        dest3 = dest.view(splits, m, n_out)
        _w8a16_gemv_kernel[(1, n_blocks, splits)](
            x2,
            qweight,
            scale,
            bias_arg,
            dest3,
            m,
            n_out,
            k,
            per_split,
            *x2.stride(),
            *qweight.stride(),
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
    block_n, block_k = 64, 64
    _w8a16_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n_out, block_n))](
        x2,
        qweight,
        scale,
        bias_arg,
        out,
        m,
        n_out,
        k,
        *x2.stride(),
        *qweight.stride(),
        *out.stride(),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.view(*lead, n_out)


def w8a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A16 linear with Triton on CUDA, the torch path elsewhere."""
    if _HAS_TRITON and x.is_cuda:
        return w8a16_linear_triton(x, qweight, scale, bias)
    return w8a16_linear_ref(x, qweight, scale, bias)
