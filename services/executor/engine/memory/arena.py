"""The page arena: one preallocated buffer holding every decoder layer's weights and the whole KV cache.

A page is one KV block for all layers, laid out head-major `[kv_head, layer, k|v, token, head_dim]`, so
that splitting heads for tensor parallelism cuts a page into contiguous pieces. The whole buffer is also
viewed as `kv_cache[page, kv_head, layer, k|v, token, head_dim]`: block tables name pages by index, so KV
can live in any page that is not in a slot, in any order, and no pointer arithmetic ever assumes where.

Each decoder layer owns a contiguous run of pages (its slot) sized for its full-precision weights; the
weight tensors are views into the slot and never move. Embeddings, the final norm and the LM head live
outside the arena. A member of an instance that spans executors holds only some layers (`held`): the slots
of the others stay KV pages, at the same place, so that a layer it takes later (a replica, a migration)
gets its slot back the way a restore does.
"""

import ctypes
import math
import mmap
from collections.abc import Collection
from dataclasses import dataclass

import torch

from shared.core.errors import MemoryBudgetError
from shared.core.memory.ledger import PageLedger

# Weight views inside a slot start on this boundary so that vectorised loads stay aligned.
ALIGN_BYTES = 256


def align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class ArenaGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        elems = self.num_kv_heads * self.num_layers * 2 * self.block_size * self.head_dim
        return elems * torch.empty((), dtype=self.dtype).element_size()

    def pages_for_bytes(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.page_bytes)

    def pages_for_tokens(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def host_buffer(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """Zeroed host memory backed by 2 MiB pages where the kernel allows it.

    Decode attention gathers a few KiB from every page of every sequence, scattered over the whole
    arena; with 4 KiB pages nearly each of those reads is a TLB miss, and huge pages make the gather
    1.5-3x faster on CPU. The mapping must outlive the tensor, so it is returned too.
    """
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE
    buffer = raw[start:start + nbytes]
    try:  # advice only: where it is refused, 4 KiB pages still work
        ctypes.CDLL(None).madvise(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass
    return buffer, region


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class Arena:
    def __init__(self, geometry: ArenaGeometry, budget_bytes: int, layer_bytes: int, min_kv_tokens: int,
                 device: torch.device | str = "cpu", held: Collection[int] | None = None,
                 slotted: Collection[int] | None = None):
        """`held`: the layers that get a slot now (all by default). `slotted`: the layers that have a slot at all
        (all by default, so that any layer may come later); a planned member (InstancePlan.slots "placed")
        keeps slots for the layers it holds only, packed from page 0, and its budget need not hold the rest."""
        self.geometry = geometry
        page_bytes = geometry.page_bytes
        num_pages = budget_bytes // page_bytes
        self.slot_pages = geometry.pages_for_bytes(layer_bytes)
        held = range(geometry.num_layers) if held is None else sorted(held)
        slotted = range(geometry.num_layers) if slotted is None else sorted(slotted)
        if not set(held) <= set(slotted):
            raise ValueError(f"layers {sorted(set(held) - set(slotted))} are held but have no slot")
        self._slot_index = {layer: n for n, layer in enumerate(slotted)}
        weight_pages = self.slot_pages * len(held)
        min_kv_pages = geometry.pages_for_tokens(min_kv_tokens)
        # Every slot must fit where it sits, held now or not, since any slotted layer may come later.
        need = max(weight_pages + min_kv_pages, self.slot_pages * len(slotted))
        if num_pages < need:
            raise MemoryBudgetError(
                f"memory budget {_mib(budget_bytes)} holds {num_pages} pages of {_mib(page_bytes)}, but the "
                f"{len(held)} decoder layers need {weight_pages} pages ({_mib(weight_pages * page_bytes)})"
                f" and one sequence of {min_kv_tokens} tokens needs {min_kv_pages} more: "
                f"raise the budget to at least {_mib(need * page_bytes)} or lower max_model_len")
        self.num_pages = num_pages
        if torch.device(device).type == "cpu":
            self.buffer, self._mapping = host_buffer(num_pages * page_bytes)
        else:
            self.buffer = torch.zeros(num_pages * page_bytes, dtype=torch.uint8, device=device)
        self.kv_cache = self.buffer.view(geometry.dtype).view(
            num_pages, geometry.num_kv_heads, geometry.num_layers, 2, geometry.block_size, geometry.head_dim)
        self.ledger = PageLedger(num_pages)
        for layer in held:
            self.ledger.assign_slot(layer, self.slot_range(layer))

    @property
    def page_bytes(self) -> int:
        return self.geometry.page_bytes

    def has_slot(self, layer: int) -> bool:
        return layer in self._slot_index

    def slot_range(self, layer: int) -> range:
        """The pages of `layer`'s full-precision slot (slots are packed from page 0 upwards)."""
        if layer not in self._slot_index:
            raise ValueError(f"layer {layer} has no slot in this arena (it keeps slots for layers "
                             f"{sorted(self._slot_index)} only)")
        start = self._slot_index[layer] * self.slot_pages
        return range(start, start + self.slot_pages)

    def slot_view(self, layer: int, byte_offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor view of `shape` at `byte_offset` inside `layer`'s slot."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        slot = self.slot_range(layer)
        start = slot.start * self.page_bytes + byte_offset
        if byte_offset % ALIGN_BYTES or byte_offset + nbytes > len(slot) * self.page_bytes:
            raise ValueError(f"view of {nbytes} bytes at {byte_offset} does not fit layer {layer}'s slot")
        return self.buffer[start:start + nbytes].view(dtype).view(shape)
