"""A span per check (sidecar.tracing), exported over OTLP/HTTP to a
receiver on loopback (tests/otlp.py): it continues the request's trace,
carries the rule, the outcome and a hash of the client's key (never the
address), and a span that cannot be made never fails the check."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sidecar.app import SluiceApp
from sidecar.engine import Engine
from sidecar.tracing import Tracing
from tests.otlp import OtlpReceiver
from tests.unit.conftest import FakeClock, connection_to, ruleset_from

RULES = """
rules:
  - id: one-a-minute
    key: [ip]
    limit: {requests: 1, per: 1m}
    action: block
"""
TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def nginx_check(client: str, traceparent: str | None = None) -> bytes:
    fields = [f"X-Sluice-Client-Addr: {client}", "X-Original-Method: GET", "X-Original-URI: /shop",
              "X-Original-Host: shop.example", "X-Request-Id: 1"]
    if traceparent is not None:
        fields.append(f"traceparent: {traceparent}")
    return ("GET /v1/nginx/auth HTTP/1.1\r\nHost: sluice\r\n" + "\r\n".join(fields) + "\r\n\r\n").encode()


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    found = OtlpReceiver()
    yield found
    found.close()


def answered(engine: Engine, *checks: bytes) -> list[bytes]:
    protocol, transport = connection_to(engine)
    for check in checks:
        protocol.data_received(check)
    return transport.written


def traced_engine(receiver: OtlpReceiver) -> Engine:
    engine = Engine(ruleset_from(RULES), clock=FakeClock())
    engine.tracing = Tracing(receiver.url, engine.derived_key(b"sluice trace keys"), "node-1")
    return engine


def test_each_check_is_a_span_of_the_requests_trace(receiver: OtlpReceiver) -> None:
    engine = traced_engine(receiver)

    written = answered(engine, nginx_check("192.0.2.7", f"00-{TRACE}-{PARENT}-01"),
                       nginx_check("192.0.2.7", f"00-{TRACE}-{PARENT}-01"), nginx_check("192.0.2.8"))
    engine.close()  # exports the last batch

    assert [answer.split(b"\r\n")[0] for answer in written] == [b"HTTP/1.1 200 OK", b"HTTP/1.1 403 Forbidden",
                                                                 b"HTTP/1.1 200 OK"]
    first, second, third = receiver.wait_for(3)
    assert (first.name, first.trace_id, first.parent_span_id) == ("sluice.check", TRACE, PARENT)
    assert first.attributes["sluice.outcome"] == "allow" and first.attributes["sluice.rule"] == ""
    assert second.attributes["sluice.outcome"] == "deny" and second.attributes["sluice.rule"] == "one-a-minute"
    assert first.attributes["sluice.front_door"] == "nginx"
    assert first.resource["service.name"] == "sluice" and first.resource["service.instance.id"] == "node-1"
    # The client's key, hashed: the same for one client, another for another, never the address.
    hashes = [span.attributes["sluice.client_key_hash"] for span in (first, second, third)]
    assert hashes[0] == hashes[1] != hashes[2]
    assert all("192.0.2" not in str(value) for span in (first, second, third) for value in span.attributes.values())
    # Without a traceparent, a trace of its own.
    assert third.trace_id != TRACE and third.parent_span_id == ""
    assert first.start_ns <= first.end_ns


@pytest.mark.parametrize("traceparent", ["junk", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", "00-xyz-abc-01",
                                         "ff" * 200])
def test_a_malformed_traceparent_starts_a_trace_of_its_own(receiver: OtlpReceiver, traceparent: str) -> None:
    engine = traced_engine(receiver)
    assert answered(engine, nginx_check("192.0.2.7", traceparent))[0].startswith(b"HTTP/1.1 200")
    engine.close()
    (span,) = receiver.wait_for(1)
    assert span.parent_span_id == ""


def test_a_trace_its_caller_did_not_sample_is_not_recorded(receiver: OtlpReceiver) -> None:
    engine = traced_engine(receiver)
    answered(engine, nginx_check("192.0.2.7", f"00-{TRACE}-{PARENT}-00"),
             nginx_check("192.0.2.9", f"00-{'1' * 32}-{PARENT}-01"))
    engine.close()
    assert [span.trace_id for span in receiver.wait_for(1)] == ["1" * 32]


def test_traces_sluice_starts_are_sampled_at_the_ratio(receiver: OtlpReceiver) -> None:
    engine = Engine(ruleset_from(RULES), clock=FakeClock())
    engine.tracing = Tracing(receiver.url, b"k" * 32, "node-1", ratio=0.0)
    answered(engine, *(nginx_check(f"192.0.2.{n}") for n in range(1, 20)),
             nginx_check("192.0.2.99", f"00-{TRACE}-{PARENT}-01"))
    engine.close()
    assert [span.trace_id for span in receiver.wait_for(1)] == [TRACE]


def test_a_span_that_cannot_be_made_never_fails_the_check(receiver: OtlpReceiver,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    engine = traced_engine(receiver)
    assert engine.tracing is not None

    def broken(*args: object) -> None:
        raise RuntimeError("exporter broken")

    monkeypatch.setattr(engine.tracing, "_record", broken)
    assert answered(engine, nginx_check("192.0.2.7"))[0].startswith(b"HTTP/1.1 200")
    assert engine.metrics.errors.value == 0
    engine.close()


def test_a_collector_that_is_down_costs_spans_not_checks() -> None:
    engine = Engine(ruleset_from(RULES), clock=FakeClock())
    engine.tracing = Tracing("http://127.0.0.1:9/v1/traces", b"k" * 32, "node-1")
    assert answered(engine, nginx_check("192.0.2.7"))[0].startswith(b"HTTP/1.1 200")
    engine.close()


def test_tracing_is_off_unless_asked() -> None:
    engine = Engine(ruleset_from(RULES), clock=FakeClock())
    assert engine.tracing is None
    assert SluiceApp(engine).engine.tracing is None
