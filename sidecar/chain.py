"""Another auth service after Sluice: ``sluice serve --then-auth URL``.

nginx allows one ``auth_request`` per location. A site whose locations
already ask an auth service (oauth2-proxy, Authelia) keeps it by naming it
here: a check of nginx's auth endpoint that Sluice admits is then asked of
that service, and its answer is what nginx gets. Sluice's own refusals never
reach it, so a flood costs the auth service nothing.

What nginx is told (sluice-location.conf, sluice-server.conf's @sluice_deny):

* the service's 2xx: 200, with Sluice's allow fields and the service's own
  (X-Auth-Request-User, Set-Cookie, ...), which the site's
  ``auth_request_set`` lines read as they read the service's before;
* its 401: 401 with its fields (Location, WWW-Authenticate), for the site's
  own ``error_page 401``. Sluice itself never answers 401 here: its
  ``close`` is a refusal with the page status 444 (``answer_before_next_auth``);
* its 403: Sluice's deny with a 403 page (@sluice_deny sends it);
* anything else, or no answer within ``--then-auth-timeout``: Sluice's deny
  with a 503 page. Authentication fails closed: a service that cannot say
  who the client is must not let the client in. Counted in
  ``sluice_then_auth_errors_total`` by reason, logged at most every 10 s.

Only nginx's endpoint chains: Envoy chains ext_authz filters itself.

The client is small on purpose: HTTP/1.1 GET over a bounded pool of kept-alive
connections, httptools' parser (already what Sluice's own listener uses), a
bounded answer head and body, one deadline for the whole exchange.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from sidecar.actions import BlockPage, PageTemplate
from sidecar.asgi import Scope
from sidecar.engine import CLOSE, DENY, Decision
from sidecar.frontdoors.common import Check, Checked, Decide, Reply, Route
from sidecar.frontdoors.nginx import (
    NGINX_AUTH_PATH,
    NGINX_DENY_STATUS,
    PAGE_HEADER,
    PAGE_STATUS_HEADER,
    PROXY_EXPIRES_HEADER,
    DenyToken,
    answer_nginx,
    describe_nginx,
    nginx_at_once,
)
from sidecar.ratelog import RateLimitedLog
from sidecar.request import CheckRequest

log = logging.getLogger("sluice")

DEFAULT_TIMEOUT = 0.5
# Connections to the service one Sluice process holds at most, busy or idle;
# a check that finds them all busy waits for one within its deadline.
POOL_SIZE = 128
# The service's answer head Sluice reads at most, and the fields of it that
# go on to nginx: with Sluice's own fields (a pending token is up to 4 KiB)
# they must fit the check location's 16 KiB proxy_buffer_size, or nginx
# would take the answer for a failure.
MAX_HEAD_BYTES = 32 * 1024
MAX_HEAD_FIELDS = 100
MAX_FORWARDED_BYTES = 10 * 1024
# An auth answer's body is read and dropped, up to this much.
MAX_BODY_BYTES = 64 * 1024
# Sluice's close (a ban, `close: true`), as a refusal @sluice_deny ends
# without a response (nginx's 444), so that 401 is the service's alone.
CLOSE_PAGE_STATUS = 444

# Why an answer could not be had, as sluice_then_auth_errors_total counts it.
REASONS = ("connect", "timeout", "closed", "invalid", "too_large", "status", "internal")

# Request fields never sent on: hop-by-hop ones (RFC 9110, 7.6.1), the
# check's own framing, and what only the proxy may say about the request,
# which the client could have sent itself and which is set again below
# from what nginx said (``forwarded_fields``).
_NOT_FORWARDED = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "proxy-authorization", "content-length", "expect", "host",
    "x-real-ip", "forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-forwarded-port",
    "x-forwarded-method", "x-forwarded-uri", "x-forwarded-prefix", "x-original-url",
})
# Answer fields never passed to nginx: hop-by-hop ones and the framing,
# the fields of Sluice's own answers, and nginx's X-Accel-* (an auth
# answer must not steer nginx's cache or redirects).
_NOT_PASSED = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "content-length", "retry-after", "x-ratelimit", "x-ratelimit-limit", "x-ratelimit-reset",
    "x-ratelimit-shadow", "ratelimit", "ratelimit-policy",
})
_OWN_PREFIXES = ("x-sluice-", "x-accel-")
# What no header line may hold (a forged line, or a broken one).
_LINE_BREAK = re.compile(r"[\r\n\x00]")

_FORBIDDEN_PAGE = BlockPage(403, PageTemplate(
    "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>403 Forbidden</title></head>"
    "<body><h1>403 Forbidden</h1><p>You are not allowed to see this page.</p>"
    "<p><small>Request ID: <code>${{request_id}}</code></small></p></body></html>"), False)
_FAILED_PAGE = BlockPage(503, PageTemplate(
    "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>503 Service Unavailable</title>"
    "</head><body><h1>503 Service Unavailable</h1><p>Signing in is not possible right now. Please try again "
    "in a moment.</p><p><small>Request ID: <code>${{request_id}}</code></small></p></body></html>"), False)
_CLOSE_PAGE = BlockPage.builtin(CLOSE_PAGE_STATUS)


class ThenAuthFailure(Exception):
    """No usable answer from the next auth service: ``reason`` is one of
    REASONS; ``unanswered`` when not one byte of an answer came."""

    def __init__(self, reason: str, unanswered: bool = False, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.unanswered = unanswered
        self.detail = detail


@dataclass(frozen=True)
class NextAuthAddress:
    """Where the next auth service answers: ``host``:``port``, and the
    request target (path and query) Sluice asks."""

    url: str
    host: str
    port: int
    target: str

    @classmethod
    def parse(cls, url: str) -> NextAuthAddress:
        """ValueError with a message a user can act on for anything but
        ``http://HOST[:PORT]/PATH[?QUERY]``."""
        example = "a URL like http://127.0.0.1:4180/oauth2/auth"
        try:
            parts = urlsplit(url)
            port = parts.port or 80
        except ValueError as exc:
            raise ValueError(f"expected {example}, got {url!r} ({exc})") from None
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected {example} (plain http, to a service beside Sluice), got {url!r}")
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"expected {example} without credentials in it, got a URL with user info")
        if parts.fragment or _LINE_BREAK.search(url) or " " in url:
            raise ValueError(f"expected {example}, got {url!r}")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(url, parts.hostname, port, target)


@dataclass(frozen=True)
class AuthAnswer:
    """The next service's status and header fields (names as it sent them)."""

    status: int
    headers: list[tuple[str, str]]


class _AnswerReader:
    """httptools' callbacks for one answer, within the head and body bounds."""

    def __init__(self, done: asyncio.Future[AuthAnswer]) -> None:
        self.done = done
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[str, str]] = []
        self.head_bytes = 0  # bytes received before the head was complete
        self.field_bytes = 0  # the head's fields
        self.head_complete = False
        self.body_bytes = 0
        self.received = False  # any byte of the answer
        self.reusable = False  # complete, kept alive, and nothing after it

    def feed(self, data: bytes) -> None:
        if self.done.done():
            self.reusable = False  # bytes after the answer: never trusted again
            return
        self.received = True
        if not self.head_complete:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self.fail(cause.reason if isinstance(cause, ThenAuthFailure) else "invalid")
            return
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self.fail("invalid")
            return
        if not self.head_complete and self.head_bytes > MAX_HEAD_BYTES:
            self.fail("too_large")

    def ended(self) -> None:
        """The service closed the connection: an answer whose head is in,
        and whose body ran to the close, is complete; anything else is not."""
        if self.head_complete and not self.done.done():
            self._answer()
        self.fail("closed")

    def fail(self, reason: str) -> None:
        self.reusable = False
        if not self.done.done():
            self.done.set_exception(ThenAuthFailure(reason, unanswered=not self.received))

    def _answer(self) -> None:
        self.done.set_result(AuthAnswer(self.parser.get_status_code(), self.headers))

    # -- httptools callbacks ------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.done.done():
            self.reusable = False  # a second answer to one request

    def on_header(self, name: bytes, value: bytes) -> None:
        self.field_bytes += len(name) + len(value) + 4
        if len(self.headers) >= MAX_HEAD_FIELDS or self.field_bytes > MAX_HEAD_BYTES:
            raise ThenAuthFailure("too_large")
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.head_complete = True
        if self.parser.get_status_code() < 200:
            # Sluice never asks for an interim answer (it sends no Expect),
            # and an upgrade is no answer to a check.
            raise ThenAuthFailure("invalid")

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > MAX_BODY_BYTES:
            raise ThenAuthFailure("too_large")

    def on_message_complete(self) -> None:
        if not self.done.done():
            self.reusable = self.parser.should_keep_alive()
            self._answer()


class _AuthConnection(asyncio.Protocol):
    """One connection to the service; one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reader: _AnswerReader | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.reader is None:
            self.close()  # bytes nobody asked for: the connection is done for
            return
        self.reader.feed(data)

    def eof_received(self) -> bool:
        if self.reader is not None:
            self.reader.ended()
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.reader is not None:
            self.reader.ended()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def exchange(self, request: bytes) -> tuple[AuthAnswer, bool]:
        """Send ``request``; the answer, and whether the connection may
        carry another exchange."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ThenAuthFailure("closed", unanswered=True)
        done: asyncio.Future[AuthAnswer] = asyncio.get_running_loop().create_future()
        self.reader = reader = _AnswerReader(done)
        try:
            transport.write(request)
            answer = await done
        finally:
            self.reader = None
        return answer, reader.reusable and not self.closed


class AuthClient:
    """Asks the service at ``address``: at most POOL_SIZE connections, kept
    alive between checks, and ``timeout`` seconds for a whole exchange
    (waiting for a connection included)."""

    def __init__(self, address: NextAuthAddress, timeout: float, pool_size: int = POOL_SIZE) -> None:
        self.address = address
        self.timeout = timeout
        self._slots = asyncio.Semaphore(pool_size)
        self._idle: list[_AuthConnection] = []

    async def ask(self, request: bytes) -> AuthAnswer:
        try:
            async with asyncio.timeout(self.timeout):
                async with self._slots:
                    return await self._exchange(request)
        except TimeoutError:
            raise ThenAuthFailure("timeout") from None

    async def _exchange(self, request: bytes) -> AuthAnswer:
        connection = self._take_idle()
        if connection is not None:
            try:
                return await self._over(connection, request)
            except ThenAuthFailure as failure:
                # A kept connection the service closed meanwhile: asked
                # again once, on a new one (a check has no body to resend).
                if failure.reason != "closed" or not failure.unanswered:
                    raise
        return await self._over(await self._connect(), request)

    async def _over(self, connection: _AuthConnection, request: bytes) -> AuthAnswer:
        try:
            answer, reusable = await connection.exchange(request)
        except BaseException:
            connection.close()  # an answer may still be on its way: never reused
            raise
        if reusable:
            self._idle.append(connection)
        else:
            connection.close()
        return answer

    def _take_idle(self) -> _AuthConnection | None:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and connection.transport is not None \
                    and not connection.transport.is_closing():
                return connection
        return None

    async def _connect(self) -> _AuthConnection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await loop.create_connection(_AuthConnection, self.address.host, self.address.port)
        except OSError:
            raise ThenAuthFailure("connect") from None
        return connection

    def close(self) -> None:
        """Close the kept connections."""
        while self._idle:
            self._idle.pop().close()


def forwarded_fields(headers: dict[str, str]) -> Iterator[tuple[str, str]]:
    """The request fields the next service gets, from the check's
    (``headers``, by lower-case name): the client's own (Cookie,
    Authorization, ...) and what nginx said about the request (X-Original-*,
    X-Request-Id), never Sluice's (X-Sluice-*) nor hop-by-hop ones; Host is
    the request's, and the forwarding fields a proxy in front of the service
    would set are set from what nginx said, never taken from the client."""
    for name, value in headers.items():
        if name not in _NOT_FORWARDED and not name.startswith("x-sluice-") and not _LINE_BREAK.search(value):
            yield name, value
    method = headers.get("x-original-method", "GET")
    host = headers.get("x-original-host", "")
    uri = headers.get("x-original-uri", "/")
    peer = headers.get("x-sluice-client-addr", "")
    proto = headers.get("x-sluice-scheme", "")
    if host:
        yield "host", host
        yield "x-forwarded-host", host
    yield "x-forwarded-method", method
    yield "x-forwarded-uri", uri
    if peer:
        yield "x-real-ip", peer
        # As nginx's $proxy_add_x_forwarded_for: the client's list, and the peer.
        forwarded_for = headers.get("x-forwarded-for")
        yield "x-forwarded-for", f"{forwarded_for}, {peer}" if forwarded_for else peer
    if proto in ("http", "https"):
        yield "x-forwarded-proto", proto
        if host:
            # Authelia's auth-request endpoint reads the whole URL here.
            yield "x-original-url", f"{proto}://{host}{uri}"


def passed_fields(answer: AuthAnswer) -> list[tuple[str, str]]:
    """The answer's fields nginx gets (see _NOT_PASSED); ThenAuthFailure
    when they would not fit the check's answer."""
    passed = []
    size = 0
    # Fields the answer's Connection field names are hop-by-hop too.
    connection = {token.strip().lower() for name, value in answer.headers if name.lower() == "connection"
                  for token in value.split(",")}
    for name, value in answer.headers:
        lower = name.lower()
        if lower in _NOT_PASSED or lower.startswith(_OWN_PREFIXES) or lower in connection:
            continue
        size += len(name) + len(value) + 4
        if size > MAX_FORWARDED_BYTES:
            raise ThenAuthFailure("too_large")
        passed.append((name, value))
    return passed


def answer_before_next_auth(request: CheckRequest, decision: Decision) -> Reply:
    """nginx's answer (``answer_nginx``), with a close told as a refusal
    whose page status is 444, never as 401: with the next service, 401 is
    its answer, for the site's own ``error_page 401``."""
    if decision.outcome != CLOSE:
        return answer_nginx(request, decision)
    return _close_before_next_auth(request)


def before_next_auth_at_once(scope: Scope, headers: dict[str, str], decide: Decide) -> Checked:
    """``NGINX_CHAINED_CHECK`` in one pass (``Check.at_once``): nginx's
    own, with a close told as ``answer_before_next_auth`` tells it."""
    request, decision, reply = nginx_at_once(scope, headers, decide)
    if decision.outcome == CLOSE:
        reply = _close_before_next_auth(request)
    return request, decision, reply


def _close_before_next_auth(request: CheckRequest) -> Reply:
    closing = Decision(outcome=DENY, page=_CLOSE_PAGE)
    headers = [("X-Sluice-Deny", DenyToken.encode(closing, request.client.text)),
               (PAGE_STATUS_HEADER, str(CLOSE_PAGE_STATUS))]
    if request.proxy_expires:
        headers.append((PROXY_EXPIRES_HEADER, f"@{request.proxy_expires}"))
    return Reply(NGINX_DENY_STATUS, headers, b"")


# The field of nginx's check that says whether its location asks the next
# service (sluice-server.conf sends the location's $sluice_then_auth: "off",
# or the URI of the location's auth service). Absent (a configuration that
# does not send it), every check is asked of the next service.
THEN_AUTH_FIELD = "x-sluice-then-auth"


def asks_next(headers: dict[str, str]) -> bool:
    """Whether the check whose fields are ``headers`` is asked of the next service."""
    return headers.get(THEN_AUTH_FIELD) != "off"


# nginx's check, when the next service is asked after Sluice's allow.
NGINX_CHAINED_CHECK = Check("nginx", describe_nginx, answer_before_next_auth, before_next_auth_at_once)


def routes_with_then_auth(routes: Iterable[Route]) -> tuple[Route, ...]:
    """The front doors' routes, nginx's check answered for a next service."""
    return tuple(Route(route.path, NGINX_CHAINED_CHECK) if route.path == NGINX_AUTH_PATH else route
                 for route in routes)


class ThenAuthMetrics(Collector):
    """sluice_then_auth_answers_total{answer} and sluice_then_auth_errors_total{reason}."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.answers: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter({reason: 0 for reason in REASONS})
        registry.register(self)

    def collect(self) -> Iterator[CounterMetricFamily]:
        answers = CounterMetricFamily(
            "sluice_then_auth_answers", "Checks Sluice admitted and asked of the next auth service "
            "(--then-auth), by what nginx was told: allow (its 2xx), unauthenticated (its 401), forbidden "
            "(its 403) or failed (no usable answer: refused with 503).", labels=["answer"])
        for answer, count in self.answers.items():
            answers.add_metric([answer], count)
        yield answers
        errors = CounterMetricFamily(
            "sluice_then_auth_errors", "Checks refused (503) because the next auth service gave no usable "
            "answer, by reason: connect, timeout, closed, invalid, too_large (its answer's head or body), "
            "status (not 2xx, 401 or 403), internal.", labels=["reason"])
        for reason, count in self.errors.items():
            errors.add_metric([reason], count)
        yield errors


class ThenAuth:
    """The next auth service of nginx's admitted checks (see the module)."""

    def __init__(self, address: NextAuthAddress, timeout: float, registry: CollectorRegistry,
                 pool_size: int = POOL_SIZE) -> None:
        self.address = address
        self.client = AuthClient(address, timeout, pool_size)
        self.metrics = ThenAuthMetrics(registry)
        self._failure_log = RateLimitedLog(log, 10)
        self._request_line = f"GET {address.target} HTTP/1.1\r\n".encode("latin-1")

    async def answer(self, headers: dict[str, str], reply: Reply) -> Reply:
        """What nginx is told of a check Sluice admitted with ``reply``,
        whose fields are ``headers``."""
        own = reply.headers
        try:
            answer = await self.client.ask(self.request(headers))
            status = answer.status
            if 200 <= status < 300:
                self.metrics.answers["allow"] += 1
                return Reply(200, [*own, *passed_fields(answer)], b"")
            if status == 401:
                self.metrics.answers["unauthenticated"] += 1
                return Reply(401, [*own, *passed_fields(answer)], b"")
            if status == 403:
                self.metrics.answers["forbidden"] += 1
                return refusal(_FORBIDDEN_PAGE, headers, [*own, *passed_fields(answer)])
            raise ThenAuthFailure("status", detail=f" {status}")
        except ThenAuthFailure as failure:
            reason = failure.reason
            self._failure_log.warning("the next auth service (%s) gave no usable answer (%s%s); the request "
                                      "was refused with 503 (reported once per 10 s)", self.address.url,
                                      reason, failure.detail)
        except Exception:
            reason = "internal"
            self._failure_log.error("asking the next auth service (%s) failed inside Sluice; the request was "
                                    "refused with 503", self.address.url, exc_info=True)
        self.metrics.answers["failed"] += 1
        self.metrics.errors[reason] += 1
        return refusal(_FAILED_PAGE, headers, [*own, ("Retry-After", "1")])

    def request(self, headers: dict[str, str]) -> bytes:
        lines = [self._request_line]
        for name, value in forwarded_fields(headers):
            lines.append(f"{name}: {value}\r\n".encode("latin-1", "replace"))
        lines.append(b"\r\n")
        return b"".join(lines)

    def close(self) -> None:
        self.client.close()


def refusal(page: BlockPage, headers: dict[str, str], fields: list[tuple[str, str]]) -> Reply:
    """Sluice's deny for nginx with ``page``, which @sluice_deny sends with
    its status (the page in a header field, as ``inline_page`` writes it)."""
    closing = Decision(outcome=DENY, page=page)
    request_id = headers.get("x-request-id", "")
    answer = [("X-Sluice-Deny", DenyToken.encode(closing, "")), *fields]
    if page.one_line is not None and request_id.isprintable():
        body = page.one_line.render("", "", request_id)
        answer += [(PAGE_STATUS_HEADER, str(page.status)), (PAGE_HEADER, body.decode("latin-1"))]
    return Reply(NGINX_DENY_STATUS, answer, b"")
