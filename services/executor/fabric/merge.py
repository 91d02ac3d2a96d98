"""A whole model becomes one member of a merged TP-k instance in place, and a whole model again (AMOEBAs
§3.1-3.2).

Merging, FFN first: every held layer's FFN is cut to the member's pieces and the slot pages it no longer
touches become KV pages; attention computes the member's heads out of the whole (duplicated) attention
weights; KV is addressed by head unit, so that the units other members' heads leave are reused as they
stand; and the member's partial o_proj and down_proj outputs are summed over the instance by `reduce`. The
KV then moves by fabric/kv_heads.py's plan: the pages freed here are part of where it puts the other
members' heads.

Splitting, KV first (kv_heads.plan_split, with the pages the cut freed reserved): then every layer's slot
takes those pages back and the pieces it dropped are refilled from the host variants at the layer's bits.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from services.executor.engine.memory.arena import Arena
from services.executor.engine.model.decoder import DecoderModel, slot_views
from services.executor.engine.morphing.variants import VariantStore
from services.executor.fabric.ffn_cut import Cut, cut_layer, piece_range, shard_views
from services.executor.fabric.shards import HeadShard, head_shards


def runs(pages: list[int]) -> list[range]:
    """Sorted `pages` as maximal runs of consecutive pages."""
    out: list[range] = []
    for p in sorted(pages):
        if out and out[-1].stop == p:
            out[-1] = range(out[-1].start, p + 1)
        else:
            out.append(range(p, p + 1))
    return out


@dataclass(frozen=True)
class Membership:
    heads: HeadShard  # the global heads the member computes
    kept: range  # the FFN pieces it keeps
    freed: dict[int, list[int]]  # layer -> the slot pages its cut turned into KV pages
    boundary_pages: int  # pages a kept and a dropped piece share (kept)
    reduce_before: Callable[[torch.Tensor], torch.Tensor]


def layer_cuts(model: DecoderModel, arena: Arena, kept: range) -> Iterator[tuple[int, Cut, list[int]]]:
    """For every held layer: its cut to the FFN pieces `kept`, and the arena pages that cut frees."""
    for layer, views in enumerate(model.layers):
        if views is None:
            continue
        slot = arena.slot_range(layer)
        held = [p - slot.start for p in slot if arena.ledger.slot_of(p) == layer]
        cut = cut_layer(views, model.cfg.ffn_pieces, kept, arena.buffer.data_ptr() + slot.start * arena.page_bytes,
                        arena.page_bytes, held)
        yield layer, cut, [slot.start + p for p in cut.freed]


def cut_pages(model: DecoderModel, arena: Arena, tp: int, rank: int) -> list[int]:
    """The slot pages become_member would free, changing nothing: a merge plans its KV with them before it
    cuts, so that a merge that does not fit is refused with nothing done."""
    kept = piece_range(model.cfg.ffn_pieces, tp, rank)
    return [page for _, _, pages in layer_cuts(model, arena, kept) for page in pages]


def kv_units(model: DecoderModel, arena: Arena, degrees: list[int]) -> dict[int, int]:
    """For each TP degree k in `degrees`: the KV head units this whole model's arena would have outside its
    slots as a member of a TP-k instance (its KV pages now and those its cut frees, a unit per KV head of
    each page; the fewest over the ranks it could take)."""
    pages, heads = arena.ledger.snapshot().pages_kv, arena.kv_cache.shape[1]
    units = {}
    for k in degrees:
        freed = min(len(cut_pages(model, arena, k, r)) for r in range(k)) if k > 1 else 0
        units[k] = heads * (pages + freed)
    return units


def become_member(model: DecoderModel, arena: Arena, store: VariantStore, tp: int, rank: int,
                  reduce: Callable[[torch.Tensor], torch.Tensor]) -> Membership:
    """Make `model` (which holds whole layers) compute as member `rank` of a TP-`tp` instance. `store` holds
    the layers' host variants the split refills from: built now if it is not yet, from the whole layers."""
    store.prepare(progress=False)
    cfg = model.cfg
    kept = piece_range(cfg.ffn_pieces, tp, rank)
    heads = head_shards(cfg.num_heads, cfg.num_kv_heads, tp)[rank]
    freed: dict[int, list[int]] = {}
    boundary = 0
    for layer, cut, pages in list(layer_cuts(model, arena, kept)):
        model.layers[layer] = cut.views
        for run in runs(pages):
            arena.ledger.release_slot_pages(layer, run)
        freed[layer], boundary = pages, boundary + cut.boundary_pages
    membership = Membership(heads, kept, freed, boundary, model.reduce)
    model.heads = (heads.q, heads.kv)
    model.reduce = reduce
    model.use_head_units(True)
    return membership


def become_whole(model: DecoderModel, arena: Arena, store: VariantStore, membership: Membership) -> int:
    """Undo become_member once the KV is back in whole pages and out of the pages the cut freed: each layer's
    slot takes them back and the pieces it dropped are written from `store` at the layer's bits. Returns the
    bytes written."""
    cfg, written = model.cfg, 0
    for layer, pages in membership.freed.items():
        for run in runs(pages):
            arena.ledger.assign_slot(layer, run)
        bits = model.layer_bits[layer]
        layout, _ = model.slot_layout(bits)
        views = slot_views(arena, layer, layout)
        source = store.full(layer) if bits == model.full_bits else store.get(layer, bits)
        for piece in range(cfg.ffn_pieces):
            if piece in membership.kept:
                continue
            into = shard_views(views, cfg.ffn_pieces, range(piece, piece + 1))
            src = shard_views(source, cfg.ffn_pieces, range(piece, piece + 1))
            for name, view in into.items():
                if view.shape != views[name].shape:  # a piece of an FFN tensor (the rest was never cut)
                    view.copy_(src[name])
                    written += view.numel() * view.element_size()
        model.layers[layer] = views
    model.heads = None
    model.reduce = membership.reduce_before
    model.use_head_units(False)
    return written
