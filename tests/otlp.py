"""An OTLP/HTTP trace receiver on loopback for the tests: it answers what a
collector answers to ``POST /v1/traces`` (protobuf) and keeps every span
it was sent, decoded."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    start_ns: int
    end_ns: int


def _values(attributes: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for attribute in attributes:
        which = attribute.value.WhichOneof("value")
        found[attribute.key] = getattr(attribute.value, which) if which else None
    return found


class OtlpReceiver:
    """Receives spans at ``url`` until ``close``."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the server's method name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                received = [ReceivedSpan(span.name, span.trace_id.hex(), span.span_id.hex(),
                                         span.parent_span_id.hex(), _values(span.attributes),
                                         _values(resource_spans.resource.attributes),
                                         span.start_time_unix_nano, span.end_time_unix_nano)
                            for resource_spans in request.resource_spans
                            for scope_spans in resource_spans.scope_spans for span in scope_spans.spans]
                with receiver.lock:
                    receiver.spans.extend(received)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def wait_for(self, count: int, seconds: float = 10.0) -> list[ReceivedSpan]:
        """The spans received, once there are ``count`` (or the time is up)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.spans) >= count:
                    return list(self.spans)
            time.sleep(0.02)
        with self.lock:
            return list(self.spans)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
