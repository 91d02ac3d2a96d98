"""Weight quantization formats of layer variants: INT8 per output channel, INT4 in groups of up to 128.

INT8: symmetric, one scale per output channel: w ≈ q * scale, q in [-127, 127].
INT4: asymmetric, per output channel and group of `group_size` input channels:
w ≈ (q - zero) * scale, q in [0, 15], packed two per byte (low nibble = even input index).
These are the torch references; the W8A16/W4A16 kernels in morphling_kernels/ consume the same tensors, except torch's
CPU int4 kernel, which wants its own layout of the same codes (`to_cpu_int4pack`).
"""

import functools
from dataclasses import dataclass

import torch

INT4_GROUP = 128  # not the GGUF's Q4_1 group of 32: our full precision is that file, so real error shows
CPU_INT4_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU int4 kernel takes
# Its layout packs blocks of output rows, each a contiguous run of bytes: 64 rows with AVX512, 32 without
# (cpu_int4pack_block); weights are cut in whole blocks of the larger, which fits either.
CPU_INT4_BLOCK = 64


def int4_group(in_features: int, preferred: int = INT4_GROUP) -> int:
    """The group size for an input width: the largest power of two from 32 up to `preferred` that divides it
    (576 -> 64, 1536 -> 128: sizes torch's CPU kernel takes), else the largest even divisor up to `preferred`."""
    for size in sorted((s for s in CPU_INT4_GROUPS if s <= preferred), reverse=True):
        if in_features % size == 0:
            return size
    for size in range(min(preferred, in_features), 1, -1):
        if in_features % size == 0 and size % 2 == 0:
            return size
    raise ValueError(f"no even INT4 group divides an input width of {in_features}")


def cpu_int4_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether torch's CPU int4 kernel takes this weight, in whole blocks (so that any cut of the output rows at
    a multiple of CPU_INT4_BLOCK is a contiguous run of the packed bytes)."""
    return group_size in CPU_INT4_GROUPS and in_features % group_size == 0 and out_features % CPU_INT4_BLOCK == 0


@dataclass
class Int8Weight:
    qweight: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # [out], the serving dtype

    def dequantize(self) -> torch.Tensor:
        return self.qweight.to(self.scale.dtype) * self.scale[:, None]


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8 [out, in // 2]
    scale: torch.Tensor  # [out, in // group]
    zero: torch.Tensor  # [out, in // group], the same dtype as scale (zero points need not be integers)
    group_size: int

    def unpack(self) -> torch.Tensor:
        """uint8 [out, in] codes in [0, 15]."""
        low = self.packed & 0x0F
        high = self.packed >> 4
        return torch.stack((low, high), dim=-1).reshape(self.packed.shape[0], -1)

    def dequantize(self) -> torch.Tensor:
        out, inp = self.packed.shape[0], self.packed.shape[1] * 2
        codes = self.unpack().to(self.scale.dtype).view(out, inp // self.group_size, self.group_size)
        return ((codes - self.zero[..., None]) * self.scale[..., None]).reshape(out, inp)


def to_cpu_int4pack(q: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """`q` in torch's CPU int4 layout: the codes repacked uint8 ``[out, in // 2]``, and the scales and zero points
    ``[in // group, out, 2]`` in bfloat16, the activations' dtype on its fast path. torch computes
    ``(code - 8) · scale + zero'``, so ``zero' = (8 - zero) · scale``."""
    packed = torch._convert_weight_to_int4pack_for_cpu(q.unpack().to(torch.int32), 1)
    scale, zero = q.scale.float(), q.zero.float()
    sz = torch.stack((scale, (8 - zero) * scale), dim=-1).transpose(0, 1)
    return packed, sz.to(torch.bfloat16).contiguous()


@functools.cache
def cpu_int4pack_block() -> int:
    """The output rows of a block of torch's CPU int4 layout on this host, found by packing a known weight: torch
    picks it by the CPU's vector width (64 on an AVX512 host, 32 on an AVX2 one)."""
    codes = torch.randint(0, 16, (CPU_INT4_BLOCK, 8), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    return next(b for b in (64, 32, 16) if torch.equal(_unblock(packed, b).to(torch.int32), codes))


def _unblock(packed: torch.Tensor, block: int) -> torch.Tensor:
    out, half = packed.shape
    blocks = packed.reshape(out // block, half * 2, block // 2)
    return torch.cat((blocks & 0x0F, blocks >> 4), dim=2).transpose(1, 2).reshape(out, half * 2)


def cpu_int4pack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[out, in]`` codes of a weight in torch's CPU int4 layout: blocks of B = cpu_int4pack_block() output
    rows, in which byte ``k·B/2 + n`` holds input k of row n in its low nibble and of row n + B/2 in its high one."""
    return _unblock(packed, cpu_int4pack_block())


def cpu_int4pack_dequantize(packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """The float32 ``[out, in]`` weight torch's CPU int4 kernel multiplies by, for ``to_cpu_int4pack``'s tensors."""
    codes = cpu_int4pack_codes(packed).float()
    out, inp = codes.shape
    groups = sz.shape[0]
    scale, zero = sz[..., 0].float().t(), sz[..., 1].float().t()
    return ((codes.view(out, groups, inp // groups) - 8) * scale[..., None] + zero[..., None]).view(out, inp)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    w32 = w.float()
    scale = w32.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q, scale.to(w.dtype))


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP) -> Int4Weight:
    out, inp = w.shape
    if inp % group_size or group_size % 2:
        raise ValueError(f"input width {inp} is not a multiple of the INT4 group size {group_size}")
    g = w.float().view(out, inp // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-8)
    zero = -lo / scale  # exact, not rounded: the float zero point keeps both ends of the range
    codes = torch.round(g / scale[..., None] + zero[..., None]).clamp_(0, 15).to(torch.uint8).view(out, inp)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return Int4Weight(packed.contiguous(), scale.to(w.dtype), zero.to(w.dtype), group_size)
