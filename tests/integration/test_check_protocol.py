"""Checks answered by Sluice's HTTP protocol itself (sidecar/server.py), as
HTTP on the wire: in order with what else comes on the same connection
(pipelined checks, a check a leaky bucket holds, other endpoints), HEAD
without a body, and the connection closed when HTTP/1.0 or the answer asks
for it. Raw sockets to a real ``sluice serve`` on loopback, with the memory
store (answered at once) and with a real Redis (answered after awaiting it)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from devstack.launcher import Stack
from tests.integration.clients import LOOPBACK
from tests.integration.conftest import fresh_client_address, start_stack
from tests.integration.redis_server import RedisServer

pytestmark = pytest.mark.integration

HELD = """
  - id: held
    match: {path: {prefix: /held}}
    key: [ip]
    limit: {rate: 5r/s, burst: 10, delay: 0}
    action: block
"""
RULES = """
  - id: refused
    match: {path: {prefix: /refused}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
    block: {status: 429}
  - id: closing
    match: {path: {prefix: /closing}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
    block: {close: true}
"""


def running_stack(run_dir: Path, rules_text: str) -> Stack:
    rules = run_dir / "rules.yaml"
    rules.write_text(rules_text)
    return start_stack(run_dir / "stack", rules)


@pytest.fixture(scope="module")
def memory_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = running_stack(tmp_path_factory.mktemp("check-protocol"), "rules:" + HELD + RULES)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def redis_stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    # No rule holds: with a shared store, the protocol answers in a task.
    running = running_stack(tmp_path_factory.mktemp("check-protocol-redis"),
                            f"state: {{backend: redis, url: '{redis_server.url}'}}\nrules:" + RULES)
    yield running
    running.stop()


@pytest.fixture(params=["memory", "redis"])
def stack(request: pytest.FixtureRequest) -> Stack:
    return request.getfixturevalue(f"{request.param}_stack")


def nginx_check(uri: str, client: str, version: str = "1.1", method: str = "GET") -> bytes:
    return (f"{method} /v1/nginx/auth HTTP/{version}\r\nHost: sluice\r\nX-Original-URI: {uri}\r\n"
            f"X-Original-Method: GET\r\nX-Sluice-Client-Addr: {client}\r\n\r\n").encode()


def forward_auth_check(uri: str, method: str = "GET") -> bytes:
    # The forward-auth door counts the connecting peer: every test here
    # connects from its own loopback address.
    return (f"{method} /v1/check HTTP/1.1\r\nHost: sluice\r\nX-Forwarded-Uri: {uri}\r\n"
            f"X-Forwarded-Host: example.com\r\n\r\n").encode()


def over_limit(port: int, source: str, client: str) -> None:
    """Each refusing rule's first request for this client (allowed: it
    reaches the threshold and starts the penalty). Both doors count the
    same key: ``source`` is ``client``."""
    with connect_from(source, port) as connection:
        stream = connection.makefile("rb")
        for request in (nginx_check("/refused", client), forward_auth_check("/closing")):
            connection.sendall(request)
            assert read_reply(stream)[0] == 200


def read_reply(stream: BinaryIO, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response off the stream: status, headers, body."""
    status_line = stream.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    headers: dict[str, str] = {}
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        assert name.lower() not in headers, f"{name} twice"
        headers[name.lower()] = value.strip()
    length = 0 if head_only else int(headers.get("content-length", "0"))
    return int(status_line.split()[1]), headers, stream.read(length)


def connect_from(source: str, port: int) -> socket.socket:
    """A connection from its own loopback address (the forward-auth client)."""
    return socket.create_connection((LOOPBACK, port), timeout=10, source_address=(source, 0))


def test_pipelined_checks_are_answered_in_order_around_a_held_one(memory_stack: Stack) -> None:
    stack = memory_stack
    client = fresh_client_address()
    over_limit(stack.ports.sluice, client, client)
    with socket.create_connection((LOOPBACK, stack.ports.sluice), timeout=10) as connection:
        stream = connection.makefile("rb")
        connection.sendall(nginx_check("/held", client))
        assert read_reply(stream)[0] == 200  # the bucket's first request: not held
        started = time.monotonic()
        # Held (about 0.2 s at 5 r/s), refused, allowed, another endpoint:
        # all in one write, so the later ones are parsed while the first waits.
        connection.sendall(nginx_check("/held", client) + nginx_check("/refused", client)
                           + nginx_check("/free", client) + b"GET /healthz HTTP/1.1\r\nHost: s\r\n\r\n")
        held = read_reply(stream)
        waited = time.monotonic() - started
        refused, allowed, health = read_reply(stream), read_reply(stream), read_reply(stream)
    assert held[0] == 200 and waited >= 0.15
    assert refused[0] == 403 and refused[1]["x-sluice-deny"].startswith("429 ")
    assert allowed[0] == 200 and "x-sluice-deny" not in allowed[1]
    assert health[0] == 200


def test_many_pipelined_checks_get_one_answer_each_in_order(stack: Stack) -> None:
    client = fresh_client_address()
    paths = ["/refused" if i % 3 == 0 else "/free" for i in range(300)]
    over_limit(stack.ports.sluice, client, client)
    with socket.create_connection((LOOPBACK, stack.ports.sluice), timeout=10) as connection:
        stream = connection.makefile("rb")
        connection.sendall(b"".join(nginx_check(path, client) for path in paths))
        statuses = [read_reply(stream)[0] for _ in paths]
    assert statuses == [403 if path == "/refused" else 200 for path in paths]


def test_a_head_check_gets_the_refusal_headers_without_a_body(stack: Stack) -> None:
    source = fresh_client_address()
    over_limit(stack.ports.sluice, source, source)
    with connect_from(source, stack.ports.sluice) as connection:
        stream = connection.makefile("rb")
        connection.sendall(forward_auth_check("/refused", method="HEAD") + forward_auth_check("/refused")
                           + forward_auth_check("/free"))
        status, headers, _ = read_reply(stream, head_only=True)
        # The next answer starts right after the head: no body was sent.
        page, after = read_reply(stream), read_reply(stream)
    assert status == 429 and int(headers["content-length"]) > 0 and "retry-after" in headers
    assert page[0] == 429 and len(page[2]) == int(headers["content-length"])
    assert after[0] == 200


def test_http_1_0_gets_its_answer_and_the_connection_closes(stack: Stack) -> None:
    with socket.create_connection((LOOPBACK, stack.ports.sluice), timeout=10) as connection:
        stream = connection.makefile("rb")
        connection.sendall(nginx_check("/free", fresh_client_address(), version="1.0"))
        status, headers, _ = read_reply(stream)
        assert (status, headers.get("connection")) == (200, "close")
        assert stream.read() == b""  # closed by Sluice


def test_an_answer_asking_for_a_close_closes_the_connection(stack: Stack) -> None:
    source = fresh_client_address()
    over_limit(stack.ports.sluice, source, source)
    with connect_from(source, stack.ports.sluice) as connection:
        stream = connection.makefile("rb")
        connection.sendall(forward_auth_check("/closing") + forward_auth_check("/free"))
        status, headers, body = read_reply(stream)
        assert (status, headers["connection"], body) == (403, "close", b"")
        assert stream.read() == b""  # the pipelined check after it is not answered
