"""Envoy's gRPC ext_authz: the request Envoy sends, as a CheckRequest, and
the decision, as the CheckResponse Envoy acts on; then one real gRPC call."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.app import SluiceApp
from sidecar.asgi import Scope
from sidecar.engine import Engine
from sidecar.frontdoors.common import Check, Reply
from sidecar.frontdoors.grpc_authz import RPC_OK, RPC_PERMISSION_DENIED, check_handler, check_response, request_headers
from sidecar.frontdoors.grpc_server import GrpcListener
from sidecar.frontdoors.messages import CHECK_METHOD, CHECK_SERVICE, CheckRequest, CheckResponse

from .conftest import FakeClock, ruleset_from
from .test_app import RULES as APP_RULES

# test_app's rules (a 503 page, a close, observe mode), and two more.
RULES = APP_RULES + """
  - id: legal
    match: {path: {prefix: /legal}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: block
    block: {status: 451, body: "gone"}
  - id: by-agent
    key: [ip, "header:user-agent"]
    limit: {requests: 3, per: 10s}
    action: block
"""

RULESET = ruleset_from(RULES)


def new_app() -> SluiceApp:
    return SluiceApp(Engine(RULESET, clock=FakeClock()))


def envoy_check(path: str, address: str = "198.51.100.7", headers: dict[str, str] | None = None,
                method: str = "GET", host: str = "shop.example") -> Any:
    """A CheckRequest as Envoy fills it: pseudo-headers among the headers."""
    message = CheckRequest()
    message.attributes.source.address.socket_address.address = address
    message.attributes.source.address.socket_address.port_value = 40000
    http = message.attributes.request.http
    http.method, http.path, http.host, http.protocol = method, path, host, "HTTP/1.1"
    http.headers.update({":method": method, ":path": path, ":authority": host, "x-request-id": "rid-1",
                         **(headers or {})})
    return message


def ask(app: SluiceApp, message: Any) -> Any:
    """One call of the handler, its answer through the wire format."""
    handler = check_handler(app).service(_Details(f"/{CHECK_SERVICE}/{CHECK_METHOD}"))
    wire = message.SerializeToString()
    answer = asyncio.run(handler.unary_unary(handler.request_deserializer(wire), None))
    return CheckResponse.FromString(handler.response_serializer(answer))


class _Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def headers_of(options: Any) -> dict[str, str]:
    return {option.header.key: option.header.value for option in options}


def test_an_allowed_request_is_ok_with_no_headers() -> None:
    answer = ask(new_app(), envoy_check("/api/a"))

    assert answer.status.code == RPC_OK
    assert answer.HasField("ok_response") and not answer.HasField("denied_response")
    assert list(answer.ok_response.response_headers_to_add) == []


def test_a_5xx_refusal_is_denied_with_its_status_headers_and_page() -> None:
    app = new_app()
    ask(app, envoy_check("/api/a"))

    answer = ask(app, envoy_check("/api/a"))

    assert answer.status.code == RPC_PERMISSION_DENIED
    denied = answer.denied_response
    assert denied.status.code == 503  # passed through by Envoy as it is
    assert denied.body == "<p>slow down 198.51.100.7 on shop.example (rid-1)</p>"
    headers = headers_of(denied.headers)
    assert headers["x-ratelimit-limit"] == "1" and headers["x-request-id"] == "rid-1"
    assert "x-sluice-status" not in headers


def test_a_status_envoys_enumeration_does_not_name_is_sent_as_it_is() -> None:
    app = new_app()
    ask(app, envoy_check("/legal"))

    assert ask(app, envoy_check("/legal")).denied_response.status.code == 451


def test_a_close_is_an_empty_403_asking_for_a_close_in_headers_and_metadata() -> None:
    app = new_app()
    ask(app, envoy_check("/quiet"))

    answer = ask(app, envoy_check("/quiet"))

    denied = answer.denied_response
    assert (denied.status.code, denied.body) == (403, "")
    assert headers_of(denied.headers)["connection"] == "close"
    assert dict(answer.dynamic_metadata) == {"connection": "close"}


def test_observe_mode_headers_go_to_the_response() -> None:
    app = new_app()
    ask(app, envoy_check("/watch"))

    answer = ask(app, envoy_check("/watch"))

    assert answer.status.code == RPC_OK
    headers = headers_of(answer.ok_response.response_headers_to_add)
    assert (headers["x-ratelimit"], headers["x-ratelimit-limit"]) == ("true", "1")


def test_the_client_is_the_direct_peer_and_headers_are_those_of_the_request() -> None:
    app = new_app()
    # A client's own X-Forwarded-For names nobody: the peer is no trusted proxy.
    spoofed = {"x-forwarded-for": "203.0.113.9", "user-agent": "a"}
    statuses = [ask(app, envoy_check("/", "192.0.2.1", spoofed)).status.code for _ in range(4)]
    other_agent = ask(app, envoy_check("/", "192.0.2.1", {"user-agent": "b"})).status.code
    other_peer = ask(app, envoy_check("/", "192.0.2.2", spoofed)).status.code

    assert statuses == [RPC_OK] * 3 + [RPC_PERMISSION_DENIED]
    assert (other_agent, other_peer) == (RPC_OK, RPC_OK)


def test_a_check_is_stamped_with_the_time_envoy_received_the_request_never_with_a_clients_header() -> None:
    from sidecar.frontdoors.grpc_authz import GRPC_MESSAGE, describe_grpc, request_headers

    forged = envoy_check("/", headers={"x-sluice-sent": "1000000000.0"})
    scope: Any = {GRPC_MESSAGE: forged}
    assert describe_grpc(scope, request_headers(forged.attributes.request.http)).sent == 0.0
    forged.attributes.request.time.seconds, forged.attributes.request.time.nanos = 1_800_000_000, 250_000_000
    assert describe_grpc(scope, request_headers(forged.attributes.request.http)).sent == 1_800_000_000.25


class _Failing:
    """A service whose decision fails inside Sluice."""

    def __init__(self) -> None:
        self.errors = 0

    async def check_later(self, check: Check, scope: Scope, headers: dict[str, str]) -> Reply:
        raise RuntimeError("boom")

    def internal_error(self) -> None:
        self.errors += 1


def test_a_failure_inside_sluice_allows_and_is_counted() -> None:
    service = _Failing()
    handler = check_handler(service).service(_Details(f"/{CHECK_SERVICE}/{CHECK_METHOD}"))

    answer = asyncio.run(handler.unary_unary(envoy_check("/"), None))

    assert answer.status.code == RPC_OK and service.errors == 1


texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
header_names = st.one_of(texts, st.sampled_from([":path", ":authority", "x-forwarded-for", "cookie",
                                                 "user-agent", "host", "x-request-id"]))
addresses = st.one_of(st.ip_addresses().map(str), texts)


@settings(max_examples=400, deadline=None)
@given(path=st.one_of(texts, st.sampled_from(["/api/x", "/quiet", "/watch", "/legal", ""])),
       address=addresses, headers=st.dictionaries(header_names, texts, max_size=8),
       method=st.one_of(texts, st.just("GET")), host=texts, repeats=st.integers(1, 3))
def test_any_request_envoy_can_send_gets_a_defined_answer(path: str, address: str, headers: dict[str, str],
                                                          method: str, host: str, repeats: int) -> None:
    app = new_app()
    for _ in range(repeats):
        answer = ask(app, envoy_check(path, address, headers, method, host))
        if answer.status.code == RPC_OK:
            assert answer.HasField("ok_response") and not answer.HasField("denied_response")
        else:
            assert answer.status.code == RPC_PERMISSION_DENIED
            assert 400 <= answer.denied_response.status.code <= 599
    assert app.engine.metrics.errors.value == 0


def test_a_real_grpc_call_is_decided_in_the_servers_event_loop() -> None:
    app = new_app()

    async def calls() -> list[int]:
        listener = GrpcListener(app, "127.0.0.1", 0)
        await listener.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{listener.port}") as channel:
                check = channel.unary_unary(f"/{CHECK_SERVICE}/{CHECK_METHOD}",
                                            request_serializer=CheckRequest.SerializeToString,
                                            response_deserializer=CheckResponse.FromString)
                answers = await asyncio.gather(*(check(envoy_check("/api/b"), timeout=5) for _ in range(20)))
        finally:
            await listener.stop()
        return sorted(answer.status.code for answer in answers)

    assert asyncio.run(calls()) == [RPC_OK] + [RPC_PERMISSION_DENIED] * 19


# -- the wire format, against Envoy's own definitions ------------------------
# Bytes serialized with the classes xds-protos generates from Envoy's API:
# the declared messages must read and write them exactly.
ENVOY_REQUEST = (b'\n\x94\x01\n\x15\n\x13\n\x11\x12\x0b2001:db8::7\x18\xc0\xb8\x02"{\x12y\n\x0242\x12\x04POST'
                 b'\x1a\x12\n\nuser-agent\x12\x04curl"\n/api/x?y=1*\x12shop.example:100002\x04httpH\xff\xff\xff'
                 b'\xff\xff\xff\xff\xff\xff\x01R\x08HTTP/1.1j\x1e\n\r\n\x06cookie\x1a\x03a=1\n\r\n\x06cookie\x12\x03b=2')
ENVOY_DENIED = (b'\n\x02\x08\x07\x12"\n\x03\x08\xf7\x03\x12\x15\n\x11\n\x0bretry-after\x12\x0210\x18\x02\x1a\x04busy'
                b'"\x17\n\x15\n\nconnection\x12\x07\x1a\x05close')
ENVOY_ALLOWED = (b'\n\x00\x1a\x162\x14\n\x10\n\tratelimit\x12\x03r=1\x18\x02"\x1b\n\x19\n\x10x-sluice-pending'
                 b'\x12\x05\x1a\x03tok')


def test_a_request_as_envoy_encodes_it_reads_field_for_field() -> None:
    message = CheckRequest.FromString(ENVOY_REQUEST)
    http = message.attributes.request.http

    assert message.attributes.source.address.socket_address.address == "2001:db8::7"
    assert (http.method, http.path, http.host) == ("POST", "/api/x?y=1", "shop.example:10000")
    assert request_headers(http) == {"cookie": "a=1; b=2"}  # header_map wins over the map
    http.ClearField("header_map")
    assert request_headers(http) == {"user-agent": "curl"}


def test_answers_encode_as_envoys_own_messages_do() -> None:
    denied = check_response((503, [("Retry-After", "10"), ("Connection", "close")], b"busy"))
    allowed = check_response((200, [("RateLimit", "r=1"), ("X-Sluice-Pending", "tok")], b""))

    # Envoy's bytes carry the close in the metadata only.
    assert [option.header.key for option in denied.denied_response.headers] == ["retry-after", "connection"]
    del denied.denied_response.headers[1]
    assert denied == CheckResponse.FromString(ENVOY_DENIED)
    assert allowed.SerializeToString(deterministic=True) == ENVOY_ALLOWED


def test_a_grpc_port_in_use_is_an_error_that_names_the_option() -> None:
    async def start_twice() -> tuple[int, str]:
        first = GrpcListener(new_app(), "127.0.0.1", 0)
        await first.start()
        try:
            second = GrpcListener(new_app(), "127.0.0.1", first.port)
            try:
                await second.start()
            except OSError as error:
                return first.port, str(error)
            await second.stop()
            return first.port, "started"
        finally:
            await first.stop()

    port, outcome = asyncio.run(start_twice())
    assert outcome == f"--grpc-port: cannot listen on 127.0.0.1:{port} (in use?)"
