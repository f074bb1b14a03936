"""An OTLP/HTTP trace receiver on loopback for the tests: it answers what a
collector answers to ``POST /v1/traces`` (protobuf) and keeps every span
it was sent, decoded."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.loopback_http import LoopbackServer, QuietHandler


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


class OtlpReceiver(LoopbackServer):
    """Receives spans at ``url`` until ``close``."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:  # noqa: N802 - the server's method name
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                received = [ReceivedSpan(span.name, span.trace_id.hex(), span.span_id.hex(),
                                         span.parent_span_id.hex(), _values(span.attributes),
                                         _values(resource_spans.resource.attributes),
                                         span.start_time_unix_nano, span.end_time_unix_nano)
                            for resource_spans in request.resource_spans
                            for scope_spans in resource_spans.scope_spans for span in scope_spans.spans]
                with receiver.lock:
                    receiver.spans.extend(received)
                self.reply(200, "application/x-protobuf", ExportTraceServiceResponse().SerializeToString())

        super().__init__(Handler)
        self.url = f"{self.base}/v1/traces"

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
