"""A tensor-parallel merge's cut of a layer's FFN, in place (AMOEBAs §3.2, "in-place migration with weight
padding"): a member of the merged TP-k instance keeps its pieces of the FFN where they lie in the layer's
slot, and every slot page that none of what it keeps touches becomes a KV page. No weight moves.

The decoder stores the FFN in `ffn_pieces` zero-padded pieces, each a contiguous run of every FFN tensor
(gate_up rows piece after piece; down_proj input-major; INT8 codes and scales, INT4 codes, scales and
zeros the same way; in torch's CPU int4 layout, gate_up's pieces are whole blocks of rows and down_proj one
matrix per piece), so member `rank` of TP-k keeps pieces [rank·p/k, (rank+1)·p/k) as one narrowed view
per tensor, at any bits. The other weights stay whole on every member (the paper keeps them duplicated:
the FFN is most of a layer).

Where a piece boundary falls inside a page, that page stays with the member that keeps its other part: the
paper pads pieces to the allocation granularity instead, which here (a page is one KV block of every layer,
a twentieth of the default model's layer) would cost more than the pages it frees. `cut_report` says how
much each cut frees and how much stays as such boundary pages.
"""

from dataclasses import dataclass

import torch

GATE_UP, DOWN = "gate_up_proj", "down_proj"


def piece_range(pieces: int, tp: int, rank: int) -> range:
    """The pieces member `rank` of a TP-`tp` instance holds."""
    if pieces % tp:
        raise ValueError(f"TP{tp} cannot split {pieces} FFN pieces evenly")
    per = pieces // tp
    return range(rank * per, (rank + 1) * per)


def piece_dim(name: str, view: torch.Tensor) -> int | None:
    """The dimension of an FFN tensor that runs over its pieces; None for one that every piece shares."""
    if name.startswith(GATE_UP):
        return 1 if name.endswith(".sz") else 0  # the CPU int4 scales are [groups, rows, 2]
    if name.startswith(DOWN):
        return {2: 1, 3: 0, 4: 0}.get(view.dim())  # input columns, or the CPU int4 layout's matrix per piece
    return None


def shard_views(views: dict[str, torch.Tensor], pieces: int, kept: range) -> dict[str, torch.Tensor]:
    """A layer's logical views (decoder.slot_views) with the FFN narrowed to the pieces `kept` along
    `piece_dim` (down_proj's INT8 per-output scale is whole). Views of the same bytes: nothing is copied."""
    out = {}
    for name, view in views.items():
        dim = piece_dim(name, view)
        if dim is None:
            out[name] = view
            continue
        step = view.shape[dim] // pieces
        out[name] = view.narrow(dim, kept.start * step, len(kept) * step)
    return out


def byte_span(view: torch.Tensor) -> tuple[int, int]:
    """[start, stop) of the bytes `view` reads, as addresses."""
    if view.numel() == 0:
        return view.data_ptr(), view.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(view.shape, view.stride()))
    return view.data_ptr(), view.data_ptr() + (last + 1) * view.element_size()


@dataclass(frozen=True)
class Cut:
    views: dict[str, torch.Tensor]  # what the layer computes with from now on
    freed: list[int]  # slot pages no kept view touches: KV pages from now on
    boundary_pages: int  # pages kept only because a kept and a dropped piece share them


def cut_layer(views: dict[str, torch.Tensor], pieces: int, kept: range, slot_base: int, page_bytes: int,
              slot_pages: list[int]) -> Cut:
    """Cut a layer whose slot starts at address `slot_base` and of whose pages `slot_pages` (indices from the
    slot's start) are still the layer's (a quantized layer gave its tail back already)."""
    kept_views = shard_views(views, pieces, kept)
    spans = [byte_span(v) for v in kept_views.values()]
    dropped = []  # a kept run is contiguous inside its tensor: what was cut lies before and after it
    for name, view in views.items():
        (a, b), (ka, kb) = byte_span(view), byte_span(kept_views[name])
        dropped += [(lo, hi) for lo, hi in ((a, ka), (kb, b)) if lo < hi]

    def touched(page: int, by: list[tuple[int, int]]) -> bool:
        start = slot_base + page * page_bytes
        return any(a < start + page_bytes and start < b for a, b in by)

    freed = [p for p in slot_pages if not touched(p, spans)]
    boundary = sum(1 for p in slot_pages if touched(p, spans) and touched(p, dropped))
    return Cut(kept_views, freed, boundary)
