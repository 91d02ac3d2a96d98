import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared.telemetry import setup_tracing
from tests.nats_server import NatsServer


@pytest.fixture
def nats_server():
    server = NatsServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def spans():
    """Every span finished in this process from now on, as the in-memory exporter records them."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the global provider can be installed only once per process
        provider = setup_tracing("test")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter
