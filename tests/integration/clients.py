"""An HTTP client for the integration tests that picks its source address."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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

    def request(
        self,
        path: str,
        method: str = "GET",
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
    ) -> Reply:
        connection = http.client.HTTPConnection(
            LOOPBACK, self.port, timeout=self.timeout, source_address=(self.source, 0)
        )
        try:
            connection.request(method, path, body=body, headers=dict(headers or {}))
            response = connection.getresponse()
            return Reply(response.status, response.headers, response.read())
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
