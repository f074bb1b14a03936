"""The HTTP service: per-request check endpoints on a bare ASGI path, the rest
(health, metrics, admin) in FastAPI (sidecar.service).

The front doors' routes (sidecar.frontdoors) are answered by ``SluiceApp``
before any framework code runs: one table lookup, no middleware stack, no
validation. Every failure inside a check is answered as
*allow* (fail open, SPEC §9) and counted; a rate limiter's bug must never
become the protected site's outage.
"""

from __future__ import annotations

import logging
import time

from sidecar.admin import Admin
from sidecar.asgi import Receive, Scope, Send
from sidecar.engine import Engine
from sidecar.frontdoors import ROUTES
from sidecar.frontdoors.common import (
    Answer, Check, Describe, RouteTable, header_map, respond, wait_unless_disconnected,
)
from sidecar.ratelog import RateLimitedLog
from sidecar.service import build_api

log = logging.getLogger("sluice")


class SluiceApp:
    """The ASGI application uvicorn runs."""

    def __init__(self, engine: Engine, report_udp: tuple[str, int] | None = None,
                 admin: Admin | None = None, share_report_port: bool = False,
                 health: tuple[str, int] | None = None) -> None:
        self.engine = engine
        self.api = build_api(engine, report_udp, admin, share_report_port, health)
        self._error_log = RateLimitedLog(log, 10)
        self._routes = RouteTable(ROUTES)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler = self._routes.find(scope["path"])
            if handler is not None:
                if isinstance(handler, Check):
                    await self._check(scope, receive, send, handler.describe, handler.answer)
                else:
                    await handler(self, scope, receive, send)
                return
        await self.api(scope, receive, send)

    async def _check(self, scope: Scope, receive: Receive, send: Send, describe: Describe,
                     answer: Answer) -> None:
        engine = self.engine
        started = time.perf_counter()
        try:
            request = describe(engine, scope, header_map(scope))
            decision = await engine.decide(request)
        except Exception:
            self.internal_error()
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

    def internal_error(self) -> None:
        self.engine.metrics.errors.inc()
        self._error_log.error("check failed inside Sluice; the request was allowed (fail open)",
                              exc_info=True)


def create_app(engine: Engine, report_udp: tuple[str, int] | None = None,
               admin: Admin | None = None, share_report_port: bool = False,
               health: tuple[str, int] | None = None) -> SluiceApp:
    """``report_udp``: where to receive nginx's response reports (syslog/UDP),
    a port several worker processes share with ``share_report_port`` (the
    health listener's too); ``admin``: reload on SIGHUP and serve the admin
    API; ``health``: where the probe listener answers (see sidecar.health)."""
    return SluiceApp(engine, report_udp, admin, share_report_port, health)
