"""A span per check, exported over OTLP/HTTP: off unless ``sluice serve
--otlp-endpoint`` (``SLUICE_OTLP_ENDPOINT``) names a collector.

Each check's span continues the trace of the request it is about: the
proxy passes the client's ``traceparent`` (and ``tracestate``) with the
check, as nginx and Envoy pass every request header. The span is named
``sluice.check`` and carries:

- ``sluice.front_door``: nginx, envoy, envoy_grpc, forward_auth;
- ``sluice.outcome``: allow, deny, close, ...;
- ``sluice.rule``: the rule whose headers the answer carries ("" for none);
- ``sluice.client_key_hash``: the client's counting key (its address, or
  its /64) under a keyed hash, as the decision log hashes keys: the same
  client gives the same value on a node, and the value never gives the
  address back. No clear key, address or header value is exported.

Spans are batched and exported by the SDK's own thread
(``BatchSpanProcessor``), so a check pays for building its span only
(about 25 µs of the SDK's Python: see bench/bench_identity.py); a
collector that is down costs dropped spans, never a check. A request whose
caller did not sample its trace (``traceparent`` flags 00) gets a span
that is not recorded, and a trace Sluice starts itself is sampled at
``--otlp-sample-ratio``. With tracing off, the doors hold None and build
nothing.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sidecar.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from sidecar.engine import Decision
    from sidecar.request import CheckRequest

log = logging.getLogger("sluice")

# How often the batch goes out, at most (the SDK's default is 5 s).
EXPORT_EVERY_MS = 1000


class Tracing:
    """Records checks as spans and exports them (``exporter``: OTLP/HTTP
    to ``endpoint`` unless another is given, as the tests and benches do)."""

    def __init__(self, endpoint: str, hash_key: bytes, node: str, exporter: SpanExporter | None = None,
                 ratio: float = 1.0) -> None:
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, timeout=5)
        # A trace the caller sampled is recorded, one it did not is not
        # (its span costs a fraction); a trace Sluice starts is with ``ratio``.
        self.provider = TracerProvider(resource=Resource.create({"service.name": "sluice",
                                                                 "service.instance.id": node}),
                                       sampler=ParentBased(TraceIdRatioBased(ratio)))
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_EVERY_MS))
        self.tracer = self.provider.get_tracer("sluice")
        self.propagator = TraceContextTextMapPropagator()
        self._hash_key = hash_key
        self._failures = RateLimitedLog(log, 60)

    def key_hash(self, key: str) -> str:
        return hmac.new(self._hash_key, key.encode("utf-8", "surrogatepass"), "sha256").hexdigest()[:16]

    def record(self, front_door: str, request: CheckRequest, decision: Decision, started_ns: int,
               ended_ns: int) -> None:
        """The check's span, from ``started_ns`` to ``ended_ns`` (Unix
        nanoseconds), a child of the request's trace when it has one. A
        span that cannot be made is dropped, and logged at most once a
        minute: never the check's failure."""
        try:
            self._record(front_door, request, decision, started_ns, ended_ns)
        except Exception:
            self._failures.error("a check's span could not be recorded (reported once per minute)",
                                 exc_info=True)

    def _record(self, front_door: str, request: CheckRequest, decision: Decision, started_ns: int,
                ended_ns: int) -> None:
        parent = self.propagator.extract(_Carrier(request.headers))
        attributes: dict[str, Any] = {
            "sluice.front_door": front_door,
            "sluice.outcome": str(decision.outcome),
            "sluice.rule": decision.rule.id if decision.rule is not None else "",
            "sluice.client_key_hash": self.key_hash(request.client.key),
        }
        span = self.tracer.start_span("sluice.check", context=parent, kind=SpanKind.SERVER,
                                      attributes=attributes, start_time=started_ns)
        span.end(end_time=ended_ns)

    def close(self) -> None:
        """Export what is batched, and stop."""
        self.provider.shutdown()


class _Carrier(dict[str, str]):
    """The check's header map as the propagator reads it (lower-case names)."""

    def __init__(self, headers: Mapping[str, str]) -> None:
        super().__init__()
        for name in ("traceparent", "tracestate"):
            value = headers.get(name)
            if value is not None:
                self[name] = value
