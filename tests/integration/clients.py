"""An HTTP client for the integration tests that picks its source address."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from sidecar.overload import PROXY_SECONDS

LOOPBACK = "127.0.0.1"

# What a client sees when nginx closes the connection without a response (444).
CONNECTION_CLOSED = (http.client.RemoteDisconnected, ConnectionResetError)


@dataclass(frozen=True)
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def echo(self) -> dict[str, Any]:
        """The demo upstream's JSON echo of the request it received."""
        echo: dict[str, Any] = json.loads(self.body)
        return echo


class Client:
    """HTTP/1.1 requests to one server from one source address, a new connection each."""

    def __init__(self, port: int, source: str = LOOPBACK, timeout: float = 5.0) -> None:
        self.port = port
        self.source = source
        self.timeout = timeout

    def connect(self) -> http.client.HTTPConnection:
        """A new connection, established before any request is sent on it."""
        connection = http.client.HTTPConnection(
            LOOPBACK, self.port, timeout=self.timeout, source_address=(self.source, 0)
        )
        connection.connect()
        return connection

    def request(
        self,
        path: str,
        method: str = "GET",
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
    ) -> Reply:
        connection = self.connect()
        try:
            return _exchange(connection, path, method, headers, body)
        finally:
            connection.close()

    def request_and_watch_connection(self, path: str, wait: float = 2.0) -> tuple[Reply, bool]:
        """A GET, and whether the server closed the connection after its reply.

        The server has `wait` seconds to close it; a connection it keeps
        open costs that long.
        """
        with socket.create_connection(
            (LOOPBACK, self.port), timeout=self.timeout, source_address=(self.source, 0)
        ) as connection:
            connection.sendall(f"GET {path} HTTP/1.1\r\nHost: {LOOPBACK}:{self.port}\r\n\r\n".encode())
            response = http.client.HTTPResponse(connection)
            response.begin()
            reply = Reply(response.status, response.headers, response.read())
            connection.settimeout(wait)
            try:
                closed = connection.recv(1) == b""
            except TimeoutError:
                closed = False
            return reply, closed


def _exchange(
    connection: http.client.HTTPConnection,
    path: str,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
) -> Reply:
    connection.request(method, path, body=body, headers=dict(headers or {}))
    response = connection.getresponse()
    return Reply(response.status, response.headers, response.read())


@dataclass(frozen=True)
class TimedReply:
    """A reply and how long the client waited for it, from sending the request."""

    reply: Reply
    seconds: float

    @property
    def status(self) -> int:
        return self.reply.status


def send_at_once(requests: Sequence[tuple[Client, str]], at: float) -> list[TimedReply]:
    """GET every (client, path) at the monotonic time `at`, each on a
    connection of its own opened beforehand: a burst, as a proxy sees one.
    The replies come in the order of `requests`.

    Every request and the whole burst are bounded by the clients' timeouts.
    """
    connections = [client.connect() for client, _ in requests]
    outcomes: list[TimedReply | Exception | None] = [None] * len(requests)

    def send(index: int) -> None:
        try:
            time.sleep(max(0.0, at - time.monotonic()))
            started = time.monotonic()
            reply = _exchange(connections[index], requests[index][1])
            outcomes[index] = TimedReply(reply, time.monotonic() - started)
        except Exception as error:  # reported below, with the others
            outcomes[index] = error
        finally:
            connections[index].close()

    threads = [threading.Thread(target=send, args=(index,), daemon=True) for index in range(len(requests))]
    for thread in threads:
        thread.start()
    deadline = max(at, time.monotonic()) + max(client.timeout for client, _ in requests)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    failed = [(path, outcome) for (_, path), outcome in zip(requests, outcomes) if not isinstance(outcome, TimedReply)]
    assert not failed, f"requests without a reply: {failed}"
    return [outcome for outcome in outcomes if isinstance(outcome, TimedReply)]


def assert_default_block(blocked: Reply, limit: int, reset: int) -> None:
    """A refusal by a `block` rule with the built-in page."""
    assert blocked.status == 429
    assert blocked.headers["X-RateLimit"] == "true"
    assert blocked.headers["X-RateLimit-Limit"] == str(limit)
    assert blocked.headers["X-RateLimit-Reset"] == str(reset)
    assert 1 <= int(blocked.headers["Retry-After"]) <= reset
    assert blocked.headers["Cache-Control"] == "no-store"
    assert blocked.headers["Content-Type"].startswith("text/html")
    request_id = blocked.headers["X-Request-Id"]
    assert request_id
    assert b"429" in blocked.body
    assert request_id.encode() in blocked.body


def assert_observed(reply: Reply, limit: int, reset: int) -> None:
    """An over-limit request in observe mode: let through, with the headers."""
    assert reply.status == 200
    assert reply.headers["X-RateLimit"] == "true"
    assert reply.headers["X-RateLimit-Limit"] == str(limit)
    assert reply.headers["X-RateLimit-Reset"] == str(reset)


def assert_refused_by_closing(client: Client, path: str, front_door: str) -> None:
    """`close: true` and bans. nginx closes the connection without
    a response; Envoy's ext_authz cannot, so Envoy answers an empty 403 with
    `Connection: close` and then closes the connection."""
    if front_door == "nginx":
        with pytest.raises(CONNECTION_CLOSED):
            client.request(path)
        return
    reply, closed = client.request_and_watch_connection(path)
    assert (reply.status, reply.headers["Connection"], reply.body) == (403, "close", b"")
    assert closed


def closed(client: Client, front_door: str, path: str = "/") -> bool:
    """Whether the door refuses the client by closing (nginx: no response;
    Envoy: an empty 403 with Connection: close)."""
    try:
        reply = client.request(path)
    except CONNECTION_CLOSED:
        return front_door == "nginx"
    return reply.status == 403 and reply.headers.get("Connection") == "close"


def let_in(client: Client, path: str) -> bool:
    """Whether the client's request to ``path`` is let in (200), not closed."""
    try:
        return client.request(path).status == 200
    except CONNECTION_CLOSED:
        return False


def assert_let_in_after_unban(client: Client, path: str, front_door: str) -> None:
    """A client whose ban was lifted is let in: at once through Envoy, and
    through nginx once its cache of the ban's refusal ends (PROXY_SECONDS at
    most after it was cached), polled until then."""
    deadline = time.monotonic() + (PROXY_SECONDS + 1 if front_door == "nginx" else 0.0)
    while not let_in(client, path):
        assert time.monotonic() < deadline, f"{client.source} not let in to {path} after the unban"
        time.sleep(0.05)
