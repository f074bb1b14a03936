"""The gRPC server: ext_authz, the Rate Limit Service and health checks on
one port (``sluice serve --grpc-port``), served by ``grpc.aio`` in the
HTTP server's event loop and started and stopped by its lifespan."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

from sidecar.frontdoors.grpc_authz import CheckingService, check_handler
from sidecar.frontdoors.messages import (
    HEALTH_SERVICE,
    NOT_SERVING,
    SERVING,
    HealthCheckRequest,
    HealthCheckResponse,
    reader,
)

if TYPE_CHECKING:
    from sidecar.frontdoors.rls import RateLimitService

# The service names grpc.health.v1 answers for: the server as a whole,
# the two Envoy services, and envoyproxy/ratelimit's own name.
HEALTH_NAMES = ("", "envoy.service.auth.v3.Authorization", "envoy.service.ratelimit.v3.RateLimitService",
                "ratelimit")
# The largest request Sluice reads: a check's headers or a request's
# descriptors come far below it.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class Health:
    """``grpc.health.v1.Health``: SERVING while the server runs, NOT_SERVING
    once it is stopping (so that a balancer moves on before the port
    closes); an unknown service name is NOT_FOUND."""

    def __init__(self) -> None:
        self.serving = True

    async def check(self, request: Any, context: Any) -> Any:
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a HealthCheckRequest")
        if request.service not in HEALTH_NAMES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return HealthCheckResponse(status=SERVING if self.serving else NOT_SERVING)

    async def watch(self, request: Any, context: Any) -> Any:
        """The status now; the stream then ends (a client watches again)."""
        yield await self.check(request, context)

    def handler(self) -> Any:
        methods = {
            "Check": grpc.unary_unary_rpc_method_handler(
                self.check, request_deserializer=reader(HealthCheckRequest),
                response_serializer=HealthCheckResponse.SerializeToString),
            "Watch": grpc.unary_stream_rpc_method_handler(
                self.watch, request_deserializer=reader(HealthCheckRequest),
                response_serializer=HealthCheckResponse.SerializeToString),
        }
        return grpc.method_handlers_generic_handler(HEALTH_SERVICE, methods)


class GrpcListener:
    """The gRPC server. Several worker processes share its port
    (SO_REUSEPORT) with ``reuse_port``; otherwise a port in use is an
    error at start. ``rls`` adds the Rate Limit Service."""

    def __init__(self, service: CheckingService, host: str, port: int, reuse_port: bool = False,
                 rls: RateLimitService | None = None) -> None:
        self.service = service
        self.rls = rls
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.reuse_port = reuse_port
        self.port = port  # the port bound, once started (port 0: one the system chose)
        self.health = Health()
        self._server: Any = None

    async def start(self) -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", int(self.reuse_port)),
                                          ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        handlers = [check_handler(self.service), self.health.handler()]
        if self.rls is not None:
            from sidecar.frontdoors.rls import rls_handler

            handlers.append(rls_handler(self.rls, self.service.internal_error))
        server.add_generic_rpc_handlers(tuple(handlers))
        try:
            self.port = server.add_insecure_port(self.address)
        except RuntimeError:  # grpcio's "Failed to bind"; older versions return 0
            self.port = 0
        if self.port == 0:
            raise OSError(f"--grpc-port: cannot listen on {self.address} (in use?)")
        await server.start()
        self.health.serving = True
        self._server = server

    async def stop(self) -> None:
        if self._server is not None:
            self.health.serving = False
            await self._server.stop(grace=1.0)
            self._server = None
