"""A member's shard of a layer: the head split rule and the padded FFN (AMOEBAs §3.2), checked against the
whole layer's arithmetic."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from services.executor.engine.model.decoder import PIECE_MULTIPLE, pad_channels
from services.executor.fabric.shards import ffn_shard, head_shards
from shared.core.errors import ModelLoadError
from shared.core.plans import FFN_PIECES


@pytest.mark.parametrize("heads,kv,tp,expected", [
    (9, 3, 2, [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]),  # the default model: uneven, whole groups
    (9, 3, 3, [(range(0, 3), range(0, 1)), (range(3, 6), range(1, 2)), (range(6, 9), range(2, 3))]),
    (16, 8, 4, [(range(4 * r, 4 * r + 4), range(2 * r, 2 * r + 2)) for r in range(4)]),
    (8, 2, 4, [(range(0, 2), range(0, 1)), (range(2, 4), range(0, 1)), (range(4, 6), range(1, 2)),
               (range(6, 8), range(1, 2))]),  # KV heads replicated, as vLLM
])
def test_heads_split_on_whole_groups_or_replicate_kv_heads(heads, kv, tp, expected):
    assert [(s.q, s.kv) for s in head_shards(heads, kv, tp)] == expected


def test_a_tp_that_cannot_keep_groups_whole_is_refused_with_why():
    with pytest.raises(ModelLoadError, match="TP4 cannot split 9 query heads over 3 KV heads"):
        head_shards(9, 3, 4)


@given(heads_per_group=st.integers(1, 8), kv=st.integers(1, 8), tp=st.sampled_from([1, 2, 4, 8]))
def test_every_query_head_is_computed_once_with_the_kv_head_it_attends_to(heads_per_group, kv, tp):
    heads = heads_per_group * kv
    try:
        shards = head_shards(heads, kv, tp)
    except ModelLoadError:
        assert tp > kv
        return
    assert sorted(h for s in shards for h in s.q) == list(range(heads))
    for s in shards:
        assert len(s.q) % len(s.kv) == 0  # ordinary grouped attention locally
        local_group = len(s.q) // len(s.kv)
        for i, h in enumerate(s.q):
            assert s.kv[i // local_group] == h // heads_per_group


def ffn(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def gated(x, gate, up):
    return F.silu(F.linear(x, gate)) * F.linear(x, up)


@pytest.mark.parametrize("intermediate", [200, 1536, 100, 7])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_padded_shards_reproduce_the_unpadded_ffn(intermediate, tp):
    # Integer-valued weights and inputs make gate·x and up·x exact whatever the summation order, so the
    # gated activations can be compared bit for bit: the real channels equal the whole layer's, and every
    # padded channel is exactly 0 (silu(0)·0), so the zero down columns behind it add exactly nothing.
    g = torch.Generator().manual_seed(intermediate * 10 + tp)
    hidden = 16
    gate, up = (torch.randint(-3, 4, (intermediate, hidden), generator=g).double() for _ in range(2))
    down = torch.randn(hidden, intermediate, generator=g, dtype=torch.float64)
    x = torch.randint(-2, 3, (5, hidden), generator=g).double()
    whole = gated(x, gate, up)
    total = torch.zeros(5, hidden, dtype=torch.float64)
    for rank in range(tp):
        real, width = ffn_shard(intermediate, tp, rank)
        assert width % PIECE_MULTIPLE == 0  # whole INT4 groups in every piece
        h = gated(x, pad_channels(gate, real, width, 0), pad_channels(up, real, width, 0))
        for piece, r in enumerate(real):
            at = piece * width
            assert torch.equal(h[:, at:at + len(r)], whole[:, r.start:r.stop])
            assert torch.equal(h[:, at + len(r):at + width], torch.zeros(5, width - len(r), dtype=torch.float64))
        total += F.linear(h, pad_channels(down, real, width, 1))
    # The all-reduce sums the shards' partial outputs: equal up to the order of that sum.
    torch.testing.assert_close(total, ffn(x, gate, up, down), rtol=1e-12, atol=1e-12)


@given(intermediate=st.integers(1, 5000), tp=st.sampled_from([1, 2, 4]))
def test_ffn_pieces_cover_each_channel_once_and_keep_their_boundaries_across_tp(intermediate, tp):
    per_rank = [ffn_shard(intermediate, tp, r)[0] for r in range(tp)]
    channels = [c for ranges in per_rank for r in ranges for c in r]
    assert channels == list(range(intermediate))
    tp1_pieces, width = ffn_shard(intermediate, 1, 0)
    assert [r for ranges in per_rank for r in ranges] == tp1_pieces  # a merge or split never moves a piece
    assert len(tp1_pieces) == FFN_PIECES
    assert width >= max(len(r) for r in tp1_pieces)
