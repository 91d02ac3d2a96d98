"""Turns one engine step's logits into one token per running sequence.

A step samples up to 64 rows over a ~50k vocabulary on a small CPU, so every transform works on
the whole batch with per-row parameter tensors, and work no row asked for (penalties, sorting,
logprobs) is skipped outright: a greedy-only batch costs one argmax. Each row draws its noise
from its own generator, a fixed amount per step, so a seeded request reproduces its tokens
whatever it happens to be batched with. The order of the transforms follows vLLM so that the
same request gives the same distribution here and there.
"""

from dataclasses import dataclass

import torch

from shared.sampling import SamplingOptions

# How many best tokens per row top-k/top-p look at before falling back to a full sort.
CANDIDATES = 1024


@dataclass
class SamplingRow:
    params: SamplingOptions
    generator: torch.Generator | None  # None only for greedy rows; otherwise torch's global RNG
    prompt_ids: list[int]
    output_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()  # masked, with stop_token_ids, until min_tokens are out


@dataclass
class SampleOutput:
    token_ids: list[int]
    # Per row: the chosen token's log-prob, or None where the row did not ask; None when no row did.
    logprobs: list[float | None] | None = None
    # Per row: the `params.logprobs` most likely (token, log-prob), best first; None as above.
    top_logprobs: list[list[tuple[int, float]] | None] | None = None


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
    raw = logits.float()
    if not rows:
        return SampleOutput(token_ids=[])
    masked = _min_tokens_mask(rows)
    penalised = [_uses_penalties(row.params) for row in rows]
    # The raw logits must survive for logprobs, so edit a copy, and only when there are edits.
    work = raw.clone(memory_format=torch.contiguous_format) if masked or any(penalised) else raw
    if masked:
        row_idx, col_idx = zip(*masked)
        work[list(row_idx), list(col_idx)] = float("-inf")
    if any(penalised):
        # Rows without penalties get neutral values and no ids, so they cost nothing and stay exact.
        repeats = [p and r.params.repetition_penalty != 1.0 for r, p in zip(rows, penalised)]
        apply_penalties(
            work,
            [r.prompt_ids if rep else [] for r, rep in zip(rows, repeats)],
            [r.output_ids if p else [] for r, p in zip(rows, penalised)],
            [r.params.repetition_penalty for r in rows],
            [r.params.frequency_penalty for r in rows],
            [r.params.presence_penalty for r in rows],
        )
    token_ids = _choose(work, rows)
    logprobs, top_logprobs = _logprobs(raw, rows, token_ids)
    return SampleOutput(token_ids.tolist(), logprobs, top_logprobs)


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    repetition_penalty: list[float],
    frequency_penalty: list[float],
    presence_penalty: list[float],
) -> torch.Tensor:
    """Penalise contiguous `logits` [b, V] in place (and return it), one list entry per row.

    Repetition (HF/vLLM): a token seen in prompt or output has a positive logit divided by the
    penalty and a negative one multiplied, so the penalty always pushes it down. Frequency and
    presence (OpenAI) look at output tokens only: logit -= freq * count + presence * (count > 0).
    """
    # Only the few (row, token) pairs that occur are touched: a dense [b, V] count matrix would
    # cost more than the rest of the step on a small CPU.
    vocab = logits.shape[-1]
    flat = logits.view(-1)
    dev = logits.device
    out_keys, out_counts = _occurrences(output_ids, vocab, dev)
    if any(p != 1.0 for p in repetition_penalty):
        seen = torch.cat([out_keys, _occurrences(prompt_ids, vocab, dev)[0]]).unique()
        rep = torch.tensor(repetition_penalty, dtype=logits.dtype, device=dev)[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / rep, values * rep)
    if any(f != 0.0 for f in frequency_penalty) or any(p != 0.0 for p in presence_penalty):
        row = out_keys // vocab
        freq = torch.tensor(frequency_penalty, dtype=logits.dtype, device=dev)[row]
        pres = torch.tensor(presence_penalty, dtype=logits.dtype, device=dev)[row]
        flat[out_keys] -= freq * out_counts.to(logits.dtype) + pres
    return logits


def _uses_penalties(params: SamplingOptions) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def _min_tokens_mask(rows: list[SamplingRow]) -> list[tuple[int, int]]:
    """(row, token) pairs that must not be sampled because the row has not reached min_tokens."""
    pairs = []
    for i, row in enumerate(rows):
        if len(row.output_ids) < row.params.min_tokens:
            banned = set(row.eos_token_ids) | set(row.params.stop_token_ids)
            pairs.extend((i, token) for token in banned)
    return pairs


def _occurrences(ids: list[list[int]], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct flat indices row * vocab + token present in `ids`, and how often each occurs."""
    flat = [i * vocab + token for i, row in enumerate(ids) for token in row]
    keys = torch.tensor(flat, dtype=torch.long, device=device)
    return keys.unique(return_counts=True)


def _choose(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        return logits.argmax(dim=-1)
    chosen = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    greedy_idx = [i for i, g in enumerate(greedy) if g]
    random_idx = [i for i, g in enumerate(greedy) if not g]
    if greedy_idx:
        chosen[greedy_idx] = logits[greedy_idx].argmax(dim=-1)
    chosen[random_idx] = _sample_random(logits[random_idx], [rows[i] for i in random_idx])
    return chosen


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then an exponential race with each row's generator."""
    dev = logits.device
    vocab = logits.shape[-1]
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=dev)
    logits = logits / temperature.unsqueeze(1)  # a fresh tensor: the edits below stay local

    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    truncated = [i for i in range(len(rows)) if top_k[i] < vocab or top_p[i] < 1.0]
    if truncated:
        logits[truncated] = _truncate(
            logits[truncated],
            torch.tensor([top_k[i] for i in truncated], device=dev),
            # A row with top_p == 1 must keep its whole tail even if cumsum rounds above 1.
            torch.tensor([top_p[i] if top_p[i] < 1.0 else float("inf") for i in truncated], device=dev),
        )

    min_p = [r.params.min_p for r in rows]
    if any(m > 0.0 for m in min_p):
        probs = logits.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=dev).unsqueeze(1)
        logits.masked_fill_(probs < floor, float("-inf"))

    probs = logits.softmax(dim=-1)
    # argmax(p / E) with E ~ Exponential(1) picks token i with probability p_i (the Gumbel trick
    # in another guise) without the sync and sort torch.multinomial needs.
    noise = torch.empty_like(probs)
    for i, row in enumerate(rows):
        noise[i].exponential_(generator=row.generator)
    # An exact 0 draw would make 0/0 = NaN on a masked token, and argmax prefers NaN.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def skip_draws(generator: torch.Generator, vocab: int, steps: int) -> None:
    """Advance `generator` past the noise of `steps` sampled tokens, drawn as _sample_random draws it: a
    seeded request continued on another executor then samples what it would have sampled on the first."""
    noise = torch.empty(vocab, dtype=torch.float32, device=generator.device)
    for _ in range(steps):
        noise.exponential_(generator=generator)


def _truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask [b, V] logits outside each row's top-k, then outside its top-p nucleus.

    Sorting the whole vocabulary dominates a CPU step, while real nuclei are small: so first look
    only at each row's CANDIDATES best tokens, and fully sort just the rows whose top-k set or
    nucleus does not fit in them. Whether a row fits depends on that row alone, which keeps seeded
    rows reproducible whatever their batch-mates.
    """
    vocab = logits.shape[-1]
    width = min(CANDIDATES, vocab)
    values, ids = logits.topk(width, dim=-1)
    values, mass_before = _mask_sorted(values, top_k, top_p, logits if width < vocab else None)
    # A row fits if its top-k lies within the candidates, or, with top-k off, if top-p already
    # dropped the last candidate (and so everything after it).
    fits = (top_k <= width) | ((top_k >= vocab) & (mass_before[:, -1] >= top_p))
    out = torch.full_like(logits, float("-inf")).scatter_(-1, ids, values)
    if not fits.all():
        slow = (~fits).nonzero().squeeze(1)
        ordered, order = logits[slow].sort(dim=-1, descending=True)
        ordered, _ = _mask_sorted(ordered, top_k[slow], top_p[slow], None)
        out[slow] = torch.empty_like(ordered).scatter_(-1, order, ordered)
    return out


def _mask_sorted(values, top_k, top_p, full_logits):
    """Apply top-k then top-p to descending `values`; `full_logits` normalise rows without top-k
    when `values` hold only part of the vocabulary. Returns the masked values and the mass of
    the tokens before each position."""
    ranks = torch.arange(values.shape[-1], device=values.device).unsqueeze(0)
    values = values.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    norm = values.logsumexp(dim=-1)
    if full_logits is not None:
        norm = torch.where(top_k <= values.shape[-1], norm, full_logits.logsumexp(dim=-1))
    probs = (values - norm.unsqueeze(1)).exp()
    # Keeping tokens while the mass before them is < top_p yields the smallest prefix whose mass
    # reaches top_p, and the first token (mass 0) always survives.
    mass_before = probs.cumsum(dim=-1) - probs
    return values.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf")), mass_before


def _logprobs(raw: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor):
    """Chosen and top-k log-probs from the raw logits (vLLM's default "raw_logprobs" mode)."""
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not asked:
        return None, None
    logprobs = torch.log_softmax(raw[asked], dim=-1)
    chosen = logprobs.gather(1, token_ids[asked].unsqueeze(1)).squeeze(1).tolist()
    k_max = min(max(rows[i].params.logprobs for i in asked), raw.shape[-1])
    top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
    chosen_out: list[float | None] = [None] * len(rows)
    top_out: list[list[tuple[int, float]] | None] = [None] * len(rows)
    for j, i in enumerate(asked):
        chosen_out[i] = chosen[j]
        k = min(rows[i].params.logprobs, k_max)
        top_out[i] = list(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist())) if k else []
    return chosen_out, top_out
