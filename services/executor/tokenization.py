"""Prompts as the engine sees them: chat rendering, and the /tokenize and /detokenize answers.

Admission and /tokenize render a chat through the same function, so the count /tokenize reports is
the prompt length a request with the same messages gets. Token ids are checked against the
vocabulary here because the gateway, which has no tokenizer, cannot.
"""

from shared.errors import InvalidRequestError
from shared.messages import DetokenizeReply, DetokenizeRequest, ErrorInfo, TokenizeReply, TokenizeRequest


def render(tokenizer, prompt: str | list[int] | None, messages: list[dict] | None, chat_template_kwargs: dict,
           add_generation_prompt: bool = True) -> str | list[int]:
    """The prompt text (or ids) of a completion or a chat; InvalidRequestError when neither or both are given."""
    if messages is not None:
        if prompt is not None:
            raise InvalidRequestError("give either prompt or messages, not both", param="messages")
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             **chat_template_kwargs)
    if prompt is None:
        raise InvalidRequestError("a request needs a prompt or messages", param="prompt")
    return prompt


def tokenize(tokenizer, executor: str, max_model_len: int, req: TokenizeRequest) -> TokenizeReply:
    try:
        text = render(tokenizer, req.prompt, req.messages, req.chat_template_kwargs, req.add_generation_prompt)
    except InvalidRequestError as exc:
        return TokenizeReply(executor=executor, error=_invalid(exc))
    ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    strs = [tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
    return TokenizeReply(executor=executor, tokens=ids, token_strs=strs, max_model_len=max_model_len)


def detokenize(tokenizer, executor: str, req: DetokenizeRequest) -> DetokenizeReply:
    bad = [t for t in req.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        error = InvalidRequestError(f"token ids must be in [0, {tokenizer.vocab_size}), got {bad[:5]}", "tokens")
        return DetokenizeReply(executor=executor, error=_invalid(error))
    return DetokenizeReply(executor=executor, prompt=tokenizer.decode(req.tokens, skip_special_tokens=False))


def _invalid(exc: InvalidRequestError) -> ErrorInfo:
    return ErrorInfo(type="invalid_request_error", message=exc.message, param=exc.param)
