"""The GPU benchmark's kernel section (CUDA only): W8A16 and W4A16 (ours, and PyTorch's built-in weight-only
ops where the installed torch has them) against cuBLAS on the three Llama-3-8B linear shapes; paged decode
attention against SDPA on contiguous K/V."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from services.executor.engine.morphing.quant import int4_group, quantize_int4, quantize_int8
from services.tools.microbench.timing import device_ms, print_table, release
from services.tools.shapes import SHAPES

KERNEL_ROWS = (1, 16, 64)
ATTENTION = dict(batches=(1, 64), context=4096, block_size=16, kv_heads=8, heads=32, head_dim=128,
                 arena_layers=4, layer=1)


def linear_shapes() -> list[tuple[int, int]]:
    """(out, in) of Llama-3-8B's linears: q/o, gate/up, down."""
    s = SHAPES["llama-3-8b"]
    return [(s.hidden_size, s.hidden_size), (s.intermediate_size, s.hidden_size), (s.hidden_size, s.intermediate_size)]


def _unavailable(exc: Exception) -> str:
    return f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def torch_int4pack(q4, group: int):
    """PyTorch's tinygemm layout of our INT4 weight: codes high nibble first, and per group (scale, zero) with
    w = (code - 8) * scale + zero, where ours is (code - z) * scale, so zero = (8 - z) * scale."""
    codes = q4.unpack()
    packed = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
    weight = torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), 8)
    scale = q4.scale.float()
    scales_zeros = torch.stack([scale, (8 - q4.zero.float()) * scale], dim=-1).transpose(0, 1).contiguous()
    return weight, scales_zeros.to(q4.scale.dtype)


def measure(fn, reference: torch.Tensor) -> dict:
    """`fn`'s relative error against `reference` and its median time, or why it cannot run here."""
    try:
        err = _rel_err(fn(), reference)
        ms = device_ms(fn)
    except Exception as exc:  # an op this torch lacks for this device or dtype: recorded, not fatal
        return dict(status=_unavailable(exc))
    return dict(status="ok", ms=ms, rel_err=err)


def _raising(exc: Exception):
    def fn():
        raise exc

    return fn


def gemlite_layers(q8, q4, dtype: torch.dtype) -> dict:
    """gemlite's linears (a Triton library with its own autotuner) over the same INT8 and INT4 codes: its format
    is HQQ's, w = (code - zero) * scale per group, which our INT4 is and our symmetric INT8 becomes with codes
    shifted by 128 and one group per output channel. Each value is a layer or why it cannot be built here."""
    try:
        from gemlite import DType, GemLiteLinear  # sent as a wheel by `make gpu-bundle`; absent elsewhere
    except ImportError as exc:
        return {8: exc, 4: exc}
    kind = {torch.bfloat16: DType.BF16, torch.float16: DType.FP16}.get(dtype)
    out, inp = q8.qweight.shape
    layers = {}
    for bits, codes, scale, zero, group in (
            (8, (q8.qweight.int() + 128).to(torch.uint8), q8.scale[:, None], torch.full_like(q8.scale[:, None], 128),
             inp),
            (4, q4.unpack(), q4.scale, q4.zero, q4.group_size)):
        try:
            if kind is None:
                raise TypeError(f"gemlite takes fp16 or bf16 activations, not {dtype}")
            layer = GemLiteLinear(bits, group_size=group, in_features=inp, out_features=out, input_dtype=kind,
                                  output_dtype=kind)
            layer.pack(codes, scale.to(dtype), zero.to(dtype), bias=None)
            layers[bits] = layer
        except Exception as exc:  # a version or dtype this gemlite refuses: reported in its rows
            layers[bits] = exc
    return layers


def linear_kernels(device: torch.device, dtype: torch.dtype, copy_gbs: float, seed: int) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return [row for n, k in linear_shapes() for row in _linear_rows(n, k, gen, device, dtype, copy_gbs)]


def _linear_rows(n: int, k: int, gen: torch.Generator, device: torch.device, dtype: torch.dtype,
                 copy_gbs: float) -> list[dict]:
    """Every kernel at every row count on one [n, k] weight (freed on return)."""
    from morphling_kernels.w4a16 import w4a16_linear
    from morphling_kernels.w8a16 import w8a16_linear

    w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype)
    q8, q4 = quantize_int8(w), quantize_int4(w, int4_group(k))
    group = q4.group_size
    dense = {"bf16": w.float(), "int8": q8.dequantize().float(), "int4": q4.dequantize().float()}
    itemsize = w.element_size()
    weight_bytes = {"bf16": n * k * itemsize, "int8": n * k + n * itemsize,
                    "int4": n * k // 2 + 2 * n * (k // group) * itemsize}
    try:
        packed4 = torch_int4pack(q4, group)
    except Exception as exc:  # absent or refusing in this torch build: every use reports it
        packed4 = exc
    gem = gemlite_layers(q8, q4, dtype)
    rows = []
    for m in KERNEL_ROWS:
        x = torch.randn(m, k, generator=gen, device=device).to(dtype)
        impls = {
            "cublas": ("bf16", lambda: F.linear(x, w)),
            "w8a16": ("int8", lambda: w8a16_linear(x, q8.qweight, q8.scale)),
            "w4a16": ("int4", lambda: w4a16_linear(x, q4.packed, q4.scale, q4.zero, group)),
            "torch_int8pack": ("int8", lambda: torch.ops.aten._weight_int8pack_mm(x, q8.qweight, q8.scale)),
            "torch_int4pack": ("int4", _raising(packed4) if isinstance(packed4, Exception) else
                               lambda: torch.ops.aten._weight_int4pack_mm(x, packed4[0], group, packed4[1])),
            **{f"gemlite_int{bits}": (f"int{bits}", _raising(layer) if isinstance(layer, Exception) else
                                      (lambda layer=layer: layer(x))) for bits, layer in gem.items()},
        }
        base = None
        for name, (fmt, fn) in impls.items():
            row = dict(out_features=n, in_features=k, rows=m, kernel=name, weight_format=fmt)
            row |= measure(fn, x.float() @ dense[fmt].T)
            if row["status"] == "ok":
                base = row["ms"] if name == "cublas" else base
                gbs = weight_bytes[fmt] / (row["ms"] / 1e3) / 1e9
                row |= dict(speedup_vs_cublas=base / row["ms"] if base else None, weight_gbs=gbs,
                            copy_fraction=gbs / copy_gbs)
            rows.append(row)
    return rows


def attention_kernels(device: torch.device, dtype: torch.dtype, copy_gbs: float, seed: int) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(seed)
    host_gen = torch.Generator().manual_seed(seed)
    rows = []
    for batch in ATTENTION["batches"]:
        rows += _attention_rows(batch, gen, host_gen, device, dtype, copy_gbs)
        release(device)
    return rows


def _attention_rows(batch: int, gen: torch.Generator, host_gen: torch.Generator, device: torch.device,
                    dtype: torch.dtype, copy_gbs: float) -> list[dict]:
    """Paged decode attention over a synthetic arena and SDPA over the same K/V made contiguous."""
    from morphling_kernels.paged_attention import paged_decode_attention, partition_tokens

    a = ATTENTION
    ctx, bs, kvh, hd, layer = a["context"], a["block_size"], a["kv_heads"], a["head_dim"], a["layer"]
    scale = 1.0 / math.sqrt(hd)
    blocks = ctx // bs
    pages = batch * blocks
    kv_cache = torch.randn(pages, kvh, a["arena_layers"], 2, bs, hd, generator=gen, device=device, dtype=dtype)
    # Pages in a shuffled order, as a long-running arena hands them out.
    tables = torch.randperm(pages, generator=host_gen).view(batch, blocks).to(torch.int32).to(device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, a["heads"], hd, generator=gen, device=device, dtype=dtype)
    layer_kv = kv_cache[:, :, layer]  # [pages, kv heads, k|v, token, head_dim]
    k, v = (layer_kv[:, :, j][tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, kvh, ctx, hd).contiguous()
            for j in (0, 1))
    kv_bytes = 2 * batch * ctx * kvh * hd * kv_cache.element_size()
    reference = paged_decode_attention(q, kv_cache, layer, tables, lens, scale).float()
    impls = {
        "paged_decode_attention": (lambda: paged_decode_attention(q, kv_cache, layer, tables, lens, scale),
                                   dict(partition_tokens=partition_tokens(batch, kvh, ctx, bs, device))),
        # enable_gqa came with torch 2.5; without it SDPA would need K/V repeated per query head
        "sdpa_contiguous": (lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale,
                                                                   enable_gqa=True).squeeze(2), {}),
    }
    rows = []
    for name, (fn, extra) in impls.items():
        row = dict(kernel=name, batch=batch, context=ctx, kv_bytes=kv_bytes, **extra) | measure(fn, reference)
        if row["status"] == "ok":
            gbs = kv_bytes / (row["ms"] / 1e3) / 1e9
            row |= dict(kv_gbs=gbs, copy_fraction=gbs / copy_gbs)
        rows.append(row)
    return rows


def kernel_section(device: torch.device, dtype: torch.dtype, copy_gbs: float, seed: int) -> dict:
    if device.type != "cuda":
        print("\nkernel microbenchmarks: skipped: no CUDA")
        return dict(skipped="no CUDA")
    linear = linear_kernels(device, dtype, copy_gbs, seed)
    print_table("weight-only linears vs cuBLAS (N x K = out x in, M rows)",
                ["N", "K", "M", "kernel", "ms", "speedup", "weight GB/s", "copy frac", "rel err", "status"],
                [[r["out_features"], r["in_features"], r["rows"], r["kernel"], r.get("ms"),
                  r.get("speedup_vs_cublas"), r.get("weight_gbs"), r.get("copy_fraction"), r.get("rel_err"),
                  r["status"][:60]] for r in linear])
    attention = attention_kernels(device, dtype, copy_gbs, seed)
    print_table(f"decode attention over {ATTENTION['context']} tokens ({ATTENTION['heads']} query heads, "
                f"{ATTENTION['kv_heads']} KV heads, head_dim {ATTENTION['head_dim']})",
                ["kernel", "batch", "ms", "KV GB/s", "copy frac", "rel err", "status"],
                [[r["kernel"], r["batch"], r.get("ms"), r.get("kv_gbs"), r.get("copy_fraction"), r.get("rel_err"),
                  r["status"][:60]] for r in attention])
    return dict(linear=linear, attention=attention, attention_setup=ATTENTION,
                timing="triton.testing.do_bench median (L2 flushed between calls) where triton is installed, "
                       "else the median of 50 CUDA-event timings",
                weights="random normal (std 0.02), contiguous [out, in]; INT8 per output channel, INT4 in groups "
                        "of 128; rel_err is against F.linear with the format's dequantized weight in float32",
                attention_reference="rel_err of attention is against paged_decode_attention's own output")
