"""Sampler and SamplingOptions tests.

The sampler is the one place where a silent bug changes every answer without crashing, so these
tests pin its semantics against independent reference computations: greedy picks, seeded
reproducibility, the empirical distribution, each truncation rule, penalties, min_tokens, raw
logprobs, and the validation of every parameter. Random draws are always seeded so nothing flakes.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.executor.engine.scheduling.sampler import CANDIDATES, SamplingRow, _truncate, apply_penalties, sample
from shared.errors import InvalidRequestError
from shared.sampling import SamplingOptions

VOCAB = 50


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def row(params: SamplingOptions | None = None, seed: int | None = 0, prompt=(), output=(), eos=()):
    params = params or SamplingOptions()
    gen = None if params.greedy else torch.Generator().manual_seed(seed if seed is not None else 0)
    return SamplingRow(params, gen, list(prompt), list(output), tuple(eos))


def test_greedy_is_argmax_and_leaves_input_alone():
    logits = random_logits(6)
    before = logits.clone()
    out = sample(logits, [row(SamplingOptions(temperature=0.0)) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None
    assert torch.equal(logits, before)


def run_seeded(seed: int, mates: list[SamplingOptions], steps: int = 12) -> list[int]:
    """Token sequence of one seeded row (batched with `mates`) fed back over `steps` steps."""
    params = SamplingOptions(temperature=0.9, top_p=0.95, seed=seed)
    target = row(params, seed=seed, prompt=[1, 2, 3])
    others = [row(p, seed=100 + i, prompt=[4, 5]) for i, p in enumerate(mates)]
    tokens = []
    for step in range(steps):
        # The target's logits come from their own draw so batch-mates cannot perturb them.
        logits = torch.cat([random_logits(1, seed=step, scale=1.0), random_logits(len(others), seed=99)])
        out = sample(logits, [target, *others])
        tokens.append(out.token_ids[0])
        target.output_ids.append(out.token_ids[0])
    return tokens


def test_seeded_row_is_reproducible_whatever_its_batch_mates():
    alone = run_seeded(7, [])
    assert run_seeded(7, []) == alone
    mates = [
        SamplingOptions(temperature=0.0, logprobs=3),
        SamplingOptions(top_k=5, min_p=0.1, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingOptions(temperature=1.5, top_p=0.5, min_tokens=4),
    ]
    assert run_seeded(7, mates) == alone


def test_different_seeds_give_different_sequences_and_none_is_greedy():
    # Over 20 draws from near-flat logits two seeds agree at a step about once in a few dozen draws, so equal
    # sequences (or a seed ignored) would show; greedy would repeat each step's argmax.
    sequences = [run_seeded(seed, [], steps=20) for seed in range(8)]
    assert len({tuple(s) for s in sequences}) == len(sequences)
    greedy = [int(random_logits(1, seed=step, scale=1.0).argmax()) for step in range(20)]
    assert all(s != greedy for s in sequences)


@pytest.mark.parametrize(
    "params",
    [SamplingOptions(top_k=1), SamplingOptions(top_p=1e-6), SamplingOptions(min_p=1.0)],
    ids=["top_k=1", "top_p=tiny", "min_p=1"],
)
def test_extreme_truncation_equals_greedy(params):
    logits = random_logits(16, seed=3)
    rows = [row(params, seed=i) for i in range(16)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def empirical(logits_row: torch.Tensor, params: SamplingOptions, draws: int, seed: int) -> torch.Tensor:
    """Token frequencies over `draws` independent draws, batched with one shared generator."""
    gen = torch.Generator().manual_seed(seed)
    rows = [SamplingRow(params, gen, [], []) for _ in range(draws)]
    tokens = sample(logits_row.expand(draws, -1).contiguous(), rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.numel()).double() / draws


def test_frequencies_match_softmax_at_temperature_one():
    logits = random_logits(1, vocab=8, seed=11, scale=1.0)[0]
    draws = 20_000
    freq = empirical(logits, SamplingOptions(temperature=1.0), draws, seed=5)
    expected = logits.double().softmax(-1)
    chi_square = (draws * (freq - expected) ** 2 / expected).sum().item()
    # 7 degrees of freedom: P(chi2 > 40) is about 1e-6, and the draw is seeded anyway.
    assert chi_square < 40


def test_lower_temperature_sharpens():
    logits = random_logits(1, vocab=8, seed=12, scale=1.0)[0]
    top = logits.argmax().item()
    share = [empirical(logits, SamplingOptions(temperature=t), 5000, seed=1)[top] for t in (2.0, 1.0, 0.3)]
    assert share[0] < share[1] < share[2]


def test_apply_penalties_follows_the_formulas():
    logits = random_logits(3, vocab=10, seed=4)
    prompts = [[0, 1, 1], [2], []]
    outputs = [[1, 3, 3, 3], [], [5, 5]]
    rep, freq, pres = [1.5, 1.2, 1.0], [0.5, 0.0, -0.7], [0.25, 1.0, 0.3]
    got = apply_penalties(logits.clone(), prompts, outputs, rep, freq, pres)
    expected = logits.clone()
    for b in range(3):
        for token in range(10):
            value = expected[b, token].item()
            if token in prompts[b] or token in outputs[b]:
                value = value / rep[b] if value > 0 else value * rep[b]
            count = outputs[b].count(token)
            expected[b, token] = value - freq[b] * count - pres[b] * (count > 0)
    # (torch.testing.assert_close costs a second of lazy imports on its first call.)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_penalties_steer_sampling_but_not_logprobs():
    logits = random_logits(1, seed=9)
    best = logits.argmax().item()
    params = SamplingOptions(temperature=0.0, frequency_penalty=2.0, logprobs=0)
    out = sample(logits, [row(params, output=[best] * 10)])
    assert out.token_ids[0] != best
    expected = torch.log_softmax(logits[0], -1)[out.token_ids[0]].item()
    assert out.logprobs[0] == pytest.approx(expected, abs=1e-5)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = random_logits(1, seed=2)
    logits[0, 7] = 100.0  # eos
    logits[0, 9] = 90.0  # stop token id
    params = SamplingOptions(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    early = sample(logits, [row(params, output=[1], eos=(7,))]).token_ids[0]
    allowed = logits.clone()
    allowed[0, [7, 9]] = float("-inf")
    assert early == allowed.argmax().item()
    assert sample(logits, [row(params, output=[1, 2, 3], eos=(7,))]).token_ids == [7]


def test_logprobs_are_raw_log_softmax_and_top_lists_are_sorted():
    logits = random_logits(4, seed=6)
    params = [
        SamplingOptions(temperature=0.7, logprobs=5, repetition_penalty=1.8),
        SamplingOptions(logprobs=0),
        SamplingOptions(),
        SamplingOptions(temperature=0.0, logprobs=20),
    ]
    out = sample(logits, [row(p, seed=i, prompt=[1, 2]) for i, p in enumerate(params)])
    reference = torch.log_softmax(logits, -1)
    for i, p in enumerate(params):
        if p.logprobs is None:
            assert out.logprobs[i] is None and out.top_logprobs[i] is None
            continue
        assert out.logprobs[i] == pytest.approx(reference[i, out.token_ids[i]].item(), abs=1e-5)
        top = out.top_logprobs[i]
        assert len(top) == p.logprobs
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        for token, lp in top:
            assert lp == pytest.approx(reference[i, token].item(), abs=1e-5)
        if top:
            assert top[0][0] == logits[i].argmax().item()


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0), ("n", 129), ("n", True), ("temperature", -0.1), ("temperature", 3),
        ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2),
        ("min_p", -0.1), ("min_p", 1.5), ("presence_penalty", 2.5), ("presence_penalty", -3),
        ("frequency_penalty", 2.1), ("frequency_penalty", -2.1), ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.5), ("max_tokens", 0), ("max_tokens", -5), ("min_tokens", -1),
        ("min_tokens", 17), ("stop", [""]), ("stop", ["x"] * 17), ("stop", [3]), ("stop_token_ids", [-1]),
        ("logprobs", -1), ("logprobs", 21), ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.5),
        ("temperature", True), ("ignore_eos", "yes"),
    ],
)
def test_validation_names_the_bad_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingOptions.checked(**{field: value})
    assert err.value.param == field
    assert field in str(err.value)


def test_a_bus_message_with_bad_options_is_refused_by_the_same_rules():
    with pytest.raises(InvalidRequestError) as err:
        SamplingOptions.model_validate({"top_p": 0})
    assert err.value.param == "top_p"


def test_validation_accepts_boundaries():
    SamplingOptions()
    SamplingOptions(
        n=128, temperature=2, top_p=1, top_k=-1, min_p=1, presence_penalty=-2, frequency_penalty=2,
        repetition_penalty=2, max_tokens=None, min_tokens=1000, stop="end", stop_token_ids=[0, VOCAB - 1],
        logprobs=20, seed=2**64 - 1,
    )
    assert SamplingOptions(temperature=0.0).greedy and SamplingOptions(temperature=1e-6).greedy
    assert not SamplingOptions(temperature=0.01).greedy


def allowed_tokens(logits: torch.Tensor, p: SamplingOptions, slack: float = 1e-4) -> set[int]:
    """Independent float64 reference of what top-k, top-p and min-p leave. A positive `slack`
    forgives float32 rounding at the boundaries (a superset), a negative one demands a margin."""
    scaled = logits.double() / p.temperature
    ordered, order = scaled.sort(descending=True)
    if 0 < p.top_k < len(order):
        ordered, order = ordered[: p.top_k], order[: p.top_k]
    probs = ordered.softmax(-1)
    keep = probs.cumsum(-1) - probs < p.top_p + slack
    keep[0] = True
    probs = probs[keep] / probs[keep].sum()
    return set(order[keep][probs >= p.min_p * probs[0] - slack].tolist())


@pytest.mark.parametrize("scale", [0.1, 3.0], ids=["flat", "peaked"])
@pytest.mark.parametrize(
    "top_k, top_p",
    [(0, 0.9), (0, 0.3), (10, 1.0), (CANDIDATES, 0.95), (CANDIDATES + 500, 1.0), (CANDIDATES + 500, 0.8)],
)
def test_truncation_matches_a_full_sort(scale, top_k, top_p):
    # A vocabulary larger than CANDIDATES exercises both the candidate fast path and the fallback.
    vocab = 3 * CANDIDATES
    logits = random_logits(3, vocab=vocab, seed=top_k, scale=scale)
    params = SamplingOptions(top_k=top_k, top_p=top_p)
    kept = _truncate(
        logits.clone(),
        torch.full((3,), top_k if top_k > 0 else vocab),
        torch.full((3,), top_p if top_p < 1 else math.inf),
    )
    for i in range(3):
        got = set(torch.isfinite(kept[i]).nonzero().squeeze(1).tolist())
        assert allowed_tokens(logits[i], params, slack=-1e-4) <= got <= allowed_tokens(logits[i], params)
        assert torch.equal(kept[i][list(got)], logits[i][list(got)])


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.sampled_from([VOCAB, 3 * CANDIDATES]),
    temperature=st.floats(0.05, 2.0),
    top_p=st.floats(0.01, 1.0),
    top_k=st.sampled_from([-1, 0, 1, 2, 5, 20, VOCAB, CANDIDATES + 1, 10**6]),
    min_p=st.floats(0.0, 1.0),
    logits_seed=st.integers(0, 10_000),
    sample_seed=st.integers(0, 2**32),
    scale=st.floats(0.1, 10.0),
)
def test_any_valid_params_sample_an_allowed_token(
    vocab, temperature, top_p, top_k, min_p, logits_seed, sample_seed, scale
):
    params = SamplingOptions(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=sample_seed)
    logits = random_logits(4, vocab=vocab, seed=logits_seed, scale=scale)
    out = sample(logits, [row(params, seed=sample_seed + i) for i in range(4)])
    for i, token in enumerate(out.token_ids):
        assert 0 <= token < vocab
        assert token in allowed_tokens(logits[i], params)
