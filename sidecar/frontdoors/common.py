"""What the front doors share: the routes' types, reading an ASGI request,
writing an answer, and the parts of a refusal that every proxy fills the
same way. (What every proxy sends the same way is read by
``sidecar.request.check_request``; a route table is ``sidecar.frontdoors.routes``.)"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from sidecar.actions import BlockPage, Refusal, page_body
from sidecar.asgi import Receive, Scope, Send
from sidecar.challenge import IssuedChallenge
from sidecar.engine import Decision, Engine
from sidecar.exchange import encode_headers
from sidecar.request import CheckRequest


class Service(Protocol):
    """What an endpoint is handed: the engine, and where a failure inside
    Sluice is counted and logged (see ``sidecar.app.SluiceApp``)."""

    engine: Engine

    def internal_error(self) -> None: ...


class Reply(NamedTuple):
    """What a front door answers: status, header fields and body."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


# A Reply from its three fields in one tuple, made in C: the front doors
# answer every allowed check with one, where calling the NamedTuple costs
# a Python frame (its generated ``__new__``).
new_reply: Callable[[tuple[int, list[tuple[str, str]], bytes]], Reply] = functools.partial(tuple.__new__, Reply)


# A check front door: the proxy's request as one CheckRequest, and the
# engine's Decision as the proxy's answer. Both are plain functions of what
# they are given, so that the same front door is served through ASGI, over
# a store that is awaited, or straight from the HTTP protocol
# (sidecar.server); neither calls the engine (the engine resolves the
# client the request names).
Describe = Callable[[Scope, dict[str, str]], CheckRequest]
Answer = Callable[[CheckRequest, Decision], Reply]
# A decision that never waits (the engine's over a store that answers at
# once), given to a front door's ``AtOnce``.
Decide = Callable[[CheckRequest], Decision]
# The whole check in one pass through the front door's module: described,
# decided by the ``Decide`` it is given, answered. The request and the
# decision come back with the answer, for what the application does with
# them (counting, refusals kept, a hold, the next auth service).
Checked = tuple[CheckRequest, Decision, Reply]
AtOnce = Callable[[Scope, dict[str, str], Decide], Checked]
# Any other endpoint on the bare ASGI path (deny page, solution, report).
Endpoint = Callable[[Service, Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Check:
    """A check front door: its label, its ``describe`` and ``answer``, and
    ``at_once``, the two with a decision between them, written out in the
    front door's own module so that a check the HTTP protocol answers at
    once enters the module once (the paths that await the store call
    ``describe`` and ``answer`` one by one; a door served only on them has
    no ``at_once``)."""

    front_door: str  # the label of its answers in sluice_decisions_total
    describe: Describe
    answer: Answer
    at_once: AtOnce | None = None


@dataclass(frozen=True)
class Route:
    """``path`` → a check or an endpoint; with ``prefix`` also every path
    under it (``path`` + ``/...``)."""

    path: str
    handler: Check | Endpoint
    prefix: bool = False


# Where the HTTP protocol leaves a check's header map when it read the
# head itself (sidecar.httphead makes it with the fields, as header_map would).
HEADER_MAP = "sluice.header_map"


def header_map(scope: Scope) -> dict[str, str]:
    """Request headers by lower-case name; repeated headers are joined.

    Built in one comprehension, which is ``join_fields`` exactly when no
    name comes twice (the case of nearly every check): only then are the
    fields joined one by one."""
    made: dict[str, str] | None = scope.get(HEADER_MAP)
    if made is not None:
        return made
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


async def respond(send: Send, status: int, headers: list[tuple[str, str]], body: bytes = b"") -> None:
    """A front door's answer as ASGI messages."""
    raw = encode_headers(headers)
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


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
