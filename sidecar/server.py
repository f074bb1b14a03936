"""Sluice's HTTP/1.1 listener: a protocol of its own on httptools' parser,
which answers checks itself and hands every other request to ASGI.

uvicorn runs the server (sockets, worker processes, lifespan, signals) and
builds one ``LimitedHttpProtocol`` per connection, as it builds its own
protocols (``uvicorn.run(http=...)``). What the protocol reads of uvicorn is
that seam and nothing else: the keywords it is built with, the ``Config``'s
``loaded_app`` and ``timeout_keep_alive``, and the ``ServerState``'s
``connections`` (each is told ``shutdown()`` on the way out), ``tasks``
(awaited on the way out), ``default_headers`` and ``total_requests``.
tests/unit/test_server.py runs a real ``uvicorn.Server`` over it, so that
an upgrade of uvicorn that changes the seam fails there.

A check is answered by the protocol itself when nothing else is in progress
on the connection: the application's door for the check's route (its
``check_doors``, sidecar.app) is asked once, when the request ends, and
answers at once inside the parser's callback (the memory store), or with a
coroutine the protocol awaits in a task of its own (a shared store); no
ASGI messages either way. Every other request is an ``AsgiExchange``
(sidecar.exchange): health, metrics, the admin API, a check a leaky bucket
holds, a check behind an unfinished answer on the same connection. Answers
go out in the order of the requests (pipelining, RFC 9112 section 9.3.2); a
connection stays open between requests until ``timeout_keep_alive`` seconds
pass without one.

Request heads are bounded. httptools would keep a request's head (request
line and header fields) in memory until its end, however long it gets: a
client talking to Sluice's port directly could send megabytes of one header
field. ``LimitedHttpProtocol`` counts the bytes of each head as they arrive,
before the parser gets them, and the header fields as they are parsed. Over
either limit, the client gets ``431 Request Header Fields Too Large`` and
the connection is closed: Sluice never holds more than ``max_header_bytes``
of one head (plus what came with it in the same read), nor builds more than
``max_headers`` header fields.

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
import collections
import functools
import gc
import logging
import urllib.parse
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import httptools

from sidecar import core
from sidecar.asgi import Scope
from sidecar.exchange import BARE_ANSWER, App, AsgiExchange, closing_answer, encode_reply
from sidecar.frontdoors.common import HEADER_MAP, Reply
from sidecar.frontdoors.routes import RouteTable
from sidecar.httphead import field_list, read_head
from sidecar.overload import AddressRefusals, LoopWatch
from sidecar.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from uvicorn.config import Config
    from uvicorn.server import ServerState

# 128 KiB: twice the largest head either shipped proxy can forward.
DEFAULT_MAX_HEADER_BYTES = 128 * 1024
# Above the 11,259 fields an nginx without max_headers can forward (and far
# above Envoy's 100); each field costs a few hundred bytes of Python objects.
DEFAULT_MAX_HEADERS = 16_384
# After a 431, what the client still sends is read and dropped for this long,
# so that the answer is not lost to a TCP reset; then the connection closes.
LINGER_SECONDS = 2.0

# Whether a read's whole check heads are read by sidecar.httphead before
# httptools: with the compiled core only, where it reads a head in C (its
# pure-Python twin, byte by byte, costs more than httptools' callbacks).
READS_HEADS = not core.PURE

log = logging.getLogger("sluice")
_refusal_log = RateLimitedLog(log, 60.0)


class CheckDoor(Protocol):
    """One check route of the application (sidecar.app.CheckDoor), asked
    once per check, when the request has ended."""

    refusals: AddressRefusals  # the stored refusals: asked ``again`` only while it has entries

    def again(self, method: str, headers: dict[str, str]) -> bytes | None:
        """A stored refusal's bytes for a check of this method and header
        map, asked before its scope is made (on a connection kept alive and
        without ``default_headers``); None: the check is the door's to answer."""

    def answer(self, scope: Scope, keep_alive: bool, default_headers: list[tuple[bytes, bytes]]
               ) -> bytes | Reply | Awaitable[Reply] | None:
        """A stored answer's bytes, written as they are (only on a
        connection kept alive and without ``default_headers``); the front
        door's reply, written at once; a coroutine that gives it, awaited
        in a task; or None: the ASGI path answers (a request a leaky bucket
        holds, one the next auth service is asked about)."""


class CheckService(Protocol):
    """What the protocol asks of an application that has checks (sidecar.app.SluiceApp)."""

    watch: LoopWatch
    check_doors: RouteTable[CheckDoor]


def has_checks(app: object) -> TypeGuard[CheckService]:
    return hasattr(app, "check_doors")


class HeadTooLarge(Exception):
    """Raised inside a parser callback to stop the parser at once."""


class ConnectionEnding(Exception):
    """Raised inside a parser callback: an answer closed the connection, so
    no later request on it is read (nor decided)."""


class PendingCheck:
    """A check the protocol answers after awaiting the store: what follows
    on the connection waits behind it, as behind any unfinished answer."""

    __slots__ = ("keep_alive", "response_complete")

    def __init__(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive  # a shutdown turns it off
        self.response_complete = False

    def connection_lost(self) -> None:
        """Nothing to tell: the answer is dropped when the decision comes."""


class LimitedHttpProtocol:
    """One HTTP/1.1 connection to Sluice: bounded request heads, checks
    answered by the protocol, everything else through ASGI. An
    ``asyncio.Protocol`` by its methods (the compiled core's is an
    extension type, which cannot subclass it)."""

    transport: asyncio.Transport

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *,
                 max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, max_headers: int = DEFAULT_MAX_HEADERS) -> None:
        if not config.loaded:
            config.load()
        self.app: App = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.app_state = app_state
        self.keep_alive_seconds: float = config.timeout_keep_alive
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        # The application's own check routes, when it has them (sidecar.app).
        self.checks = self.app if has_checks(self.app) else None
        self.doors = self.checks.check_doors if self.checks is not None else None
        self.parser: Any = httptools.HttpRequestParser(self)
        try:
            # Answer the first of several pipelined requests even when it
            # asks to close the connection (httptools 0.6.3 and later).
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:  # pragma: no cover
            pass
        self.client: tuple[str, int] | None = None
        self.server: tuple[str, int | None] | None = None
        self.scheme = "http"
        # Bytes the current head may still take; None while no head is
        # being read (the body of a request, after its head).
        self._head_budget: int | None = max_header_bytes
        self._header_count = 0
        self._refused = False
        # Whether the parser is between two requests (none begun): only
        # then may sidecar.httphead read the next heads instead.
        self._between_requests = True
        self._linger: asyncio.TimerHandle | None = None
        # The request being read: its head, and what answers it.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._expect_continue = False
        self._keep_alive = True
        self._scope: Scope = {}
        self._door: CheckDoor | None = None  # the door of a check the protocol answers
        self._exchange: AsgiExchange | None = None  # or the exchange its body goes to
        # The answer being written, and the exchanges waiting behind it.
        self._responding: AsgiExchange | PendingCheck | None = None
        self._waiting: collections.deque[AsgiExchange] = collections.deque()
        # Flow control: reading paused (a body not taken yet, requests
        # waiting, a client not taking its answers), writing paused by the
        # transport.
        self.read_paused = False
        self.write_paused = False
        self._reading_paused_for_writes = False
        self._writable: asyncio.Event | None = None
        # Keep-alive: when the connection fell idle (None while a request
        # is read or answered), and the one timer that closes it.
        self._idle_since: float | None = None
        self._keep_alive_timer: asyncio.TimerHandle | None = None

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:
        """What uvicorn adds to every answer (Sluice runs without Server and Date)."""
        return self.server_state.default_headers

    # -- the connection -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        # uvicorn types the set with its own protocols; of each it calls
        # shutdown() only (tests/unit/test_server.py runs its shutdown).
        self.server_state.connections.add(self)  # type: ignore[arg-type]
        self.client = _remote_address(transport)
        self.server = _local_address(transport)
        if transport.get_extra_info("sslcontext"):
            self.scheme = "https"
        # Every request's scope on this connection is a copy of this one,
        # its own fields set (_request_scope): copying a dict of these keys
        # costs a fifth of making one key by key.
        self._scope_template = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "server": self.server, "client": self.client, "scheme": self.scheme, "root_path": "",
            "headers": None, "state": None, "method": "", "path": "", "raw_path": b"", "query_string": b"",
            HEADER_MAP: None}
        if self.checks is not None:
            self.checks.watch.watch(self.loop)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        for timer in (self._linger, self._keep_alive_timer):
            if timer is not None:
                timer.cancel()
        self._linger = self._keep_alive_timer = None
        if self._responding is not None:
            self._responding.connection_lost()
        self._waiting.clear()
        self.write_paused = False
        self._wake_writers()  # nothing waits to write any more
        if exc is None:
            self.transport.close()
        self.parser = None  # the parser refers to the protocol: no cycle left behind

    def eof_received(self) -> bool | None:
        """The client will send no more: close once the answers in progress
        are written (``asyncio.Protocol``'s own answer, None)."""
        return None

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close now when idle, else after the
        answer being written."""
        if self._responding is None:
            self.transport.close()
        else:
            self._responding.keep_alive = False

    # -- reading ------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a 431: dropped unread
        self._idle_since = None
        rest: Any = data
        if READS_HEADS and self._between_requests and self.doors is not None and type(data) is bytes:
            rest = self._read_checks(data)
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

    def _read_checks(self, data: bytes) -> bytes | None:
        """Answer the checks whose heads ``data`` holds whole and
        sidecar.httphead reads (a GET or HEAD, no body, the connection kept
        open), each as the parser's callbacks would; what it does not read
        goes to the parser as ``data_received`` gives it: within the head
        budget, the rest of that piece at once (its bytes after a request's
        end are not counted), and what is left is returned (None: nothing,
        or the connection is done for)."""
        budget = self._head_budget
        assert budget is not None  # between requests
        window = min(len(data), budget)
        doors = self.doors
        assert doors is not None
        start = 0
        while start < window:
            if self._responding is not None or self.transport.is_closing():
                break  # behind an unfinished answer, or after the last: the parser's
            head = read_head(data, start, self.max_headers)
            if head is None or head[5] > window:
                break
            method, path, raw_path, query, fields, head_end = head
            if "%" in path:
                path = urllib.parse.unquote(path)
            door = doors.exact.get(path) or doors.find(path)
            if door is None:
                break  # not a check: the parser reads it for the ASGI path
            start = head_end
            self._keep_alive = True
            if door.refusals.entries and not self.server_state.default_headers:
                # A refusal answered again from its bytes, without a scope.
                stored = door.again(method, fields)
                if stored is not None:
                    self.transport.write(stored)
                    self._answered()
                    continue
            # The fields as ASGI lists them are made only for the ASGI path (_answer).
            scope = self._request_scope("1.1", method, path, raw_path, query, None)
            scope[HEADER_MAP] = fields
            self._answer(door, scope)
        if start == 0:
            return data
        # As the parser's on_message_complete leaves it.
        self._head_budget = self.max_header_bytes
        if start < window and not self._feed(data[start:window]):
            return None
        return data[window:] if window < len(data) else None

    def _request_scope(self, http_version: str, method: str, path: str, raw_path: bytes, query: bytes,
                       headers: list[tuple[bytes, bytes]] | None) -> Scope:
        """A request's ASGI scope on this connection, however its head was
        read (``headers`` None: a check's head read by sidecar.httphead,
        whose fields are the scope's ``HEADER_MAP`` until it goes to ASGI:
        None until then). The connection's fields are its own at
        ``connection_made``; the ``asgi`` version dict is the connection's."""
        scope: Scope = self._scope_template.copy()
        scope["http_version"] = http_version
        scope["headers"] = headers
        scope["state"] = self.app_state.copy()
        scope["method"] = method
        scope["path"] = path
        scope["raw_path"] = raw_path
        scope["query_string"] = query
        return scope

    def _feed(self, chunk: Any) -> bool:
        """Give the parser one piece; False when the connection is done for."""
        try:
            self.parser.feed_data(chunk)
        except httptools.HttpParserCallbackError as exc:
            self._between_requests = False
            if isinstance(exc.__context__, HeadTooLarge):
                self._refuse(str(exc.__context__))
            elif not isinstance(exc.__context__, ConnectionEnding):
                self._bad_request()
            return False
        except httptools.HttpParserError:
            self._between_requests = False
            self._bad_request()
            return False
        except httptools.HttpParserUpgrade:
            self._between_requests = False  # the parser reads nothing more
            # The parser stops at an upgrade; Sluice speaks no other protocol.
            log.warning("Unsupported upgrade request.")
            return False
        return not self.transport.is_closing()

    def _bad_request(self) -> None:
        message = "Invalid HTTP request received."
        log.warning(message)
        self.transport.write(closing_answer(400, message.encode("ascii"), self.default_headers))
        self.transport.close()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    # -- parser callbacks -----------------------------------------------------

    def on_message_begin(self) -> None:
        if self.transport.is_closing():
            raise ConnectionEnding
        self._between_requests = False
        self._url = b""
        self._headers = []
        self._header_count = 0
        self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_headers:
            raise HeadTooLarge(f"more than {self.max_headers} header fields")
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_budget = None
        parser = self.parser
        http_version = parser.get_http_version()
        self._keep_alive = keep_alive = http_version != "1.0" and parser.should_keep_alive()
        url = httptools.parse_url(self._url)  # an invalid one stops the parser: 400
        raw_path = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        self._scope = scope = self._request_scope(http_version, parser.get_method().decode("ascii"), path,
                                                  raw_path, url.query or b"", self._headers)
        if self._responding is None and self.doors is not None and not self._expect_continue \
                and not parser.should_upgrade():
            self._door = self.doors.find(path)
            if self._door is not None:
                return
        self._exchange = exchange = AsgiExchange(scope, self, keep_alive, self._expect_continue)
        if self._responding is None:
            self._start(exchange)
        else:
            # Pipelined behind an unfinished answer: served in turn.
            self.pause_reading()
            self._waiting.append(exchange)

    def on_body(self, body: bytes) -> None:
        if self._exchange is not None:  # a check's body is never read
            self._exchange.body_received(body)

    def on_message_complete(self) -> None:
        # The next head starts now. (Bytes of it that came in the same read
        # as the end of this request are not counted: at most one read.)
        self._head_budget = self.max_header_bytes
        self._between_requests = True
        exchange, self._exchange = self._exchange, None
        if exchange is not None:
            exchange.request_complete()
            return
        door, self._door = self._door, None
        if door is not None:
            self._answer(door, self._scope)

    # -- checks answered by the protocol ----------------------------------------

    def _answer(self, door: CheckDoor, scope: Scope) -> None:
        """Ask the check's door, once, and write what it answers (see
        ``CheckDoor.answer``)."""
        keep_alive = self._keep_alive
        default_headers = self.server_state.default_headers
        answer = door.answer(scope, keep_alive, default_headers)
        transport = self.transport
        if isinstance(answer, Reply):
            # As _send, written out: this runs for nearly every check.
            if keep_alive and not default_headers and not answer.headers and not answer.body:
                content = BARE_ANSWER[answer.status]  # encode_reply's first answer, without its (interpreted) call
            else:
                content, keep_alive = encode_reply(answer, scope["method"], keep_alive, default_headers)
            transport.write(content)
            if not keep_alive:
                transport.close()
        elif answer is None:
            # Held by a leaky bucket (or to be asked of the next auth
            # service): the ASGI path waits and answers, in order with what
            # follows on this connection.
            if scope["headers"] is None:
                scope["headers"] = field_list(scope[HEADER_MAP])
            exchange = AsgiExchange(scope, self, keep_alive, False)
            exchange.request_complete()
            self._start(exchange)
            return
        elif isinstance(answer, bytes):
            transport.write(answer)  # a stored refusal's
        else:
            # Awaited in a task; what follows on the connection waits behind it.
            pending = PendingCheck(keep_alive)
            self._responding = pending
            self._track(self.loop.create_task(self._finish(answer, scope["method"], pending)))
            return
        # As _answered, written out.
        self.response_complete()
        if self.write_paused and not transport.is_closing():
            self._reading_paused_for_writes = True
            self.pause_reading()

    async def _finish(self, answer: Awaitable[Reply], method: str, pending: PendingCheck) -> None:
        reply = await answer
        pending.response_complete = True
        if self.transport.is_closing():
            return  # counted, as on the ASGI path; nobody to tell
        self._send(reply, method, pending.keep_alive)
        self._answered()

    def _send(self, reply: Reply, method: str, keep_alive: bool) -> None:
        """Write the answer, and close the connection when it ends with it."""
        content, keep_alive = encode_reply(reply, method, keep_alive, self.server_state.default_headers)
        self.transport.write(content)
        if not keep_alive:
            self.transport.close()

    def _answered(self) -> None:
        """A check's answer is written. A client that sends checks without
        reading the answers is not read from until it takes them, as an
        ASGI answer waits for the client."""
        self.response_complete()
        if self.write_paused and not self.transport.is_closing():
            self._reading_paused_for_writes = True
            self.pause_reading()

    # -- answers in order ---------------------------------------------------------

    def _start(self, exchange: AsgiExchange) -> None:
        self._responding = exchange
        self._track(self.loop.create_task(exchange.run(self.app)))

    def _track(self, task: asyncio.Task[None]) -> None:
        """uvicorn's shutdown waits for the server's tasks."""
        tasks = self.server_state.tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def response_complete(self) -> None:
        """The answer in progress is written: serve the next request
        waiting, or wait for one."""
        self.server_state.total_requests += 1
        self._responding = None
        if self.transport.is_closing():
            return
        if self.read_paused:
            self.resume_reading()
        if self._waiting:
            self._start(self._waiting.popleft())
        else:
            self._idle_since = self.loop.time()
            if self._keep_alive_timer is None:
                self._keep_alive_timer = self.loop.call_later(self.keep_alive_seconds, self._keep_alive_expired)

    def _keep_alive_expired(self) -> None:
        """Close the connection when it has been idle long enough. One timer
        per connection, not one per answer: when it fires early (the
        connection was busy meanwhile), it waits again for what is left."""
        self._keep_alive_timer = None
        idle_since = self._idle_since
        if idle_since is None or self.transport.is_closing():
            return  # busy: the next answer arms it again
        left = idle_since + self.keep_alive_seconds - self.loop.time()
        if left > 0:
            self._keep_alive_timer = self.loop.call_later(left, self._keep_alive_expired)
        else:
            self.transport.close()

    # -- writing ----------------------------------------------------------------

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writers()
        if self._reading_paused_for_writes:
            self._reading_paused_for_writes = False
            self.resume_reading()

    def _wake_writers(self) -> None:
        if self._writable is not None:
            self._writable.set()
            self._writable = None

    async def drain(self) -> None:
        if self.write_paused:
            if self._writable is None:
                self._writable = asyncio.Event()
            await self._writable.wait()

    # -- refusing -------------------------------------------------------------

    def _refuse(self, reason: str) -> None:
        self._refused = True
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a Unix socket peer"
        _refusal_log.warning("431 to %s: %s (sluice serve --max-header-bytes, --max-headers)", client, reason)
        last = self._waiting[-1] if self._waiting else self._responding
        if last is not None:
            # Answers to earlier requests on this connection are still to be
            # sent: the last one ends the connection, with no 431 after it.
            last.keep_alive = False
            return
        transport = self.transport
        transport.write(closing_answer(431, b"Request Header Fields Too Large\n", self.default_headers))
        if transport.can_write_eof():
            # Half-close, read and drop what the client still sends, close
            # when it does or at the deadline.
            transport.write_eof()
            self._linger = self.loop.call_later(LINGER_SECONDS, transport.close)
        else:
            transport.close()


def _remote_address(transport: asyncio.Transport) -> tuple[str, int] | None:
    """The peer's (host, port); None for a Unix socket's peer."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            info = sock.getpeername()
        except OSError:  # uvloop, now and then, for a Unix socket's peer
            return None
    else:
        info = transport.get_extra_info("peername")
    return (str(info[0]), int(info[1])) if isinstance(info, (tuple, list)) and len(info) >= 2 else None


def _local_address(transport: asyncio.Transport) -> tuple[str, int | None] | None:
    """The listening end's (host, port), or (path, None) for a Unix socket."""
    sock = transport.get_extra_info("socket")
    info = sock.getsockname() if sock is not None else transport.get_extra_info("sockname")
    if isinstance(info, (tuple, list)) and len(info) >= 2:
        return (str(info[0]), int(info[1]))
    return (info, None) if isinstance(info, str) else None


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
    always.

    Collections run until they stop untracking: a collection untracks a
    tuple only when its items are untracked already, and a rule's key
    prefix is a tuple holding a tuple (its dimensions' names). Frozen while
    still tracked, a prefix would keep tracked every counting key built on
    it, for as long as the key is stored: every full collection would walk
    the store's keys, and every eviction would unlink one from the
    collector's lists. Untracked, a key is untracked by its first young
    collection."""
    tracked = len(gc.get_objects())
    while True:
        gc.collect()
        left = len(gc.get_objects())
        if left >= tracked:
            break
        tracked = left
    gc.freeze()


def protocol_factory(max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                     max_headers: int = DEFAULT_MAX_HEADERS) -> functools.partial[LimitedHttpProtocol]:
    """What to give uvicorn as ``http=``: picklable, for worker processes."""
    return functools.partial(LimitedHttpProtocol, max_header_bytes=max_header_bytes, max_headers=max_headers)
