"""The OpenAI wire format: request validation (400 with OpenAI's message and param) and response builders."""

import json

import pytest

from services.gateway.openai_api import (SSE_DONE, ApiError, ChatCompletionRequest, ChunkBuilder, Choice,
                                         CompletionRequest, chat_response, completion_response, parse_request,
                                         sse_error)
from shared.messages import LogprobEntry, TopLogprob


def completion(**body):
    req = parse_request({"model": "m", "prompt": "hi"} | body, CompletionRequest)
    return req, req.sampling()


def chat(**body):
    req = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | body,
                        ChatCompletionRequest)
    return req, req.sampling()


def error_of(fn, **body) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(**body)
    assert info.value.status == 400
    return info.value


def test_completion_defaults_and_fields_reach_sampling():
    req, s = completion(max_tokens=5, temperature=0, stop="x", top_k=3, stop_token_ids=[7], seed=1, n=2)
    assert req.single_prompt() == "hi"
    assert (s.max_tokens, s.temperature, s.stop, s.top_k, s.stop_token_ids, s.seed, s.n) == (5, 0, ["x"], 3, [7], 1, 2)
    assert completion()[1].max_tokens == 16  # OpenAI's legacy default


@pytest.mark.parametrize("prompt,expected", [("a", "a"), (["a"], "a"), ([1, 2], [1, 2]), ([[3]], [3])])
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt)[0].single_prompt() == expected


def test_two_prompts_are_refused():
    req, _ = completion(prompt=["a", "b"])
    with pytest.raises(ApiError) as info:
        req.single_prompt()
    assert info.value.param == "prompt"


@pytest.mark.parametrize("body,param", [
    ({"temperature": 3}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"n": 0}, "n"),
    ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"), ({"logprobs": 21}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"frobnicate": 1}, "frobnicate"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids")])
def test_completion_errors_name_the_param(body, param):
    err = error_of(completion, **body)
    assert err.param == param
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_unknown_field_message_is_openais():
    assert error_of(completion, frobnicate=1).message == "Unrecognized request argument supplied: frobnicate"


def test_chat_rules():
    req, s = chat(max_completion_tokens=7, max_tokens=3, logprobs=True, top_logprobs=2)
    assert (s.max_tokens, s.logprobs) == (7, 2)
    assert chat()[1].max_tokens is None and chat()[1].logprobs is None
    assert error_of(chat, top_logprobs=2).param == "top_logprobs"
    assert error_of(chat, response_format={"type": "json_object"}).param == "response_format"
    assert error_of(chat, max_completion_tokens=0).param == "max_completion_tokens"
    assert error_of(chat, messages=[]).param == "messages"
    assert error_of(chat, messages=[{"role": "robot", "content": "x"}]).param == "messages"
    with pytest.raises(ApiError) as info:
        parse_request({"model": "m"}, ChatCompletionRequest)
    assert info.value.param == "messages" and "Missing required parameter" in info.value.message
    parts = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert parts[0].messages[0].flat() == {"role": "user", "content": "ab"}
    assert chat(response_format={"type": "text"})[1].n == 1


def _choice(text="hello", reason="stop"):
    c = Choice(0)
    c.text, c.finish_reason, c.output_tokens = text, reason, 2
    c.logprobs = [LogprobEntry(token_id=1, token="hel", logprob=-0.5, top=[TopLogprob(token_id=1, token="hel", logprob=-0.5),
                                                                           TopLogprob(token_id=2, token="x", logprob=-1.0)]),
                  LogprobEntry(token_id=3, token="lo", logprob=-0.1)]
    return c


def test_completion_response_shape_and_logprobs():
    out = completion_response("cmpl-1", "m", 5, [_choice()], 3, with_logprobs=True)
    assert out["object"] == "text_completion" and out["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                                                   "total_tokens": 5}
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == ["hel", "lo"] and lp["text_offset"] == [0, 3]
    assert lp["top_logprobs"][0] == {"hel": -0.5, "x": -1.0} and lp["token_logprobs"] == [-0.5, -0.1]


def test_chat_response_shape_and_logprobs():
    out = chat_response("chatcmpl-1", "m", 5, [_choice()], 3, with_logprobs=True)
    choice = out["choices"][0]
    assert out["object"] == "chat.completion" and choice["message"] == {"role": "assistant", "content": "hello"}
    first = choice["logprobs"]["content"][0]
    assert first["bytes"] == list(b"hel") and [t["token"] for t in first["top_logprobs"]] == ["hel", "x"]
    assert chat_response("c", "m", 5, [_choice()], 3, with_logprobs=False)["choices"][0]["logprobs"] is None


def _data(line: str):
    assert line.startswith("data: ") and line.endswith("\n\n")
    return json.loads(line[len("data: "):])


def test_sse_chunks():
    b = ChunkBuilder(chat=True, model="m", include_usage=True, with_logprobs=False)
    role = _data(b.role(0))
    assert role["object"] == "chat.completion.chunk" and role["choices"][0]["delta"]["role"] == "assistant"
    assert role["usage"] is None
    last = _data(b.delta(0, "hi", None, "stop"))
    assert last["choices"][0]["delta"] == {"content": "hi"} and last["choices"][0]["finish_reason"] == "stop"
    usage = _data(b.usage(3, 1))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 4
    assert SSE_DONE == "data: [DONE]\n\n"
    c = ChunkBuilder(chat=False, model="m", include_usage=False, with_logprobs=True)
    e = LogprobEntry(token_id=1, token="ab", logprob=-1.0)
    assert _data(c.delta(0, "ab", [e], None))["choices"][0]["logprobs"]["text_offset"] == [0]
    second = _data(c.delta(0, "cd", [e.model_copy(update={"token": "cd"})], None))
    assert second["choices"][0]["logprobs"]["text_offset"] == [2] and "usage" not in second
    err = _data(sse_error(ApiError(504, "late", "timeout", None, "deadline_exceeded")))
    assert err == {"error": {"message": "late", "type": "timeout", "param": None, "code": "deadline_exceeded"}}
