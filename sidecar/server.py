"""Sluice's HTTP listener: uvicorn's httptools protocol with a bounded request head.

uvicorn and httptools keep a request's head (request line and header fields)
in memory until its end, however long it gets: a client talking to Sluice's
port directly could send megabytes of one header field. ``LimitedHttpProtocol``
counts the bytes of each head as they arrive, before the parser gets them,
and the header fields as they are parsed. Over either limit, the client gets
``431 Request Header Fields Too Large`` and the connection is closed: Sluice
never holds more than ``max_header_bytes`` of one head (plus what came with it
in the same read), nor builds more than ``max_headers`` header fields.

The defaults are above anything the shipped proxy templates can forward in a
check request, so that no legitimate client ever meets them:

* Envoy (envoy.yaml.template: ``max_request_headers_kb: 60``,
  ``max_headers_count: 100``) forwards a check request of at most about
  61 KiB (its 60 KiB count names and values only, and ext_authz adds a few
  headers: 61,710 bytes measured) with at most 100 + 9 header fields.
* nginx (sluice.conf.template: ``large_client_header_buffers 4 8k``) takes a
  client head of at most about 33 KiB. nginx 1.29.8 and later (and Debian 12's
  1.22.1) accept at most 1000 header lines (``max_headers``); earlier ones
  (the nginx:1.27 image) as many as fit: 11,253 three-byte lines ``a:<LF>``,
  forwarded as ``a: <CR><LF>``, a check request of 56.5 KiB with 11,259
  header fields (measured). The other mixes measured forward fewer bytes
  (the URI goes twice, as request line and X-Original-URI, 8 KiB at most).

Raise the limits (``sluice serve --max-header-bytes / --max-headers``) together
with the proxies' own: a check request Sluice refuses with 431 is a denied
request through Envoy and, worse, a request let in unchecked through nginx
(auth_request takes any unexpected status for a failure and fails open).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from sidecar.ratelog import RateLimitedLog

# 128 KiB: twice the largest head either shipped proxy can forward.
DEFAULT_MAX_HEADER_BYTES = 128 * 1024
# Above the 11,259 fields an nginx without max_headers can forward (and far
# above Envoy's 100); each field costs a few hundred bytes of Python objects.
DEFAULT_MAX_HEADERS = 16_384
# After a 431, what the client still sends is read and dropped for this long,
# so that the answer is not lost to a TCP reset; then the connection closes.
LINGER_SECONDS = 2.0

log = logging.getLogger("sluice")
_refusal_log = RateLimitedLog(log, 60.0)


class HeadTooLarge(Exception):
    """Raised inside a parser callback to stop the parser at once."""


class LimitedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol refusing request heads over a byte or field count."""

    def __init__(self, *args: Any, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                 max_headers: int = DEFAULT_MAX_HEADERS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        # Bytes the current head may still take; None while no head is
        # being read (the body of a request, after its head).
        self._head_budget: int | None = max_header_bytes
        self._header_count = 0
        self._refused = False
        self._linger: asyncio.TimerHandle | None = None

    # -- reading ------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a 431: dropped unread
        self._unset_keepalive_if_required()
        rest: Any = data
        while rest:
            budget = self._head_budget
            if budget is None or len(rest) <= budget:
                chunk, rest = rest, None
            elif budget == 0:
                self._refuse(f"request head over {self.max_header_bytes} bytes")
                return
            else:
                view = memoryview(rest)
                chunk, rest = view[:budget], view[budget:]
            if budget is not None:
                self._head_budget = budget - len(chunk)
            if not self._feed(chunk):
                return

    def _feed(self, chunk: Any) -> bool:
        """Give the parser one piece; False when the connection is done for."""
        try:
            self.parser.feed_data(chunk)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, HeadTooLarge):
                self._refuse(str(exc.__context__))
            else:
                self._bad_request()
            return False
        except httptools.HttpParserError:
            self._bad_request()
            return False
        except httptools.HttpParserUpgrade:
            # As uvicorn does: the parser stops at an upgrade.
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return False
        return not self.transport.is_closing()

    def _bad_request(self) -> None:
        msg = "Invalid HTTP request received."
        self.logger.warning(msg)
        self.send_400_response(msg)

    # -- parser callbacks -----------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_headers:
            raise HeadTooLarge(f"more than {self.max_headers} header fields")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_budget = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        # The next head starts now. (Bytes of it that came in the same read
        # as the end of this request are not counted: at most one read.)
        self._head_budget = self.max_header_bytes
        super().on_message_complete()

    # -- refusing -------------------------------------------------------------

    def _refuse(self, reason: str) -> None:
        self._refused = True
        client = "%s:%d" % self.client if self.client else "a Unix socket peer"
        _refusal_log.warning("431 to %s: %s (sluice serve --max-header-bytes, --max-headers)", client, reason)
        transport = self.transport
        if self.cycle is not None and not self.cycle.response_complete:
            # A response to an earlier request on this connection is still
            # being sent: it ends the connection, with no 431 after it.
            self.cycle.keep_alive = False
            return
        body = b"Request Header Fields Too Large\n"
        content = [STATUS_LINE[431]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend([
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
            b"connection: close\r\n",
            b"\r\n",
            body,
        ])
        transport.write(b"".join(content))
        if transport.can_write_eof():
            # Half-close, read and drop what the client still sends, close
            # when it does or at the deadline.
            transport.write_eof()
            self._linger = self.loop.call_later(LINGER_SECONDS, transport.close)
        else:
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        super().connection_lost(exc)


def protocol_factory(max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                     max_headers: int = DEFAULT_MAX_HEADERS) -> Any:
    """What to give uvicorn as ``http=``: picklable, for worker processes."""
    return functools.partial(LimitedHttpProtocol, max_header_bytes=max_header_bytes, max_headers=max_headers)
