"""A request continued from the tokens another executor already sent: the client must not tell the
difference. Same tokens, same text (held-back text included), same seeded draws, same length limit."""

import pytest

from services.executor.engine.engine import LLMEngine
from shared.config import EngineConfig
from shared.errors import InvalidRequestError
from shared.messages import ResumedCompletion
from shared.sampling import SamplingOptions


@pytest.fixture(scope="module")
def smol():
    return LLMEngine(EngineConfig(memory_budget=700 << 20, max_model_len=2048), progress=False)


def run(engine: LLMEngine, request_id: str, prompt, params: SamplingOptions, resume=None) -> dict[int, list]:
    """The deltas of each completion, in order."""
    engine.add_request(request_id, prompt, params, resume=resume)
    out: dict[int, list] = {}
    while engine.has_unfinished():
        for d in engine.step():
            out.setdefault(d.index, []).append(d)
    return out


def cut(deltas: list, sent: int) -> ResumedCompletion:
    """What a client holds after the first `sent` deltas of a completion."""
    return ResumedCompletion(index=deltas[0].index, token_ids=[t for d in deltas[:sent] for t in d.token_ids],
                             text_chars=sum(len(d.text) for d in deltas[:sent]))


def joined(before: list, after: list) -> tuple[list[int], str, str | None]:
    deltas = before + after
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas[-1].finish_reason


@pytest.fixture(scope="module")
def chat(smol):
    return smol.tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers of Europe."}])


def test_a_greedy_completion_continued_elsewhere_is_the_undisturbed_one(smol, chat):
    params = SamplingOptions(temperature=0.0, max_tokens=30, ignore_eos=True)
    whole = run(smol, "whole", chat, params)[0]
    for sent in (1, 7, 29):
        rest = run(smol, f"resumed-{sent}", chat, params, resume=[cut(whole, sent)])[0]
        assert joined(whole[:sent], rest) == joined(whole, [])
        assert rest[-1].num_output_tokens == 30  # max_tokens counts the tokens sent before


def test_seeded_n_completions_continue_with_their_own_draws(smol, chat):
    params = SamplingOptions(temperature=0.9, top_p=0.95, seed=11, n=3, max_tokens=24, ignore_eos=True,
                             presence_penalty=0.5)
    whole = run(smol, "seeded", chat, params)
    # Completion 1 had finished and is not continued; 0 and 2 were cut at different points.
    rest = run(smol, "seeded-resumed", chat, params, resume=[cut(whole[0], 5), cut(whole[2], 13)])
    assert set(rest) == {0, 2}
    assert joined(whole[0][:5], rest[0]) == joined(whole[0], [])
    assert joined(whole[2][:13], rest[2]) == joined(whole[2], [])


def test_held_back_text_comes_out_after_the_move(smol, chat):
    # A stop string that never matches still holds back its length - 1 characters at every step.
    params = SamplingOptions(temperature=0.0, max_tokens=20, ignore_eos=True, stop=["@@@@@@@@@@@@"])
    whole = run(smol, "held", chat, params)[0]
    resumed = cut(whole, 6)
    assert resumed.text_chars < len(smol.tokenizer.decode(resumed.token_ids))  # something was held back
    rest = run(smol, "held-resumed", chat, params, resume=[resumed])[0]
    assert joined(whole[:6], rest) == joined(whole, [])


@pytest.mark.parametrize("resume, param", [
    ([ResumedCompletion(index=0), ResumedCompletion(index=0)], "resume"),
    ([ResumedCompletion(index=2)], "resume"),
    ([ResumedCompletion(index=0, token_ids=[10**9])], "resume"),
    ([ResumedCompletion(index=0, token_ids=[1] * 8)], "resume"),
])
def test_an_impossible_resume_is_refused_and_admits_nothing(smol, chat, resume, param):
    params = SamplingOptions(temperature=0.0, max_tokens=8, n=2)
    with pytest.raises(InvalidRequestError) as err:
        smol.add_request("bad-resume", chat, params, resume=resume)
    assert err.value.param == param
    assert not smol.has_request("bad-resume") and not smol.has_unfinished()
