"""vLLM's /tokenize and /detokenize: the served model's tokenizer, through an executor that holds it.

The gateway has no tokenizer (it never loads a model), so it asks an executor serving the model over
the bus. A chat is rendered with the model's template exactly as admission renders it, so `count` is
the prompt length a chat completion with the same messages would report.
"""

from typing import Any

from pydantic import StrictBool, StrictInt

from services.gateway.dispatch import unavailable
from services.gateway.openai_api import ApiError, ChatMessage, StrictBody, check_template_kwargs, parse_request
from shared import subjects
from shared.bus import BusError
from shared.core.router import choose_executor
from shared.messages import DetokenizeReply, DetokenizeRequest, TokenizeReply, TokenizeRequest


class TokenizeBody(StrictBody):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False


class DetokenizeBody(StrictBody):
    model: str
    tokens: list[StrictInt]


async def tokenize(dispatcher, body) -> dict:
    req = parse_request(body, TokenizeBody)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", "invalid_request_error", "prompt")
    check_template_kwargs(req.chat_template_kwargs)
    message = TokenizeRequest(prompt=req.prompt, messages=[m.flat() for m in req.messages] if req.messages else None,
                              add_special_tokens=req.add_special_tokens,
                              add_generation_prompt=req.add_generation_prompt,
                              chat_template_kwargs=req.chat_template_kwargs or {},
                              return_token_strs=req.return_token_strs)
    reply = await _ask(dispatcher, req.model, subjects.tokenize, message, TokenizeReply)
    return {"count": len(reply.tokens), "max_model_len": reply.max_model_len, "tokens": reply.tokens,
            "token_strs": reply.token_strs}


async def detokenize(dispatcher, body) -> dict:
    req = parse_request(body, DetokenizeBody)
    reply = await _ask(dispatcher, req.model, subjects.detokenize, DetokenizeRequest(tokens=req.tokens),
                       DetokenizeReply)
    return {"prompt": reply.prompt}


async def _ask(dispatcher, model: str, subject_of, message, reply_model):
    """The reply of the first executor serving `model` that answers; 400 for what it refused."""
    dispatcher.check_model(model)
    tried: set[str] = set()
    while (executor := choose_executor(dispatcher.state, tried, model)) is not None:
        tried.add(executor)
        try:
            reply = await dispatcher.bus.request(subject_of(executor), message, reply_model,
                                                 timeout=dispatcher.config.admission_timeout_s)
        except BusError:
            continue  # gone or busy: another executor of the model answers as well
        if reply.error is not None:
            if reply.error.type == "invalid_request_error":
                raise ApiError(400, reply.error.message, "invalid_request_error", reply.error.param)
            raise ApiError(500, reply.error.message, "server_error", None, "internal_error")
        return reply
    raise unavailable("no executor of the model answered", "no_executor")
