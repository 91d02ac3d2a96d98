"""W8A16 linear: int8 weights with one scale per output channel, 16/32-bit activations.

The weight is ``qweight`` int8 ``[out, in]`` and ``scale`` ``[out]`` with
``w ≈ qweight * scale`` (see ``services/executor/engine/morphing/quant.py``).  Because the
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
  dequantised to a full-precision copy first. It may split K too.
* Which tiles, split and path a shape gets is timed on the GPU itself, once
  per (shape, power of two of the rows): ``morphling_kernels/tuning.py``.

On CPU a decode step's few rows go to torch's packed int8 kernel
(``torch._weight_int8pack_mm``) with bfloat16 activations, which reads the
int8 codes as they are where the reference first casts the whole weight to
float32. Over the default model's linears (`morphling bench-cpu-kernels`,
docs/benchmarks.md) it was 1.45-1.88x faster than float32 at 1-4 rows and
1.2-1.3x at 8-12, break-even or slower from 16; its float32-activation path
and ``torch.compile`` of the reference were slower than float32 at every row
count, so neither is used. It needs the codes contiguous, so a transposed
(input-major) weight stays on the reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from morphling_kernels.tuning import choose, rows_bucket

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # CPU-only installs run the torch path.
    _HAS_TRITON = False

# Batches up to this many rows are decode steps and take the GEMV kernel untuned. tl.dot needs 16-row tiles,
# so below that a GEMM tile is mostly padding, yet decode is bound by the weight's bytes, not the multiplies:
# on an H100 the tuned GEMV took 5-9x a 16-row GEMM's time at 4-8 rows (docs/benchmarks.md), so from 2 rows
# the tuner times 16-row GEMM tiles too.
DECODE_MAX_ROWS = 16
GEMM_MIN_ROWS = 2
CPU_PACKED_MAX_ROWS = 8  # on CPU, rows up to this take torch's packed int8 kernel (break-even near 16)


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


def _split_k(device: torch.device, other_programs: int, chunks: int, per_sm: int = 2) -> tuple[int, int]:
    """(splits, chunks per split) so that ``other_programs * splits`` roughly fills the device with ``per_sm``
    programs per multiprocessor (0: no split)."""
    if per_sm == 0:
        return 1, chunks
    if device.type == "cuda":
        target = per_sm * _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
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


# What the tuner (morphling_kernels/tuning.py) times beside the defaults. A GEMV's broadcast product holds
# BLOCK_M x BLOCK_N x BLOCK_K floats, so its tiles shrink as rows grow; a K split aims at SPLITS programs per
# multiprocessor (0: none), which decode's few output tiles need and a GEMM's many may not.
GEMV_TILES = ((32, 64), (32, 128), (64, 128), (128, 64), (64, 256), (16, 256), (16, 64))  # (BLOCK_N, BLOCK_K)
GEMM_TILES = ((16, 64, 64), (16, 64, 128), (32, 64, 64), (32, 128, 64), (64, 64, 64), (64, 128, 64),
              (128, 128, 64), (64, 64, 128))  # (BLOCK_M, BLOCK_N, BLOCK_K)
SPLITS = (2, 1, 4, 0)
GEMV_PRODUCT = 16384


def launch_candidates(m: int, block_ks: tuple[int, ...], gemm: bool = True) -> list[tuple]:
    """Launch configurations worth timing for up to ``m`` rows (a power of two), the untuned default first:
    ``("gemv", BLOCK_N, BLOCK_K, split)`` up to DECODE_MAX_ROWS rows, ``("gemm", BLOCK_M, BLOCK_N, BLOCK_K,
    split)`` from GEMM_MIN_ROWS rows on (when ``gemm``; below 16 rows, the 16-row tiles). ``block_ks``: the
    chunk widths the weight allows, its default first."""
    block_m = min(triton.next_power_of_2(m), DECODE_MAX_ROWS)
    out = []
    if m <= DECODE_MAX_ROWS or not gemm:
        out.append(("gemv", _gemv_block_n(block_m), block_ks[0], 2))
        out += [("gemv", bn, bk, split) for bn, bk in GEMV_TILES for split in SPLITS
                if bk in block_ks and block_m * bn * bk <= GEMV_PRODUCT]
    if m >= GEMM_MIN_ROWS and gemm:
        gemm_ks = [bk for bk in block_ks if bk >= 32]
        if m >= DECODE_MAX_ROWS:
            out.append(("gemm", 64 if m >= 64 else 32, 64, gemm_ks[0], 0))
        out += [("gemm", bm, bn, bk, split) for bm, bn, bk in GEMM_TILES for split in SPLITS
                if bk in gemm_ks and bm <= max(16, triton.next_power_of_2(m))]
    return list(dict.fromkeys(out))


def partials(out: torch.Tensor, splits: int) -> torch.Tensor:
    """Where ``splits`` K splits write: ``out`` itself for one, float32 partials to fold for several."""
    if splits == 1:
        return out.view(1, *out.shape)
    return torch.empty(splits, *out.shape, dtype=torch.float32, device=out.device)


if _HAS_TRITON:

    @triton.jit
    def gemv_sum(x, w, EXACT: tl.constexpr):
        """x [M, K] times w [K, N] in float32, summed over K: [M, N].

        Triton's combine pass turns x[:, :, None] * w[None, :, :] summed over K into a tensor-core dot once M
        and N are both 16 or more, and triton 3.6 (the GPU images') makes it a TF32 one: float32 activations
        lose 13 bits of mantissa (the GEMV erred 3.4e-4 at 16 rows on an H200). bf16 activations and int8
        codes are exact in TF32, so only float32 activations (EXACT) take the product the pass does not match.
        """
        if EXACT:
            total = tl.sum(w[None, :, :] * x[:, :, None], axis=1)
        else:
            total = tl.sum(x[:, :, None] * w[None, :, :], axis=1)
        return total

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
            acc += gemv_sum(x, w, x_ptr.dtype.element_ty == tl.float32)

        # Per-channel scaling is linear, so each split may scale its own partial sum.
        scale = tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc * scale[None, :]
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
    def _w8a16_gemm_kernel(
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
            bias = tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
            acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
        tl.store(
            out_ptr + pid_k.to(tl.int64) * stride_os + rm[:, None] * stride_om + rn[None, :] * stride_on,
            acc.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & n_mask[None, :],
        )


W8_BLOCK_KS = (64, 128, 256)


def w8a16_linear_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple | None = None,
) -> torch.Tensor:
    """Triton version of :func:`w8a16_linear_ref`. ``config``: one of :func:`launch_candidates`; None takes
    the tuned one (morphling_kernels/tuning.py)."""
    n_out, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"activation width {x.shape[-1]} does not match the weight's {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n_out)

    def launch(cfg: tuple) -> None:
        _w8a16_launch(cfg, x2, qweight, scale, bias, out)

    if config is None:
        rows = rows_bucket(m)
        config = choose("w8a16", (n_out, k, rows, bias is not None), lambda: launch_candidates(rows, W8_BLOCK_KS),
                        launch, x.device)
    launch(config)
    return out.view(*lead, n_out)


def _w8a16_launch(config: tuple, x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None, out: torch.Tensor) -> None:
    (m, k), n_out = x2.shape, qweight.shape[0]
    # The kernels never read the bias pointer without HAS_BIAS, but they need a tensor to bind.
    bias_arg = bias if bias is not None else scale
    if config[0] == "gemv":
        _, block_n, block_k, per_sm = config
        block_m, m_blocks = triton.next_power_of_2(m), 1
        kernel = _w8a16_gemv_kernel
    else:
        _, block_m, block_n, block_k, per_sm = config
        m_blocks = triton.cdiv(m, block_m)
        kernel = _w8a16_gemm_kernel
    n_blocks = triton.cdiv(n_out, block_n)
    splits, per_split = _split_k(x2.device, m_blocks * n_blocks, triton.cdiv(k, block_k), per_sm)
    dest = partials(out, splits)
    kernel[(m_blocks, n_blocks, splits)](
        x2, qweight, scale, bias_arg, dest, m, n_out, k, per_split, *x2.stride(), *qweight.stride(), *dest.stride(),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    if splits > 1:
        out.copy_(dest.sum(dim=0))


def w8a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A16 linear with Triton on CUDA, torch's packed kernel for a CPU decode, the torch reference elsewhere."""
    if _HAS_TRITON and x.is_cuda:
        return w8a16_linear_triton(x, qweight, scale, bias)
    if x.device.type == "cpu" and x.numel() <= CPU_PACKED_MAX_ROWS * x.shape[-1] and qweight.is_contiguous():
        return w8a16_linear_cpu_packed(x, qweight, scale, bias)
    return w8a16_linear_ref(x, qweight, scale, bias)


def w8a16_linear_cpu_packed(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`w8a16_linear_ref` through ``torch._weight_int8pack_mm`` with the activations in bfloat16 (its fast
    path on CPU); the result in ``x``'s dtype. ``qweight`` must be contiguous."""
    lead, k = x.shape[:-1], x.shape[-1]
    y = torch._weight_int8pack_mm(x.reshape(-1, k).to(torch.bfloat16), qweight, scale.to(torch.bfloat16)).to(x.dtype)
    if bias is not None:
        y.add_(bias.to(x.dtype))
    return y.view(*lead, qweight.shape[0])
