"""The OpenAI wire format: request models with OpenAI's validation behaviour, response and SSE builders.

Kept free of I/O so every shape a client sees is unit-testable. Range rules for sampling fields are
not restated here: they come from shared.sampling, so the gateway and the executor can never disagree
on what is valid (the engine checks stop token ids against the real vocabulary).
"""

import json
import secrets
import time
from typing import Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from shared.errors import InvalidRequestError
from shared.messages import LogprobEntry
from shared.sampling import SamplingOptions

MAX_COMPLETION_LOGPROBS = 20  # OpenAI allows 5; vLLM (and we) allow the engine's 20


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


# --- requests -------------------------------------------------------------------------------------
class StrictBody(BaseModel):
    """A request body part: unknown fields are a 400, as OpenAI's are."""
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictBody):
    include_usage: bool = False


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(StrictBody):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def flat(self) -> dict[str, Any]:
        """The message as the chat template expects it: content always a plain string."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class _Common(StrictBody):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def _check_common(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingOptions:
        # The fields both models share go across by name; an OpenAI null means the option's default.
        shared = {name: value for name in SamplingOptions.model_fields
                  if name in type(self).model_fields and (value := getattr(self, name)) is not None}
        try:
            return SamplingOptions.checked(**(shared | {"max_tokens": max_tokens, "logprobs": logprobs}))
        except InvalidRequestError as exc:
            raise bad_request(exc.message, exc.param) from exc

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = 16  # OpenAI's legacy default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad_request("only one prompt per request is supported; send one request per prompt",
                                  "prompt")
            p = p[0]
        if isinstance(p, list) and not p:
            raise bad_request("prompt must not be empty", "prompt")
        return p

    def sampling(self) -> SamplingOptions:
        self._check_common()
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is only supported when equal to n", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {self.logprobs}",
                              "logprobs")
        return self._sampling(self.max_tokens, self.logprobs)


# Passed to the chat template by the executor itself: a kwarg of the same name would collide with them.
TEMPLATE_ARGUMENTS = {"messages", "add_generation_prompt"}


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    if reserved := sorted(set(kwargs or {}) & TEMPLATE_ARGUMENTS):
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def sampling(self) -> SamplingOptions:
        self._check_common()
        if not self.messages:
            raise bad_request("messages must hold at least one message", "messages")
        check_template_kwargs(self.chat_template_kwargs)
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise bad_request('only response_format {"type": "text"} is supported', "response_format")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= self.top_logprobs <= 20:
                raise bad_request(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", "top_logprobs")
        # max_completion_tokens supersedes the deprecated max_tokens; neither means "until the context is full".
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        try:
            return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
        except ApiError as exc:
            if exc.param == "max_tokens":
                exc.param = param
            raise


def parse_request(body: Any, model: type[StrictBody]):
    """Validate a decoded JSON body, raising ApiError(400) with OpenAI's messages and `param`."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in body:
        if name not in model.model_fields:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
    for name, value in body.items():
        _check_wire_safe(name, value)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(part) for part in err["loc"]]
        if err["type"] == "missing":
            raise bad_request(f"Missing required parameter: '{loc[0]}'", loc[0]) from exc
        where = ".".join(loc)
        raise bad_request(f"Invalid value for '{where}': {err['msg']}", loc[0] if loc else None) from exc


def _check_wire_safe(name: str, value: Any) -> None:
    """The request travels to the executor as MessagePack, which cannot carry every JSON value:
    refuse those here as a 400 rather than failing to send them (a 500)."""
    try:
        msgpack.packb({name: value}, use_bin_type=True)
    except UnicodeEncodeError as exc:
        raise bad_request(f"Invalid value for '{name}': strings must be valid Unicode (no lone surrogates)",
                          name) from exc
    except OverflowError as exc:
        raise bad_request(f"Invalid value for '{name}': integers must be in [-2**63, 2**64 - 1]", name) from exc
    except ValueError as exc:  # msgpack's nesting limit
        raise bad_request(f"Invalid value for '{name}': {exc}", name) from exc


# --- responses ------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: list[LogprobEntry], offset: int = 0) -> dict:
    """The legacy completions format; `offset` is where the first token starts in the choice's text."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e.token)
        out["token_logprobs"].append(e.logprob)
        top = {t.token: t.logprob for t in e.top}
        top.setdefault(e.token, e.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(e.token)
    return out


def _chat_lp(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list[LogprobEntry]) -> dict:
    return {"content": [_chat_lp(e.token, e.logprob) | {"top_logprobs": [_chat_lp(t.token, t.logprob) for t in e.top]}
                        for e in entries]}


class Choice:
    """What the gateway accumulates for one of the n completions."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.logprobs: list[LogprobEntry] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.output_tokens = 0


def completion_response(rid: str, model: str, created: int, choices: list[Choice], prompt_tokens: int,
                        with_logprobs: bool) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.text,
                         "logprobs": completion_logprobs(c.logprobs) if with_logprobs else None,
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices],
            "usage": usage(prompt_tokens, sum(c.output_tokens for c in choices))}


def chat_response(rid: str, model: str, created: int, choices: list[Choice], prompt_tokens: int,
                  with_logprobs: bool) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": chat_logprobs(c.logprobs) if with_logprobs else None,
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices],
            "usage": usage(prompt_tokens, sum(c.output_tokens for c in choices))}


class ChunkBuilder:
    """SSE chunks of one streamed response, in the format of its endpoint."""

    def __init__(self, chat: bool, model: str, include_usage: bool, with_logprobs: bool):
        self.chat, self.model, self.include_usage, self.with_logprobs = chat, model, include_usage, with_logprobs
        self.id = new_id(chat)
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}

    def _chunk(self, choices: list[dict]) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            out["usage"] = None
        return out

    def role(self, index: int) -> str:
        """Chat streams open each choice with the assistant role, as OpenAI's do."""
        return sse(self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]))

    def delta(self, index: int, text: str, logprobs: list[LogprobEntry] | None, finish_reason: str | None,
              stop_reason: int | str | None = None) -> str:
        lp = None
        if self.with_logprobs:
            if self.chat:
                lp = chat_logprobs(logprobs or [])
            else:
                lp = completion_logprobs(logprobs or [], self._offsets.get(index, 0))
        self._offsets[index] = self._offsets.get(index, 0) + len(text)
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text or not finish_reason else {},
                      "logprobs": lp, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return sse(self._chunk([choice]))

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        chunk = self._chunk([])
        chunk["usage"] = usage(prompt_tokens, completion_tokens)
        return sse(chunk)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(err: ApiError) -> str:
    return sse(err.body())
