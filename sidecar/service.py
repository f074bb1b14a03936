"""The FastAPI service beside the front doors: health, readiness, metrics,
the admin API, and the lifespan (the UDP report listener, SIGHUP and the
watch of the rules file, the ``--health`` probe listener)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated, Any, Protocol, TypeVar, cast

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from sidecar.admin import MAX_LISTED, Admin, Refused, parse_assignment, parse_ban
from sidecar.engine import Engine
from sidecar.health import HealthListener, Heartbeat
from sidecar.hook import listen_for_reports
from sidecar.plurals import plural
from sidecar.store import StoreUnavailable
from sidecar.store.node import NodeStore


class Listener(Protocol):
    """A server of another protocol in the same event loop (the gRPC front door)."""

    def start(self) -> Awaitable[None]: ...

    def stop(self) -> Awaitable[None]: ...


def build_api(engine: Engine, report_udp: tuple[str, int] | None = None,
              admin: Admin | None = None, share_report_port: bool = False,
              health: tuple[str, int] | None = None, grpc: Listener | None = None) -> FastAPI:
    def readiness() -> str:
        return f"ok: {plural(len(engine.ruleset.rules), 'rule')} from {engine.ruleset.source}\n"

    @contextlib.asynccontextmanager
    async def lifespan(_api: FastAPI) -> AsyncIterator[None]:
        node = engine.metrics.node  # a worker's part of the node's metrics
        if node is not None:
            node.start(asyncio.get_running_loop())
        try:
            await engine.store.open()
        except StoreUnavailable as exc:
            engine.store_failed(exc)  # the first requests connect again
        transport = await listen_for_reports(engine, *report_udp, reuse_port=share_report_port) \
            if report_udp else None
        loop = asyncio.get_running_loop()
        watch = None
        if admin is not None:
            loop.add_signal_handler(signal.SIGHUP, admin.reload)
            if admin.file_watch is not None:
                watch = loop.create_task(admin.file_watch.run())
        following = follow_other_workers(engine, admin, loop) if isinstance(engine.store, NodeStore) else None
        probes = None
        if health is not None:
            heartbeat = Heartbeat()
            heartbeat.start(loop)
            probes = HealthListener(*health, heartbeat, readiness, reuse_port=share_report_port)
            probes.start()
        if grpc is not None:
            await grpc.start()
        try:
            yield
        finally:
            if grpc is not None:
                await grpc.stop()
            if probes is not None:
                probes.heartbeat.stop()
                await asyncio.to_thread(probes.stop)
            for task in (watch, following):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if admin is not None:
                loop.remove_signal_handler(signal.SIGHUP)
            if transport is not None:
                transport.close()
            if node is not None:
                node.stop()
            engine.close()

    api = FastAPI(title="Sluice", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    for name, (documentation, read) in engine.store.gauges().items():
        engine.metrics.watch(name, documentation, read)
    engine.metrics.watch("sluice_waiting_requests", "Requests held by a leaky bucket right now.",
                         lambda: engine.delayed)

    # HEAD as well as GET: probes and scrapers that only look at the status.
    @api.api_route("/healthz", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    def healthz() -> str:
        return "ok\n"

    @api.api_route("/readyz", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    def readyz() -> str:
        return readiness()

    # envoyproxy/ratelimit's health path, for probes carried over unchanged.
    @api.api_route("/healthcheck", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    def healthcheck() -> str:
        return "OK"

    @api.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(await engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    if admin is not None:
        api.include_router(admin_routes(admin))
    return api


# How often a worker of the node-wide memory store looks for what other
# workers changed, between its own requests (which look every time).
FOLLOW_SECONDS = 1.0


def follow_other_workers(engine: Engine, admin: Admin | None,
                         loop: asyncio.AbstractEventLoop) -> asyncio.Task[None]:
    """Over the node's shared table, act on what an administrator did
    through another worker: forget the refusals this one keeps, and reload
    the rules when another worker was asked to. A task that looks every
    ``FOLLOW_SECONDS`` even when no request comes."""
    store = cast(NodeStore, engine.store)

    def reload() -> None:
        if admin is not None:
            admin.reload("worker")

    def reload_soon() -> None:
        loop.call_soon(reload)  # not inside the request that noticed

    store.follow(engine.forget_refusals, reload_soon)

    async def look() -> None:
        while True:
            store.refresh()
            await asyncio.sleep(FOLLOW_SECONDS)

    return loop.create_task(look())


T = TypeVar("T")


def _peer(request: Request) -> str | None:
    """The peer's address; "" for a peer of a Unix socket, which uvicorn
    gives no address (and the server the socket's path, without a port)."""
    if request.client is not None:
        return request.client.host
    server = request.scope.get("server")
    return "" if server is not None and server[1] is None else None


async def _answered(call: Awaitable[T]) -> T:
    """What an admin call answers; what it refuses, with its status; a shared
    store that did not answer is a 503."""
    try:
        return await call
    except Refused as refused:
        raise HTTPException(refused.status, refused.message) from None
    except StoreUnavailable as exc:
        raise HTTPException(503, f"the shared state store did not answer ({exc}); try again") from None


def admin_routes(admin: Admin) -> APIRouter:
    """``/v1/admin/...``: rules with their statistics, bans (list, ban, lift),
    tiers (list, assign, remove), counters (list, reset), reload."""

    def authorized(request: Request, authorization: str | None = Header(None)) -> None:
        if admin.allows(authorization, _peer(request)):
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
    async def rules() -> list[dict[str, Any]]:
        return admin.rules()

    @router.get("/bans")
    async def bans() -> list[dict[str, Any]]:
        return await _answered(admin.bans())

    @router.post("/bans", status_code=201)
    async def ban(request: Request) -> JSONResponse:
        """Ban an address or a network by hand: ``{"address", "duration", "reason"}``."""
        try:
            address, duration, reason = parse_ban(await request.body())
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
        return JSONResponse(await _answered(admin.ban(address, duration, reason, admin.caller)), status_code=201)

    @router.delete("/bans", status_code=204)
    async def lift_ban(address: str) -> Response:
        """Lift the ban of an address (as listed: an IPv6 /64 as
        ``2001:db8::/64``) or of a network, earned or by hand."""
        if not await _answered(admin.lift_ban(address, admin.caller)):
            raise HTTPException(404, admin.no_ban(address))
        return Response(status_code=204)

    @router.get("/tiers")
    async def tiers(limit: Annotated[int, Query(ge=1, le=MAX_LISTED)] = 1000) -> dict[str, Any]:
        """The tiers, and the identities assigned to them: at run time, then by the tiers file."""
        return await _answered(admin.tier_assignments(limit))

    @router.post("/tiers")
    async def assign_tier(request: Request) -> dict[str, Any]:
        """Assign an identity to a tier at run time: ``{"identity", "tier"}``."""
        try:
            identity, tier = parse_assignment(await request.body())
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
        return await _answered(admin.assign_tier(identity, tier, admin.caller))

    @router.delete("/tiers", status_code=204)
    async def unassign_tier(request: Request) -> Response:
        """Remove an identity's run-time assignment: ``{"identity"}`` (in the
        body, so that an API key is in no URL)."""
        try:
            identity, _ = parse_assignment(await request.body(), needs_tier=False)
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
        if not await _answered(admin.unassign_tier(identity, admin.caller)):
            raise HTTPException(404, admin.no_assignment(identity))
        return Response(status_code=204)

    # Keyword-only parameters: ``key`` has its default from ``Query`` (an
    # empty list made afresh for each request), not from ``=``.
    @router.get("/counters")
    async def counters(*, ip: str | None = None, rule: str | None = None,
                       key: Annotated[list[str], Query(default_factory=list)],
                       limit: Annotated[int, Query(ge=1, le=MAX_LISTED)] = 1000) -> dict[str, Any]:
        """The counters of a client address (``ip``), of a rule, or of one key
        of a rule (``rule`` and ``key=DIMENSION=VALUE``, one per dimension)."""
        return await _answered(admin.counters(ip, rule, key, limit))

    @router.delete("/counters")
    async def reset(*, ip: str | None = None, rule: str | None = None,
                    key: Annotated[list[str], Query(default_factory=list)]) -> dict[str, Any]:
        """Reset the counters the same parameters name: counts and penalties end."""
        return await _answered(admin.reset(ip, rule, key, admin.caller))

    @router.post("/reload")
    async def reload() -> JSONResponse:
        errors = admin.reload(admin.caller)
        if errors:
            return JSONResponse({"reloaded": False, "errors": errors}, status_code=422)
        if isinstance(admin.engine.store, NodeStore):
            admin.engine.store.announce_reload()  # the node's other workers reload too
        return JSONResponse({"reloaded": True, "rules": len(admin.engine.ruleset.rules)})

    return router
