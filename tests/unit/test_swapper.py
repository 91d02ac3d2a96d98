"""Layer swapping and KV resizing on a real engine: capacity moves exactly, requests never notice."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.executor.engine.engine import LLMEngine
from services.executor.engine.morphing.swapper import SwapError
from shared.config import EngineConfig
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3

GREEDY = SamplingOptions(temperature=0.0, max_tokens=20, ignore_eos=True)
PAGE = 8192  # the tiny model's page: 8 tokens x 4 layers x k|v x 2 kv heads x 16 dims x 4 bytes


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama3(tmp_path_factory.mktemp("tiny") / "model")


def tiny(tiny_dir, kv_pages: int, **kw) -> LLMEngine:
    probe = LLMEngine(EngineConfig(model=str(tiny_dir), memory_budget=4 << 20, block_size=8, max_model_len=128),
                      progress=False)
    slots = probe.stats().ledger.pages_slot
    cfg = dict(model=str(tiny_dir), memory_budget=(slots + kv_pages) * PAGE, block_size=8, max_model_len=64,
               max_num_batched_tokens=64) | kw
    return LLMEngine(EngineConfig(**cfg), progress=False)


def run(engine: LLMEngine, prompts, params=GREEDY, hook=None) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    step = 0
    while engine.has_unfinished():
        if hook:
            hook(engine, step)
        for d in engine.step():
            outs[d.request_id] += d.token_ids
        step += 1
    return list(outs.values())


PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 30, 9)]


def test_quantizing_grows_kv_by_exactly_the_released_pages_and_restoring_returns_them(tiny_dir):
    engine = tiny(tiny_dir, kv_pages=40)
    sw, before = engine.swapper, engine.stats().ledger
    slot = engine.arena.slot_pages
    assert sw.pages_for(4) < sw.pages_for(8) < slot
    report = sw.set_bits([0, 2], 8)
    after8 = engine.stats().ledger
    assert report.pages_released == 2 * (slot - sw.pages_for(8))
    assert after8.pages_kv == before.pages_kv + report.pages_released
    assert after8.pages_extension == report.pages_released and after8.pages_base == before.pages_base
    assert engine.model.layer_bits == [8, 32, 8, 32]
    report4 = sw.set_bits([0, 1, 2, 3], 4)
    assert report4.pages_released == 2 * (sw.pages_for(8) - sw.pages_for(4)) + 2 * (slot - sw.pages_for(4))
    back = sw.restore([0, 1, 2, 3])
    assert back.pages_reclaimed == 4 * (slot - sw.pages_for(4)) and back.blocks_relocated == 0
    assert engine.stats().ledger == before and engine.model.layer_bits == [32] * 4
    engine.arena.ledger.check_consistency()


def test_greedy_output_is_identical_before_a_quantize_and_after_the_restore(tiny_dir):
    engine = tiny(tiny_dir, kv_pages=40)
    original = run(engine, PROMPTS)
    engine.swapper.set_bits([0, 1, 2, 3], 4)
    quantized = run(engine, PROMPTS)
    assert quantized != original  # INT4 of a random tiny model shows
    engine.swapper.restore([0, 1, 2, 3])
    assert run(engine, PROMPTS) == original


def test_requests_keep_generating_across_quantize_and_restore(tiny_dir):
    engine = tiny(tiny_dir, kv_pages=40)

    def morph(engine, step):
        if step == 3:
            engine.swapper.set_bits([1, 2], 8)
        if step == 9:
            engine.swapper.restore([1, 2])

    outs = run(engine, PROMPTS, hook=morph)
    assert [len(o) for o in outs] == [20] * len(PROMPTS)  # nothing lost, nothing repeated
    assert engine.stats().ledger.pages_kv_used == 0


def test_restore_relocates_live_kv_and_outputs_match_a_run_that_did_not_need_to(tiny_dir):
    """Both runs do the same math (the same quantize, abort and restore at the same steps); only where
    the KV lives differs. With 12 KV pages the prompts fill the base pages and the rest spills into the
    pages quantization freed; the long request's end frees base pages, and the restore must move the
    live blocks out of the slots into them. The survivors fit the restored capacity, so no preemption
    (whose recomputation is numerically a hair different) muddies the comparison."""
    prompts = [list(range(3, 23)), list(range(30, 50)), list(range(60, 104)), list(range(110, 120))]
    params = SamplingOptions(temperature=0.0, max_tokens=8, ignore_eos=True)

    def morph(engine, step):
        if step == 0:
            engine.swapper.set_bits([0, 1, 2, 3], 4)
        if step == 3:
            engine.abort("r2")
        if step == 4:
            reports.append(engine.swapper.restore([0, 1, 2, 3]))

    reports = []
    roomy = run(tiny(tiny_dir, kv_pages=200), prompts, params, hook=morph)
    assert reports[-1].blocks_relocated == 0
    tight_engine = tiny(tiny_dir, kv_pages=12)
    tight = run(tight_engine, prompts, params, hook=morph)
    assert reports[-1].blocks_relocated > 0 and tight_engine.stats().preemptions == 0
    assert tight == roomy
    assert [len(o) for i, o in enumerate(tight) if i != 2] == [8, 8, 8]
    tight_engine.arena.ledger.check_consistency()


def test_a_restore_that_cannot_make_room_is_refused_and_changes_nothing(tiny_dir):
    engine = tiny(tiny_dir, kv_pages=8, max_num_seqs=8)
    engine.swapper.set_bits([0, 1, 2, 3], 4)  # the extension pages are used once the 8 base pages are
    for i in range(6):
        engine.add_request(f"r{i}", list(range(3, 40)), SamplingOptions(temperature=0.0, max_tokens=20,
                                                                        ignore_eos=True))
    for _ in range(4):
        engine.step()
    before, bits = engine.stats().ledger, list(engine.model.layer_bits)
    with pytest.raises(SwapError, match="live KV blocks"):
        engine.swapper.restore([0, 1, 2, 3])
    assert engine.stats().ledger == before and engine.model.layer_bits == bits
    with pytest.raises(SwapError):
        engine.swapper.set_bits([7], 8)
    with pytest.raises(SwapError):
        engine.swapper.set_bits([0], 3)


def test_counts_follow_the_swap_order_up_and_come_back_most_recent_first(tiny_dir):
    engine = tiny(tiny_dir, kv_pages=8)
    swapper, full = engine.swapper, engine.model.full_bits
    assert swapper.swap_order == [0, 1, 2, 3]  # until a profile is set
    swapper.swap_order = [2, 0, 3, 1]
    assert swapper.next_layers(2, 8) == [2, 0]
    swapper.set_bits([2, 0], 8)
    assert swapper.next_layers(3, 4) == [2, 0, 3]  # narrower: the INT8 layers first, in order, then on
    assert swapper.next_layers(1, full) == [0]  # restoring walks back: the last one quantized first
    for bad in ([0, 1, 2], [0, 0, 1, 2], [0, 1, 2, 3, 4]):
        with pytest.raises(SwapError, match="name each of the 4 layers once"):
            swapper.swap_order = bad
    assert swapper.swap_order == [2, 0, 3, 1]
    with pytest.raises(SwapError, match="between 1 and 2"):
        swapper.next_layers(3, full)
    with pytest.raises(SwapError, match="between 1 and 2"):
        swapper.next_layers(0, full)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 3)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 20)),
    st.tuples(st.just("bits"), st.sets(st.integers(0, 3), min_size=1), st.sampled_from([8, 4, 32])),
), min_size=1, max_size=25))
def test_any_interleaving_of_requests_swaps_and_aborts_keeps_pages_exact(tiny_dir, ops):
    engine = tiny(tiny_dir, kv_pages=12, max_num_seqs=6, max_waiting=8)
    added = []
    for op in ops:
        if op[0] == "add":
            try:
                engine.add_request(f"r{len(added)}", list(range(3, 3 + op[1])),
                                   SamplingOptions(n=op[2], temperature=0.5, seed=3, max_tokens=8, ignore_eos=True))
                added.append(f"r{len(added)}")
            except Exception as exc:  # a full queue is a legal answer; anything else is a failure
                assert type(exc).__name__ == "QueueFullError"
        elif op[0] == "abort" and added:
            engine.abort(added[op[1] % len(added)])
        elif op[0] == "bits":
            try:
                engine.swapper.set_bits(sorted(op[1]), op[2])
            except SwapError as exc:
                assert "live KV" in str(exc)
        else:
            for _ in range(op[1]):
                engine.step()
        ledger = engine.arena.ledger
        ledger.check_consistency()
        held: dict[int, int] = {}
        for seq in engine.scheduler.running:
            for page in seq.block_table:
                assert ledger.slot_of(page) is None
                held[page] = held.get(page, 0) + 1
        assert all(ledger.refcount(p) == n for p, n in held.items())
        assert ledger.snapshot().pages_kv_used == len(held)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().ledger.pages_kv_used == 0
