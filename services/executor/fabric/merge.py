"""A whole model becomes one member of a merged TP-k instance, in place (AMOEBAs §3.1-3.2, FFN first):
every held layer's FFN is cut to the member's pieces and the slot pages it no longer touches become KV
pages; attention computes the member's heads out of the whole (duplicated) attention weights; KV is
addressed by head unit, so that the units other members' heads leave are reused as they stand; and the
member's partial o_proj and down_proj outputs are summed over the instance by `reduce`.

The KV itself moves by fabric/kv_heads.py's plan, after this: the pages freed here are part of what it
places the other members' heads in.
"""

from collections.abc import Callable

import torch

from services.executor.engine.memory.arena import Arena
from services.executor.engine.model.decoder import DecoderModel
from services.executor.fabric.ffn_cut import cut_layer, piece_range
from services.executor.fabric.shards import head_shards


def runs(pages: list[int]) -> list[range]:
    """Sorted `pages` as maximal runs of consecutive pages."""
    out: list[range] = []
    for p in sorted(pages):
        if out and out[-1].stop == p:
            out[-1] = range(out[-1].start, p + 1)
        else:
            out.append(range(p, p + 1))
    return out


def become_member(model: DecoderModel, arena: Arena, tp: int, rank: int,
                  reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """Make `model` (which holds whole layers) compute as member `rank` of a TP-`tp` instance. Returns the
    slot pages freed per layer, the pages that a kept and a dropped piece share (kept), and the member's
    heads."""
    cfg = model.cfg
    kept = piece_range(cfg.ffn_pieces, tp, rank)
    heads = head_shards(cfg.num_heads, cfg.num_kv_heads, tp)[rank]
    freed: dict[int, list[int]] = {}
    boundary = 0
    for layer, views in enumerate(model.layers):
        if views is None:
            continue
        slot = arena.slot_range(layer)
        held = [p - slot.start for p in slot if arena.ledger.slot_of(p) == layer]
        cut = cut_layer(views, cfg.ffn_pieces, kept, arena.buffer.data_ptr() + slot.start * arena.page_bytes,
                        arena.page_bytes, held)
        model.layers[layer] = cut.views
        pages = [slot.start + p for p in cut.freed]
        for run in runs(pages):
            arena.ledger.release_slot_pages(layer, run)
        freed[layer], boundary = pages, boundary + cut.boundary_pages
    model.heads = (heads.q, heads.kv)
    model.reduce = reduce
    model.use_head_units(True)
    return {"freed": freed, "boundary_pages": boundary, "heads": heads}
