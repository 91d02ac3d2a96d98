"""The gateway process: FastAPI app (OpenAI endpoints, auth, limits, health, metrics) and its entry point.

Bodies are read and validated by hand instead of through FastAPI's parameter binding, because OpenAI
clients expect 400 with OpenAI's error shape (never FastAPI's 422) and a byte limit that also holds
for chunked uploads without a Content-Length.
"""

import argparse
import asyncio
import hmac
import inspect
import logging
import time
import uuid
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway import admin, tokenize
from services.gateway.completions import SPAN_SCOPE_KEY, generate, read_json, too_large
from services.gateway.dispatch import Dispatcher
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_api import ApiError, ChatCompletionRequest, CompletionRequest
from shared import subjects
from shared.bus import Bus, BusError
from shared.commands import CommandSender
from shared.config import GatewayConfig, seconds
from shared.core.router import serving
from shared.messages import GATEWAY_HEARTBEAT_S, Event, GatewayHeartbeat
from shared.telemetry import setup_tracing, tracer

log = logging.getLogger("morphling.gateway")

_ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/cluster", "/v1/cluster/morph",
              "/tokenize", "/detokenize", "/health", "/ready", "/metrics"}
_OPEN_WHILE_DRAINING = {"/health", "/metrics"}
_PROBES = {"/health", "/ready"}  # their 503s say how the gateway is, not that a request was turned away
_TOKENIZER_ROUTES = {"/tokenize", "/detokenize"}  # outside /v1 as in vLLM, but they take API keys like /v1
# Room the rest of a GenerateRequest (sampling options, ids, trace headers) needs beside the client's body
# in one bus message: bodies are limited to the bus's max_payload less this.
BUS_HEADROOM_BYTES = 64 << 10


class Gateway:
    """Per-app state shared by the middleware, the routes and main()'s graceful shutdown."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.metrics = GatewayMetrics()
        self.bus: Bus | None = None
        self.dispatcher: Dispatcher | None = None
        self.commands: CommandSender | None = None  # admin morph commands, issued as gateway-<id>
        self.draining = False
        self.in_flight = 0

    @property
    def max_body_bytes(self) -> int:
        """The body limit in force: the configured one, or less where the bus could not carry such a body
        to an executor (NATS's default max_payload, 1 MiB, is below the default limit)."""
        if self.bus is None:
            return self.config.max_body_bytes
        return max(0, min(self.config.max_body_bytes, self.bus.max_payload - BUS_HEADROOM_BYTES))


def _error(err: ApiError, retry_after: int | None = None) -> JSONResponse:
    """OpenAI's error body; 429s and 503s say when to retry, as clients (openai's among them) heed it."""
    headers = {"Retry-After": str(retry_after)} if err.status in (429, 503) and retry_after is not None else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _key_ok(header: str | None, keys: tuple[str, ...]) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    given = header[len("Bearer "):].strip().encode()
    # Compare against every key so the time taken does not reveal which one nearly matched.
    return any([hmac.compare_digest(given, k.encode()) for k in keys])


def _guard(gw: Gateway, request: Request) -> ApiError | None:
    """Draining, auth and declared body size, checked before any route runs."""
    path = request.url.path
    if gw.draining and path not in _OPEN_WHILE_DRAINING:
        return ApiError(503, "the gateway is shutting down", "server_error", None, "draining")
    if path.startswith("/v1/") or path in _TOKENIZER_ROUTES:
        # With any key configured, admin routes take only admin keys: an API key never changes the cluster.
        admin = path.startswith("/v1/cluster")
        auth_on = bool(gw.config.api_keys or gw.config.admin_keys)
        keys = gw.config.admin_keys if admin else gw.config.api_keys
        if auth_on and (admin or keys) and not _key_ok(request.headers.get("authorization"), keys):
            return ApiError(401, "Incorrect API key provided" + (" (admin routes need an admin key)" if admin else ""),
                            "invalid_request_error", None, "invalid_api_key")
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > gw.max_body_bytes:
        return too_large(gw)
    return None


class _Guard:
    """Pure ASGI middleware (not BaseHTTPMiddleware, which ends before a streamed body does): the
    server span, request counting for graceful drain, and the checks of _guard, around every request."""

    def __init__(self, app, gw: Gateway, otel: trace.Tracer):
        self.app, self.gw, self.otel = app, gw, otel

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        gw, path = self.gw, scope["path"]
        status = 500

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        with self.otel.start_as_current_span(f"{scope['method']} {path}", kind=trace.SpanKind.SERVER) as span:
            # The generation flow outlives the endpoint call when streaming: hand it the span itself.
            scope[SPAN_SCOPE_KEY] = span
            gw.in_flight += 1
            try:
                err = _guard(gw, Request(scope))
                if err is not None:
                    if path not in _PROBES:
                        gw.metrics.rejected.labels(err.code or err.type).inc()
                    await _error(err, gw.config.retry_after_s)(scope, receive, send_and_note)
                else:
                    await self.app(scope, receive, send_and_note)
            finally:
                gw.in_flight -= 1
                span.set_attribute("http.response.status_code", status)
                gw.metrics.requests.labels(path if path in _ENDPOINTS else "other", str(status)).inc()


_REF = "#/components/schemas/{model}"


def _body_schema(*models) -> dict:
    """The request body of a route that takes one of `models` (exactly one of them matches a valid body)."""
    schemas = [model.model_json_schema(ref_template=_REF) for model in models]
    for schema in schemas:
        schema.pop("$defs", None)  # hoisted into components by _openapi_with_bodies
    body = schemas[0] if len(schemas) == 1 else {"oneOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}}


def _openapi_with_bodies(app: FastAPI):
    """FastAPI's schema plus the nested models of the hand-parsed request bodies."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = build()
            for model in (CompletionRequest, ChatCompletionRequest, tokenize.TokenizeBody):
                defs = model.model_json_schema(ref_template=_REF).get("$defs", {})
                spec.setdefault("components", {}).setdefault("schemas", {}).update(defs)
            app.openapi_schema = spec
        return app.openapi_schema

    return openapi


async def _heartbeat(bus: Bus, gateway: str) -> None:
    """Say this gateway lives: the executors cancel the earlier requests of one that restarted."""
    beat = GatewayHeartbeat(gateway=gateway, incarnation=uuid.uuid4().hex[:12])
    while True:
        try:
            await bus.publish(subjects.GATEWAYS, beat)
        except BusError:  # down: the next beat is what counts
            pass
        await asyncio.sleep(GATEWAY_HEARTBEAT_S)


def create_app(config: GatewayConfig) -> FastAPI:
    gw = Gateway(config)
    otel = tracer("morphling.gateway")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not (config.api_keys or config.admin_keys):
            log.warning("no API keys configured: authentication is off")
        gw.bus = await Bus.connect(config.nats_url, f"gateway-{config.gateway_id}")
        gw.commands = CommandSender(gw.bus, f"gateway-{config.gateway_id}", admin.COMMAND_TIMEOUT_S,
                                    admin.COMMAND_RETRIES)
        gw.dispatcher = Dispatcher(gw.bus, config, gw.metrics, gw.commands)
        await gw.dispatcher.start()
        gw.bus.on_outage(config.bus_outage_s, lambda _: gw.dispatcher.bus_lost())
        beating = asyncio.create_task(_heartbeat(gw.bus, config.gateway_id))

        async def on_event(incoming) -> None:
            gw.metrics.observe_event(incoming.message)
        await gw.bus.subscribe(subjects.EVENTS, Event, on_event)
        log.info("gateway %s connected to %s", config.gateway_id, config.nats_url)
        yield
        beating.cancel()
        await gw.bus.close()

    # Recent FastAPI emits its own server spans; ours carry the GenAI attributes, so one set is enough.
    native = {"telemetry": {"tracing": False, "metrics": False, "logs": False}} \
        if "telemetry" in inspect.signature(FastAPI).parameters else {}
    app = FastAPI(title="Morphling", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  **native)
    app.state.gateway = gw

    app.add_middleware(_Guard, gw=gw, otel=otel)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, err: ApiError):
        if err.status in (404, 413, 429, 503) and request.url.path not in _PROBES:
            gw.metrics.rejected.labels(err.code or err.type).inc()
        return _error(err, config.retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        return _error(ApiError(400, first["msg"], "invalid_request_error", ".".join(map(str, first["loc"])) or None))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return _error(ApiError(exc.status_code, str(exc.detail), "invalid_request_error"), config.retry_after_s)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if gw.bus is None or not gw.bus.connected:
            raise ApiError(503, "not connected to the bus", "server_error", None, "bus_disconnected")
        if not gw.dispatcher.live_count():
            raise ApiError(503, "no live executor", "server_error", None, "no_executor")
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics():
        return Response(gw.metrics.render(), media_type=gw.metrics.content_type)

    @app.get("/v1/models")
    async def models():
        seen: dict[str, dict] = {}
        for e in serving(gw.dispatcher.state):
            t = e.telemetry
            entry = seen.setdefault(t.model, {"id": t.model, "object": "model", "created": int(t.time),
                                              "owned_by": "morphling", "max_model_len": t.max_model_len})
            entry["max_model_len"] = min(entry["max_model_len"], t.max_model_len)
        return {"object": "list", "data": list(seen.values())}

    @app.get("/v1/cluster")
    async def cluster():
        return admin.cluster_body(gw.dispatcher.state)

    @app.post("/v1/cluster/morph", openapi_extra=_body_schema(*admin.MORPH_BODIES))
    async def cluster_morph(request: Request):
        return await admin.morph(gw.dispatcher, gw.commands, await read_json(gw, request))

    # Bodies are parsed by hand (OpenAI's 400s, not FastAPI's 422s); the schema is still published so that
    # clients and fuzzers know the shape.
    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        return await generate(gw, request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await generate(gw, request, chat=True)

    @app.post("/tokenize", openapi_extra=_body_schema(tokenize.TokenizeBody))
    async def tokenize_prompt(request: Request):
        return await tokenize.tokenize(gw.dispatcher, await read_json(gw, request))

    @app.post("/detokenize", openapi_extra=_body_schema(tokenize.DetokenizeBody))
    async def detokenize_tokens(request: Request):
        return await tokenize.detokenize(gw.dispatcher, await read_json(gw, request))

    app.openapi = _openapi_with_bodies(app)

    return app


class _DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT keep listening but answer 503, let in-flight requests finish (up to
    drain_timeout_s), then shut down; a second signal shuts down at once."""

    def __init__(self, config: uvicorn.Config, gw: Gateway):
        super().__init__(config)
        self.gw = gw
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.gw.draining or self._loop is None:
            return super().handle_exit(sig, frame)
        self.gw.draining = True
        log.info("draining: refusing new requests, waiting for %d in flight", self.gw.in_flight)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.gw.config.drain_timeout_s
        while self.gw.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.gw.in_flight:
            log.warning("drain timeout: %d requests still in flight", self.gw.in_flight)
        self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="morphling gateway", description="Morphling's OpenAI-compatible gateway")
    parser.add_argument("--nats", help="NATS URL (default nats://127.0.0.1:4222)")
    parser.add_argument("--host", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8000)")
    parser.add_argument("--id", dest="gateway_id", help="gateway id on the bus (default gw0)")
    parser.add_argument("--failover-timeout", dest="failover_timeout_s", type=seconds(), metavar="SECONDS",
                        help="seconds a request whose executor was lost tries to move to another before its "
                             "stream ends with executor_lost (default 10)")
    parser.add_argument("--bus-outage", dest="bus_outage_s", type=seconds(), metavar="SECONDS",
                        help="end the requests in flight (503 bus_unavailable) once the bus has been gone this "
                             "long (default 3; env MORPHLING_BUS_OUTAGE_S)")
    parser.add_argument("--tp-scheduler", choices=("amoebas", "rr", "llf", "off"),
                        help="where requests go and which instances merge for a request that fits none (AMOEBAs): "
                             "amoebas, round-robin, least-load-first, or off (default amoebas)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {k: v for k, v in (("nats_url", args.nats), ("host", args.host), ("port", args.port),
                                   ("gateway_id", args.gateway_id),
                                   ("failover_timeout_s", args.failover_timeout_s),
                                   ("bus_outage_s", args.bus_outage_s), ("tp_scheduler", args.tp_scheduler))
                 if v is not None}
    config = GatewayConfig.from_env(**overrides)
    setup_tracing("gateway")
    app = create_app(config)
    server = _DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=args.log_level,
                                            timeout_graceful_shutdown=5, access_log=False), app.state.gateway)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    raise SystemExit(main())
