"""The request flow of /v1/completions and /v1/chat/completions: validate, admit, relay tokens.

One flow serves both endpoints and both response modes, so that accounting (metrics, span
attributes), error mapping and cancellation cannot drift apart between them. Errors that happen
before the first byte is sent are ApiErrors (JSON bodies); after a stream has started they become an
SSE `data: {"error": ...}` event followed by `data: [DONE]`, since the status line is already out.
"""

import asyncio
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from opentelemetry import trace

from services.gateway.dispatch import Ticket, finish_error
from services.gateway.openai_api import (SSE_DONE, ApiError, ChatCompletionRequest, ChunkBuilder, Choice,
                                         CompletionRequest, chat_response, completion_response, new_id,
                                         parse_request, sse_error)
from shared.messages import GenerateRequest

if TYPE_CHECKING:  # the gateway imports this module
    from services.gateway.app import Gateway

log = logging.getLogger("morphling.gateway")

SPAN_SCOPE_KEY = "morphling.server_span"  # set by app.py's middleware in the ASGI scope
# Deeper bodies are refused: what reads them later (pydantic, MessagePack, the chat template) recurses and
# fails somewhere past a few hundred levels, and no real request nests anywhere near this.
MAX_JSON_DEPTH = 64


async def read_json(gw: "Gateway", request: Request):
    """The body as JSON, refusing more than gw.max_body_bytes even when no Content-Length was sent, and
    more than MAX_JSON_DEPTH levels of nesting."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > gw.max_body_bytes:
            raise too_large(gw)
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as exc:  # also covers invalid UTF-8 and nesting too deep for json
        raise ApiError(400, f"the request body is not valid JSON: {exc}", "invalid_request_error") from exc
    if nesting_exceeds(value, MAX_JSON_DEPTH):
        raise ApiError(400, f"the request body nests objects and arrays more than {MAX_JSON_DEPTH} levels deep",
                       "invalid_request_error")
    return value


def nesting_exceeds(value, limit: int) -> bool:
    """Whether JSON `value` has objects or arrays more than `limit` levels deep (the outermost is level 1);
    without recursion, since depth is the very thing in question."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def too_large(gw: "Gateway") -> ApiError:
    return ApiError(413, f"the request body exceeds {gw.max_body_bytes} bytes", "invalid_request_error",
                    None, "request_too_large")


async def generate(gw: "Gateway", request: Request, chat: bool):
    """Validate, admit, then answer with one JSON body or an SSE stream."""
    arrival = time.time()
    req = parse_request(await read_json(gw, request), ChatCompletionRequest if chat else CompletionRequest)
    sampling = req.sampling()
    span = request.scope.get(SPAN_SCOPE_KEY) or trace.get_current_span()
    span.set_attributes({"gen_ai.operation.name": "chat" if chat else "text_completion",
                         "gen_ai.request.model": req.model, "gen_ai.request.temperature": sampling.temperature,
                         "gen_ai.request.top_p": sampling.top_p})
    if sampling.max_tokens is not None:
        span.set_attribute("gen_ai.request.max_tokens", sampling.max_tokens)
    gw.dispatcher.check_model(req.model)
    gen = GenerateRequest(request_id=uuid.uuid4().hex, gateway=gw.config.gateway_id,
                          prompt=None if chat else req.single_prompt(),
                          messages=[m.flat() for m in req.messages] if chat else None,
                          chat_template_kwargs=(req.chat_template_kwargs or {}) if chat else {},
                          sampling=sampling, arrival_time=arrival, deadline=arrival + gw.config.request_timeout_s)
    ticket = await gw.dispatcher.submit(gen, req.model, trace.set_span_in_context(span))
    gw.metrics.queue.observe(ticket.admitted_at - arrival)
    with_logprobs = sampling.logprobs is not None
    if req.stream:
        builder = ChunkBuilder(chat, req.model, req.include_usage, with_logprobs)
        return StreamingResponse(_stream(gw, ticket, builder, span, arrival), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    choices, prompt_tokens = await _collect_unless_disconnected(gw, ticket, request, span, arrival)
    if choices is None:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    build = chat_response if chat else completion_response
    return build(new_id(chat), req.model, int(arrival), choices, prompt_tokens, with_logprobs)


class _Progress:
    """Per-request accounting shared by the streaming and non-streaming paths."""

    def __init__(self, gw: "Gateway", ticket: Ticket, span: trace.Span, arrival: float):
        self.gw, self.ticket, self.span, self.arrival = gw, ticket, span, arrival
        self.choices = [Choice(i) for i in range(ticket.request.sampling.n)]
        self.first_token_at: float | None = None
        self.last_ts: dict[int, float | None] = {}
        self.prompt_tokens = ticket.prompt_tokens

    def add(self, delta) -> None:
        if delta.token_ids and self.first_token_at is None:
            self.first_token_at = time.time()
            self.gw.metrics.ttft.observe(self.first_token_at - self.arrival)
        self.last_ts[delta.index] = self.gw.metrics.observe_token_times(self.last_ts.get(delta.index),
                                                                         delta.timestamps)
        c = self.choices[delta.index]
        c.text += delta.text
        c.logprobs += delta.logprobs or []
        c.output_tokens = max(c.output_tokens + len(delta.token_ids), delta.output_tokens)
        self.prompt_tokens = delta.prompt_tokens or self.prompt_tokens
        if delta.finished:
            c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
            if delta.finish_reason not in ("stop", "length"):
                raise finish_error(delta)

    def done(self) -> None:
        self.gw.metrics.e2e.observe(time.time() - self.arrival)
        self.span.set_attributes({
            "gen_ai.usage.input_tokens": self.prompt_tokens,
            "gen_ai.usage.output_tokens": sum(c.output_tokens for c in self.choices),
            "gen_ai.response.finish_reasons": [c.finish_reason or "error" for c in self.choices]})


async def _collect(gw: "Gateway", progress: _Progress) -> None:
    async for delta in gw.dispatcher.events(progress.ticket):
        try:
            progress.add(delta)
        except ApiError:
            gw.dispatcher.cancel(progress.ticket)  # the other n-1 completions are of no use now
            raise


async def _collect_unless_disconnected(gw: "Gateway", ticket: Ticket, request: Request, span, arrival: float):
    progress = _Progress(gw, ticket, span, arrival)

    async def disconnected() -> None:
        # With the body consumed, the next ASGI message is the disconnect (or the end of the response).
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(_collect(gw, progress))
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            gw.dispatcher.cancel(progress.ticket)
            log.info("client went away: cancelled %s", progress.ticket.request_id)
    if work.cancelled():
        return None, 0
    work.result()  # re-raises an ApiError
    progress.done()
    return progress.choices, progress.prompt_tokens


async def _stream(gw: "Gateway", ticket: Ticket, builder: ChunkBuilder, span, arrival: float):
    progress = _Progress(gw, ticket, span, arrival)
    complete = False
    try:
        if builder.chat:
            for i in range(len(progress.choices)):
                yield builder.role(i)
        async for delta in gw.dispatcher.events(ticket):
            try:
                progress.add(delta)
            except ApiError as err:
                span.set_status(trace.Status(trace.StatusCode.ERROR, err.message))
                yield sse_error(err)
                yield SSE_DONE
                return
            yield builder.delta(delta.index, delta.text, delta.logprobs,
                                delta.finish_reason if delta.finished else None, delta.stop_reason)
        complete = True
        progress.done()
        if builder.include_usage:
            yield builder.usage(progress.prompt_tokens, sum(c.output_tokens for c in progress.choices))
        yield SSE_DONE
    except ApiError as err:  # the executor died mid-stream, the deadline passed or the client fell behind
        span.set_status(trace.Status(trace.StatusCode.ERROR, err.message))
        yield sse_error(err)
        yield SSE_DONE
    finally:
        if not complete:  # disconnect, error or deadline: make sure the executor stops working on it
            gw.dispatcher.cancel(ticket)
