"""Where a gRPC ext_authz check's CPU goes: Sluice's handler in process
(the CheckRequest parsed, decided by the ten rules of bench_engine.py, the
CheckResponse written) against the same checks over grpc.aio on loopback,
client and server in this one process (both sides' CPU counted).

Loopback only, bounded: 5,000 checks each way, 50 in flight.
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
from sidecar.frontdoors.messages import CheckRequest  # noqa: E402
from sidecar.frontdoors.grpc_authz import CHECK_METHOD, CHECK_SERVICE, check_handler  # noqa: E402
from sidecar.frontdoors.grpc_server import GrpcListener  # noqa: E402

CHECKS = 5_000


class _Call:
    """What a grpc handler is asked for its method (grpc's HandlerCallDetails)."""

    method = f"/{CHECK_SERVICE}/{CHECK_METHOD}"
    invocation_metadata = ()


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


async def in_process(app: SluiceApp, wire: list[bytes]) -> float:
    handler = check_handler(app).service(_Call())
    started = time.process_time()
    for data in wire:
        answer = await handler.unary_unary(handler.request_deserializer(data), None)
        handler.response_serializer(answer)
    return (time.process_time() - started) / len(wire) * 1e6


async def over_grpc(app: SluiceApp, wire: list[bytes]) -> float:
    listener = GrpcListener(app, "127.0.0.1", 0)
    await listener.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{listener.port}") as channel:
            call = channel.unary_unary(_Call.method, request_serializer=lambda data: data,
                                       response_deserializer=lambda data: data)
            started = time.process_time()
            for i in range(0, len(wire), 50):
                await asyncio.gather(*(call(data, timeout=10) for data in wire[i:i + 50]))
            return (time.process_time() - started) / len(wire) * 1e6
    finally:
        await listener.stop()


def main() -> None:
    uvloop.install()
    wire = messages()
    handler = asyncio.run(in_process(SluiceApp(engine_for(TEN_RULES)), wire))
    grpc_call = asyncio.run(over_grpc(SluiceApp(engine_for(TEN_RULES)), wire))
    print("== gRPC ext_authz: CPU per check (10 rules, rotating clients)")
    print(f"Sluice's handler in process (parse, decide, answer): {handler:7.0f} µs")
    print(f"over grpc.aio, client and server in one process:      {grpc_call:7.0f} µs")
    print(f"grpcio's share, both sides of the call:               {grpc_call - handler:7.0f} µs")


if __name__ == "__main__":
    main()
