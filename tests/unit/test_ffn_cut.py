"""The in-place FFN cut of a tensor-parallel merge (AMOEBAs §3.2), on a real engine's slots at every bits: what
a member keeps is bitwise the gather of its pieces from the whole layer, the kept shards together compute the
whole FFN, and the pages a cut frees are exactly those no kept weight touches."""

import pytest
import torch
import torch.nn.functional as F

from services.executor.engine.engine import LLMEngine
from services.executor.engine.model.decoder import ffn_piece_width, fused_ffn, mlp
from services.executor.fabric.ffn_cut import byte_span, cut_layer, piece_range, shard_views
from shared.config import EngineConfig
from tests.checkpoints import write_tiny_llama3

LAYER = 1


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_llama3(tmp_path_factory.mktemp("tiny") / "model")
    return LLMEngine(EngineConfig(model=str(path), memory_budget=4 << 20, block_size=8, max_model_len=128,
                                  variant_cache_dir=str(tmp_path_factory.mktemp("variants"))), progress=False)


def gathered(whole: torch.Tensor, name: str, pieces: int, kept: range) -> torch.Tensor:
    """The pieces `kept` of a whole logical FFN tensor, gathered by copying piece after piece: gate_up's rows (in
    torch's CPU int4 scales, `[groups, rows, 2]`, dimension 1), down_proj's input columns (in torch's CPU int4
    layout, a matrix per piece: dimension 0)."""
    if name.startswith("gate_up_proj"):
        dim = 1 if name.endswith(".sz") else 0
    else:
        dim = 1 if whole.dim() == 2 else 0
    return torch.cat([chunk.clone() for chunk in whole.chunk(pieces, dim=dim)[kept.start:kept.stop]], dim=dim)


@pytest.mark.parametrize("bits", [32, 8, 4])
@pytest.mark.parametrize("tp", [2, 4])
def test_each_member_keeps_bitwise_its_pieces_and_together_they_compute_the_whole_ffn(engine, bits, tp):
    model, pieces = engine.model, engine.model.cfg.ffn_pieces
    engine.swapper.set_bits([LAYER], bits)
    try:
        views = model.layers[LAYER]
        x = torch.randn(5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(bits + tp))
        total = torch.zeros_like(x)
        for rank in range(tp):
            kept = piece_range(pieces, tp, rank)
            shard = shard_views(views, pieces, kept)
            for name, view in shard.items():
                if view.shape == views[name].shape:
                    assert view.data_ptr() == views[name].data_ptr()  # not an FFN tensor: whole, where it was
                    continue
                assert torch.equal(view, gathered(views[name], name, pieces, kept)), name
                lo, hi = byte_span(views[name])
                assert lo <= byte_span(view)[0] < byte_span(view)[1] <= hi  # a view of the slot, not a copy
            total += mlp(x, shard, model.layer_bits[LAYER], model.ffn_width)
        torch.testing.assert_close(total, mlp(x, views, model.layer_bits[LAYER], model.ffn_width),
                                   rtol=1e-5, atol=1e-5)
    finally:
        engine.swapper.set_bits([LAYER], model.full_bits)


@pytest.mark.parametrize("bits", [32, 8, 4])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_cut_frees_every_page_no_kept_weight_touches_and_no_other(engine, bits, tp):
    model, arena = engine.model, engine.arena
    engine.swapper.set_bits([LAYER], bits)
    try:
        slot = arena.slot_range(LAYER)
        held = [p - slot.start for p in slot if arena.ledger.slot_of(p) == LAYER]
        base, page = arena.buffer.data_ptr() + slot.start * arena.page_bytes, arena.page_bytes
        for rank in range(tp):
            cut = cut_layer(model.layers[LAYER], model.cfg.ffn_pieces, piece_range(model.cfg.ffn_pieces, tp, rank),
                            base, page, held)
            kept_bytes = [byte_span(v) for v in cut.views.values()]
            for p in held:
                start = base + p * page
                touched = any(a < start + page and start < b for a, b in kept_bytes)
                assert (p in cut.freed) != touched, (rank, p)
            assert set(cut.freed) <= set(held) and cut.boundary_pages <= 2 * (len(held) - len(cut.freed))
        if bits == model.full_bits:  # the whole layer: a TP-k member frees most of the other members' FFN
            ffn_pages = (byte_span(model.layers[LAYER]["down_proj"])[1] - byte_span(
                model.layers[LAYER]["gate_up_proj"])[0]) / page
            assert len(cut.freed) >= ffn_pages * (tp - 1) / tp - 2 * tp
    finally:
        engine.swapper.set_bits([LAYER], model.full_bits)


def test_the_padded_pieces_change_no_output():
    # Integer-valued gate/up weights and inputs make every product exact: the padded layout's real channels
    # equal the unpadded FFN's bit for bit, and its padding contributes exact zeros.
    g = torch.Generator().manual_seed(0)
    hidden, intermediate, pieces = 8, 70, 4
    gate, up = (torch.randint(-3, 4, (intermediate, hidden), generator=g).double() for _ in range(2))
    down = torch.randint(-3, 4, (hidden, intermediate), generator=g).double()
    x = torch.randint(-2, 3, (3, hidden), generator=g).double()
    width = ffn_piece_width(intermediate, pieces)
    assert width % 32 == 0 and width * pieces >= intermediate
    w = fused_ffn(gate, up, down, pieces, width)
    expected = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    torch.testing.assert_close(mlp(x, w, 64, width), expected, rtol=1e-12, atol=1e-12)
