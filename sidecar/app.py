"""The HTTP service: per-request check endpoints on a bare ASGI path, the rest
(health, metrics, admin) in FastAPI (sidecar.service).

The front doors' routes (sidecar.frontdoors) are answered by ``SluiceApp``
before any framework code runs: one table lookup, no middleware stack, no
validation. Every failure inside a check is answered as
*allow* (fail open) and counted; a rate limiter's bug must never
become the protected site's outage.

The HTTP protocol (sidecar.server) answers checks itself through
``check_for``, before ASGI: with the memory store at once
(``check_at_once``: no task, no ASGI messages), with a shared store in a
task of its own (``check_later``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from sidecar.admin import Admin
from sidecar.asgi import Receive, Scope, Send
from sidecar.at_once import run_at_once
from sidecar.chain import NGINX_CHAINED_CHECK, ThenAuth, asks_next, routes_with_then_auth
from sidecar.engine import ALLOW, Decision, Engine
from sidecar.frontdoors import ROUTES
from sidecar.frontdoors.common import (
    Check,
    Reply,
    RouteTable,
    header_map,
    respond,
    wait_unless_disconnected,
)
from sidecar.overload import STORED_FRONT_DOORS, AddressRefusals, LoopWatch, StoredKey, stored_key
from sidecar.ratelog import RateLimitedLog
from sidecar.request import CheckRequest
from sidecar.server import encode_reply
from sidecar.service import build_api

if TYPE_CHECKING:
    from sidecar.frontdoors.rls import RateLimitService

log = logging.getLogger("sluice")


# The answer to a check that failed inside Sluice: allow (fail open).
FAIL_OPEN: Reply = (200, [], b"")
# Where the HTTP protocol leaves a check it decided at once but that a leaky
# bucket holds: the ASGI path then waits and answers (see check_at_once).
HELD = "sluice.held"
# Where it leaves a check it admitted that the next auth service is to be
# asked about (sidecar.chain): the ASGI path asks and answers.
THEN_AUTH = "sluice.then_auth"


class SluiceApp:
    """The ASGI application uvicorn runs."""

    def __init__(self, engine: Engine, report_udp: tuple[str, int] | None = None,
                 admin: Admin | None = None, share_report_port: bool = False,
                 health: tuple[str, int] | None = None, grpc: tuple[str, int] | None = None,
                 rls: RateLimitService | None = None, then_auth: ThenAuth | None = None) -> None:
        self.engine = engine
        self.then_auth = then_auth
        listener = None
        if grpc is not None:
            # grpcio is loaded only by a Sluice that serves gRPC.
            from sidecar.frontdoors.grpc_server import GrpcListener

            listener = GrpcListener(self, *grpc, reuse_port=share_report_port, rls=rls)
        self.api = build_api(engine, report_udp, admin, share_report_port, health, listener)
        self._error_log = RateLimitedLog(log, 10)
        self._routes = RouteTable(ROUTES if then_auth is None else routes_with_then_auth(ROUTES))
        self._decisions = engine.metrics.decisions
        # How far the serving loop is behind, for late checks
        # (sidecar.overload); the HTTP protocol starts it on its loop.
        self.watch = LoopWatch()
        engine.loop_behind = self.watch.behind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            held = scope.get(HELD)
            if held is not None:
                await self._answer_after_hold(receive, send, *held)
                return
            chained = scope.get(THEN_AUTH)
            if chained is not None:
                await respond(send, *await self._then_auth(NGINX_CHAINED_CHECK, *chained))
                return
            handler = self._routes.find(scope["path"])
            if handler is not None:
                if isinstance(handler, Check):
                    await self._check(scope, receive, send, handler)
                else:
                    await handler(self, scope, receive, send)
                return
        await self.api(scope, receive, send)

    @property
    def answers_at_once(self) -> bool:
        """Whether a check is decided without waiting (the memory store)."""
        return self.engine.store.answers_at_once

    def check_for(self, path: str) -> Check | None:
        """The check front door at ``path`` when the HTTP protocol may answer
        it itself (sidecar.server): at once with the memory store
        (``check_at_once``), or after awaiting a shared store
        (``check_later``) when no rule can hold a request."""
        if not self.engine.store.answers_at_once and self.engine.ruleset.holds:
            return None  # a held request waits on the ASGI path, which sees the client leave
        handler = self._routes.find(path)
        return handler if isinstance(handler, Check) else None

    @property
    def stored_refusals(self) -> AddressRefusals:
        """Refusals whose answers the HTTP protocol sends again (``refused_at_once``)."""
        return self.engine.address_refusals

    def refused_at_once(self, check: Check, key: StoredKey, request_id: bytes) -> bytes | None:
        """The stored answer of a refusal that still holds for the client
        these fields name (``StoredKey``), counted as its decision was; None
        when there is none and the check is decided."""
        engine = self.engine
        stored = engine.address_refusals.recall(key, request_id, engine.clock())
        if stored is None:
            return None
        engine.refused_again(stored)
        self._decisions[check.front_door, stored.outcome] += 1
        return stored.bytes_for(request_id)

    def _store_refusal(self, check: Check, request: CheckRequest, decision: Decision, reply: Reply,
                       method: str) -> None:
        """Keep the answer of a refusal that holds for every request of the
        client, as the HTTP protocol writes it on a connection kept alive."""
        if check.front_door not in STORED_FRONT_DOORS:
            return
        content, keep_alive = encode_reply(reply, method, True, [])
        if not keep_alive:
            return  # Envoy's close: the connection ends with the answer
        rule_id, action, log_key = request.refused_as
        engine = self.engine
        until = request.refused_until
        if request.proxy_expires and check.front_door == "nginx":
            # The answer names the last second nginx may keep it, which a
            # decision names one later from the next second on.
            until = min(until, engine.clock() + 1 - engine.wall_clock() % 1)
        engine.address_refusals.remember(stored_key(check.front_door, method, request.headers),
                                         request.request_id, content, until, rule_id, action, decision.outcome,
                                         log_key)

    def check_at_once(self, check: Check, scope: Scope, headers: dict[str, str]) -> Reply | None:
        """The reply to a check, decided and answered without awaiting (see
        ``check_for``); None when a leaky bucket holds the request, which
        ``scope[HELD]`` then carries to the ASGI path to wait and answer, or
        when the next auth service is to be asked (``scope[THEN_AUTH]``)."""
        decided = run_at_once(self._decide(check, scope, headers))
        if decided is None:
            return self._unless_chained(check, scope, headers, self._fail_open(check))
        request, decision = decided
        if decision.delay > 0:
            scope[HELD] = (check, request, decision)
            return None
        reply = self._answer(check, request, decision, scope.get("method"))
        return self._unless_chained(check, scope, headers, reply)

    def _unless_chained(self, check: Check, scope: Scope, headers: dict[str, str], reply: Reply) -> Reply | None:
        """``reply``, or None when the next auth service is to be asked about it first."""
        if not self._chains(check, headers, reply):
            return reply
        scope[THEN_AUTH] = (headers, reply)
        return None

    def _chains(self, check: Check, headers: dict[str, str], reply: Reply) -> bool:
        """Whether ``reply`` admits a check that the next auth service is
        asked about (``sluice serve --then-auth``): nginx's, from a location
        that asks it, and only when Sluice let it in (a failure inside
        Sluice included: it lets the request in, never past authentication)."""
        return check is NGINX_CHAINED_CHECK and 200 <= reply[0] < 300 and asks_next(headers)

    async def _then_auth(self, check: Check, headers: dict[str, str], reply: Reply) -> Reply:
        """``reply``, or the next auth service's answer when it is asked (``_chains``)."""
        if self.then_auth is None or not self._chains(check, headers, reply):
            return reply
        return await self.then_auth.answer(headers, reply)

    async def check_later(self, check: Check, scope: Scope, headers: dict[str, str]) -> Reply:
        """The reply to a check over a store that is awaited (see
        ``check_for``)."""
        decided = await self._decide(check, scope, headers)
        if decided is None:
            return await self._then_auth(check, headers, self._fail_open(check))
        request, decision = decided
        if decision.delay > 0:
            # Only after a reload made a rule hold while this check was
            # being decided: it waits here, without watching the client.
            try:
                await asyncio.sleep(decision.delay)
            finally:
                self.engine.release_hold()
        return await self._then_auth(check, headers, self._answer(check, request, decision, scope.get("method")))

    async def _check(self, scope: Scope, receive: Receive, send: Send, check: Check) -> None:
        headers = header_map(scope)
        decided = await self._decide(check, scope, headers)
        if decided is None:
            await respond(send, *await self._then_auth(check, headers, self._fail_open(check)))
        elif decided[1].delay > 0:
            await self._answer_after_hold(receive, send, check, *decided)
        else:
            reply = self._answer(check, *decided, scope.get("method"))
            await respond(send, *await self._then_auth(check, headers, reply))

    async def _decide(self, check: Check, scope: Scope, headers: dict[str, str]
                      ) -> tuple[CheckRequest, Decision] | None:
        """The front door's request and the engine's decision; None when
        that failed inside Sluice (counted and logged; the caller fails open)."""
        engine = self.engine
        started = time.perf_counter()
        try:
            request = check.describe(scope, headers)
            decision = await engine.decide(request)
        except Exception:
            self.internal_error()
            return None
        engine.metrics.latency.observe(time.perf_counter() - started)
        return request, decision

    async def _answer_after_hold(self, receive: Receive, send: Send, check: Check,
                                 request: CheckRequest, decision: Decision) -> None:
        """A leaky bucket admitted the request at a later slot: the proxy
        waits for our answer. The decision took a hold slot; it is
        given back when the wait ends or the proxy goes away."""
        try:
            if not await wait_unless_disconnected(receive, decision.delay):
                return
        finally:
            self.engine.release_hold()
        await respond(send, *await self._then_auth(check, request.headers, self._answer(check, request, decision)))

    def _answer(self, check: Check, request: CheckRequest, decision: Decision, method: str | None = None) -> Reply:
        """The front door's reply; a refusal that holds for the client's
        every request is kept too, for the check's ``method``."""
        try:
            reply = check.answer(request, decision)
            if request.refused_until and method is not None:
                self._store_refusal(check, request, decision, reply, method)
        except Exception:
            self.internal_error()
            return self._fail_open(check)
        self._decisions[check.front_door, decision.outcome] += 1
        return reply

    def _fail_open(self, check: Check) -> Reply:
        """The answer to a check that failed inside Sluice (counted and
        logged already): allow."""
        self._decisions[check.front_door, ALLOW] += 1
        return FAIL_OPEN

    def internal_error(self) -> None:
        self.engine.metrics.errors.inc()
        self._error_log.error("check failed inside Sluice; the request was allowed (fail open)",
                              exc_info=True)


def create_app(engine: Engine, report_udp: tuple[str, int] | None = None,
               admin: Admin | None = None, share_report_port: bool = False,
               health: tuple[str, int] | None = None, grpc: tuple[str, int] | None = None,
               rls: RateLimitService | None = None, then_auth: ThenAuth | None = None) -> SluiceApp:
    """``report_udp``: where to receive nginx's response reports (syslog/UDP),
    a port several worker processes share with ``share_report_port`` (the
    health listener's too); ``admin``: reload on SIGHUP and serve the admin
    API; ``health``: where the probe listener answers (see sidecar.health);
    ``grpc``: where Envoy's gRPC ext_authz is served (see
    sidecar.frontdoors.grpc_authz), and with it ``rls``, the Rate Limit
    Service (sidecar.frontdoors.rls); ``then_auth``: the auth service
    nginx's admitted checks are asked of next (sidecar.chain)."""
    return SluiceApp(engine, report_udp, admin, share_report_port, health, grpc, rls, then_auth)
