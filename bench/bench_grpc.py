"""Where a gRPC call's CPU goes: Sluice's handler in process against the
same calls over grpc.aio on loopback, client and server in this one process
(both sides' CPU counted), and a handler that does nothing over grpc.aio
(grpcio's floor). Two handlers: ext_authz (the CheckRequest parsed, decided
by the ten rules of bench_engine.py, the CheckResponse written) and the Rate
Limit Service (a RateLimitRequest of two descriptors, counted, answered).

Loopback only, bounded: 5,000 calls each way, 50 in flight.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import uvloop  # noqa: E402
from bench_engine import TEN_RULES, engine_for  # noqa: E402

from sidecar.app import SluiceApp  # noqa: E402
from sidecar.frontdoors.grpc_authz import CHECK_METHOD, CHECK_SERVICE, check_handler  # noqa: E402
from sidecar.frontdoors.grpc_server import GrpcListener  # noqa: E402
from sidecar.frontdoors.messages import (  # noqa: E402
    RATE_LIMIT_SERVICE,
    SHOULD_RATE_LIMIT,
    CheckRequest,
    RateLimitRequest,
)
from sidecar.frontdoors.rls import RateLimitService, rls_handler  # noqa: E402
from sidecar.rls import RlsConfig, compile_domain, parse_rls_text  # noqa: E402

CHECKS = 5_000


class _Call:
    """What a grpc handler is asked for its method (grpc's HandlerCallDetails)."""

    method = f"/{CHECK_SERVICE}/{CHECK_METHOD}"
    invocation_metadata = ()


class _RlsCall(_Call):
    method = f"/{RATE_LIMIT_SERVICE}/{SHOULD_RATE_LIMIT}"


# Two descriptors a request, as the shipped rate_limits send, limits far above the load.
RLS_CONFIG = """
domain: sluice
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 1000000000}
    descriptors:
      - key: api_key
        rate_limit: {unit: second, requests_per_unit: 1000000000}
"""


def messages() -> list[bytes]:
    """Envoy's CheckRequests, from rotating clients."""
    found = []
    for i in range(CHECKS):
        message = CheckRequest()
        message.attributes.source.address.socket_address.address = f"10.1.{i // 250}.{i % 250}"
        http = message.attributes.request.http
        http.method, http.path, http.host = "GET", "/api/items?page=2&q=shoes", "example.com"
        http.headers.update({":method": "GET", ":path": http.path, ":authority": http.host,
                             "x-api-key": "k", "user-agent": "bench", "accept": "application/json"})
        found.append(message.SerializeToString())
    return found


def rls_messages() -> list[bytes]:
    """Envoy's RateLimitRequests, from rotating clients."""
    found = []
    for i in range(CHECKS):
        message = RateLimitRequest(domain="sluice")
        message.descriptors.add().entries.add(key="remote_address", value=f"10.1.{i // 250}.{i % 250}")
        both = message.descriptors.add()
        both.entries.add(key="remote_address", value=f"10.1.{i // 250}.{i % 250}")
        both.entries.add(key="api_key", value="k")
        found.append(message.SerializeToString())
    return found


def rls_app() -> tuple[SluiceApp, RateLimitService]:
    app = SluiceApp(engine_for(TEN_RULES))
    service = RateLimitService(app.engine, None)
    service.config = RlsConfig({"sluice": compile_domain(parse_rls_text(RLS_CONFIG, "bench"))})
    return app, service


def floor_handler() -> grpc.GenericRpcHandler:
    """A method that answers an empty message and does nothing else."""
    async def nothing(request: bytes, context: object) -> bytes:
        return b""

    method = grpc.unary_unary_rpc_method_handler(nothing)
    return grpc.method_handlers_generic_handler(CHECK_SERVICE, {CHECK_METHOD: method})


async def in_process(app: SluiceApp, wire: list[bytes], rls: RateLimitService | None = None) -> float:
    handler = (check_handler(app).service(_Call()) if rls is None else
               rls_handler(rls, app.internal_error).service(_RlsCall()))
    started = time.process_time()
    for data in wire:
        answer = await handler.unary_unary(handler.request_deserializer(data), None)
        handler.response_serializer(answer)
    return (time.process_time() - started) / len(wire) * 1e6


async def over_grpc(app: SluiceApp, wire: list[bytes], rls: RateLimitService | None = None,
                    floor: bool = False) -> float:
    if floor:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((floor_handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
    else:
        listener = GrpcListener(app, "127.0.0.1", 0, rls=rls)
        await listener.start()
        port = listener.port
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            method = _Call.method if rls is None else _RlsCall.method
            call = channel.unary_unary(method, request_serializer=lambda data: data,
                                       response_deserializer=lambda data: data)
            started = time.process_time()
            for i in range(0, len(wire), 50):
                await asyncio.gather(*(call(data, timeout=10) for data in wire[i:i + 50]))
            return (time.process_time() - started) / len(wire) * 1e6
    finally:
        if floor:
            await server.stop(None)
        else:
            await listener.stop()


def main() -> None:
    uvloop.install()
    wire = messages()
    handler = asyncio.run(in_process(SluiceApp(engine_for(TEN_RULES)), wire))
    grpc_call = asyncio.run(over_grpc(SluiceApp(engine_for(TEN_RULES)), wire))
    floor = asyncio.run(over_grpc(SluiceApp(engine_for(TEN_RULES)), wire, floor=True))
    print("== gRPC ext_authz: CPU per check (10 rules, rotating clients)")
    print(f"Sluice's handler in process (parse, decide, answer): {handler:7.0f} µs")
    print(f"over grpc.aio, client and server in one process:      {grpc_call:7.0f} µs")
    print(f"grpcio's share, both sides of the call:               {grpc_call - handler:7.0f} µs")
    print(f"a handler that does nothing, over grpc.aio:           {floor:7.0f} µs")
    rls_wire = rls_messages()
    app, service = rls_app()
    rls_handler_cost = asyncio.run(in_process(app, rls_wire, service))
    app, service = rls_app()
    rls_call = asyncio.run(over_grpc(app, rls_wire, service))
    print("== Rate Limit Service: CPU per ShouldRateLimit (2 descriptors, rotating clients)")
    print(f"Sluice's handler in process (parse, count, answer):  {rls_handler_cost:7.0f} µs")
    print(f"over grpc.aio, client and server in one process:      {rls_call:7.0f} µs")
    print(f"grpcio's share, both sides of the call:               {rls_call - rls_handler_cost:7.0f} µs")


if __name__ == "__main__":
    main()
