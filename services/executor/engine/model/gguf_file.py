"""A GGUF file's metadata and tensor table, read at the speed of its bytes.

gguf's GGUFReader makes a numpy view of every value it reads: the default model's tokenizer (49,152 tokens and
48,900 merges) took it 4.5 s, paid by the loader and again by the tokenizer in every process that loads the
model. This reads the same format (ggml's docs/gguf.md, versions 2 and 3, either byte order) with struct over
one memory map. Metadata comes back as GGUFReader's `contents()` gives it (str, int, float, bool, lists of
them); tensor data stays views of the map, typed and shaped as GGUFReader shapes them, which is what
gguf.quants.dequantize reads.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

V = GGUFValueType
_SCALARS = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i", V.FLOAT32: "f",
            V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}  # struct's codes
_TYPED = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}  # every other type is read as the bytes of its blocks
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as the file lists it: innermost dimension first
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, object]
    tensors: dict[str, GGUFTensor]  # in the file's order


class _Cursor:
    def __init__(self, buffer: mmap.mmap, order: str):
        self.buffer, self.order, self.at = buffer, order, 0

    def take(self, code: str):
        (value,) = struct.unpack_from(self.order + code, self.buffer, self.at)
        self.at += struct.calcsize(code)
        return value

    def string(self) -> str:
        size = self.take("Q")
        if self.at + size > len(self.buffer):
            raise ValueError(f"a string of {size} bytes at offset {self.at} runs past the end of the file")
        text = self.buffer[self.at:self.at + size].decode("utf-8")
        self.at += size
        return text

    def value(self, kind: int):
        if kind == V.STRING:
            return self.string()
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind != V.ARRAY:
            raise ValueError(f"unknown metadata value type {kind} at offset {self.at}")
        item, count = self.take("I"), self.take("Q")
        if item in _SCALARS:  # one read for the whole array
            codes = f"{self.order}{count}{_SCALARS[item]}"
            values = list(struct.unpack_from(codes, self.buffer, self.at))
            self.at += struct.calcsize(codes)
            return values
        return [self.value(item) for _ in range(count)]


def read_gguf(path: str) -> GGUFFile:
    """ValueError (or struct.error) when the file is not a GGUF this reads: the caller names the file."""
    with open(path, "rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if len(buffer) < 8 or struct.unpack_from("<I", buffer)[0] != GGUF_MAGIC:
        raise ValueError("no GGUF magic number at the start")
    # A little-endian version (2 or 3) has its low half set; one written on a big-endian machine, its high half.
    order = "<" if struct.unpack_from("<I", buffer, 4)[0] & 0xFFFF else ">"
    cursor = _Cursor(buffer, order)
    cursor.at = 4
    if (version := cursor.take("I")) not in (2, 3):
        raise ValueError(f"GGUF version {version} (this reads versions 2 and 3)")
    tensor_count, kv_count = cursor.take("Q"), cursor.take("Q")
    metadata: dict[str, object] = {}
    for _ in range(kv_count):
        key = cursor.string()
        if key in metadata:
            raise ValueError(f"metadata key {key!r} appears twice")
        metadata[key] = cursor.value(cursor.take("I"))
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        shape = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
        table.append((name, shape, GGMLQuantizationType(cursor.take("I")), cursor.take("Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    start = -(-cursor.at // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, shape, kind, offset in table:
        if name in tensors:
            raise ValueError(f"tensor {name!r} appears twice")
        tensors[name] = GGUFTensor(name, kind, shape, _tensor_data(buffer, order, start + offset, shape, kind))
    return GGUFFile(metadata, tensors)


def _tensor_data(buffer: mmap.mmap, order: str, offset: int, shape: tuple[int, ...],
                 kind: GGMLQuantizationType) -> np.ndarray:
    dims, elements = tuple(reversed(shape)), int(np.prod(shape, dtype=np.int64))
    if kind in _TYPED:
        dtype = np.dtype(_TYPED[kind]).newbyteorder(order)
        return np.frombuffer(buffer, dtype, elements, offset).reshape(dims)
    block, block_bytes = GGML_QUANT_SIZES[kind]
    return np.frombuffer(buffer, np.uint8, elements * block_bytes // block, offset).reshape(
        quant_shape_to_byte_shape(dims, kind))
