"""Sluice, then the next auth service (sidecar.chain, ``sluice serve --then-auth``).

The next service here is a fake on a loopback socket that answers from a
script; Sluice is its real HTTP protocol on another, so that nginx's checks
take the same path as in production (decided at once, then asked of the
next service on the ASGI path).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from uvicorn.config import Config
from uvicorn.server import ServerState

from sidecar.app import SluiceApp
from sidecar.chain import (
    CLOSE_PAGE_STATUS,
    MAX_BODY_BYTES,
    MAX_FORWARDED_BYTES,
    MAX_HEAD_BYTES,
    AuthAnswer,
    AuthClient,
    NextAuthAddress,
    ThenAuth,
    ThenAuthFailure,
    answer_before_next_auth,
    forwarded_fields,
    passed_fields,
)
from sidecar.engine import CLOSED, Engine, Outcome
from sidecar.frontdoors.nginx import DenyToken, answer_nginx
from sidecar.server import LimitedHttpProtocol
from sidecar.store.memory import MemoryStore
from tests.unit.conftest import Harness, ruleset_from

RULES = """
rules:
  - id: limited
    match: {path: {prefix: /limited/}}
    key: [ip]
    limit: {requests: 2, per: 1h}
    action: block
  - id: closer
    match: {path: {prefix: /close/}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
    block: {close: true}
"""

TIMEOUT = 0.5


# -- the fake next service ------------------------------------------------------


@dataclass
class Step:
    """Part of a scripted answer: wait ``delay`` seconds, then send ``data``."""

    data: bytes
    delay: float = 0.0


@dataclass
class Script:
    steps: list[Step]
    close: bool = False  # close the connection after the steps


def ok(*fields: str, status: str = "200 OK", body: bytes = b"") -> Script:
    head = "".join(f"{line}\r\n" for line in fields)
    return Script([Step(f"HTTP/1.1 {status}\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)])


@dataclass
class FakeService:
    """Answers each request with the next script (the last one for ever)."""

    scripts: list[Script]
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    open_now: int = 0
    most_open: int = 0
    server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
                    return  # the client went, or the test ended
                self.requests.append(head)
                script = self.scripts[min(len(self.requests), len(self.scripts)) - 1]
                for step in script.steps:
                    if step.delay:
                        await asyncio.sleep(step.delay)
                    writer.write(step.data)
                    await writer.drain()
                if script.close:
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            self.open_now -= 1
            writer.close()

    @property
    def address(self) -> NextAuthAddress:
        return NextAuthAddress.parse(f"http://127.0.0.1:{self.port}/oauth2/auth?from=sluice")


@contextlib.asynccontextmanager
async def next_service(*scripts: Script) -> AsyncIterator[FakeService]:
    service = FakeService(list(scripts))
    service.server = await asyncio.start_server(service.handle, "127.0.0.1", 0)
    try:
        yield service
    finally:
        service.server.close()
        await service.server.wait_closed()


def closed_port() -> NextAuthAddress:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return NextAuthAddress.parse(f"http://127.0.0.1:{port}/auth")


# -- Sluice on a loopback socket ------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, list[str]]

    def field(self, name: str) -> str | None:
        values = self.headers.get(name.lower())
        return values[0] if values else None


class AwaitedMemoryStore(MemoryStore):
    """This node's memory, taken for a store that is awaited (as Redis is):
    checks then take the protocol's task path (``check_later``)."""

    answers_at_once = False


@contextlib.asynccontextmanager
async def sluice(address: NextAuthAddress, timeout: float = TIMEOUT,
                 awaited: bool = False) -> AsyncIterator[tuple[SluiceApp, int]]:
    ruleset = ruleset_from(RULES)
    engine = Engine(ruleset, store=AwaitedMemoryStore(ruleset.max_keys, ruleset.node) if awaited else None)
    app = SluiceApp(engine, then_auth=ThenAuth(address, timeout, engine.metrics.registry))
    config = Config(app=app, lifespan="off", log_level="warning", proxy_headers=False)
    config.load()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: LimitedHttpProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop),
        "127.0.0.1", 0)
    try:
        yield app, server.sockets[0].getsockname()[1]
    finally:
        assert app.then_auth is not None
        app.then_auth.close()
        server.close()


def check_request(path: str = "/", client: str = "192.0.2.7", **fields: str) -> bytes:
    lines = ["GET /v1/nginx/auth HTTP/1.1", "Host: sluice", f"X-Original-URI: {path}",
             "X-Original-Method: GET", "X-Original-Host: shop.example", f"X-Sluice-Client-Addr: {client}",
             "X-Request-Id: 0123abcd"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in fields.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def check(port: int, request: bytes) -> Answer:
    """One check on a connection of its own, as nginx sends it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        status_line = await reader.readline()
        headers: dict[str, list[str]] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers.setdefault(name.strip().lower(), []).append(value.strip())
        return Answer(int(status_line.split()[1]), headers)
    finally:
        writer.close()


def run(coroutine):  # type: ignore[no-untyped-def]
    return asyncio.run(coroutine)


# -- the URL ----------------------------------------------------------------------


def test_the_next_service_is_an_http_url_with_its_path_and_query() -> None:
    address = NextAuthAddress.parse("http://auth.internal:4180/oauth2/auth?allowed_groups=admins")

    assert (address.host, address.port, address.target) == ("auth.internal", 4180,
                                                            "/oauth2/auth?allowed_groups=admins")
    assert NextAuthAddress.parse("http://[::1]/").target == "/"
    assert NextAuthAddress.parse("http://127.0.0.1").port == 80


@pytest.mark.parametrize("url, says", [
    ("https://auth/x", "plain http"),
    ("auth:4180/x", "plain http"),
    ("http:///x", "plain http"),
    ("http://user:secret@auth/x", "without credentials"),
    ("http://auth:99999/x", "Port out of range"),
    ("http://auth/x#top", "got"),
    ("http://auth/x y", "got"),
])
def test_anything_else_is_refused_with_what_was_expected(url: str, says: str) -> None:
    with pytest.raises(ValueError, match="expected a URL like http://") as refused:
        NextAuthAddress.parse(url)

    assert says in str(refused.value)
    assert "secret" not in str(refused.value)


# -- what goes to the next service, and what comes back --------------------------


def test_the_next_service_sees_the_clients_fields_and_what_nginx_said_never_sluices() -> None:
    headers = {"host": "sluice", "cookie": "session=ok; theme=dark", "authorization": "Bearer t",
               "x-original-uri": "/account?tab=1", "x-original-method": "POST", "x-original-host": "shop.example",
               "x-request-id": "abc", "x-sluice-client-addr": "198.51.100.4", "x-sluice-sent": "1.5",
               "x-sluice-tls-fingerprint": "", "x-sluice-scheme": "https", "x-forwarded-for": "203.0.113.9",
               "connection": "keep-alive", "te": "trailers", "content-length": "0", "user-agent": "ua",
               # What a client may send, and only a proxy may say:
               "x-real-ip": "10.0.0.1", "x-forwarded-host": "admin.example", "x-forwarded-proto": "http",
               "x-original-url": "https://admin.example/", "x-forwarded-uri": "/public", "forwarded": "for=1"}

    sent = list(forwarded_fields(headers))
    fields = dict(sent)

    assert len(fields) == len(sent)  # each field once
    assert {name for name in fields if name.startswith("x-sluice-")} == set()
    assert {"connection", "te", "content-length", "forwarded"}.isdisjoint(fields)
    assert fields["cookie"] == "session=ok; theme=dark" and fields["authorization"] == "Bearer t"
    assert (fields["host"], fields["x-forwarded-host"]) == ("shop.example", "shop.example")
    assert (fields["x-original-uri"], fields["x-forwarded-uri"]) == ("/account?tab=1", "/account?tab=1")
    assert (fields["x-original-method"], fields["x-forwarded-method"]) == ("POST", "POST")
    assert fields["x-real-ip"] == "198.51.100.4"
    assert fields["x-forwarded-for"] == "203.0.113.9, 198.51.100.4"
    assert fields["x-forwarded-proto"] == "https"
    assert fields["x-original-url"] == "https://shop.example/account?tab=1"
    assert (fields["user-agent"], fields["x-request-id"]) == ("ua", "abc")


def test_without_the_scheme_from_nginx_no_url_is_made_up() -> None:
    fields = dict(forwarded_fields({"x-original-host": "shop.example", "x-original-uri": "/",
                                    "x-forwarded-proto": "https", "x-original-url": "https://evil/"}))

    assert "x-forwarded-proto" not in fields and "x-original-url" not in fields
    assert "x-real-ip" not in fields and "x-forwarded-for" not in fields  # nginx named no peer


def test_nginx_gets_the_services_fields_but_never_ones_that_steer_nginx_or_sluice() -> None:
    answer = AuthAnswer(200, [
        ("X-Auth-Request-User", "alice"), ("X-Auth-Request-Email", "alice@example.com"),
        ("Set-Cookie", "_oauth2_proxy=a; Path=/"), ("Set-Cookie", "_oauth2_proxy_1=b; Path=/"),
        ("Connection", "keep-alive, X-Hop"), ("X-Hop", "1"), ("Content-Length", "0"), ("Transfer-Encoding", "x"),
        ("X-Accel-Redirect", "/internal"), ("X-Accel-Expires", "@99999999999"), ("X-Sluice-Deny", "forged"),
        ("X-Sluice-Pending", "forged"), ("X-RateLimit", "true"), ("Retry-After", "9"), ("RateLimit", "r=1"),
    ])

    assert passed_fields(answer) == [
        ("X-Auth-Request-User", "alice"), ("X-Auth-Request-Email", "alice@example.com"),
        ("Set-Cookie", "_oauth2_proxy=a; Path=/"), ("Set-Cookie", "_oauth2_proxy_1=b; Path=/"),
    ]


def test_fields_that_would_not_fit_nginxs_buffer_are_a_failure() -> None:
    cookie = "c" * 1000
    fits = AuthAnswer(200, [("Set-Cookie", cookie)] * (MAX_FORWARDED_BYTES // 1100))
    too_many = AuthAnswer(200, [("Set-Cookie", cookie)] * (MAX_FORWARDED_BYTES // 1000 + 1))

    assert len(passed_fields(fits)) == MAX_FORWARDED_BYTES // 1100
    with pytest.raises(ThenAuthFailure, match="too_large"):
        passed_fields(too_many)


def test_sluices_own_close_is_never_a_401_so_that_401_is_the_next_services() -> None:
    harness = Harness(RULES)
    request = harness.request(ip="192.0.2.9", path="/close/")
    allowed = harness.engine.decide_now(request)
    closed = harness.engine.decide_now(request)

    status, headers, _ = answer_before_next_auth(request, closed)
    fields = dict(headers)

    assert closed.outcome == CLOSED.outcome and answer_nginx(request, closed)[0] == 401
    assert status == 403
    assert fields["X-Sluice-Page-Status"] == str(CLOSE_PAGE_STATUS)
    assert DenyToken.decode(fields["X-Sluice-Deny"])[0] == CLOSE_PAGE_STATUS
    # Anything else is nginx's answer as always.
    assert answer_before_next_auth(request, allowed) == answer_nginx(request, allowed)
    limited = harness.request(ip="192.0.2.10", path="/limited/")
    refusal = [harness.engine.decide_now(limited) for _ in range(3)][-1]
    assert refusal.outcome == Outcome.DENY
    assert answer_before_next_auth(limited, refusal) == answer_nginx(limited, refusal)


# -- the client -----------------------------------------------------------------------


def test_checks_share_kept_alive_connections() -> None:
    async def scenario() -> tuple[list[int], int]:
        async with next_service(ok("X-Auth-Request-User: alice")) as service:
            client = AuthClient(service.address, TIMEOUT)
            statuses = [(await client.ask(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")).status for _ in range(5)]
            client.close()
            return statuses, service.connections

    statuses, connections = run(scenario())

    assert statuses == [200] * 5
    assert connections == 1


def test_a_kept_connection_the_service_closed_is_replaced_without_a_failure() -> None:
    async def scenario() -> tuple[list[int], int]:
        closing = Script(ok().steps, close=True)
        async with next_service(closing) as service:
            client = AuthClient(service.address, TIMEOUT)
            statuses = []
            for _ in range(3):
                statuses.append((await client.ask(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")).status)
            client.close()
            return statuses, service.connections

    statuses, connections = run(scenario())

    assert statuses == [200, 200, 200]
    assert connections == 3


def test_the_pool_holds_at_most_its_size_of_connections() -> None:
    async def scenario() -> tuple[int, int]:
        slow = Script([Step(ok().steps[0].data, delay=0.02)])
        async with next_service(slow) as service:
            client = AuthClient(service.address, 5.0, pool_size=3)
            answers = await asyncio.gather(*(client.ask(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n") for _ in range(20)))
            client.close()
            return sum(answer.status == 200 for answer in answers), service.most_open

    answered, most_open = run(scenario())

    assert answered == 20
    assert most_open == 3


@pytest.mark.parametrize("script, reason", [
    (Script([Step(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", delay=2 * TIMEOUT)]), "timeout"),
    (Script([Step(b"garbage\r\n\r\n")]), "invalid"),
    (Script([Step(b"HTTP/1.1 200 OK\r\nX-Field: " + b"v" * MAX_HEAD_BYTES + b"\r\n\r\n")]), "too_large"),
    (Script([Step(b"HTTP/1.1 200 OK\r\n" + b"X-F: 1\r\n" * 101 + b"Content-Length: 0\r\n\r\n")]), "too_large"),
    (Script([Step(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1)
                  + b"b" * (MAX_BODY_BYTES + 1))]), "too_large"),
    (Script([Step(b"HTTP/1.1 200 OK\r\nContent-Le")], close=True), "closed"),
    (Script([], close=True), "closed"),
    (Script([Step(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n")]),
     "invalid"),
])
def test_no_usable_answer_is_a_failure_with_its_reason(script: Script, reason: str) -> None:
    async def scenario() -> str:
        async with next_service(script) as service:
            client = AuthClient(service.address, TIMEOUT)
            try:
                await client.ask(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
            except ThenAuthFailure as failure:
                return failure.reason
            finally:
                client.close()
            return "answered"

    assert run(scenario()) == reason


def test_a_service_that_is_down_is_a_connect_failure() -> None:
    async def scenario() -> str:
        client = AuthClient(closed_port(), TIMEOUT)
        try:
            await client.ask(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
        except ThenAuthFailure as failure:
            return failure.reason
        return "answered"

    assert run(scenario()) == "connect"


def test_an_answer_whose_body_runs_to_the_close_is_complete() -> None:
    async def scenario() -> tuple[int, list[tuple[str, str]]]:
        until_close = Script([Step(b"HTTP/1.1 200 OK\r\nX-Auth-Request-User: bob\r\n\r\nwelcome")], close=True)
        async with next_service(until_close) as service:
            client = AuthClient(service.address, TIMEOUT)
            answer = await client.ask(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
            client.close()
            return answer.status, answer.headers

    assert run(scenario()) == (200, [("X-Auth-Request-User", "bob")])


def test_a_second_answer_to_one_request_is_never_taken_for_the_next_ones() -> None:
    async def scenario() -> tuple[list[int], int]:
        twice = Script([Step(b"HTTP/1.1 401 No\r\nContent-Length: 0\r\n\r\n"
                             b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")])
        async with next_service(twice) as service:
            client = AuthClient(service.address, TIMEOUT)
            statuses = [(await client.ask(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")).status for _ in range(2)]
            client.close()
            return statuses, service.connections

    statuses, connections = run(scenario())

    assert statuses == [401, 401]
    assert connections == 2


# -- through Sluice ---------------------------------------------------------------------


def test_an_admitted_check_gets_the_next_services_answer_and_fields() -> None:
    async def scenario() -> tuple[Answer, bytes]:
        answer = ok("X-Auth-Request-User: alice", "Set-Cookie: _oauth2_proxy=refreshed")
        async with next_service(answer) as service, sluice(service.address) as (_, port):
            got = await check(port, check_request("/account", cookie="session=ok", x_sluice_scheme="https"))
            return got, service.requests[0]

    got, asked = run(scenario())

    assert got.status == 200
    assert got.field("X-Auth-Request-User") == "alice"
    assert got.field("Set-Cookie") == "_oauth2_proxy=refreshed"
    assert asked.startswith(b"GET /oauth2/auth?from=sluice HTTP/1.1\r\n")
    assert b"\r\ncookie: session=ok\r\n" in asked and b"\r\nhost: shop.example\r\n" in asked
    assert b"x-original-url: https://shop.example/account\r\n" in asked
    assert b"x-sluice-" not in asked.lower()


def test_the_next_services_401_is_nginxs_with_where_to_sign_in() -> None:
    async def scenario() -> Answer:
        refused = ok("Location: https://auth.example/?rd=x", 'WWW-Authenticate: Bearer realm="x"',
                     status="401 Unauthorized")
        async with next_service(refused) as service, sluice(service.address) as (_, port):
            return await check(port, check_request("/account"))

    got = run(scenario())

    assert got.status == 401
    assert got.field("Location") == "https://auth.example/?rd=x"
    assert got.field("WWW-Authenticate") == 'Bearer realm="x"'
    assert got.field("X-Sluice-Deny") is None


def test_the_next_services_403_is_a_refusal_with_a_403_page() -> None:
    async def scenario() -> Answer:
        async with next_service(ok(status="403 Forbidden")) as service, sluice(service.address) as (_, port):
            return await check(port, check_request("/account"))

    got = run(scenario())

    assert got.status == 403
    assert got.field("X-Sluice-Page-Status") == "403"
    assert "403 Forbidden" in (got.field("X-Sluice-Page") or "")
    assert DenyToken.decode(got.field("X-Sluice-Deny") or "")[0] == 403


@pytest.mark.parametrize("script, reason", [
    (ok(status="302 Found"), "status"),
    (ok(status="500 Internal Server Error"), "status"),
    (Script([Step(b"nonsense\r\n\r\n")]), "invalid"),
])
def test_any_other_answer_is_a_503_refusal_counted_by_reason(script: Script, reason: str) -> None:
    async def scenario() -> tuple[Answer, float, float]:
        async with next_service(script) as service, sluice(service.address) as (app, port):
            got = await check(port, check_request("/account"))
            return got, *metrics_of(app, reason)

    got, errors, internal = run(scenario())

    assert got.status == 403
    assert (got.field("X-Sluice-Page-Status"), got.field("Retry-After")) == ("503", "1")
    assert DenyToken.decode(got.field("X-Sluice-Deny") or "")[0] == 503
    assert (errors, internal) == (1, 0)


def test_a_service_that_is_down_refuses_with_503_and_is_counted() -> None:
    async def scenario() -> tuple[Answer, float, float]:
        async with sluice(closed_port()) as (app, port):
            got = await check(port, check_request("/account"))
            return got, *metrics_of(app, "connect")

    got, errors, internal = run(scenario())

    assert (got.status, got.field("X-Sluice-Page-Status")) == (403, "503")
    assert (errors, internal) == (1, 0)


@pytest.mark.parametrize("awaited", [False, True], ids=["decided at once", "store awaited"])
def test_sluices_refusals_never_reach_the_next_service(awaited: bool) -> None:
    async def scenario() -> tuple[list[int], list[str | None], int]:
        async with next_service(ok()) as service, sluice(service.address, awaited=awaited) as (_, port):
            statuses, page_statuses = [], []
            for _ in range(4):
                got = await check(port, check_request("/limited/", client="192.0.2.50"))
                statuses.append(got.status)
                page_statuses.append(got.field("X-Sluice-Page-Status"))
            closing = [await check(port, check_request("/close/", client="192.0.2.51")) for _ in range(2)]
            statuses += [got.status for got in closing]
            page_statuses += [got.field("X-Sluice-Page-Status") for got in closing]
            return statuses, page_statuses, len(service.requests)

    statuses, page_statuses, asked = run(scenario())

    assert statuses == [200, 200, 403, 403, 200, 403]
    assert page_statuses == [None, None, "429", "429", None, str(CLOSE_PAGE_STATUS)]
    assert asked == 3  # the admitted ones only


def test_checks_sent_one_behind_the_other_on_a_connection_are_each_asked_in_order() -> None:
    async def scenario() -> tuple[list[bytes], int]:
        fields = [ok("X-Auth-Request-User: first"), ok(status="401 Unauthorized")]
        async with next_service(*fields) as service, sluice(service.address) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            # Pipelined: the second waits behind the first, on the ASGI path.
            writer.write(check_request("/a") + check_request("/b"))
            lines = []
            while len([line for line in lines if line.startswith(b"HTTP/1.1")]) < 2 or lines[-1] != b"\r\n":
                lines.append(await asyncio.wait_for(reader.readline(), 5))
            writer.close()
            return lines, len(service.requests)

    lines, asked = run(scenario())

    assert [line.split()[1] for line in lines if line.startswith(b"HTTP/1.1")] == [b"200", b"401"]
    assert b"x-auth-request-user: first\r\n" in [line.lower() for line in lines]
    assert asked == 2


def test_a_location_whose_then_auth_is_off_is_never_asked_of_the_next_service() -> None:
    async def scenario() -> tuple[list[int], int]:
        async with next_service(ok(status="401 Unauthorized")) as service, sluice(service.address) as (_, port):
            statuses = [(await check(port, check_request("/open/", x_sluice_then_auth="off"))).status,
                        (await check(port, check_request("/account", x_sluice_then_auth="/oauth2/auth"))).status,
                        (await check(port, check_request("/account"))).status]
            return statuses, len(service.requests)

    statuses, asked = run(scenario())

    # off: Sluice's own allow; a location's auth URI, or nothing said: asked.
    assert statuses == [200, 401, 401]
    assert asked == 2


def test_without_then_auth_nginxs_answers_are_unchanged() -> None:
    async def scenario() -> list[int]:
        engine = Engine(ruleset_from(RULES))
        app = SluiceApp(engine)
        config = Config(app=app, lifespan="off", log_level="warning", proxy_headers=False)
        config.load()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: LimitedHttpProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop),
            "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return [(await check(port, check_request("/close/", client="192.0.2.60"))).status for _ in range(2)]
        finally:
            server.close()

    assert run(scenario()) == [200, 401]


def metrics_of(app: SluiceApp, reason: str) -> tuple[float, float]:
    """sluice_then_auth_errors_total{reason} and sluice_internal_errors_total."""
    registry = app.engine.metrics.registry
    errors = registry.get_sample_value("sluice_then_auth_errors_total", {"reason": reason})
    internal = registry.get_sample_value("sluice_internal_errors_total")
    return errors or 0.0, internal or 0.0


# -- fuzzing the next service's answers -----------------------------------------------------

STATUSES = st.sampled_from([b"200 OK", b"204 No Content", b"401 Unauthorized", b"403 Forbidden", b"302 Found",
                            b"500 Oops", b"503 Busy", b"100 Continue", b"999 What", b"2000 X", b"", b"abc"])
FIELD_NAMES = st.sampled_from([b"X-Auth-Request-User", b"Set-Cookie", b"Location", b"X-Sluice-Deny",
                               b"X-Accel-Redirect", b"Content-Length", b"Transfer-Encoding", b"Connection",
                               b"X-" + b"n" * 300, b"Bad Name", b""])
FIELD_VALUES = st.one_of(st.binary(max_size=40), st.sampled_from([b"0", b"5", b"chunked", b"close", b"v" * 20_000]))
FIELDS = st.lists(st.tuples(FIELD_NAMES, FIELD_VALUES), max_size=8)
BODIES = st.one_of(st.binary(max_size=64), st.just(b"x" * (MAX_BODY_BYTES + 10)))


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    """An answer the next service might give: well formed or not, whole or
    cut short, fast or slower than the timeout, then closed or not."""
    status = draw(STATUSES)
    head = b"HTTP/1.1 " + status + b"\r\n" + b"".join(name + b": " + value + b"\r\n" for name, value in draw(FIELDS))
    data = head + b"\r\n" + draw(BODIES)
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    if draw(st.booleans()):
        data = draw(st.binary(max_size=200))
    pieces = draw(st.integers(1, 3))
    step = max(1, len(data) // pieces)
    delay = draw(st.sampled_from([0.0, 0.0, 0.0, 0.01, 2 * FUZZ_TIMEOUT]))
    steps = [Step(data[at:at + step], delay if at == 0 else 0.0) for at in range(0, len(data), step)] or \
        [Step(b"", delay)]
    return Script(steps, close=draw(st.booleans()))


FUZZ_TIMEOUT = 0.2


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def sluice_log() -> Iterator[Records]:
    records = Records()
    logger = logging.getLogger("sluice")
    logger.addHandler(records)
    try:
        yield records
    finally:
        logger.removeHandler(records)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answers=st.lists(scripts(), min_size=1, max_size=3))
def test_whatever_the_next_service_answers_nginx_gets_a_defined_answer(answers: list[Script]) -> None:
    async def scenario() -> tuple[list[Answer], float, float, int]:
        async with next_service(*answers) as service, sluice(service.address, FUZZ_TIMEOUT) as (app, port):
            got = [await check(port, check_request(f"/fuzz/{n}")) for n in range(len(answers))]
            registry = app.engine.metrics.registry
            failed = registry.get_sample_value("sluice_then_auth_answers_total", {"answer": "failed"}) or 0.0
            internal = registry.get_sample_value("sluice_internal_errors_total") or 0.0
            # Sluice's connection reached the service's socket; on a busy
            # machine the service's loop may accept it only after Sluice's
            # timeout answered (both run in this loop).
            deadline = time.monotonic() + 5
            while not service.connections and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return got, failed, internal, service.connections

    with sluice_log() as records:
        got, failed, internal, asked = run(scenario())

    for answer in got:
        # Only what nginx's auth_request understands: 2xx, 401, 403.
        assert answer.status in (200, 401, 403)
        if answer.status == 403:
            # Always Sluice's refusal, with its page: 403 from the service, else 503.
            assert answer.field("X-Sluice-Page-Status") in ("403", "503")
            assert answer.field("X-Sluice-Deny") is not None
        assert all(not name.startswith(("x-accel-", "transfer-encoding")) for name in answer.headers)
    assert failed == sum(answer.field("X-Sluice-Page-Status") == "503" for answer in got)
    assert internal == 0
    assert asked >= 1
    assert not [record for record in records.records if record.exc_info or record.levelno >= logging.ERROR]


@pytest.mark.parametrize("url", ["https://auth/x", "http://user:secret@auth/x", "auth"])
def test_serve_names_the_flag_of_a_next_service_url_it_cannot_use(url: str) -> None:
    from click.testing import CliRunner

    from sidecar.cli import main

    result = CliRunner().invoke(main, ["serve", "--then-auth", url])

    assert result.exit_code == 2
    assert "Invalid value for '--then-auth'" in result.output
    assert "expected a URL like http://127.0.0.1:4180/oauth2/auth" in result.output
    assert "secret" not in result.output
