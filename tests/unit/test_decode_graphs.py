"""Decode graphs' static batches, run eagerly on the CPU: what a captured graph replays on a GPU (tests/gpu
replays the graphs themselves) must give the tokens the engine gives without them."""

import pytest

from morphling_kernels.tuning import rows_bucket
from services.executor.engine.engine import LLMEngine
from services.executor.engine.graphs import DecodeGraphs, buckets, warm_linears
from services.executor.engine.model import decoder
from shared.config import EngineConfig
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3, write_tiny_qwen2

PROMPTS = [[5 + i, 40 + 3 * i, 17, 99 - i] * (1 + i) for i in range(6)]  # lengths 4..24: blocks of 8 straddled


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama3(tmp_path_factory.mktemp("tiny") / "model")


def engine(tiny_dir, static: bool) -> LLMEngine:
    e = LLMEngine(EngineConfig(model=str(tiny_dir), memory_budget=4 << 20, block_size=8, max_model_len=256,
                               max_num_seqs=8, max_num_batched_tokens=64), progress=False)
    if static:
        e.runner.graphs = DecodeGraphs(e.model, 8, e.max_model_len, 8, e.config.variant_bits, capture=False)
    return e


def generate(e: LLMEngine, prompts: list[list[int]], swap_at: int | None = None, max_tokens: int = 12
             ) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of `prompts` run together, layers 1 and 2 swapped to INT8 and INT4 after `swap_at`
    steps; and the batch sizes of the steps that ran through the static path."""
    params = SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, params)
    static_steps: list[int] = []
    graphs = e.runner.graphs
    if graphs is not None:
        run = graphs.run
        graphs.run = lambda decodes: static_steps.append(len(decodes)) or run(decodes)
    tokens: dict[str, list[int]] = {}
    steps = 0
    while e.has_unfinished():
        if steps == swap_at:
            e.swapper.set_bits([1], 8)
            e.swapper.set_bits([2], 4)
        for d in e.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
        steps += 1
    return [tokens[str(i)] for i in range(len(prompts))], static_steps


def test_buckets_are_vllms_sizes_up_to_the_cap():
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(1) == [1]


@pytest.mark.parametrize("count", [1, 3, 6])
def test_a_static_padded_decode_gives_the_tokens_of_the_eager_one(tiny_dir, count):
    # 3 and 6 sequences run in buckets of 4 and 8: the padding rows must write no KV and change no real row.
    expected, _ = generate(engine(tiny_dir, static=False), PROMPTS[:count])
    got, static_steps = generate(engine(tiny_dir, static=True), PROMPTS[:count])
    assert got == expected
    assert count in static_steps  # the whole batch decoded in the static path


def test_swaps_select_the_layers_other_pieces(tiny_dir):
    expected, _ = generate(engine(tiny_dir, static=False), PROMPTS[:4], swap_at=4)
    got, static_steps = generate(engine(tiny_dir, static=True), PROMPTS[:4], swap_at=4)
    assert got == expected and len(static_steps) > 4
    unswapped, _ = generate(engine(tiny_dir, static=False), PROMPTS[:4])
    assert got != unswapped  # the swap reached the static path's layers


@pytest.mark.parametrize("write", [write_tiny_llama3, write_tiny_qwen2], ids=["llama3", "qwen2"])
def test_the_start_meets_every_low_bit_kernel_that_serving_after_a_swap_does(write, tmp_path, monkeypatch):
    # On a GPU a low-bit kernel compiles and is tuned the first time it meets a key (tuning.py), so a key
    # that warm_linears misses stalls the first step after a swap. Qwen2's q/k/v bias is part of the key: a
    # start that warmed them without it left every biased key to serving (an H200, 2026-11-27).
    monkeypatch.setattr(decoder, "int4_packing", lambda device: decoder.NIBBLES)  # the GPU's, whose kernels tune
    e = engine(write(tmp_path / "model"), static=False)
    met: set[tuple] = set()

    def recording(kernel, bits: int):
        def run(x, q, *rest):
            met.add((bits, tuple(q.shape), rows_bucket(x.reshape(-1, x.shape[-1]).shape[0]), rest[-1] is not None))
            return kernel(x, q, *rest)
        return run

    monkeypatch.setattr(decoder, "w8a16_linear", recording(decoder.w8a16_linear, 8))
    monkeypatch.setattr(decoder, "w4a16_linear", recording(decoder.w4a16_linear, 4))
    warm_linears(e.model, e.config.variant_bits, e.config.max_num_batched_tokens)
    warmed = set(met)
    met.clear()
    generate(e, PROMPTS, swap_at=1)
    assert {bits for bits, *_ in met} == {4, 8}  # prefill and decode ran through both low-bit kernels
    assert met <= warmed, sorted(met - warmed)
