"""Weight quantization formats of layer variants: INT8 per output channel, INT4 in groups of 128.

INT8: symmetric, one scale per output channel: w ≈ q * scale, q in [-127, 127].
INT4: asymmetric, per output channel and group of `group_size` input channels:
w ≈ (q - zero) * scale, q in [0, 15], packed two per byte (low nibble = even input index).
These are the torch references; the W8A16/W4A16 kernels in kernels/ consume the same tensors.
"""

from dataclasses import dataclass

import torch

INT4_GROUP = 128  # not the GGUF's Q4_1 group of 32: our full precision is that file, so real error shows


def int4_group(in_features: int, preferred: int = INT4_GROUP) -> int:
    """The largest even group size up to `preferred` that divides `in_features` (576 -> 96, 1536 -> 128)."""
    for size in range(min(preferred, in_features), 1, -1):
        if in_features % size == 0 and size % 2 == 0:
            return size
    raise ValueError(f"no even INT4 group divides an input width of {in_features}")


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
