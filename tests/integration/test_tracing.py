"""A span per check through nginx and Envoy, exported over OTLP/HTTP to a
receiver on loopback (tests/otlp.py): Sluice runs with
SLUICE_OTLP_ENDPOINT, and each proxied request's span continues the trace
its client started."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from devstack.launcher import Stack
from tests.integration.clients import Client
from tests.integration.conftest import (
    fresh_client_address,
    front_door_port,
    stack_on,
    unique_path,
    wait_until,
)
from tests.otlp import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.integration

RULES = """
rules:
  - id: twice
    match: {path: {prefix: /traced/}}
    key: [ip, path]
    limit: {requests: 2, per: 1h}
    action: block
"""


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    found = OtlpReceiver()
    yield found
    found.close()


@pytest.fixture(scope="module")
def traced_stack(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("traced-stack")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLUICE_OTLP_ENDPOINT", receiver.url)  # read by the stack's Sluice as it starts
        with stack_on(directory, RULES) as stack:
            yield stack


def wait_for_trace(receiver: OtlpReceiver, trace: str, count: int) -> list[ReceivedSpan]:
    """The spans of one trace, once there are ``count`` (the batch goes
    out every second)."""
    found: list[ReceivedSpan] = []

    def arrived() -> bool:
        found[:] = [span for span in receiver.spans if span.trace_id == trace]
        return len(found) >= count

    wait_until(arrived, f"{count} spans of trace {trace}", 10)
    return found


@pytest.mark.parametrize("front_door", ["nginx", "envoy", "envoy-grpc"])
def test_each_check_continues_the_clients_trace(traced_stack: Stack, receiver: OtlpReceiver,
                                                front_door: str) -> None:
    trace, parent = secrets.token_hex(16), secrets.token_hex(8)
    client = Client(front_door_port(traced_stack, front_door), fresh_client_address())
    path = unique_path("/traced/")

    statuses = [client.request(path, headers={"traceparent": f"00-{trace}-{parent}-01"}).status for _ in range(3)]

    assert statuses == [200, 200, 429]
    spans = wait_for_trace(receiver, trace, 3)
    assert {span.parent_span_id for span in spans} == {parent}
    assert [span.attributes["sluice.outcome"] for span in sorted(spans, key=lambda span: span.start_ns)] == \
        ["allow", "allow", "deny"]
    assert {span.attributes["sluice.front_door"] for span in spans} == {front_door.replace("-", "_")}
    assert all(client.source not in str(span.attributes) for span in spans)
