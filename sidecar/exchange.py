"""One request of Sluice's HTTP connection answered by the ASGI application,
and the HTTP/1.1 of the answers the connection writes itself.

Checks are answered by the connection itself (sidecar.server, in the bytes
``encode_reply`` writes); every other
request (health, metrics, the admin API, the deny page, a check a leaky
bucket holds, a check behind an unfinished answer on the same connection)
is handed to the application as ASGI 3 (spec version 2.3): ``AsgiExchange``
is its ``receive`` and ``send``, and writes the answer as HTTP/1.1.

What it writes follows RFC 9112: a response without ``content-length`` is
sent chunked (section 7.1), except to HEAD and for 204 and 304, which have
no body (RFC 9110 section 6.4.1); HTTP/1.0 and ``connection: close`` end
the connection after the answer (RFC 9112 section 9.3).
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from sidecar.asgi import Message, Receive, Scope, Send

if TYPE_CHECKING:
    from sidecar.frontdoors.common import Reply

# An ASGI 3 application. It should return None; what else it returns is
# reported (as uvicorn reports it), hence ``object``.
App = Callable[[Scope, Receive, Send], Awaitable[object]]

# A request body buffered beyond this stops reading the connection until
# the application takes it.
BODY_HIGH_WATER = 64 * 1024

# Bytes never sent in a header name (RFC 9110 section 5.1: a token) or
# value (section 5.5: no control character but tab).
HEADER_NAME_FORBIDDEN = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
HEADER_VALUE_FORBIDDEN = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
# The same bytes, for ``forbidden_in_value``: deleting them is a C loop
# over the value, some three times as fast as the search over a page.
_VALUE_FORBIDDEN_BYTES = bytes([*range(0x00, 0x09), *range(0x0a, 0x20), 0x7f])


def forbidden_in_value(value: bytes) -> bool:
    """Whether a header field's value has a byte HEADER_VALUE_FORBIDDEN finds."""
    return len(value.translate(None, _VALUE_FORBIDDEN_BYTES)) != len(value)


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


STATUS_LINE = {status: _status_line(status) for status in range(100, 600)}
# The whole answer of a status with no header field and no body, on a
# connection kept open without default header fields: what nearly every
# allowed check gets, written once here.
BARE_ANSWER = {status: line + b"content-length: 0\r\n\r\n" for status, line in STATUS_LINE.items()}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

log = logging.getLogger("sluice")


def closing_answer(status: int, message: bytes, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A plain-text answer after which the connection closes (400, 431)."""
    content = [STATUS_LINE[status]]
    for name, value in default_headers:
        content.extend([name, b": ", value, b"\r\n"])
    content.extend([b"content-type: text/plain; charset=utf-8\r\ncontent-length: ", b"%d" % len(message),
                    b"\r\nconnection: close\r\n\r\n", message])
    return b"".join(content)


def encode_headers(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """A front door's header fields as ASGI and HTTP/1.1 carry them."""
    return [(name.lower().encode("latin-1"), value.encode("latin-1", "replace"))
            for name, value in headers]


def encode_reply(reply: Reply, method: str, keep_alive: bool,
                 default_headers: list[tuple[bytes, bytes]]) -> tuple[bytes, bool]:
    """A check's answer as HTTP/1.1, and whether the connection stays open
    after it."""
    status, headers, body = reply
    if not headers and not body and keep_alive and not default_headers:
        return BARE_ANSWER[status], True
    content = [STATUS_LINE[status]]
    asks_close = False
    for raw_name, raw_value in default_headers:
        content.extend([raw_name, b": ", raw_value, b"\r\n"])
    for name, value in headers:  # as encode_headers encodes them, written out
        raw_name, raw_value = name.lower().encode("latin-1"), value.encode("latin-1", "replace")
        if forbidden_in_value(raw_value):
            raw_value = b""  # never a forged header line; no value of ours has one
        if raw_name == b"connection" and b"close" in raw_value.lower():
            keep_alive, asks_close = False, True
        content.extend([raw_name, b": ", raw_value, b"\r\n"])
    content.extend([b"content-length: ", str(len(body)).encode("ascii"), b"\r\n"])
    if not keep_alive and not asks_close:
        content.append(b"connection: close\r\n")
    content.append(b"\r\n")
    if body and method != "HEAD":
        content.append(body)
    return b"".join(content), keep_alive


class Connection(Protocol):
    """What an exchange needs of the connection it answers on."""

    transport: asyncio.Transport

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]: ...

    @property
    def write_paused(self) -> bool: ...

    async def drain(self) -> None:
        """Return once the client has taken enough of what was written."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def response_complete(self) -> None:
        """The answer was written in full: the next request may be served."""


class AsgiExchange:
    """The ASGI ``receive`` and ``send`` of one request, and the HTTP/1.1
    answer they write."""

    def __init__(self, scope: Scope, connection: Connection, keep_alive: bool, expect_continue: bool) -> None:
        self.scope = scope
        self.connection = connection
        self.transport = connection.transport
        self.keep_alive = keep_alive  # a shutdown turns it off
        self.waiting_for_continue = expect_continue
        self.disconnected = False
        # The request body read and not yet received by the application.
        self.body = bytearray()
        self.more_body = True
        self.message_event = asyncio.Event()
        self.response_started = False
        self.response_complete = False
        self.chunked = False
        self.length_left = 0

    # -- from the connection ----------------------------------------------------

    def body_received(self, body: bytes) -> None:
        if self.response_complete:
            return  # answered already: what is left of the body is dropped
        self.body += body
        if len(self.body) > BODY_HIGH_WATER:
            self.connection.pause_reading()
        self.message_event.set()

    def request_complete(self) -> None:
        if not self.response_complete:
            self.more_body = False
            self.message_event.set()

    def connection_lost(self) -> None:
        if not self.response_complete:
            self.disconnected = True
        self.message_event.set()

    # -- the application ----------------------------------------------------------

    async def run(self, app: App) -> None:
        """Run the application on this request; answer 500 when it fails
        before answering, close the connection when it fails after."""
        try:
            result = await app(self.scope, self.receive, self.send)
        except BaseException:
            log.exception("Exception in ASGI application")
            if not self.response_started:
                await self._send_500()
            else:
                self.transport.close()
            return
        if result is not None:
            log.error("ASGI callable should return None, but returned %r.", result)
            self.transport.close()
        elif not self.response_started and not self.disconnected:
            log.error("ASGI callable returned without starting response.")
            await self._send_500()
        elif not self.response_complete and not self.disconnected:
            log.error("ASGI callable returned without completing response.")
            self.transport.close()

    async def _send_500(self) -> None:
        await self.send({"type": "http.response.start", "status": 500, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21"), (b"connection", b"close")]})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})

    async def receive(self) -> Message:
        if self.waiting_for_continue and not self.transport.is_closing():
            self.transport.write(CONTINUE)
            self.waiting_for_continue = False
        if not self.disconnected and not self.response_complete:
            self.connection.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        message: Message = {"type": "http.request", "body": bytes(self.body), "more_body": self.more_body}
        self.body = bytearray()
        return message

    async def send(self, message: Message) -> None:
        if self.connection.write_paused and not self.disconnected:
            await self.connection.drain()
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{message['type']}'.")
            self.response_started = True
            self.waiting_for_continue = False
            self.transport.write(self._head(message["status"], message.get("headers", [])))
        elif not self.response_complete:
            if message["type"] != "http.response.body":
                raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{message['type']}'.")
            self._write_body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"Unexpected ASGI message '{message['type']}' sent, after response already completed.")

    def _head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        content = [STATUS_LINE[status]]
        framed = False  # by content-length or transfer-encoding
        asks_close = False
        for name, value in [*self.connection.default_headers, *headers]:
            if HEADER_NAME_FORBIDDEN.search(name):
                raise RuntimeError("Invalid HTTP header name.")
            if forbidden_in_value(value):
                raise RuntimeError("Invalid HTTP header value.")
            name = name.lower()
            if name == b"content-length" and not framed:
                self.length_left = int(value.decode())
                framed = True
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.length_left = 0
                self.chunked = framed = True
            elif name == b"connection" and b"close" in [token.lower().strip() for token in value.split(b",")]:
                self.keep_alive = False
                asks_close = True
            content.extend([name, b": ", value, b"\r\n"])
        if not self.keep_alive and not asks_close:
            content.append(b"connection: close\r\n")
        if not framed and self.scope["method"] != "HEAD" and status not in (204, 304):
            self.chunked = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        return b"".join(content)

    def _write_body(self, body: bytes, more_body: bool) -> None:
        if self.scope["method"] == "HEAD":
            self.length_left = 0
        elif self.chunked:
            content = [b"%x\r\n" % len(body), body, b"\r\n"] if body else []
            if not more_body:
                content.append(b"0\r\n\r\n")
            self.transport.write(b"".join(content))
        else:
            if len(body) > self.length_left:
                raise RuntimeError("Response content longer than Content-Length")
            self.length_left -= len(body)
            self.transport.write(body)
        if more_body:
            return
        if self.length_left != 0:
            raise RuntimeError("Response content shorter than Content-Length")
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.connection.response_complete()
