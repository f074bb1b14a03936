"""What the front doors share: the route table's types, reading an ASGI
request, writing an answer, and the parts of a ``CheckRequest`` and of a
refusal that every proxy fills the same way."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from sidecar.actions import BlockPage, Refusal, deny_headers, over_limit_headers, page_body, prefers_json
from sidecar.asgi import Receive, Scope, Send
from sidecar.challenge import FINGERPRINT_HEADER, IssuedChallenge
from sidecar.engine import Decision, Engine
from sidecar.overload import SENT_HEADER, parse_sent
from sidecar.request import UNRESOLVED, CheckRequest


class Service(Protocol):
    """What an endpoint is handed: the engine, and where a failure inside
    Sluice is counted and logged (see ``sidecar.app.SluiceApp``)."""

    engine: Engine

    def internal_error(self) -> None: ...


# What a front door answers: status, header fields and body.
Reply = tuple[int, list[tuple[str, str]], bytes]
# A check front door: the proxy's request as one CheckRequest, and the
# engine's Decision as the proxy's answer. Both are plain functions of what
# they are given, so that the same front door is served through ASGI or
# straight from the HTTP protocol (sidecar.server); neither calls the
# engine (the engine resolves the client the request names).
Describe = Callable[[Scope, dict[str, str]], CheckRequest]
Answer = Callable[[CheckRequest, Decision], Reply]
# Any other endpoint on the bare ASGI path (deny page, solution, report).
Endpoint = Callable[[Service, Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Check:
    front_door: str  # the label of its answers in sluice_decisions_total
    describe: Describe
    answer: Answer


@dataclass(frozen=True)
class Route:
    """``path`` → a check or an endpoint; with ``prefix`` also every path
    under it (``path`` + ``/...``)."""

    path: str
    handler: Check | Endpoint
    prefix: bool = False


class RouteTable:
    """The front doors' routes, answered before any framework code runs."""

    def __init__(self, routes: Iterable[Route]) -> None:
        self.exact: dict[str, Check | Endpoint] = {}
        self.prefixes: list[tuple[str, Check | Endpoint]] = []
        seen: set[str] = set()
        for route in routes:
            if route.path in seen:
                raise ValueError(f"two front doors answer {route.path}")
            seen.add(route.path)
            if route.prefix:
                self.prefixes.append((route.path, route.handler))
            else:
                self.exact[route.path] = route.handler

    def find(self, path: str) -> Check | Endpoint | None:
        handler = self.exact.get(path)
        if handler is not None:
            return handler
        for prefix, handler in self.prefixes:
            if path.startswith(prefix) and (len(path) == len(prefix) or path[len(prefix)] == "/"):
                return handler
        return None


def header_map(scope: Scope) -> dict[str, str]:
    """Request headers by lower-case name; repeated headers are joined.

    Built in one comprehension, which is ``join_fields`` exactly when no
    name comes twice (the case of nearly every check): only then are the
    fields joined one by one."""
    fields = scope["headers"]
    headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in fields}
    if len(headers) < len(fields):  # a name repeated: its values joined, in order
        return join_fields([(name.decode("latin-1"), value.decode("latin-1")) for name, value in fields])
    return headers


def join_fields(fields: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Header fields by lower-case name, repeated ones joined (cookies with
    "; ", as a client sends them in one field)."""
    headers: dict[str, str] = {}
    for name, value in fields:
        name = name.lower()
        if name in headers:
            headers[name] += ("; " if name == "cookie" else ", ") + value
        else:
            headers[name] = value
    return headers


def new_request_id() -> str:
    return os.urandom(10).hex()


def request_id_of(headers: dict[str, str]) -> str:
    """The proxy's request id, or a new one."""
    return headers.get("x-request-id") or new_request_id()


def check_request(headers: dict[str, str], method: str, host: str, uri: str, peer: str) -> CheckRequest:
    """A CheckRequest with what every proxy sends the same way: the headers,
    the request id, the TLS fingerprint, the time the proxy sent it, and
    the client as the proxy names it (``peer``, the address the request
    came from, and X-Forwarded-For), which the engine resolves."""
    return CheckRequest(method=method, host=host, uri=uri, headers=headers, client=UNRESOLVED,
                        request_id=request_id_of(headers),
                        tls_fingerprint=headers.get(FINGERPRINT_HEADER, ""),
                        sent=parse_sent(headers.get(SENT_HEADER)),
                        peer=peer, forwarded_for=headers.get("x-forwarded-for"))


def encode_headers(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.lower().encode("latin-1"), value.encode("latin-1", "replace"))
            for name, value in headers]


async def respond(send: Send, status: int, headers: list[tuple[str, str]], body: bytes = b"") -> None:
    raw = encode_headers(headers)
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def allow_headers(decision: Decision) -> list[tuple[str, str]]:
    """Over-limit headers in observe mode, and the pending-counts token the
    proxy hands back with the response report."""
    rule = decision.rule
    headers = [] if rule is None else over_limit_headers(decision.limit, decision.reset)
    if rule is not None and rule.shadow:
        headers.append(("X-RateLimit-Shadow", "true"))
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


def client_prefers_json(request: CheckRequest) -> bool:
    """Whether the original request's Accept header prefers JSON to HTML."""
    return prefers_json(request.headers.get("accept", ""))


def render_deny(request: CheckRequest, decision: Decision) -> Reply:
    """A deny's status, headers and page (HTML or JSON, see
    sidecar.actions)."""
    page = decision.page
    assert page is not None
    refusal = Refusal(page.status, decision.retry_after, decision.rule.id if decision.rule is not None else None,
                      request.request_id, request.client.text, request.host, decision.challenge)
    content_type, body = page_body(page, refusal, page.sends_json(client_prefers_json(request)))
    headers = deny_headers(decision.limit, decision.reset, decision.retry_after, request.request_id,
                           content_type, page.json == "if_preferred")
    return page.status, headers, body


def render_page(page: BlockPage, remote_addr: str, host: str, request_id: str,
                challenge: IssuedChallenge | None) -> bytes:
    """A page as HTML (or its template's own type), never the JSON body."""
    return page_body(page, Refusal(page.status, 0, None, request_id, remote_addr, host, challenge), False)[1]


async def read_body(receive: Receive, limit: int) -> bytes:
    """The request body, or b"" when it is longer than ``limit`` bytes."""
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b""
        chunk: bytes = message.get("body", b"")
        body += chunk
        if len(body) > limit:
            return b""
        if not message.get("more_body"):
            return body
