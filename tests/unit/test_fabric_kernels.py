"""The Triton kernels (interpreted: TRITON_INTERPRET=1, tests/conftest.py) on the shapes a tensor-parallel
member feeds them: its share of the heads (uneven for the default model: 6/2 and 3/1; replicated KV heads)
and its padded FFN shard, quantized or not. On CUDA they are the path a member's layers take; here they
must match the torch references the CPU runs."""

import pytest
import torch

from morphling_kernels.paged_attention import paged_decode_attention_ref, paged_decode_attention_triton
from morphling_kernels.w4a16 import w4a16_linear_ref, w4a16_linear_triton
from morphling_kernels.w8a16 import w8a16_linear_ref, w8a16_linear_triton
from services.executor.engine.morphing.quant import int4_group, quantize_int4, quantize_int8
from services.executor.engine.model.decoder import pad_channels
from services.executor.fabric.shards import ffn_shard, head_shards
from tests.unit.test_kernels import ATOL, RTOL, decode_case

# (query heads, KV heads, TP) of the default model and of the tests' 8-KV-head checkpoint
MODELS = [(9, 3, 2), (9, 3, 3), (16, 8, 2), (16, 8, 4), (8, 2, 4)]


@pytest.mark.parametrize("heads,kv,tp", MODELS)
def test_decode_attention_on_each_members_heads(heads, kv, tp):
    for rank, shard in enumerate(head_shards(heads, kv, tp)):
        q, kv_cache, tables, ctx, scale = decode_case((len(shard.q), len(shard.kv)), 64, 16, [1, 16, 17, 97],
                                                      seed=rank)
        out = paged_decode_attention_triton(q, kv_cache, 1, tables, ctx, scale)
        torch.testing.assert_close(out, paged_decode_attention_ref(q, kv_cache, 1, tables, ctx, scale),
                                   atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("intermediate,hidden,tp", [(1536, 576, 2), (200, 128, 2), (200, 128, 4)])
def test_quantized_linears_on_a_padded_ffn_shard(intermediate, hidden, tp):
    gen = torch.Generator().manual_seed(intermediate + tp)
    up = torch.randn(intermediate, hidden, generator=gen) * 0.05
    down = torch.randn(hidden, intermediate, generator=gen) * 0.05
    real, width = ffn_shard(intermediate, tp, tp - 1)
    for w in (pad_channels(up, real, width, 0), pad_channels(down, real, width, 1)):  # column- and row-split
        x = torch.randn(5, w.shape[1], generator=gen)
        q8 = quantize_int8(w)
        torch.testing.assert_close(w8a16_linear_triton(x, q8.qweight, q8.scale, None),
                                   w8a16_linear_ref(x, q8.qweight, q8.scale, None), atol=ATOL, rtol=1e-5)
        q4 = quantize_int4(w, int4_group(w.shape[1]))
        torch.testing.assert_close(w4a16_linear_triton(x, q4.packed, q4.scale, q4.zero, q4.group_size, None),
                                   w4a16_linear_ref(x, q4.packed, q4.scale, q4.zero, q4.group_size, None),
                                   atol=ATOL, rtol=1e-5)
