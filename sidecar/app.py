"""The HTTP service: per-request check endpoints on a bare ASGI path, the rest
(health, metrics) in FastAPI.

The check endpoints are answered by ``SluiceApp`` before any framework code
runs: no routing table, no middleware stack, no validation. Every failure
inside a check is answered as *allow* (fail open, SPEC §9) and counted; a
rate limiter's bug must never become the protected site's outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import os
import re
import signal
import time
from typing import Any, AsyncIterator, Awaitable, Callable
from urllib.parse import parse_qsl

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sidecar.admin import Admin
from sidecar.asgi import Receive, Scope, Send
from sidecar.actions import CHALLENGE_PAGE, CONTENT_TYPE_HTML, BlockPage, deny_headers, over_limit_headers
from sidecar.challenge import FINGERPRINT_HEADER, MAX_CHALLENGE_LENGTH, SOLUTION_PATH, IssuedChallenge
from sidecar.clientip import parse_address
from sidecar.config import RULE_ID_RE
from sidecar.engine import ALLOW, CLOSE, DENY, Decision, Engine
from sidecar.health import HealthListener, Heartbeat
from sidecar.hook import listen_for_reports, report_from_headers
from sidecar.ratelog import RateLimitedLog
from sidecar.request import CheckRequest, strip_port
from sidecar.rules import CompiledRule

log = logging.getLogger("sluice")


HOOK_PATH = "/v1/hook"
NGINX_AUTH_PATH = "/v1/nginx/auth"
# Envoy's HTTP ext_authz appends the original path to a prefix.
ENVOY_AUTH_PREFIX = "/v1/envoy/auth"
NGINX_DENY_PATH = "/v1/nginx/deny"
FORWARD_AUTH_PATH = "/v1/check"
# Where a challenge page's solution arrives; the proxy maps the site's
# SOLUTION_PATH here, without checking it (SPEC §6).
CHALLENGE_PATH = "/v1/challenge"
MAX_SOLUTION_BODY = 8192

# nginx's auth_request understands only 2xx, 401 and 403. Sluice answers 403
# for "deny with a page" (nginx then fetches the page from NGINX_DENY_PATH,
# which answers with the real status) and 401 for "close the connection".
NGINX_DENY_STATUS = 403
NGINX_CLOSE_STATUS = 401


def header_map(scope: Scope) -> dict[str, str]:
    """Request headers by lower-case name; repeated headers are joined."""
    headers: dict[str, str] = {}
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        if name in headers:
            headers[name] += ("; " if name == "cookie" else ", ") + value
        else:
            headers[name] = value
    return headers


def new_request_id() -> str:
    return os.urandom(10).hex()


def _encode(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.lower().encode("latin-1"), value.encode("latin-1", "replace"))
            for name, value in headers]


async def respond(send: Send, status: int, headers: list[tuple[str, str]], body: bytes = b"") -> None:
    raw = _encode(headers)
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def allow_headers(decision: Decision) -> list[tuple[str, str]]:
    """Over-limit headers in observe mode, and the pending-counts token the
    proxy hands back with the response report (SPEC §8)."""
    rule = decision.rule
    headers = [] if rule is None else over_limit_headers(decision.limit, decision.reset)
    if decision.pending is not None:
        headers.append(("X-Sluice-Pending", decision.pending))
    if decision.quota is not None:
        headers.append(("RateLimit-Policy", decision.quota[0]))
        headers.append(("RateLimit", decision.quota[1]))
    return headers


async def wait_unless_disconnected(receive: Receive, seconds: float) -> bool:
    """Sleep ``seconds``; False as soon as the client disconnects."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (remaining := deadline - loop.time()) > 0:
        message = asyncio.ensure_future(receive())
        done, _ = await asyncio.wait({message}, timeout=remaining)
        if not done:
            message.cancel()
            return True
        if message.result()["type"] == "http.disconnect":
            return False
    return True


class DenyToken:
    """What nginx carries from the auth answer to the page request.

    Plain text ``status limit reset retry-after rule-id client``, and for a
    challenge page ``difficulty challenge`` after them: rule ids, addresses
    and challenges contain no spaces (rule ids are checked at load).
    """

    @staticmethod
    def encode(decision: Decision, client_text: str) -> str:
        rule = decision.rule
        assert decision.page is not None
        # No rule: refused because the shared store is unavailable (fail:
        # closed); the page request then gets the built-in page.
        token = (f"{decision.page.status} {decision.limit} {decision.reset} {decision.retry_after} "
                 f"{rule.id if rule is not None else '-'} {client_text or '-'}")
        if decision.challenge is not None:
            token += f" {decision.challenge.difficulty} {decision.challenge.text}"
        return token

    @staticmethod
    def decode(token: str) -> tuple[int, int, int, int, str, str, IssuedChallenge | None]:
        """The token's fields; ValueError for anything ``encode`` does not
        write (a token is checked field by field, never trusted)."""
        if len(token) > MAX_DENY_TOKEN:
            raise ValueError("token too long")
        fields = token.split(" ")
        if len(fields) not in (6, 8):
            raise ValueError(f"{len(fields)} fields")
        status, limit, reset, retry_after, rule_id, client = fields[:6]
        status_code = _token_number(status, 3)
        if not 400 <= status_code <= 599:
            raise ValueError(f"status {status_code} out of range")
        if rule_id != "-" and not RULE_ID_RE.fullmatch(rule_id):
            raise ValueError("not a rule id")
        address = parse_address(client) if client != "-" else None
        if client != "-" and address is None:
            raise ValueError("not a client address")
        challenge = None
        if len(fields) == 8:
            if not (0 < len(fields[7]) <= MAX_CHALLENGE_LENGTH and _CHALLENGE_TEXT.fullmatch(fields[7])):
                raise ValueError("not a challenge")
            challenge = IssuedChallenge(fields[7], _token_number(fields[6], 3))
        return status_code, _token_number(limit), _token_number(reset), _token_number(retry_after), \
            rule_id, "" if address is None else str(address), challenge


# Longer than any token encode writes (a challenge is at most
# MAX_CHALLENGE_LENGTH); numbers are plain decimal digits, never signs,
# spaces, underscores or exponents, and at most 20 digits (64 bits).
MAX_DENY_TOKEN = MAX_CHALLENGE_LENGTH + 256
_CHALLENGE_TEXT = re.compile(r"[A-Za-z0-9_.-]+")


def _token_number(text: str, digits: int = 20) -> int:
    if not (0 < len(text) <= digits and text.isascii() and text.isdigit()):
        raise ValueError(f"not a number of at most {digits} digits")
    return int(text)


# A client that reaches the deny endpoint can send bad tokens as fast as it likes.
_bad_token_log = RateLimitedLog(log, 60.0)


def _deny_page(rule: CompiledRule | None, status: int, challenge: IssuedChallenge | None
               ) -> tuple[BlockPage, IssuedChallenge | None]:
    """The page (and challenge) for a deny token whose rule may have been
    reloaded since nginx was told: the rule's own page while it still gives
    one for that status, else the built-in page for the status. A challenge
    is shown only while its rule still challenges (a solution would be
    refused otherwise), and a challenge rule's token without one (the rule
    blocked when nginx asked) gets the built-in page."""
    if rule is None or rule.page is None or rule.page.close:
        return BlockPage.builtin(status), None
    if rule.challenge is not None:
        return (rule.page, challenge) if challenge is not None else (BlockPage.builtin(status), None)
    return (rule.page if rule.page.status == status else BlockPage.builtin(status)), None


def describe_nginx(engine: Engine, scope: Scope, headers: dict[str, str]) -> CheckRequest:
    """nginx sends the original request line and client address as headers."""
    return CheckRequest(
        method=headers.get("x-original-method", "GET"),
        host=headers.get("x-original-host") or strip_port(headers.get("host", "")),
        uri=headers.get("x-original-uri", "/"),
        headers=headers,
        client=engine.resolve_client(headers.get("x-sluice-client-addr", ""),
                                     headers.get("x-forwarded-for")),
        request_id=headers.get("x-request-id") or new_request_id(),
    )


async def answer_nginx(send: Send, request: CheckRequest, decision: Decision) -> None:
    if decision.outcome == ALLOW:
        await respond(send, 200, allow_headers(decision))
    elif decision.outcome == CLOSE:
        await respond(send, NGINX_CLOSE_STATUS, [])
    else:
        token = DenyToken.encode(decision, request.client.text)
        await respond(send, NGINX_DENY_STATUS, [("X-Sluice-Deny", token)])


def describe_forward_auth(engine: Engine, scope: Scope, headers: dict[str, str]) -> CheckRequest:
    """Traefik/Caddy conventions; the client is the connecting peer (SPEC §10)."""
    peer = scope.get("client")
    return CheckRequest(
        method=headers.get("x-forwarded-method", "GET"),
        host=strip_port(headers.get("x-forwarded-host") or headers.get("host", "")),
        uri=headers.get("x-forwarded-uri", "/"),
        headers=headers,
        client=engine.resolve_client(peer[0] if peer else "", headers.get("x-forwarded-for")),
        request_id=headers.get("x-request-id") or new_request_id(),
    )


async def answer_in_full(send: Send, request: CheckRequest, decision: Decision) -> None:
    """For proxies that pass a refusal to the client as it is (forward-auth,
    Envoy ext_authz): status, headers and page in this one answer."""
    if decision.outcome == ALLOW:
        await respond(send, 200, allow_headers(decision))
    elif decision.outcome == CLOSE:
        # Neither a forward-auth subrequest nor ext_authz can close the
        # client's connection: an empty 403 asking for a close (SPEC §6).
        await respond(send, 403, [("Connection", "close"), ("Cache-Control", "no-store")])
    else:
        await respond(send, *render_deny(request, decision))


def render_deny(request: CheckRequest, decision: Decision) -> tuple[int, list[tuple[str, str]], bytes]:
    """A deny's status, headers and page."""
    assert decision.page is not None
    body = render_page(decision.page, request.client.text, request.host, request.request_id,
                       decision.challenge)
    headers = deny_headers(decision.limit, decision.reset, decision.retry_after, request.request_id)
    return decision.page.status, headers, body


def render_page(page: BlockPage, remote_addr: str, host: str, request_id: str,
                challenge: IssuedChallenge | None) -> bytes:
    if challenge is None:
        return page.template.render(remote_addr, host, request_id)
    return CHALLENGE_PAGE.template.render(remote_addr, host, request_id, challenge=challenge.text,
                                          difficulty=str(challenge.difficulty),
                                          solution_path=SOLUTION_PATH)


async def read_body(receive: Receive, limit: int) -> bytes:
    """The request body, or b"" when it is longer than ``limit`` bytes."""
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b""
        body += message.get("body", b"")
        if len(body) > limit:
            return b""
        if not message.get("more_body"):
            return body


def refused_solution_page(problem: str, location: str) -> bytes:
    return (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>Verification failed</title></head>\n<body><h1>Verification failed</h1>\n"
            f"<p>{html.escape(problem)}.</p>\n<p><a href=\"{html.escape(location, quote=True)}\">"
            f"Try again</a></p></body></html>\n").encode("utf-8")


def describe_envoy(engine: Engine, scope: Scope, headers: dict[str, str]) -> CheckRequest:
    """Envoy HTTP ext_authz: the original method, the original path after
    ENVOY_AUTH_PREFIX, the original Host, and the direct peer's address
    added by the filter as ``x-sluice-client-addr``."""
    raw_path = scope.get("raw_path") or scope["path"].encode()
    uri = raw_path[len(ENVOY_AUTH_PREFIX):].decode("latin-1") or "/"
    if scope.get("query_string"):
        uri += "?" + scope["query_string"].decode("latin-1")
    return CheckRequest(
        method=scope["method"],
        host=strip_port(headers.get("host", "")),
        uri=uri,
        headers=headers,
        client=engine.resolve_client(headers.get("x-sluice-client-addr", ""),
                                     headers.get("x-forwarded-for")),
        request_id=headers.get("x-request-id") or new_request_id(),
    )


# Envoy's ext_authz takes any 5xx from the authorization service for a
# failure of the service itself and, failing open, lets the request in. A
# refusal with such a status is sent as 403 carrying the real status, which
# the shipped Envoy template's Lua filter puts back.
ENVOY_STATUS_HEADER = "X-Sluice-Status"


async def answer_envoy(send: Send, request: CheckRequest, decision: Decision) -> None:
    if decision.outcome != DENY:
        await answer_in_full(send, request, decision)
        return
    status, headers, body = render_deny(request, decision)
    if status >= 500:
        headers.append((ENVOY_STATUS_HEADER, str(status)))
        status = 403
    await respond(send, status, headers, body)


Describe = Callable[[Engine, Scope, dict[str, str]], CheckRequest]
Answer = Callable[[Send, CheckRequest, Decision], Awaitable[None]]


class SluiceApp:
    """The ASGI application uvicorn runs."""

    def __init__(self, engine: Engine, report_udp: tuple[str, int] | None = None,
                 admin: Admin | None = None, share_report_port: bool = False,
                 health: tuple[str, int] | None = None) -> None:
        self.engine = engine
        self.api = build_api(engine, report_udp, admin, share_report_port, health)
        self._error_log = RateLimitedLog(log, 10)
        self._checks: dict[str, tuple[Describe, Answer]] = {
            NGINX_AUTH_PATH: (describe_nginx, answer_nginx),
            FORWARD_AUTH_PATH: (describe_forward_auth, answer_in_full),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            adapter = self._checks.get(path)
            if adapter is not None:
                await self._check(scope, receive, send, *adapter)
                return
            if path.startswith(ENVOY_AUTH_PREFIX) and \
                    (len(path) == len(ENVOY_AUTH_PREFIX) or path[len(ENVOY_AUTH_PREFIX)] == "/"):
                await self._check(scope, receive, send, describe_envoy, answer_envoy)
                return
            if path == NGINX_DENY_PATH:
                await self._nginx_deny(scope, send)
                return
            if path == HOOK_PATH:
                await self._hook(scope, send)
                return
            if path == CHALLENGE_PATH:
                await self._solution(scope, receive, send)
                return
        await self.api(scope, receive, send)

    async def _check(self, scope: Scope, receive: Receive, send: Send, describe: Describe,
                     answer: Answer) -> None:
        engine = self.engine
        started = time.perf_counter()
        try:
            request = describe(engine, scope, header_map(scope))
            decision = await engine.decide_async(request)
        except Exception:
            self._internal_error()
            await respond(send, 200, [])
            return
        engine.metrics.latency.observe(time.perf_counter() - started)
        if decision.delay > 0:
            # A leaky bucket admitted the request at a later slot: the proxy
            # waits for our answer (SPEC §7). The decision took a hold slot;
            # it is given back when the wait ends or the proxy goes away.
            try:
                if not await wait_unless_disconnected(receive, decision.delay):
                    return
            finally:
                engine.release_hold()
        await answer(send, request, decision)

    async def _nginx_deny(self, scope: Scope, send: Send) -> None:
        """The page for a deny nginx was told about (see NGINX_DENY_STATUS).

        Every token gets a page: a malformed one the built-in 429, a stale
        one (its rule reloaded away or changed) the built-in page for the
        status nginx was told."""
        headers = header_map(scope)
        request_id = headers.get("x-request-id") or new_request_id()
        token = headers.get("x-sluice-deny", "")
        try:
            status, limit, reset, retry_after, rule_id, client, challenge = DenyToken.decode(token)
        except ValueError as exc:
            _bad_token_log.warning("deny page asked for with an invalid token %r (%s; reported once "
                                   "per minute)", token[:200], exc)
            status, limit, reset, retry_after, rule_id, client, challenge = 429, 1, 1, 1, "", "", None
        try:
            page, challenge = _deny_page(self.engine.ruleset.by_id.get(rule_id), status, challenge)
            body = render_page(page, client, headers.get("x-original-host", ""), request_id, challenge)
        except Exception:  # a bug: still a refusal, never a 500 for nginx to show
            self._internal_error()
            status, limit, reset, retry_after = 429, 1, 1, 1
            body = BlockPage.builtin(status).template.render(client, "", request_id)
        await respond(send, status, deny_headers(limit, reset, retry_after, request_id), body)

    async def _solution(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A challenge page's solution (SPEC §6): a credential cookie and back
        to the original page, or a refusal."""
        engine = self.engine
        headers = header_map(scope)
        body = await read_body(receive, MAX_SOLUTION_BODY)
        form = dict(parse_qsl(body.decode("latin-1"))) if scope["method"] == "POST" and body else {}
        # nginx and Envoy name the client as for a check; a forward-auth
        # proxy's route to here makes the proxy the peer (SPEC §3, §10).
        peer = scope.get("client")
        client = engine.resolve_client(headers.get("x-sluice-client-addr") or (peer[0] if peer else ""),
                                       headers.get("x-forwarded-for"))
        fingerprint = headers.get(FINGERPRINT_HEADER, "")
        ticket, problem = engine.challenges.verify(form.get("challenge", ""), form.get("nonce", ""),
                                                   client.key, fingerprint)
        rule = engine.ruleset.by_id.get(ticket.rule_id) if ticket is not None else None
        # A reload may have removed the rule or changed its action since.
        settings = rule.challenge if rule is not None else None
        if ticket is None or problem or rule is None or settings is None:
            engine.metrics.challenges_failed.inc()
            await respond(send, 403, [("Cache-Control", "no-store"), ("Content-Type", CONTENT_TYPE_HTML)],
                          refused_solution_page(problem or "this page no longer asks for a check",
                                                ticket.location if ticket is not None else "/"))
            return
        engine.metrics.challenges_passed.inc()
        credential = engine.challenges.credential(rule.id, client.key, fingerprint, settings.ttl)
        proto = headers.get("x-forwarded-proto") or scope.get("scheme", "http")
        cookie = (f"{settings.cookie}={credential}; Max-Age={int(settings.ttl)}; Path=/; "
                  "HttpOnly; SameSite=Lax" + ("; Secure" if proto.lower() == "https" else ""))
        await respond(send, 303, [("Location", ticket.location), ("Set-Cookie", cookie),
                                  ("Cache-Control", "no-store")])

    async def _hook(self, scope: Scope, send: Send) -> None:
        """A response report over HTTP (Envoy's Lua filter); answered at once."""
        try:
            await report_from_headers(self.engine, header_map(scope))
        except Exception:
            self._internal_error()
        await respond(send, 204, [])

    def _internal_error(self) -> None:
        self.engine.metrics.errors.inc()
        self._error_log.error("check failed inside Sluice; the request was allowed (fail open)",
                              exc_info=True)


def build_api(engine: Engine, report_udp: tuple[str, int] | None = None,
              admin: Admin | None = None, share_report_port: bool = False,
              health: tuple[str, int] | None = None) -> FastAPI:
    def readiness() -> str:
        return f"ok: {len(engine.ruleset.rules)} rules from {engine.ruleset.source}\n"

    @contextlib.asynccontextmanager
    async def lifespan(_api: FastAPI) -> AsyncIterator[None]:
        transport = await listen_for_reports(engine, *report_udp, reuse_port=share_report_port) \
            if report_udp else None
        loop = asyncio.get_running_loop()
        if admin is not None:
            loop.add_signal_handler(signal.SIGHUP, admin.reload)
        probes = None
        if health is not None:
            heartbeat = Heartbeat()
            heartbeat.start(loop)
            probes = HealthListener(*health, heartbeat, readiness, reuse_port=share_report_port)
            probes.start()
        try:
            yield
        finally:
            if probes is not None:
                probes.heartbeat.stop()
                await asyncio.to_thread(probes.stop)
            if admin is not None:
                loop.remove_signal_handler(signal.SIGHUP)
            if transport is not None:
                transport.close()

    api = FastAPI(title="Sluice", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    if not engine.shared_store:
        # A shared store's bans and keys are Redis's to count, not a node's.
        store = engine.store
        engine.metrics.watch("sluice_active_bans", "IP bans in force on this node.",
                             lambda: len(store.active_bans(engine.clock())))  # type: ignore[arg-type]
        engine.metrics.watch("sluice_tracked_keys", "Counting keys held in memory.",
                             store.tracked_keys)  # type: ignore[attr-defined]
    engine.metrics.watch("sluice_waiting_requests", "Requests held by a leaky bucket right now.",
                         lambda: engine.delayed)

    @api.get("/healthz", response_class=PlainTextResponse)
    def healthz() -> str:
        return "ok\n"

    @api.get("/readyz", response_class=PlainTextResponse)
    def readyz() -> str:
        return readiness()

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if admin is not None:
        api.include_router(admin_routes(admin))
    return api


def admin_routes(admin: Admin) -> APIRouter:
    """``/v1/admin/...``: rules with their statistics, bans, unban, reload."""

    def authorized(request: Request, authorization: str | None = Header(None)) -> None:
        peer = request.client.host if request.client else None
        if admin.allows(authorization, peer):
            return
        if admin.needs_token:
            # RFC 6750: no token, or one that is not the admin token.
            challenge = 'Bearer realm="sluice"' + (', error="invalid_token"' if authorization else "")
            raise HTTPException(401, "the admin API needs its bearer token (Authorization: Bearer ...)",
                                headers={"WWW-Authenticate": challenge})
        raise HTTPException(403, "the admin API needs a bearer token (--admin-token-file), "
                                 "or a loopback listener and peer")

    router = APIRouter(prefix="/v1/admin", dependencies=[Depends(authorized)])

    @router.get("/rules")
    async def rules() -> list[dict]:
        return admin.rules()

    @router.get("/bans")
    async def bans() -> list[dict]:
        return await admin.bans()

    @router.delete("/bans", status_code=204)
    async def lift_ban(address: str) -> Response:
        """Lift the ban of one address (as listed: an IPv6 /64 as ``2001:db8::/64``)."""
        if not await admin.lift_ban(address):
            raise HTTPException(404, f"no active ban for {address!r}")
        return Response(status_code=204)

    @router.post("/reload")
    async def reload() -> JSONResponse:
        errors = admin.reload()
        if errors:
            return JSONResponse({"reloaded": False, "errors": errors}, status_code=422)
        return JSONResponse({"reloaded": True, "rules": len(admin.engine.ruleset.rules)})

    return router


def create_app(engine: Engine, report_udp: tuple[str, int] | None = None,
               admin: Admin | None = None, share_report_port: bool = False,
               health: tuple[str, int] | None = None) -> SluiceApp:
    """``report_udp``: where to receive nginx's response reports (syslog/UDP),
    a port several worker processes share with ``share_report_port`` (the
    health listener's too); ``admin``: reload on SIGHUP and serve the admin
    API; ``health``: where the probe listener answers (see sidecar.health)."""
    return SluiceApp(engine, report_udp, admin, share_report_port, health)
