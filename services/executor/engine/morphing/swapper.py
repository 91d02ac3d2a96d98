"""Layer swapping and KV resizing (MorphServe): change a decoder layer's precision in place.

Quantizing writes the layer's INT8/INT4 variant into the start of its own slot and releases the pages
it no longer fills to the KV free list in the same call. Restoring first moves live KV blocks out of
those pages (page copy + block-table patch for every sequence that holds them), takes them back into
the slot, and only then writes full precision back. Calls happen between engine steps, so requests
running across a swap keep their KV and continue. Full-precision copies and variants come from a
VariantStore (variants.py), built ahead of the first swap, so a swap only copies.
"""

import time
from dataclasses import dataclass

import torch

from services.executor.engine.memory.arena import Arena
from services.executor.engine.model.decoder import DecoderModel, load_layer, slot_views
from services.executor.engine.morphing.variants import VariantStore
from shared.core.errors import EngineError, OutOfPagesError
from shared.core.scheduling.scheduler import Scheduler
from shared.core.slots import SwapRefused, next_layers, resize_slots


class SwapError(EngineError):
    """A swap was refused: bad layers or bits, or the KV in use cannot make room. Nothing changed."""


@dataclass
class SwapReport:
    layers: list[int]
    bits: int
    pages_released: int  # slot pages that became KV pages
    pages_reclaimed: int  # KV pages taken back into slots
    blocks_relocated: int  # live KV pages moved out of reclaimed pages
    seconds: float


class LayerSwapper:
    def __init__(self, model: DecoderModel, arena: Arena, scheduler: Scheduler, store: VariantStore | None = None):
        """`store` defaults to an in-memory one (no disk cache, no cap), prepared at the first swap."""
        self.model = model
        self.arena = arena
        self.scheduler = scheduler
        self.store = store if store is not None else VariantStore(model, fingerprint=None)
        self._fp_views = list(model.layers)  # the slot's full-precision views, to switch back to
        on_cuda = arena.buffer.is_cuda
        self._side = torch.cuda.Stream(device=arena.buffer.device) if on_cuda else None
        self._layouts, self._pages = {}, {}
        for bits in (model.full_bits, *self.store.bits):
            self._layouts[bits], nbytes = model.slot_layout(bits)
            self._pages[bits] = arena.geometry.pages_for_bytes(nbytes)
        self._order = list(range(len(model.layers)))

    @property
    def swap_order(self) -> list[int]:
        """The order layers are quantized in when a command gives a count (an LIS profile; front to back
        until one is set)."""
        return list(self._order)

    @swap_order.setter
    def swap_order(self, order: list[int]) -> None:
        num = len(self.model.layers)
        if sorted(order) != list(range(num)):
            raise SwapError(f"a swap order must name each of the {num} layers once, got {order}")
        self._order = list(order)

    def next_layers(self, count: int, bits: int) -> list[int]:
        """The `count` layers that going to `bits` takes next (slots.next_layers: the swap order, backwards for a
        restore)."""
        try:
            return next_layers(self._order, self.model.layer_bits, self.model.full_bits, count, bits)
        except SwapRefused as exc:
            raise SwapError(str(exc)) from exc

    def pages_for(self, bits: int) -> int:
        """Slot pages a layer occupies at `bits` (the rest of its slot serves as KV)."""
        return self._pages[bits]

    def set_bits(self, layers: list[int], bits: int) -> SwapReport:
        """Bring every layer in `layers` to `bits` (8, 4, or the full precision, which restores)."""
        start = time.perf_counter()
        if bits not in self._pages:
            raise SwapError(f"layers can hold {sorted(self._pages)} bits, not {bits}")
        bad = [i for i in layers if not 0 <= i < len(self.model.layers)]
        if bad or len(set(layers)) != len(layers):
            raise SwapError(f"layer indices must be distinct and in [0, {len(self.model.layers)}): {layers}")
        changes = {i: (self._slot(i), self.pages_for(self.model.layer_bits[i]), self.pages_for(bits)) for i in layers}
        try:
            done = resize_slots(self.arena.ledger, changes, self._vacate, lambda i: self._write(i, bits))
        except OutOfPagesError as exc:
            raise SwapError(f"restoring needs {exc.needed} live KV blocks moved out of the layers' slots, but only "
                            f"{exc.free} free KV pages are elsewhere") from exc
        return SwapReport(list(layers), bits, done.released, done.reclaimed, len(done.moved),
                          time.perf_counter() - start)

    def restore(self, layers: list[int]) -> SwapReport:
        return self.set_bits(layers, self.model.full_bits)

    # --- every layer at once: an executor that joins an instance for replicas, and leaves it -------
    def release_all(self) -> int:
        """Turn every layer's slot pages into free KV pages and hold no layer (no KV may be live); the pages
        released."""
        ledger, released = self.arena.ledger, 0
        for layer, views in enumerate(self.model.layers):
            if views is None:
                continue
            slot = self._slot(layer)
            held = [p for p in slot if ledger.slot_of(p) == layer]
            if held:
                ledger.release_slot_pages(layer, range(held[0], held[-1] + 1))
            self.model.layers[layer] = None
            released += len(held)
        return released

    def reload_all(self, checkpoint) -> int:
        """Hold every layer whole at full precision again, read from `checkpoint`, its slot taken back from
        the KV pages (none may be live); the pages taken."""
        ledger, full, taken = self.arena.ledger, self.model.full_bits, 0
        for layer, views in enumerate(self.model.layers):
            if views is not None:
                continue
            start = self._slot(layer).start
            ledger.assign_slot(layer, range(start, start + self.pages_for(full)))
            load_layer(self._fp_views[layer], checkpoint, layer)
            self.model.layers[layer] = self._fp_views[layer]
            self.model.layer_bits[layer] = full
            taken += self.pages_for(full)
        return taken

    # --- pages --------------------------------------------------------------------------------
    def _slot(self, layer: int) -> range:
        return self.arena.slot_range(layer)

    def _vacate(self, pages: set[int]) -> dict[int, int]:
        """Move live KV out of `pages` (block tables first, then the data). Refuses with OutOfPagesError,
        changing nothing, when the KV pages elsewhere cannot take it."""
        moved = self.scheduler.evacuate(pages)
        if moved:
            device = self.arena.buffer.device
            src, dst = torch.tensor(list(moved), device=device), torch.tensor(list(moved.values()), device=device)
            self.arena.kv_cache[dst] = self.arena.kv_cache[src]
        return moved

    # --- weights ------------------------------------------------------------------------------
    def _write(self, layer: int, bits: int) -> None:
        # The store is asked before the slot is written: its first use builds from full-precision slots.
        if bits == self.model.full_bits:
            source, views = self.store.full(layer), self._fp_views[layer]
        else:
            source = self.store.get(layer, bits)
            views = slot_views(self.arena, layer, self._layouts[bits])
        if self._side is None:
            for name, tensor in source.items():
                views[name].copy_(tensor)
        else:
            # The copy runs beside the compute stream, after every kernel queued so far (one may still be
            # reading these bytes, or the KV just moved out of them); the layer's next use waits on its event.
            self._side.wait_stream(torch.cuda.current_stream(self._side.device))
            with torch.cuda.stream(self._side):
                for name, tensor in source.items():
                    views[name].copy_(tensor, non_blocking=True)  # held entries are pinned host memory
                ready = torch.cuda.Event()
                ready.record(self._side)
            self.model.layer_ready[layer] = ready
        self.model.layers[layer] = views
        self.model.layer_bits[layer] = bits
