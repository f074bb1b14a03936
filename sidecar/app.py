"""The HTTP service: per-request check endpoints on a bare ASGI path, the rest
(health, metrics, admin) in FastAPI (sidecar.service).

The front doors' routes (sidecar.frontdoors) are answered by ``SluiceApp``
before any framework code runs: one table lookup, no middleware stack, no
validation. Every failure inside a check is answered as
*allow* (fail open) and counted; a rate limiter's bug must never
become the protected site's outage.

Each check route is a ``CheckDoor``, made once when the application starts:
its front door bound to the engine, to the way the store answers and to
whether the next auth service is asked (``--then-auth``). The HTTP protocol
(sidecar.server) finds a check's door in ``check_doors`` and asks it once
(``CheckDoor.answer``), before ASGI:

* over a store that answers at once (the memory store), ``AtOnceDoor``
  answers in the protocol's callback, in one straight line: the front door
  describes the request, the engine decides, the front door answers
  (``Check.at_once``), and the door counts the answer; no task, no ASGI
  messages. A check passes through each module on its way once.
* over a store that is awaited (Redis), ``AwaitedDoor`` gives the protocol
  the coroutine it awaits in a task of its own.

Either answers a refusal the engine keeps for the client's every request
from its stored bytes, without a decision, and hands the protocol back to
the ASGI path (None) for what must wait there: a request a leaky bucket
holds, one the next auth service is asked about.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from time import perf_counter
from typing import TYPE_CHECKING

from sidecar.admin import Admin
from sidecar.asgi import Receive, Scope, Send
from sidecar.chain import NGINX_CHAINED_CHECK, ThenAuth, asks_next, routes_with_then_auth
from sidecar.engine import ALLOW, Decision, Engine
from sidecar.exchange import encode_reply
from sidecar.frontdoors import ROUTES
from sidecar.frontdoors.common import (
    HEADER_MAP,
    Check,
    Endpoint,
    Reply,
    header_map,
    respond,
    wait_unless_disconnected,
)
from sidecar.frontdoors.routes import RouteTable
from sidecar.metrics import add_one
from sidecar.overload import STORED_FRONT_DOORS, LoopWatch, stored_key
from sidecar.ratelog import RateLimitedLog
from sidecar.request import CheckRequest, new_request_id
from sidecar.service import build_api

if TYPE_CHECKING:
    from sidecar.frontdoors.rls import RateLimitService

log = logging.getLogger("sluice")


# The answer to a check that failed inside Sluice: allow (fail open).
FAIL_OPEN = Reply(200, [], b"")
# Where the HTTP protocol leaves a check it decided at once but that a leaky
# bucket holds: the ASGI path then waits and answers (see AtOnceDoor.reply).
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
        # Each check route's door, made once; the ASGI path finds doors and
        # endpoints by path, the HTTP protocol its doors (check_doors).
        routes: list[tuple[str, CheckDoor | Endpoint, bool]] = []
        for route in ROUTES if then_auth is None else routes_with_then_auth(ROUTES):
            handler = route.handler
            routes.append((route.path, self._door(handler) if isinstance(handler, Check) else handler,
                           route.prefix))
        self._routes = RouteTable(routes)
        self.check_doors = RouteTable([(path, handler, prefix) for path, handler, prefix in routes
                                       if isinstance(handler, CheckDoor)])
        self._awaited_doors: dict[Check, AwaitedDoor] = {}
        # How far the serving loop is behind, for late checks
        # (sidecar.overload); the HTTP protocol starts it on its loop.
        self.watch = LoopWatch()
        engine.loop_behind = self.watch.behind

    def _door(self, check: Check) -> CheckDoor:
        """``check``'s door: answered at once when the store answers at
        once and the front door has its ``at_once``, else awaited."""
        if self.engine.store.answers_at_once and check.at_once is not None:
            return AtOnceDoor(self, check)
        return AwaitedDoor(self, check)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            held = scope.get(HELD)
            if held is not None:
                door, request, decision = held
                await door.after_hold(receive, send, request, decision)
                return
            chained = scope.get(THEN_AUTH)
            if chained is not None:
                assert self.then_auth is not None
                await respond(send, *await self.then_auth.answer(*chained))
                return
            handler = self._routes.find(scope["path"])
            if handler is not None:
                if isinstance(handler, CheckDoor):
                    await handler.asgi(scope, receive, send)
                else:
                    await handler(self, scope, receive, send)
                return
        await self.api(scope, receive, send)

    def check_for(self, path: str) -> CheckDoor | None:
        """The door of the check route at ``path``, if there is one."""
        return self.check_doors.find(path)

    async def check_later(self, check: Check, scope: Scope, headers: dict[str, str]) -> Reply:
        """The reply to a check of a front door served elsewhere (gRPC),
        the engine awaited."""
        door = self._awaited_doors.get(check)
        if door is None:
            door = self._awaited_doors[check] = AwaitedDoor(self, check)
        return await door.later(scope, headers)

    def internal_error(self) -> None:
        self.engine.metrics.errors.inc()
        self._error_log.error("check failed inside Sluice; the request was allowed (fail open)",
                              exc_info=True)


# What a door answers the HTTP protocol: a stored refusal's bytes, the
# front door's reply, a coroutine that gives it, or None when the ASGI path
# is to answer (see sidecar.server.CheckDoor).
DoorAnswer = bytes | Reply | Awaitable[Reply] | None


class CheckDoor:
    """One check route of the application, bound when it starts: its front
    door (``check``), the engine, the counters its answers go to, and
    whether the next auth service is asked after an allow (``chains``:
    only nginx's check, with ``--then-auth``)."""

    def __init__(self, app: SluiceApp, check: Check) -> None:
        engine = app.engine
        self.app = app
        self.engine = engine
        self.check = check
        self.front_door = check.front_door
        self.decisions = engine.metrics.decisions
        self.latency = engine.metrics.latency
        self.refusals = engine.address_refusals
        # Whether its refusals that hold for the client's every request are
        # kept, and answered again from their bytes (sidecar.overload).
        self.stores = check.front_door in STORED_FRONT_DOORS
        self.chains = app.then_auth is not None and check is NGINX_CHAINED_CHECK
        self.tracing = engine.tracing  # None unless spans are exported (sidecar.tracing)

    def answer(self, scope: Scope, keep_alive: bool, default_headers: list[tuple[bytes, bytes]]) -> DoorAnswer:
        """What the HTTP protocol sends for a check (see ``DoorAnswer``)."""
        raise NotImplementedError

    # -- stored refusals ---------------------------------------------------------

    def again(self, method: str, headers: dict[str, str]) -> bytes | None:
        """The stored answer of a refusal that still holds for the client
        these fields name (``StoredKey``), counted as its decision was; None
        when there is none and the check is decided. It enters the module of
        stored refusals once, and the engine once (which counts it, the
        front door's answer included). The protocol asks only while refusals
        are stored, on a connection kept alive and without default header
        fields, as the bytes were written for one; before it makes the
        check's scope, when it read the head itself."""
        if not self.stores:
            return None
        # As request_id_of: the proxy's, or a new one.
        request_id = headers.get("x-request-id") or new_request_id()
        engine = self.engine
        again = self.refusals.answer_again(self.front_door, method, headers, request_id, engine.clock())
        if again is None:
            return None
        stored, content = again
        engine.refused_again(stored, self.front_door)
        return content

    def _store_refusal(self, request: CheckRequest, decision: Decision, reply: Reply, method: str) -> None:
        """Keep the answer of a refusal that holds for every request of the
        client, as the HTTP protocol writes it on a connection kept alive."""
        if not self.stores:
            return
        content, keep_alive = encode_reply(reply, method, True, [])
        if not keep_alive:
            return  # Envoy's close: the connection ends with the answer
        rule_id, action, log_key = request.refused_as
        engine = self.engine
        until = request.refused_until
        if request.proxy_expires and self.front_door == "nginx":
            # The answer names the last second nginx may keep it, which a
            # decision names one later from the next second on.
            until = min(until, engine.clock() + 1 - engine.wall_clock() % 1)
        self.refusals.remember(stored_key(self.front_door, method, request.headers), request.request_id, content,
                               until, rule_id, action, decision.outcome, log_key)

    # -- decided, then answered (the paths that await the engine) ------------------

    async def _decided(self, scope: Scope, headers: dict[str, str]) -> tuple[CheckRequest, Decision] | None:
        """The front door's request and the engine's decision; None when
        that failed inside Sluice (counted and logged; the caller fails open)."""
        started = perf_counter()
        tracing = self.tracing
        began = time.time_ns() if tracing is not None else 0
        try:
            request = self.check.describe(scope, headers)
            decision = await self.engine.decide(request)
        except Exception:
            self.app.internal_error()
            return None
        self.latency.observe(perf_counter() - started)
        if tracing is not None:
            tracing.record(self.front_door, request, decision, began, time.time_ns())
        return request, decision

    def _answer(self, request: CheckRequest, decision: Decision, method: str | None = None) -> Reply:
        """The front door's reply, counted; a refusal that holds for the
        client's every request is kept too, for the check's ``method``."""
        try:
            reply = self.check.answer(request, decision)
            if request.refused_until and method is not None:
                self._store_refusal(request, decision, reply, method)
        except Exception:
            self.app.internal_error()
            return self._fail_open()
        add_one(self.decisions, (self.front_door, decision.outcome))
        return reply

    def _fail_open(self) -> Reply:
        """The answer to a check that failed inside Sluice (counted and
        logged already): allow."""
        add_one(self.decisions, (self.front_door, ALLOW))
        return FAIL_OPEN

    def _asks_next(self, headers: dict[str, str], reply: Reply) -> bool:
        """Whether ``reply``, from a door that ``chains``, admits a check
        that the next auth service is asked about: from a location that
        asks it, and only when Sluice let it in (a failure inside Sluice
        included: it lets the request in, never past authentication)."""
        return 200 <= reply.status < 300 and asks_next(headers)

    async def _next_auth(self, headers: dict[str, str], reply: Reply) -> Reply:
        """``reply``, or the next auth service's answer when it is asked."""
        if self.chains and self._asks_next(headers, reply):
            assert self.app.then_auth is not None
            return await self.app.then_auth.answer(headers, reply)
        return reply

    async def later(self, scope: Scope, headers: dict[str, str]) -> Reply:
        """The reply to a check over a store that is awaited."""
        decided = await self._decided(scope, headers)
        if decided is None:
            return await self._next_auth(headers, self._fail_open())
        request, decision = decided
        if decision.delay > 0:
            # Only after a reload made a rule hold while this check was
            # being decided: it waits here, without watching the client.
            try:
                await asyncio.sleep(decision.delay)
            finally:
                self.engine.release_hold()
        return await self._next_auth(headers, self._answer(request, decision, scope.get("method")))

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The check on the ASGI path."""
        headers = header_map(scope)
        decided = await self._decided(scope, headers)
        if decided is None:
            reply = self._fail_open()
        elif decided[1].delay > 0:
            await self.after_hold(receive, send, *decided)
            return
        else:
            reply = self._answer(*decided, scope.get("method"))
        await respond(send, *await self._next_auth(headers, reply))

    async def after_hold(self, receive: Receive, send: Send, request: CheckRequest, decision: Decision) -> None:
        """A leaky bucket admitted the request at a later slot: the proxy
        waits for our answer. The decision took a hold slot; it is
        given back when the wait ends or the proxy goes away."""
        try:
            if not await wait_unless_disconnected(receive, decision.delay):
                return
        finally:
            self.engine.release_hold()
        await respond(send, *await self._next_auth(request.headers, self._answer(request, decision)))


class AtOnceDoor(CheckDoor):
    """A check route over a store that answers at once: the check decided
    and answered inside the protocol's callback, in one pass through the
    front door (``Check.at_once``) with the engine's decision run at once
    (``decide``)."""

    def __init__(self, app: SluiceApp, check: Check) -> None:
        super().__init__(app, check)
        assert check.at_once is not None
        self.at_once = check.at_once
        # The door exists over a store that answers at once: decide_now, no coroutine.
        self.decide = self.engine.decide_now

    def answer(self, scope: Scope, keep_alive: bool, default_headers: list[tuple[bytes, bytes]]) -> DoorAnswer:
        headers: dict[str, str] | None = scope.get(HEADER_MAP)  # as header_map, when the protocol made it
        if headers is None:
            headers = header_map(scope)
        if keep_alive and not default_headers and self.refusals.entries:
            stored = self.again(scope["method"], headers)
            if stored is not None:
                return stored
        return self.reply(scope, headers)

    def reply(self, scope: Scope, headers: dict[str, str]) -> Reply | None:
        """The reply to a check, decided and answered without awaiting; None
        when a leaky bucket holds the request, which ``scope[HELD]`` then
        carries to the ASGI path to wait and answer, or when the next auth
        service is to be asked (``scope[THEN_AUTH]``)."""
        started = perf_counter()
        tracing = self.tracing
        began = time.time_ns() if tracing is not None else 0
        try:
            request, decision, reply = self.at_once(scope, headers, self.decide)
            self.latency.observe(perf_counter() - started)
            if tracing is not None:
                tracing.record(self.front_door, request, decision, began, time.time_ns())
            if decision.delay > 0:
                # Its answer is the front door's again after the wait.
                scope[HELD] = (self, request, decision)
                return None
            if request.refused_until:
                self._store_refusal(request, decision, reply, scope["method"])
        except Exception:
            self.app.internal_error()
            reply = self._fail_open()
        else:
            # add_one, written out: a field of a dict read in C.
            decisions = self.decisions
            counted = (self.front_door, decision.outcome)
            decisions[counted] = decisions.get(counted, 0) + 1
        if self.chains and self._asks_next(headers, reply):
            scope[THEN_AUTH] = (headers, reply)
            return None
        return reply


class AwaitedDoor(CheckDoor):
    """A check route over a store that is awaited: the protocol awaits the
    door's coroutine in a task; a rule that may hold a request sends the
    check to the ASGI path, which sees the client leave while it waits."""

    def answer(self, scope: Scope, keep_alive: bool, default_headers: list[tuple[bytes, bytes]]) -> DoorAnswer:
        if self.engine.ruleset.holds:
            return None
        headers = header_map(scope)
        if keep_alive and not default_headers and self.refusals.entries:
            stored = self.again(scope["method"], headers)
            if stored is not None:
                return stored
        return self.later(scope, headers)

    def again(self, method: str, headers: dict[str, str]) -> bytes | None:
        # A rule that may hold a request: every check is the ASGI path's.
        return None if self.engine.ruleset.holds else super().again(method, headers)


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
