"""The demo upstream: an application to put behind Sluice.

It answers any method and path with 200 and a small JSON echo of the request.
`?status=N` makes it answer with status N, `?score=S` adds the response
header `x-score: S`, for trying response-phase and score rules by hand.
`?sleep=S` answers after S seconds, and `?stream=S` sends the headers and
the echo at once but ends the body S seconds later (each 0 to 10, fractions
allowed), for requests that stay in flight (concurrency limits).

The echo also says how many requests this process has received for the path
(`hits`), so a test can tell whether a denied request reached the application.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs

import uvicorn

from sidecar.asgi import Receive, Scope, Send

# Paths remembered for `hits`; the oldest is forgotten first, so a client
# walking through endless paths cannot grow memory.
MAX_TRACKED_PATHS = 10_000
_STATUSES_WITHOUT_BODY = frozenset({204, 304})
MAX_SLEEP_SECONDS = 10.0
KEEP_ALIVE_SECONDS = 75
_SECONDS = re.compile(r"[0-9]{1,2}(?:\.[0-9]{1,6})?")


class DemoUpstream:
    """A raw ASGI application, so that it needs nothing beyond uvicorn."""

    def __init__(self) -> None:
        self._hits: OrderedDict[str, int] = OrderedDict()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body_bytes = await _read_body_length(receive)
        query = parse_qs(scope["query_string"].decode("latin-1"), keep_blank_values=True)
        path = scope["path"]

        status = 200
        extra_headers: list[tuple[bytes, bytes]] = []
        if "status" in query:
            asked = _parse_status(query["status"][0])
            if asked is None:
                await _respond(send, scope, 400, {"error": "status must be an integer from 200 to 599"})
                return
            status = asked
        if "score" in query:
            score = query["score"][0]
            if not (score.isascii() and score.isprintable() and score.strip()):
                await _respond(send, scope, 400, {"error": "score must be printable ASCII"})
                return
            extra_headers.append((b"x-score", score.strip().encode("ascii")))
        waits = {}
        for name in ("sleep", "stream"):
            if name in query:
                seconds = parse_sleep(query[name][0])
                if seconds is None:
                    await _respond(send, scope, 400, {"error": f"{name} must be a number of seconds from 0 to 10"})
                    return
                waits[name] = seconds
        if "sleep" in waits:
            await asyncio.sleep(waits["sleep"])

        echo = {
            "method": scope["method"],
            "path": path,
            "query": scope["query_string"].decode("latin-1"),
            "headers": _headers_as_dict(scope["headers"]),
            "body_bytes": body_bytes,
            "hits": self._count_hit(path),
        }
        await _respond(send, scope, status, echo, extra_headers, waits.get("stream", 0.0))

    def _count_hit(self, path: str) -> int:
        hits = self._hits.pop(path, 0) + 1
        self._hits[path] = hits
        if len(self._hits) > MAX_TRACKED_PATHS:
            self._hits.popitem(last=False)
        return hits


def parse_sleep(text: str) -> float | None:
    """Seconds like ``2`` or ``0.25``, at most ten; None for anything else."""
    if not _SECONDS.fullmatch(text):
        return None
    seconds = float(text)
    return seconds if seconds <= MAX_SLEEP_SECONDS else None


def _parse_status(text: str) -> int | None:
    if not text.isdigit():
        return None
    status = int(text)
    return status if 200 <= status <= 599 else None


def _headers_as_dict(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in raw:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return headers


async def _read_body_length(receive: Receive) -> int:
    length = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return length
        length += len(message.get("body", b""))
        if not message.get("more_body", False):
            return length


async def _respond(
    send: Send,
    scope: Scope,
    status: int,
    document: dict[str, Any],
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
    stream: float = 0.0,
) -> None:
    """The response; with ``stream``, its body ends that many seconds after
    the document was sent (chunked, without a length)."""
    headers = [*extra_headers]
    body = b""
    if status not in _STATUSES_WITHOUT_BODY:
        body = json.dumps(document).encode() + b"\n"
        headers.append((b"content-type", b"application/json"))
        if not stream:
            headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    body = b"" if scope["method"] == "HEAD" else body
    if stream:
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await asyncio.sleep(stream)
        body = b""
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m devstack.demo_upstream", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args(argv)
    uvicorn.run(DemoUpstream(), host=args.host, port=args.port, lifespan="off", access_log=False, log_level="warning",
                # Longer than the proxies keep an idle connection (Envoy's
                # idle_timeout, nginx's upstream keepalive_timeout: 60 s), so
                # that the proxy, never the application, closes it.
                timeout_keep_alive=KEEP_ALIVE_SECONDS)


if __name__ == "__main__":
    main()
