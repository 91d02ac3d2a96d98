"""An OTLP/HTTP trace receiver for tests: what a collector would see of our spans, and nothing more.

It speaks the real protocol (OTLP 1.x over HTTP, binary protobuf): `POST /v1/traces` with
`Content-Type: application/x-protobuf`, optionally gzip- or deflate-encoded, decoded as an
`ExportTraceServiceRequest` and answered 200 with an empty `ExportTraceServiceResponse`. Point a
process's `OTEL_EXPORTER_OTLP_ENDPOINT` at `receiver.endpoint` and every span it exports lands in
`receiver.spans()` as a plain `ReceivedSpan`, with the service that sent it. Requests it cannot decode
are answered 4xx and kept in `receiver.refused`, so that a test can tell "nothing sent" from "sent
but malformed".
"""

import gzip
import threading
import time
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, TypeVar

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"

T = TypeVar("T")


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # 16 hex digits, or "" for a root span
    kind: str  # "SERVER", "CLIENT", "INTERNAL", "PRODUCER", "CONSUMER" or "UNSPECIFIED"
    attributes: dict[str, Any]
    start_ns: int  # Unix time in nanoseconds
    end_ns: int


def any_value(value: AnyValue) -> Any:
    """An OTLP AnyValue as the Python value it carries (arrays as lists, key-value lists as dicts)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which)


def decode(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
        service = resource.get("service.name", "")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    service=service, name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex(),
                    kind=Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                    attributes={kv.key: any_value(kv.value) for kv in span.attributes},
                    start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano))
    return spans


class OtlpReceiver:
    """The receiver on 127.0.0.1 and a free port, serving from a thread; a context manager."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self.refused: list[str] = []  # why each refused request was refused
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as exporters expect of a collector

            def do_POST(self) -> None:
                status, reason = receiver._handle(self.path, self.headers, self._body())
                payload = ExportTraceServiceResponse().SerializeToString() if status == 200 else reason.encode()
                self.send_response(status)
                self.send_header("Content-Type", PROTOBUF if status == 200 else "text/plain")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    parts = []
                    while size := int(self.rfile.readline().split(b";")[0].strip(), 16):
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return b"".join(parts)
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def log_message(self, format, *args) -> None:  # no access log on the test's stderr
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        """The base URL for OTEL_EXPORTER_OTLP_ENDPOINT (exporters append /v1/traces)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "OtlpReceiver":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _handle(self, path: str, headers, body: bytes) -> tuple[int, str]:
        if path != TRACES_PATH:
            return self._refuse(404, f"POST {path}: only {TRACES_PATH} is served")
        content_type = headers.get("Content-Type", "").split(";")[0].strip()
        if content_type != PROTOBUF:
            return self._refuse(415, f"Content-Type {content_type!r}: only {PROTOBUF} is accepted")
        encoding = headers.get("Content-Encoding", "identity").strip().lower()
        try:
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            elif encoding != "identity":
                return self._refuse(415, f"Content-Encoding {encoding!r} is not supported")
            request = ExportTraceServiceRequest.FromString(body)
        except (OSError, EOFError, zlib.error, DecodeError) as exc:
            return self._refuse(400, f"undecodable {encoding} body of {len(body)} bytes: {exc}")
        with self._changed:
            self._spans.extend(decode(request))
            self._changed.notify_all()
        return 200, "OK"

    def _refuse(self, status: int, reason: str) -> tuple[int, str]:
        with self._changed:
            self.refused.append(reason)
            self._changed.notify_all()
        return status, reason

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in the order of arrival."""
        with self._changed:
            return list(self._spans)

    def wait_for(self, check: Callable[[list[ReceivedSpan]], T], what: str, timeout: float = 10.0) -> T:
        """`check(spans)` once it is truthy, re-evaluated at each arrival; AssertionError after `timeout` s."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not (value := check(list(self._spans))):
                left = deadline - time.monotonic()
                assert left > 0, (f"timed out after {timeout:.0f} s waiting for {what}; received "
                                  f"{len(self._spans)} spans: {sorted({(s.service, s.name) for s in self._spans})}"
                                  + (f"; refused: {self.refused}" if self.refused else ""))
                self._changed.wait(left)
        return value
