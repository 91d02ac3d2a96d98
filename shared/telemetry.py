"""OpenTelemetry set-up shared by every process, and W3C trace context in NATS headers.

Spans use the GenAI semantic-convention attribute names (gen_ai.*). Prompt text is never recorded
unless MORPHLING_TRACE_CONTENT=1. Spans are exported over OTLP/HTTP only when
OTEL_EXPORTER_OTLP_ENDPOINT is set; tests install their own in-memory exporter instead.
"""

import logging
import os

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

log = logging.getLogger(__name__)

RECORD_CONTENT = os.environ.get("MORPHLING_TRACE_CONTENT") == "1"


def setup_tracing(service: str, exporter: SpanExporter | None = None) -> TracerProvider:
    """Install a tracer provider for `service`; OTLP export if configured, or the given exporter."""
    provider = TracerProvider(resource=Resource.create({"service.name": f"morphling-{service}"}))
    if exporter is None and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
        log.info("exporting traces over OTLP to %s", os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"])
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """The `traceparent` (and `tracestate`) of `ctx`, or of the current span, as NATS headers."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def extract_context(headers: dict[str, str] | None) -> otel_context.Context:
    return propagate.extract(headers or {})
