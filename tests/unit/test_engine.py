"""The engine API as the executor service uses it, on a real model: what a user of it would notice."""

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.executor.engine.engine import LLMEngine
from shared.config import EngineConfig
from shared.core.errors import MemoryBudgetError, QueueFullError
from shared.errors import InvalidRequestError
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3

GREEDY = SamplingOptions(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama3(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def smol():
    return LLMEngine(EngineConfig(memory_budget=700 << 20, max_model_len=2048), progress=False)


def tiny(tiny_dir, **kw) -> LLMEngine:
    cfg = dict(model=str(tiny_dir), memory_budget=4 << 20, block_size=8, max_model_len=256,
               max_num_batched_tokens=64) | kw
    return LLMEngine(EngineConfig(**cfg), progress=False)


def drain(engine: LLMEngine) -> dict[str, list]:
    deltas: dict[str, list] = {}
    while engine.has_unfinished():
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
    return deltas


def assert_no_kv_in_use(engine: LLMEngine) -> None:
    snap = engine.stats().ledger
    assert snap.pages_kv_used == 0 and snap.pages_kv_free == snap.pages_kv
    engine.arena.ledger.check_consistency()


def test_budget_too_small_names_the_numbers(tiny_dir):
    with pytest.raises(MemoryBudgetError, match=r"decoder layers need \d+ pages .* raise the budget to at least"):
        tiny(tiny_dir, memory_budget=200 << 10)


def test_streamed_text_is_the_decoded_tokens_and_timestamps_advance(smol):
    prompt = smol.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}])
    smol.add_request("s", prompt, SamplingOptions(temperature=0.0, max_tokens=40))
    deltas = drain(smol)["s"]
    tokens = [t for d in deltas for t in d.token_ids]
    stamps = [t for d in deltas for t in d.timestamps]
    assert "".join(d.text for d in deltas) == smol.tokenizer.decode(tokens)
    assert stamps == sorted(stamps) and len(stamps) == len(tokens)
    assert deltas[-1].finished and deltas[-1].finish_reason in ("stop", "length")
    assert_no_kv_in_use(smol)


def test_stop_string_ends_generation_and_is_not_returned(smol):
    prompt = "The days of the week are Monday, Tuesday, Wednesday,"
    free = smol.generate([prompt], SamplingOptions(temperature=0.0, max_tokens=30))[0].outputs[0]
    assert "Friday" in free.text
    cut = smol.generate([prompt], SamplingOptions(temperature=0.0, max_tokens=30, stop=["Friday"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == "Friday"
    assert cut.text == free.text[:free.text.index("Friday")]


def test_stop_token_id_ends_generation(smol):
    prompt = "The days of the week are Monday, Tuesday, Wednesday,"
    free = smol.generate([prompt], SamplingOptions(temperature=0.0, max_tokens=12))[0].outputs[0]
    stop_at = free.token_ids[3]
    out = smol.generate([prompt], SamplingOptions(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]))
    first = out[0].outputs[0]
    assert first.finish_reason == "stop" and first.stop_reason == stop_at
    assert first.token_ids == free.token_ids[:free.token_ids.index(stop_at) + 1]


def test_seeded_sampling_is_reproducible_whatever_runs_beside_it(smol):
    params = SamplingOptions(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = smol.generate(["Tell me a story."], params)[0].outputs[0].token_ids
    crowd = smol.generate(["Tell me a story.", "Why is the sky blue?", "List three fruits."],
                          [params, SamplingOptions(temperature=1.0, max_tokens=15),
                           SamplingOptions(temperature=0.7, max_tokens=9)])
    assert crowd[0].outputs[0].token_ids == alone
    other = smol.generate(["Tell me a story."], SamplingOptions(temperature=1.0, top_p=0.95, seed=99,
                                                               max_tokens=20, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_n_completions_share_the_prompt_pages(smol):
    prompt = smol.tokenizer.encode("word " * 100)  # 100 tokens: 6 full blocks and a partial one
    params = SamplingOptions(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    smol.add_request("fan", prompt, params)
    deltas = []
    while not deltas:
        deltas = [d for d in smol.step() if d.token_ids]
    assert len(deltas) == 4
    assert smol.stats().ledger.pages_kv_used == 7  # one copy of the prompt's pages for all four sequences
    assert smol.stats().running == 4
    deltas += drain(smol)["fan"]
    texts = {i: [t for d in deltas if d.index == i for t in d.token_ids] for i in range(4)}
    assert all(len(t) == 8 for t in texts.values())
    assert len({tuple(t) for t in texts.values()}) > 1  # independent samples
    assert_no_kv_in_use(smol)


def test_logprobs_are_the_models_and_sorted(smol):
    out = smol.generate(["The capital of France is"], SamplingOptions(temperature=0.0, max_tokens=3, logprobs=5))
    lps = out[0].outputs[0].logprobs
    assert len(lps) == 3
    for lp in lps:
        assert len(lp.top) == 5
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob)  # greedy = most likely
        assert lp.logprob <= 0


def test_abort_anywhere_frees_everything(tiny_dir):
    engine = tiny(tiny_dir, max_num_batched_tokens=16)
    engine.add_request("waiting", list(range(3, 40)), GREEDY)
    engine.add_request("prefilling", list(range(3, 120)), GREEDY)
    engine.add_request("decoding", list(range(3, 10)), GREEDY)
    assert engine.abort("waiting")
    engine.step()
    assert engine.abort("prefilling")
    for _ in range(20):
        engine.step()
    assert engine.abort("decoding")
    assert not engine.abort("decoding") and not engine.abort("never-added")
    ends = [d for d in engine.step() if d.finished]
    assert {d.request_id for d in ends} == {"decoding"}  # each abort's final delta arrives once
    assert ends[0].finish_reason == "abort"
    assert not engine.has_unfinished()
    assert_no_kv_in_use(engine)
    assert engine.stats().aborted == 3


def test_deadline_expires_requests_and_frees_their_pages(tiny_dir):
    engine = tiny(tiny_dir)
    engine.add_request("late", list(range(3, 30)), SamplingOptions(temperature=0.0, max_tokens=200, ignore_eos=True),
                       deadline=time.time() + 0.05)
    engine.add_request("fine", list(range(3, 30)), GREEDY)
    deltas = drain(engine)
    assert deltas["late"][-1].finish_reason == "deadline"
    assert deltas["fine"][-1].finish_reason == "length"
    assert engine.stats().expired == 1
    assert_no_kv_in_use(engine)


def test_full_queue_and_invalid_requests_are_refused_without_side_effects(tiny_dir):
    engine = tiny(tiny_dir, max_waiting=2)
    engine.add_request("a", [5, 6], GREEDY)
    engine.add_request("b", [5, 6], GREEDY)
    with pytest.raises(QueueFullError):
        engine.add_request("c", [5, 6], GREEDY)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("d", [5] * 250, SamplingOptions(max_tokens=10))
    assert err.value.param == "max_tokens" and "maximum context length is 256" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("e", [10 ** 6], GREEDY)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("f", [5], SamplingOptions(stop_token_ids=[engine.model_config.vocab_size]))
    assert err.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError) as err:  # n sequences start together: more than fit would never run
        engine.add_request("g", [5], SamplingOptions(n=engine.config.max_num_seqs + 1))
    assert err.value.param == "n"
    with pytest.raises(InvalidRequestError):
        engine.add_request("a", [5], GREEDY)
    assert engine.stats().waiting == 2
    assert set(drain(engine)) == {"a", "b"}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 70), st.integers(1, 12), st.integers(1, 3)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
), min_size=1, max_size=25))
def test_any_interleaving_leaves_no_page_leaked_and_no_request_lost(tiny_dir, ops):
    """Tight memory (preemptions happen), forks, aborts: every admitted request ends exactly once."""
    engine = tiny(tiny_dir, memory_budget=(92 + 40) * 8192, max_num_batched_tokens=24, max_waiting=6)
    admitted, ended = [], {}
    for op in ops:
        if op[0] == "add":
            rid = f"r{len(admitted)}-{op[1]}"
            try:
                engine.add_request(rid, list(range(3, 3 + op[1])), SamplingOptions(
                    n=op[3], temperature=0.8, seed=1, max_tokens=op[2], ignore_eos=True))
                admitted.append(rid)
            except QueueFullError:
                pass
        elif op[0] == "abort" and admitted:
            engine.abort(admitted[op[1] % len(admitted)])
        else:
            for _ in range(op[1]):
                for d in engine.step():
                    if d.finished:
                        ended.setdefault(d.request_id, set()).add(d.index)
        engine.arena.ledger.check_consistency()
        held = {}
        for seqs in engine._requests.values():
            for s in seqs:
                for page in s.block_table:
                    held[page] = held.get(page, 0) + 1
        assert all(engine.arena.ledger.refcount(p) == n for p, n in held.items())
        assert engine.stats().ledger.pages_kv_used == len(held)
    while engine.has_unfinished():
        for d in engine.step():
            if d.finished:
                ended.setdefault(d.request_id, set()).add(d.index)
    assert set(ended) == set(admitted)
    assert_no_kv_in_use(engine)
