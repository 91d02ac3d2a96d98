"""`morphling bench`'s measured quality: agreement with the reference's tokens, and the client's reading
of the gateway's streamed logprobs, on hand-made records and chunks of the gateway's own shape."""

import json

import pytest

from services.gateway.openai_api import ChunkBuilder, CompletionRequest, parse_request
from services.tools.bench.agreement import agreement, mean_logprob
from services.tools.bench.client import RequestRecord, read_chunk, request_body
from services.tools.bench.trace import TraceRequest
from shared.messages import LogprobEntry

TEN = list("abcdefghij")


def record(i: int, tokens: list[str], error: str | None = None, completion_tokens: int | None = None,
           logprobs: list[float] | None = None) -> RequestRecord:
    """A request that finished (unless `error`) having streamed `tokens`."""
    n = len(tokens) if completion_tokens is None else completion_tokens
    return RequestRecord(i, float(i), 10, n, sent_s=float(i), completion_tokens=n, tokens=list(tokens),
                         token_logprobs=logprobs if logprobs is not None else [-0.5] * len(tokens),
                         done_s=None if error else i + 1.0, error=error)


def test_identical_outputs_agree_fully():
    ref = [record(0, TEN), record(1, list("xyz"))]
    served = [record(0, TEN), record(1, list("xyz"))]
    assert agreement(served, ref, "fp16") == {
        "requests_compared": 2, "requests_skipped": 0, "prefix_agreement": 1.0, "token_agreement": 1.0,
        "exact_share": 1.0, "prefix_agreement_p10": 1.0, "reference": "fp16"}
    assert agreement(ref, ref, "fp16")["prefix_agreement"] == 1.0  # the reference against itself


def test_divergence_at_position_3_of_10():
    diverged = list("abcXefgYij")  # positions 3 and 7 differ: a prefix of 3, 8 of 10 equal
    result = agreement([record(0, diverged)], [record(0, TEN)], "fp16")
    assert result["prefix_agreement"] == pytest.approx(0.3)
    assert result["token_agreement"] == pytest.approx(0.8)
    assert result["exact_share"] == 0.0
    assert result["prefix_agreement_p10"] == pytest.approx(0.3)


def test_means_and_p10_over_requests():
    ref = [record(0, TEN), record(1, TEN)]
    served = [record(0, list("abcXefgYij")), record(1, TEN)]
    result = agreement(served, ref, "fp16")
    assert result["requests_compared"] == 2
    assert result["prefix_agreement"] == pytest.approx((0.3 + 1.0) / 2)
    assert result["token_agreement"] == pytest.approx((0.8 + 1.0) / 2)
    assert result["exact_share"] == 0.5
    assert result["prefix_agreement_p10"] == pytest.approx(0.3 + 0.1 * (1.0 - 0.3))  # interpolated, numpy's way


def test_failed_requests_are_skipped():
    ref = [record(0, TEN), record(1, TEN), record(2, list("abc"))]
    served = [record(0, list("Xbcdefghij"), error="HTTP 503: busy"), record(1, TEN), record(2, list("abc"))]
    ref[2].error = "unfinished 60 s after the last arrival (drain timeout)"
    result = agreement(served, ref, "fp16")
    assert (result["requests_compared"], result["requests_skipped"]) == (1, 2)
    assert result["prefix_agreement"] == 1.0


def test_mismatched_lengths_are_skipped():
    ref = [record(0, TEN), record(1, TEN[:9]), record(2, list("abc"))]
    served = [record(0, TEN[:9]),  # another number of tokens than the reference
              record(1, TEN[:9], completion_tokens=10),  # 10 generated, but the stream carried 9
              record(2, list("abX"))]
    result = agreement(served, ref, "int4")
    assert (result["requests_compared"], result["requests_skipped"]) == (1, 2)
    assert result["prefix_agreement"] == pytest.approx(2 / 3)
    assert result["reference"] == "int4"


@pytest.mark.parametrize("served, ref", [
    ([record(0, TEN, error="boom")], [record(0, TEN)]),
    ([record(0, [])], [record(0, [])]),  # nothing generated: nothing to agree on
    ([], []),
])
def test_nothing_comparable_gives_none_not_nan(served, ref):
    assert agreement(served, ref, "fp16") == {
        "requests_compared": 0, "requests_skipped": len(served), "prefix_agreement": None, "token_agreement": None,
        "exact_share": None, "prefix_agreement_p10": None, "reference": "fp16"}


def test_runs_of_different_traces_are_refused():
    with pytest.raises(ValueError, match="not the same trace"):
        agreement([record(0, TEN)], [], "fp16")
    with pytest.raises(ValueError, match="paired with"):
        agreement([record(1, TEN)], [record(0, TEN)], "fp16")


def test_mean_logprob_is_per_token_over_finished_requests():
    records = [record(0, list("ab"), logprobs=[-1.0, -2.0]), record(1, list("c"), logprobs=[-3.0]),
               record(2, list("d"), logprobs=[-100.0], error="HTTP 500: oops")]
    assert mean_logprob(records) == pytest.approx(-2.0)  # (-1 - 2 - 3) / 3, not the mean of per-request means
    assert mean_logprob([records[2]]) is None
    assert mean_logprob([]) is None


# --- the client's reading of the stream ------------------------------------------------------------

# Completions chunks as the gateway's ChunkBuilder streams them with "logprobs": 0 and include_usage.
HELD_BACK = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "usage": None,
             "choices": [{"index": 0, "text": "",  # half a UTF-8 character: the text waits, the token does not
                          "logprobs": {"tokens": ["\ufffd"], "token_logprobs": [-0.25],
                                       "top_logprobs": [{"\ufffd": -0.25}], "text_offset": [0]},
                          "finish_reason": None}]}
LAST = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "usage": None,
        "choices": [{"index": 0, "text": "é x",
                     "logprobs": {"tokens": ["\ufffd", " x"], "token_logprobs": [-0.5, -1.0],
                                  "top_logprobs": [{"\ufffd": -0.5}, {" x": -1.0}], "text_offset": [0, 1]},
                     "finish_reason": "length", "stop_reason": None}]}
USAGE = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [],
         "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def test_read_chunk_takes_tokens_from_logprobs_even_when_text_is_held_back():
    r = RequestRecord(0, 0.0, 5, 3, sent_s=0.0)
    for now, chunk in [(0.1, HELD_BACK), (0.2, LAST), (0.25, USAGE)]:
        read_chunk(chunk, r, now)
    assert r.tokens == ["\ufffd", "\ufffd", " x"]
    assert r.token_logprobs == [-0.25, -0.5, -1.0]
    assert r.chunk_s == [0.1, 0.2]  # the usage chunk carries no token
    assert r.completion_tokens == 3
    assert r.error is None


def test_read_chunk_records_a_stream_error():
    r = RequestRecord(0, 0.0, 5, 3, sent_s=0.0)
    read_chunk({"error": {"message": "executor died", "type": "server_error", "param": None, "code": None}}, r, 0.1)
    assert r.error == "stream error: executor died"
    assert r.tokens == [] and r.chunk_s == []


def test_client_reads_what_the_gateway_streams():
    """The request the client sends is valid for the gateway and asks for the logprobs that the gateway's
    own chunk builder then streams; read back, they are every token in order."""
    body = request_body("m", TraceRequest(0.0, 3, 3), [1, 2, 3])
    req = parse_request(body, CompletionRequest)
    assert req.sampling().logprobs == 0 and req.stream and req.include_usage
    builder = ChunkBuilder(chat=False, model="m", include_usage=req.include_usage,
                           with_logprobs=req.sampling().logprobs is not None)
    events = [builder.delta(0, "", [LogprobEntry(token_id=7, token="\ufffd", logprob=-0.25)], None),
              builder.delta(0, "é", [LogprobEntry(token_id=8, token="\ufffd", logprob=-0.5)], None),
              builder.delta(0, " x", [LogprobEntry(token_id=9, token=" x", logprob=-1.0)], "length"),
              builder.usage(3, 3)]
    r = RequestRecord(0, 0.0, 3, 3, sent_s=0.0)
    for now, event in enumerate(events):
        read_chunk(json.loads(event.removeprefix("data: ")), r, float(now))
    assert (r.tokens, r.token_logprobs, r.chunk_s) == (["\ufffd", "\ufffd", " x"], [-0.25, -0.5, -1.0], [0.0, 1.0, 2.0])
    assert r.completion_tokens == 3
