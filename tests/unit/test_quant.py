"""Quantized weights reconstruct the original within the format's resolution."""

import pytest
import torch

from services.executor.engine.morphing.quant import quantize_int4, quantize_int8


@pytest.mark.parametrize("shape", [(64, 128), (9, 256), (1536, 576 - 64)])
def test_int8_error_is_within_half_a_step_per_channel(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    q = quantize_int8(w)
    # the step is the format's, computed here: a channel's absolute maximum over the 127 codes each side of zero
    step = w.abs().amax(dim=1) / 127
    assert q.qweight.dtype == torch.int8 and torch.allclose(q.scale, step, rtol=1e-6)
    err = (q.dequantize() - w).abs()
    assert (err <= step[:, None] / 2 + 1e-6).all()
    assert (q.qweight.abs().amax(dim=1) == 127).all()  # every channel's extreme takes the extreme code


@pytest.mark.parametrize("group", [128, 32])
def test_int4_packs_two_codes_a_byte_and_reconstructs_within_half_a_step(group):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    q = quantize_int4(w, group)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (48, 128)
    assert q.scale.shape == q.zero.shape == (48, 256 // group)
    codes = q.unpack()
    assert codes.max() <= 15 and codes.shape == (48, 256)
    g = w.view(48, -1, group)
    step = (g.amax(-1) - g.amin(-1)) / 15  # a group's range over its 16 codes, computed here
    assert torch.allclose(q.scale, step, rtol=1e-6)
    err = (q.dequantize() - w).abs().view(48, 256 // group, group)
    assert (err <= step[..., None] / 2 + 1e-6).all()
    # both ends of every group are representable, so its extremes come back almost exactly
    back = q.dequantize().view(48, -1, group)
    assert torch.allclose(back.amin(-1), g.amin(-1), atol=1e-5) and torch.allclose(back.amax(-1), g.amax(-1), atol=1e-5)


def test_int4_refuses_widths_that_do_not_split_into_groups():
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(torch.randn(4, 100))


def test_int4_group_is_a_power_of_two_from_32_where_one_divides_else_the_largest_even_divisor_up_to_128():
    from services.executor.engine.morphing.quant import int4_group

    assert int4_group(1536) == 128 and int4_group(576) == 64 and int4_group(4096) == 128 and int4_group(64) == 64
    assert int4_group(96) == 32 and int4_group(48) == 48 and int4_group(100) == 100 and int4_group(300) == 100
