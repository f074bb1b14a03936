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
import gc
import logging
import urllib.parse
from typing import Any, cast

import httptools
from uvicorn.protocols.http.httptools_impl import HEADER_VALUE_RE, STATUS_LINE, HttpToolsProtocol

from sidecar.asgi import Scope
from sidecar.frontdoors.common import Check, Reply, encode_headers, header_map, new_request_id
from sidecar.overload import STORED_KEY_FIELDS
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


class CheckInFlight:
    """What uvicorn's protocol reads of its request cycle, for a check the
    protocol answers after awaiting the store: an unfinished response holds
    later requests of the connection in uvicorn's pipeline; a lost
    connection or a shutdown is noted here."""

    __slots__ = ("response_complete", "keep_alive", "disconnected", "message_event")

    def __init__(self, keep_alive: bool) -> None:
        self.response_complete = False
        self.keep_alive = keep_alive  # a shutdown turns it off
        self.disconnected = False
        self.message_event = _NoEvent()


class _NoEvent:
    """uvicorn sets its cycle's event when the connection is lost; nothing waits on ours."""

    __slots__ = ()

    def set(self) -> None:
        pass


class LimitedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol refusing request heads over a byte or field count,
    and answering checks itself.

    A check the state store answers at once (the memory store) is decided
    and answered inside the parser's callback: no task, no ASGI messages, no
    per-request cycle object, which is most of what uvicorn costs per
    request. A check over a shared store is awaited in a task of its own,
    still without ASGI. Everything else (other paths, a check behind an
    unfinished response on the same connection, a check a leaky bucket
    holds) goes through uvicorn's ASGI machinery unchanged.
    """

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
        # The application's own check routes, when it has them (sidecar.app).
        self._check_for = getattr(self.app, "check_for", None)
        # The check front door of the request being read, answered here.
        self._check: Check | None = None
        # Reading stopped until the client takes the answers written so far.
        self._reading_paused_for_writes = False
        watch = getattr(self.app, "watch", None)
        if watch is not None:
            watch.watch(self.loop)
        # Refusals answered again as stored bytes (sidecar.overload.AddressRefusals).
        self._stored: Any = getattr(self.app, "stored_refusals", None)

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
        self._check = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_headers:
            raise HeadTooLarge(f"more than {self.max_headers} header fields")
        # What uvicorn's on_header does, without the call: this runs for
        # every header field of every check.
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_budget = None
        self._check = self._own_check()
        if self._check is None:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._check is None:  # a check's body is never read
            super().on_body(body)

    def on_message_complete(self) -> None:
        # The next head starts now. (Bytes of it that came in the same read
        # as the end of this request are not counted: at most one read.)
        self._head_budget = self.max_header_bytes
        check, self._check = self._check, None
        if check is None:
            super().on_message_complete()
            return
        scope = cast(Scope, self.scope)
        if self._stored and self._answer_stored(check, scope):
            return
        if not self.app.answers_at_once:
            self._answer_later(check, scope)
            return
        reply = self.app.check_at_once(check, scope, header_map(scope))
        if reply is None:
            # Held by a leaky bucket: the ASGI path waits and answers, in order
            # with what follows on this connection.
            super().on_headers_complete()
            super().on_message_complete()
            return
        self._write(reply)

    # -- checks answered by the protocol ----------------------------------------

    def _own_check(self) -> Check | None:
        """The check front door of this request when the protocol may answer
        it itself: nothing else is in progress on the connection."""
        if self._check_for is None or self.pipeline or self.expect_100_continue or \
                (self.cycle is not None and not self.cycle.response_complete) or self.parser.should_upgrade():
            return None
        try:
            url = httptools.parse_url(self.url)
            raw_path = url.path
            path = raw_path.decode("ascii")
        except (httptools.HttpParserInvalidURLError, UnicodeDecodeError):
            return None  # uvicorn's own path answers it as it always has
        check = self._check_for(urllib.parse.unquote(path) if "%" in path else path)
        if check is not None:
            scope = self.scope
            scope["method"] = self.parser.get_method().decode("ascii")
            scope["http_version"] = self.parser.get_http_version()
            scope["path"] = path
            scope["raw_path"] = raw_path
            scope["query_string"] = url.query or b""
        return check

    def _answer_stored(self, check: Check, scope: Scope) -> bool:
        """Answer a check from a stored refusal of its client, without a
        decision; False when there is none for it (the check is decided).
        Only on a connection kept alive, when the header fields that make the
        key come once each, as the protocol writes answers itself."""
        if self.server_state.default_headers or not self._keep_alive(scope):
            return False
        fields = dict(self.headers)
        if len(fields) != len(self.headers):
            return False
        # As request_id_of: the proxy's, or a new one.
        request_id = fields.get(b"x-request-id") or new_request_id().encode("ascii")
        peer, forwarded, original_host, host, accept = (fields.get(name) for name in _STORED_KEY_FIELDS)
        key = (check.front_door, scope["method"], _text(peer), _text(forwarded), _text(original_host), _text(host),
               _text(accept))
        answer = self.app.refused_at_once(check, key, request_id)
        if answer is None:
            return False
        self.transport.write(answer)
        self._answered()
        return True

    def _keep_alive(self, scope: Scope) -> bool:
        """Whether the connection may carry another request, as uvicorn decides it."""
        return scope["http_version"] != "1.0" and self.parser.should_keep_alive()

    def _answer_later(self, check: Check, scope: Scope) -> None:
        """Await the decision in a task; meanwhile ``CheckInFlight`` stands
        in for uvicorn's cycle, so what follows on the connection waits in
        uvicorn's pipeline, as behind any unfinished response."""
        waiting = CheckInFlight(self._keep_alive(scope))
        # Not a RequestResponseCycle, but all of one that uvicorn reads here.
        self.cycle = cast(Any, waiting)
        task = self.loop.create_task(self._finish(check, scope, header_map(scope), waiting))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    async def _finish(self, check: Check, scope: Scope, headers: dict[str, str], waiting: CheckInFlight) -> None:
        reply = await self.app.check_later(check, scope, headers)
        waiting.response_complete = True
        if waiting.disconnected or self.transport.is_closing():
            return  # counted, as on the ASGI path; nobody to tell
        self._send(reply, scope["method"], waiting.keep_alive)
        self._answered()

    def _write(self, reply: Reply) -> None:
        """Write a check's answer as uvicorn would have, at once."""
        scope = cast(Scope, self.scope)
        self._send(reply, scope["method"], self._keep_alive(scope))
        self._answered()

    def _answered(self) -> None:
        """Carry on as uvicorn does when a response is complete (the next
        pipelined request, or the keep-alive timer). A client that sends
        checks without reading the answers is not read from until it takes
        them, as uvicorn's own responses wait for the client."""
        self.on_response_complete()  # resumes reading: paused again below while writes are
        if self.flow.write_paused and not self.transport.is_closing():
            self._reading_paused_for_writes = True
            self.flow.pause_reading()

    def _send(self, reply: Reply, method: str, keep_alive: bool) -> None:
        """Write the answer, and close the connection when it ends with it."""
        content, keep_alive = encode_reply(reply, method, keep_alive, self.server_state.default_headers)
        self.transport.write(content)
        if not keep_alive:
            self.transport.close()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._reading_paused_for_writes:
            self._reading_paused_for_writes = False
            self.flow.resume_reading()

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


_STORED_KEY_FIELDS = tuple(name.encode("ascii") for name in STORED_KEY_FIELDS)


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None


def encode_reply(reply: Reply, method: str, keep_alive: bool,
                 default_headers: list[tuple[bytes, bytes]]) -> tuple[bytes, bool]:
    """A check's answer as uvicorn would have written it, and whether the
    connection stays open after it."""
    status, headers, body = reply
    content = [STATUS_LINE[status]]
    asks_close = False
    for name, value in default_headers:
        content.extend([name, b": ", value, b"\r\n"])
    for name, value in encode_headers(headers):
        if HEADER_VALUE_RE.search(value):
            value = b""  # never a forged header line; no value of ours has one
        if name == b"connection" and b"close" in value.lower():
            keep_alive, asks_close = False, True
        content.extend([name, b": ", value, b"\r\n"])
    content.extend([b"content-length: ", str(len(body)).encode("ascii"), b"\r\n"])
    if not keep_alive and not asks_close:
        content.append(b"connection: close\r\n")
    content.append(b"\r\n")
    if body and method != "HEAD":
        content.append(body)
    return b"".join(content), keep_alive


# Young objects between two collections of the youngest generation (Python's
# default is 700). A decision allocates a few objects per rule, nearly all
# freed by reference counting at once; at the default, a young collection ran
# every hundred or so decisions, and under key rotation those collections
# (and the older generations' they trigger) over the 100,000 states of a full
# store cost a fifth of every decision (bench/bench_engine.py: 89 against
# 72 µs per decision; 72 with the collector off altogether). Cycles are still
# collected, just in larger batches.
YOUNG_GENERATION_THRESHOLD = 10_000


def tune_garbage_collector() -> None:
    """The collector settings of a Sluice process (``sluice serve`` and
    each worker)."""
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, middle, oldest)


def freeze_loaded_objects() -> None:
    """Keep what a started process has loaded (modules, the framework, the
    rules) out of every later collection of the oldest generation.

    Each full collection walks every object of that generation, and under
    key rotation one runs every few thousand decisions: without this, the
    hundreds of thousands of objects of the imported packages were walked
    each time, besides the store's states. They live as long as the process,
    so freezing them loses nothing; objects made later are collected as
    always."""
    gc.collect()
    gc.freeze()


def protocol_factory(max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                     max_headers: int = DEFAULT_MAX_HEADERS) -> Any:
    """What to give uvicorn as ``http=``: picklable, for worker processes."""
    return functools.partial(LimitedHttpProtocol, max_header_bytes=max_header_bytes, max_headers=max_headers)
