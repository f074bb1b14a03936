"""A response report over HTTP (Envoy's Lua filter), answered at once; the
report's meaning and the syslog/UDP way in are in ``sidecar.hook``."""

from __future__ import annotations

from sidecar.asgi import Receive, Scope, Send
from sidecar.frontdoors.common import Route, Service, header_map, respond
from sidecar.hook import report_from_headers

HOOK_PATH = "/v1/hook"


async def report(service: Service, scope: Scope, receive: Receive, send: Send) -> None:
    try:
        await report_from_headers(service.engine, header_map(scope))
    except Exception:
        service.internal_error()
    await respond(send, 204, [])


ROUTES = (Route(HOOK_PATH, report),)
