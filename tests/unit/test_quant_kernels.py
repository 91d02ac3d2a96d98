"""Correctness tests for the W8A16 and W4A16 linear kernels.

Weights are quantized from random float weights with the engine's own
quantize_int8/quantize_int4, so the kernels are checked against the format the
loader produces.  The torch references are checked against F.linear over
quant.py's dequantize(); the Triton kernels, run by the interpreter
(TRITON_INTERPRET=1 from tests/conftest.py) on CPU tensors, are checked against
the references.  Row counts 1, 3 and 16 take the split-K GEMV path and 40 the
tl.dot GEMM path; output widths that are not multiples of the tiles exercise the
masks.  Shapes stay small because the interpreter runs every program in numpy.
"""

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from morphling_kernels.w4a16 import w4a16_linear, w4a16_linear_cpu_packed, w4a16_linear_ref, w4a16_linear_triton
from morphling_kernels.w8a16 import (CPU_PACKED_MAX_ROWS, w8a16_linear, w8a16_linear_cpu_packed, w8a16_linear_ref,
                           w8a16_linear_triton)
from services.executor.engine.morphing.quant import (cpu_int4pack_codes, cpu_int4pack_dequantize, quantize_int4,
                                                     quantize_int8, to_cpu_int4pack)

ATOL = 1e-5
RTOL = 1e-5

SHAPES = [(64, 128), (96, 256), (48, 384)]
ROWS = [1, 3, 16, 40]
GROUPS = [128, 64]


def make_case(out_features, in_features, rows, seed, dtype=torch.float32):
    """Random activations, a random float weight of realistic magnitude and a random bias."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = (torch.randn(out_features, generator=gen) * 0.1).to(dtype)
    return x, w, bias


def case_seed(*parts):
    # hash() of strings is salted per process; crc32 keeps every case's data the same across runs.
    return zlib.crc32(repr(parts).encode())


# --- torch references -------------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_w8a16_reference_matches_linear_over_dequantized_weight(shape, with_bias):
    x, w, bias = make_case(*shape, rows=5, seed=case_seed("ref8", shape))
    q = quantize_int8(w)
    b = bias if with_bias else None
    y = w8a16_linear_ref(x, q.qweight, q.scale, b)
    assert y.dtype == x.dtype and y.shape == (5, shape[0])
    torch.testing.assert_close(y, F.linear(x, q.dequantize(), b), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("shape", SHAPES)
def test_w4a16_reference_matches_linear_over_dequantized_weight(shape, group, with_bias):
    x, w, bias = make_case(*shape, rows=5, seed=case_seed("ref4", shape, group))
    q = quantize_int4(w, group)
    b = bias if with_bias else None
    y = w4a16_linear_ref(x, q.packed, q.scale, q.zero, q.group_size, b)
    assert y.dtype == x.dtype and y.shape == (5, shape[0])
    torch.testing.assert_close(y, F.linear(x, q.dequantize(), b), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_references_keep_half_precision_activations_close_to_float32(dtype):
    x, w, bias = make_case(96, 256, rows=7, seed=case_seed("half", str(dtype)), dtype=dtype)
    q8, q4 = quantize_int8(w), quantize_int4(w, 64)
    y8 = w8a16_linear_ref(x, q8.qweight, q8.scale, bias)
    y4 = w4a16_linear_ref(x, q4.packed, q4.scale, q4.zero, q4.group_size, bias)
    assert y8.dtype == y4.dtype == dtype
    # Compare with the same quantized weights applied in float32: only activation rounding may differ.
    want8 = F.linear(x.float(), q8.dequantize().float(), bias.float())
    want4 = F.linear(x.float(), q4.dequantize().float(), bias.float())
    torch.testing.assert_close(y8.float(), want8, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y4.float(), want4, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, 5, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_cpu_packed_int8_kernel_matches_the_reference_within_bfloat16_rounding(rows, with_bias):
    x, w, bias = make_case(96, 256, rows=rows, seed=case_seed("packed", str(rows)))
    q8 = quantize_int8(w)
    b = bias if with_bias else None
    y = w8a16_linear_cpu_packed(x, q8.qweight, q8.scale, b)
    assert y.dtype == x.dtype and y.shape == (rows, 96)
    # only the activations' and the scale's rounding to bfloat16 differ: 2^-8 relative, summed over 256 inputs
    torch.testing.assert_close(y, w8a16_linear_ref(x, q8.qweight, q8.scale, b), atol=3e-2, rtol=2e-2)
    assert torch.equal(w8a16_linear(x, q8.qweight, q8.scale, b), y)  # a decode step's rows take it on CPU


@pytest.mark.parametrize("rows", [1, 5, 16, 70])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_cpu_int4_kernel_on_its_layout_matches_the_reference_within_bfloat16_rounding(rows, group, with_bias):
    x, w, bias = make_case(128, 384, rows=rows, seed=case_seed("packed4", rows, group))
    q4 = quantize_int4(w, group)
    packed, sz = to_cpu_int4pack(q4)
    assert packed.shape == q4.packed.shape and torch.equal(cpu_int4pack_codes(packed), q4.unpack())
    b = bias if with_bias else None
    y = w4a16_linear_cpu_packed(x, packed, sz, b)
    assert y.dtype == x.dtype and y.shape == (rows, 128)
    # activations, scales and zeros in bfloat16: 2^-8 relative each, summed over 384 inputs
    torch.testing.assert_close(y, w4a16_linear_ref(x, q4.packed, q4.scale, q4.zero, group, b), atol=5e-2, rtol=3e-2)


def test_the_cpu_int4_layout_is_read_back_as_torch_s_kernel_computes_with_it():
    # the identity's rows through the kernel are the weight's columns: what it multiplies by, exactly
    _, w, _ = make_case(192, 256, rows=1, seed=case_seed("layout4"))
    packed, sz = to_cpu_int4pack(quantize_int4(w, 64))
    seen = w4a16_linear_cpu_packed(torch.eye(256, dtype=torch.bfloat16), packed, sz).float().t()
    torch.testing.assert_close(seen, cpu_int4pack_dequantize(packed, sz), atol=1e-2, rtol=1e-2)
    # a cut of whole 64-row blocks is the same bytes as the layout of those rows alone
    torch.testing.assert_close(w4a16_linear_cpu_packed(torch.eye(256), packed[64:192], sz[:, 64:192]).t(),
                               cpu_int4pack_dequantize(packed, sz)[64:192], atol=1e-2, rtol=1e-2)


def test_dispatchers_run_the_reference_on_cpu_past_a_decodes_rows_and_for_transposed_codes():
    x, w, bias = make_case(48, 384, rows=CPU_PACKED_MAX_ROWS + 1, seed=7)
    q8, q4 = quantize_int8(w), quantize_int4(w)
    assert torch.equal(w8a16_linear(x, q8.qweight, q8.scale, bias), w8a16_linear_ref(x, q8.qweight, q8.scale, bias))
    input_major = q8.qweight.t().contiguous().t()  # how the slot holds down_proj
    few = x[:3]
    assert torch.equal(w8a16_linear(few, input_major, q8.scale, bias), w8a16_linear_ref(few, input_major, q8.scale, bias))
    assert torch.equal(
        w4a16_linear(x, q4.packed, q4.scale, q4.zero, q4.group_size, bias),
        w4a16_linear_ref(x, q4.packed, q4.scale, q4.zero, q4.group_size, bias),
    )


# --- Triton kernels (interpreted) ---------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_w8a16_triton_matches_reference(rows, shape, with_bias):
    x, w, bias = make_case(*shape, rows=rows, seed=case_seed("tri8", rows, shape))
    q = quantize_int8(w)
    b = bias if with_bias else None
    y = w8a16_linear_triton(x, q.qweight, q.scale, b)
    assert y.dtype == x.dtype and y.shape == (rows, shape[0])
    torch.testing.assert_close(y, w8a16_linear_ref(x, q.qweight, q.scale, b), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_w4a16_triton_matches_reference(rows, shape, group, with_bias):
    x, w, bias = make_case(*shape, rows=rows, seed=case_seed("tri4", rows, shape, group))
    q = quantize_int4(w, group)
    b = bias if with_bias else None
    y = w4a16_linear_triton(x, q.packed, q.scale, q.zero, q.group_size, b)
    assert y.dtype == x.dtype and y.shape == (rows, shape[0])
    want = w4a16_linear_ref(x, q.packed, q.scale, q.zero, q.group_size, b)
    torch.testing.assert_close(y, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("rows", [3, 40])
def test_triton_kernels_follow_activation_strides_and_leading_dims(rows):
    """A column slice of a wider buffer (row stride != width) and a [2, rows/2, in] batch."""
    x_wide, w, bias = make_case(96, 256 + 32, rows=rows + 1, seed=case_seed("strides", rows))
    x = x_wide[1:, 16 : 16 + 256]
    assert not x.is_contiguous()
    q8, q4 = quantize_int8(w[:, :256]), quantize_int4(w[:, :256], 64)
    torch.testing.assert_close(
        w8a16_linear_triton(x, q8.qweight, q8.scale, bias), w8a16_linear_ref(x, q8.qweight, q8.scale, bias),
        atol=ATOL, rtol=RTOL,
    )
    torch.testing.assert_close(
        w4a16_linear_triton(x, q4.packed, q4.scale, q4.zero, 64, bias),
        w4a16_linear_ref(x, q4.packed, q4.scale, q4.zero, 64, bias),
        atol=ATOL, rtol=RTOL,
    )
    if rows % 2 == 0:
        x3 = x.reshape(2, rows // 2, 256)
        y = w4a16_linear_triton(x3, q4.packed, q4.scale, q4.zero, 64, bias)
        assert y.shape == (2, rows // 2, 96)
        torch.testing.assert_close(y.reshape(rows, 96), w4a16_linear_ref(x, q4.packed, q4.scale, q4.zero, 64, bias))


def test_w4a16_triton_group_too_narrow_for_tl_dot_takes_the_gemv_path():
    """Group 48 gives 16-wide chunks, i.e. 8 bytes a row: too narrow for tl.dot even at prefill size."""
    x, w, bias = make_case(40, 96, rows=40, seed=11)
    q = quantize_int4(w, 48)
    torch.testing.assert_close(
        w4a16_linear_triton(x, q.packed, q.scale, q.zero, 48, bias),
        w4a16_linear_ref(x, q.packed, q.scale, q.zero, 48, bias),
        atol=ATOL, rtol=RTOL,
    )


# --- every configuration the tuner may pick ----------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 4, 16, 40])
def test_every_launch_configuration_the_tuner_may_pick_computes_the_same_product(rows):
    # On a GPU the tuner may pick any candidate (tuning.py); here each runs once, on a shape that no tile
    # divides, so masks and K splits with empty tails are all exercised.
    from morphling_kernels.tuning import rows_bucket
    from morphling_kernels.w4a16 import block_ks
    from morphling_kernels.w8a16 import W8_BLOCK_KS, launch_candidates

    x, w, bias = make_case(72, 512, rows=rows, seed=case_seed("tuned", rows))
    q8, q4 = quantize_int8(w), quantize_int4(w, 128)
    want8 = w8a16_linear_ref(x, q8.qweight, q8.scale, bias)
    want4 = w4a16_linear_ref(x, q4.packed, q4.scale, q4.zero, 128, bias)
    configs8 = launch_candidates(rows_bucket(rows), W8_BLOCK_KS)
    configs4 = launch_candidates(rows_bucket(rows), block_ks(128))
    # GEMM tiles from 2 rows: a GEMV at 4-8 rows took 5-9x a 16-row GEMM's time on an H100
    assert len(configs8) > 10 and {c[0] for c in configs8} == ({"gemv"} if rows == 1 else {"gemm"} if rows > 16
                                                                else {"gemv", "gemm"})
    for config in configs8:
        got = w8a16_linear_triton(x, q8.qweight, q8.scale, bias, config=config)
        torch.testing.assert_close(got, want8, atol=ATOL, rtol=RTOL, msg=f"W8A16 {config}")
    for config in configs4:
        got = w4a16_linear_triton(x, q4.packed, q4.scale, q4.zero, 128, bias, config=config)
        torch.testing.assert_close(got, want4, atol=ATOL, rtol=RTOL, msg=f"W4A16 {config}")


def test_a_fresh_machine_starts_from_the_shipped_choices_and_its_own_tuning_wins(tmp_path, monkeypatch):
    from morphling_kernels import tuning

    shipped, own = tmp_path / "shipped", tmp_path / "cache" / "NVIDIA_H100_80GB_HBM3.json"
    shipped.mkdir()
    (shipped / own.name).write_text(json.dumps({"w8a16(4096, 4096, 1, False)": ["gemv", 16, 64, 0],
                                                "w8a16(4096, 4096, 16, False)": ["gemm", 16, 64, 128, 0]}))
    monkeypatch.setattr(tuning, "SHIPPED", shipped)
    assert tuning.saved_choices(own) == {"w8a16(4096, 4096, 1, False)": ("gemv", 16, 64, 0),
                                         "w8a16(4096, 4096, 16, False)": ("gemm", 16, 64, 128, 0)}
    own.parent.mkdir()
    own.write_text(json.dumps({"w8a16(4096, 4096, 1, False)": ["gemv", 32, 128, 2]}))
    assert tuning.saved_choices(own)["w8a16(4096, 4096, 1, False)"] == ("gemv", 32, 128, 2)
    # what ships is what a lent H100 chose, and each choice is one its kernel can launch
    from morphling_kernels.w8a16 import W8_BLOCK_KS, launch_candidates
    table = json.loads((Path(tuning.__file__).parent / "tuned" / own.name).read_text())
    w8 = {key: tuple(choice) for key, choice in table.items() if key.startswith("w8a16")}
    assert w8 and all(choice in launch_candidates(int(key.split(", ")[2]), W8_BLOCK_KS) for key, choice in w8.items())


# --- what the compiler makes of the GEMV ------------------------------------------------------------

TTIR_DOTS = """
import inspect, json
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from morphling_kernels.w4a16 import _w4a16_gemv_kernel
from morphling_kernels.w8a16 import _w8a16_gemv_kernel

def dots(kernel, activation, codes):
    constexprs = {"HAS_BIAS": True, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64}
    signature = {name: "constexpr" if name in constexprs else
                 (f"*{codes}" if name in ("q_ptr", "p_ptr") else f"*{activation}") if name.endswith("_ptr") else "i32"
                 for name in inspect.signature(kernel.fn).parameters}
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(kernel, signature, constexprs=constexprs)
    module = source.make_ir(backend.target, options, backend.get_codegen_implementation(options),
                            backend.get_module_map(), context)
    stages = {}
    backend.add_stages(stages, options, source.language)
    return str(stages["ttir"](module, {})).count("tt.dot ")

print(json.dumps({a: [dots(_w8a16_gemv_kernel, a, "i8"), dots(_w4a16_gemv_kernel, a, "u8")] for a in ("fp32", "bf16")}))
"""


def test_float32_gemv_at_16_rows_is_not_made_a_tensor_core_dot():
    """At 16 rows Triton's combine pass turns the GEMV's product into a dot, a TF32 one in the GPU images'
    triton, and float32 activations then erred 3.4e-4 on an H200: morphling_kernels/w8a16.gemv_sum keeps float32
    activations out of it. The kernels' Triton IR for an H100, compiled without a GPU (no interpreter)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", TTIR_DOTS], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).parents[2], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    dots = json.loads(done.stdout.splitlines()[-1])
    assert dots["fp32"] == [0, 0]
    assert min(dots["bf16"]) > 0  # the pass runs here: bf16 activations, exact in TF32, keep the dot
