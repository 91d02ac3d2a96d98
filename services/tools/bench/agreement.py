"""How closely a mode's served tokens follow full precision's: measured on the tokens, not looked up.

The rule, per request i of the trace (the same request with the same prompt in both runs):

- it is compared when it finished in both runs (`record.ok`), each run streamed a token for every
  token it generated, and both generated the same number n > 0 of them; otherwise it is skipped;
- prefix_i = (length of the common prefix of the two token lists) / n: how far the served output
  follows the full-precision greedy path before it first leaves it;
- match_i = (positions j where the two tokens are equal) / n.

Reported: `prefix_agreement` and `token_agreement`, the means of prefix_i and match_i over the
compared requests; `exact_share`, the share of them whose tokens are identical (prefix_i = 1);
`prefix_agreement_p10`, the 10th percentile of prefix_i (bench.metrics.percentile), the requests
that diverged earliest. None, not NaN, for each when no request was compared.

prefix is the strict measure. After the first divergence the two runs continue from different
texts, so match_i counts positions where the continuations line up again. It is reported beside
prefix to tell one flipped token whose run falls back into step (prefix low, match high) from an
output that drifted away for good (both low).

The reference is the same system serving the same requests greedily at full precision, under the
same open-loop batching, so that a difference comes from the precision setting and nothing else
(not another engine, another tokenizer or unbatched decoding). It is not noise-free: a batch's
float32 matmuls reduce in an order that depends on what else is in the batch, which can flip a
greedy choice between two tokens of nearly equal logit, and the full-precision run would show
that against itself if it ran twice. The reference's agreement with itself is 1.0 by definition
(`agreement(ref, ref)` gives exactly that); the noise floor is measured separately, by running
fp16 twice and comparing the two runs with this same function.

Tokens are compared by their text, each token decoded alone, since OpenAI's completions logprobs
carry no token ids. Distinct tokens with the same text compare equal: notably byte tokens that are
part of one UTF-8 character each decode to "\\ufffd". That can only overstate agreement, and only
at such tokens.

`mean_logprob` is context, not a quality score: each mode's tokens are scored by that mode's own
model, which can be confident about a token full precision would not have chosen.
"""

from services.tools.bench.client import RequestRecord
from services.tools.bench.metrics import percentile


def _comparable(served: RequestRecord, reference: RequestRecord) -> bool:
    return (served.ok and reference.ok
            and len(served.tokens) == served.completion_tokens and len(reference.tokens) == reference.completion_tokens
            and len(served.tokens) == len(reference.tokens) > 0)


def common_prefix(a: list[str], b: list[str]) -> int:
    """The number of leading positions where `a` and `b` hold the same token."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def matches(a: list[str], b: list[str]) -> int:
    """The number of positions where `a` and `b` hold the same token."""
    return sum(1 for x, y in zip(a, b) if x == y)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def agreement(served: list[RequestRecord], reference: list[RequestRecord], reference_name: str) -> dict:
    """How closely `served` follows `reference`, request by request (the rule in the module docstring);
    `reference_name` (e.g. "fp16") is reported with it."""
    if len(served) != len(reference):
        raise ValueError(f"{len(served)} served requests against {len(reference)} in the reference: not the same trace")
    prefix: list[float] = []
    match: list[float] = []
    for s, r in zip(served, reference):
        if s.index != r.index:
            raise ValueError(f"request {s.index} paired with reference request {r.index}")
        if _comparable(s, r):
            n = len(s.tokens)
            prefix.append(common_prefix(s.tokens, r.tokens) / n)
            match.append(matches(s.tokens, r.tokens) / n)
    return {"requests_compared": len(prefix), "requests_skipped": len(served) - len(prefix),
            "prefix_agreement": _mean(prefix), "token_agreement": _mean(match),
            "exact_share": _mean([1.0 if p == 1.0 else 0.0 for p in prefix]),
            "prefix_agreement_p10": percentile(prefix, 10), "reference": reference_name}


def mean_logprob(records: list[RequestRecord]) -> float | None:
    """The served model's own mean log-prob per token, over every token of the finished requests."""
    return _mean([lp for r in records if r.ok for lp in r.token_logprobs])
