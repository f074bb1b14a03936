"""Sluice's HTTP protocol (sidecar/server.py): a client that sends checks
without reading the answers is not read from until it takes them, so its
answers cannot pile up in memory; uvicorn runs the protocol and shuts it
down as the protocol expects (the seam between them, pinned); keep-alive;
and a connection's answers, and its head limit, whatever reads its bytes
come in."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.config import Config
from uvicorn.server import ServerState

from sidecar.app import SluiceApp
from sidecar.engine import Engine
from sidecar.server import DEFAULT_MAX_HEADER_BYTES, LimitedHttpProtocol, protocol_factory
from tests.unit.conftest import FakeClock, ruleset_from
from tests.unit.http_wire import LOOPBACK, closed_by_server, read_answer, request, serving

RULES = """
rules:
  - id: everyone
    key: [ip]
    limit: {requests: 1000000, per: 1h}
    action: block
"""

CHECK = (b"GET /v1/nginx/auth HTTP/1.1\r\nHost: s\r\nX-Original-URI: /x\r\n"
         b"X-Sluice-Client-Addr: 192.0.2.7\r\n\r\n")


class SlowReader(asyncio.Transport):
    """A transport whose peer stops reading after ``high_water`` bytes."""

    def __init__(self, high_water: int) -> None:
        super().__init__()
        self.high_water = high_water
        self.written = b""
        self.reading = True
        self.protocol: Any = None
        self.writing_paused = False

    def write(self, data: Any) -> None:
        self.written += bytes(data)
        if len(self.written) > self.high_water and not self.writing_paused:
            self.writing_paused = True
            self.protocol.pause_writing()

    def drain(self) -> None:
        self.written = b""
        self.writing_paused = False
        self.protocol.resume_writing()

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8181), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def close(self) -> None:
        self.reading = False

    def can_write_eof(self) -> bool:
        return False


def test_the_protocol_answers_every_call_of_an_asyncio_protocol() -> None:
    """It is one by its methods, not by its class (the compiled core's is an
    extension type): a transport may call any of asyncio.Protocol's, and a
    client's end of input closes the connection, as asyncio's default does."""
    missing = [name for name in dir(asyncio.Protocol)
               if not name.startswith("_") and not hasattr(LimitedHttpProtocol, name)]
    assert missing == []
    config = Config(app=SluiceApp(Engine(ruleset_from(RULES))), lifespan="off", log_level="warning",
                    proxy_headers=False)
    config.load()
    loop = asyncio.new_event_loop()
    try:
        protocol = LimitedHttpProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
        assert not protocol.eof_received()
    finally:
        loop.close()


def test_a_client_not_reading_its_answers_is_not_read_from_until_it_does() -> None:
    async def run() -> tuple[bool, int, bool, int]:
        app = SluiceApp(Engine(ruleset_from(RULES)))
        config = Config(app=app, lifespan="off", log_level="warning", proxy_headers=False)
        config.load()
        protocol = LimitedHttpProtocol(config=config, server_state=ServerState(), app_state={},
                                       _loop=asyncio.get_running_loop())
        transport = SlowReader(high_water=2000)
        transport.protocol = protocol
        protocol.connection_made(transport)
        protocol.data_received(CHECK * 100)
        paused, answered = transport.reading, transport.written.count(b"HTTP/1.1 200")
        transport.drain()
        resumed = transport.reading
        protocol.data_received(CHECK)
        after = transport.written.count(b"HTTP/1.1 200")
        protocol.connection_lost(None)
        return paused, answered, resumed, after

    reading_while_full, answered, reading_after_drain, answered_after = asyncio.run(run())
    # Every check that arrived was answered (they were in one read), then
    # reading stopped; it starts again once the client took the answers.
    assert answered == 100 and not reading_while_full
    assert reading_after_drain and answered_after == 1


# -- the seam with uvicorn: what the protocol reads of it, run for real ------------------

HELD_RULES = """
rules:
  - id: held
    match: {path: {prefix: /held}}
    key: [ip]
    limit: {rate: 5r/s, burst: 10, delay: 0}
    action: block
"""


def nginx_check(uri: str, client: str = "192.0.2.7") -> bytes:
    return request("/v1/nginx/auth", X_Original_URI=uri, X_Original_Method="GET", X_Sluice_Client_Addr=client,
                   X_Request_Id="0123abcd")


def test_uvicorn_serves_the_protocol_and_shuts_it_down_gracefully() -> None:
    """What the protocol reads of uvicorn (sidecar/server.py's docstring),
    under uvicorn's own Server: the keywords it is built with, the Config's
    app and keep-alive, the ServerState's default headers (uvicorn's Server
    header, on here), connections (an idle one is closed by shutdown(), a
    busy one after its answer) and tasks (a held check is answered before
    the server stops), and total_requests."""
    async def scenario() -> tuple[Any, Any, Any, bool, bool, ServerState]:
        app = SluiceApp(Engine(ruleset_from(HELD_RULES)))
        with socket.socket() as probe:
            probe.bind((LOOPBACK, 0))
            port = probe.getsockname()[1]
        config = Config(app=app, host=LOOPBACK, port=port, lifespan="off", log_level="warning",
                        proxy_headers=False, date_header=False, timeout_keep_alive=30, http=protocol_factory())
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and not serving.done(), "uvicorn did not start"
            await asyncio.sleep(0.01)
        idle_reader, idle_writer = await asyncio.open_connection(LOOPBACK, port)
        idle_writer.write(nginx_check("/page"))
        answered = await read_answer(idle_reader)
        busy_reader, busy_writer = await asyncio.open_connection(LOOPBACK, port)
        # The bucket's first request is answered at once, the second is held
        # (about 0.2 s at 5 r/s) in a task on the ASGI path.
        busy_writer.write(nginx_check("/held", "192.0.2.8") + nginx_check("/held", "192.0.2.8"))
        first = await read_answer(busy_reader)
        server.should_exit = True
        held = await read_answer(busy_reader)
        idle_closed, busy_closed = await closed_by_server(idle_reader), await closed_by_server(busy_reader)
        await asyncio.wait_for(serving, 10)
        idle_writer.close()
        busy_writer.close()
        return answered, first, held, idle_closed, busy_closed, server.server_state

    answered, first, held, idle_closed, busy_closed, state = asyncio.run(scenario())
    assert answered[0] == 200 and answered[1]["server"] == "uvicorn" and "connection" not in answered[1]
    assert first[0] == 200
    assert held[0] == 200 and held[1]["connection"] == "close"
    assert idle_closed and busy_closed
    assert not state.connections and not state.tasks and state.total_requests == 3


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout_and_one_in_use_is_not() -> None:
    keep_alive = 0.5

    async def scenario() -> tuple[list[int], float, bool]:
        app = SluiceApp(Engine(ruleset_from(RULES)))
        async with serving(app, keep_alive=keep_alive) as (port, _):
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            statuses = []
            # Three times the timeout, a check every fifth of it: the
            # connection's one timer fires while it is busy and waits again.
            for _ in range(15):
                writer.write(nginx_check("/page"))
                statuses.append((await read_answer(reader))[0])
                answered_at = time.monotonic()
                await asyncio.sleep(keep_alive / 5)
            closed = await closed_by_server(reader, within=10)
            idle_for = time.monotonic() - answered_at
            writer.close()
            return statuses, idle_for, closed

    statuses, idle_for, closed = asyncio.run(scenario())
    assert statuses == [200] * 15
    assert closed and idle_for >= keep_alive - 0.02  # the event loop's timers are to the millisecond


# -- the wire, however it is cut into reads ------------------------------------------

MIXED_RULES = """
rules:
  - id: per-address
    key: [ip]
    limit: {requests: 3, per: 1h}
    action: block
  - id: closes
    match: {path: {prefix: /close}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
    block: {close: true}
"""

WIRE_REQUESTS = [nginx_check("/a", "192.0.2.1"), nginx_check("/b", "192.0.2.2"), nginx_check("/a", "192.0.2.1"),
                 nginx_check("/close", "192.0.2.3"), request("/v1/nginx/auth", method="HEAD", X_Original_URI="/h",
                                                          X_Sluice_Client_Addr="192.0.2.1", X_Request_Id="r2"),
                 request("/v1/nginx/auth", version="1.0", X_Original_URI="/", X_Sluice_Client_Addr="192.0.2.4")]


def answers_to(stream: bytes, cuts: list[int], max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> tuple[bytes, bool]:
    """What one connection answers to ``stream`` read in pieces cut at
    ``cuts``, by a fresh Sluice on a fixed clock; and whether it closed."""
    async def run() -> tuple[bytes, bool]:
        engine = Engine(ruleset_from(MIXED_RULES), clock=FakeClock(), wall_clock=lambda: 1_800_000_000.25,
                        secret=b"s" * 32)
        config = Config(app=SluiceApp(engine), lifespan="off", log_level="warning", proxy_headers=False)
        config.load()
        protocol = LimitedHttpProtocol(config=config, server_state=ServerState(), app_state={},
                                       _loop=asyncio.get_running_loop(), max_header_bytes=max_header_bytes)
        transport = SlowReader(high_water=1 << 30)
        transport.protocol = protocol
        protocol.connection_made(transport)
        edges = [0, *sorted(set(cuts)), len(stream)]
        for start, end in zip(edges, edges[1:]):
            if start < end and transport.reading:
                protocol.data_received(stream[start:end])
        protocol.connection_lost(None)
        return transport.written, not transport.reading

    return asyncio.run(run())


@settings(max_examples=100, deadline=None)
@given(order=st.lists(st.integers(0, len(WIRE_REQUESTS) - 1), min_size=1, max_size=12), data=st.data())
def test_a_connections_answers_do_not_depend_on_how_its_bytes_arrive(order: list[int], data: st.DataObject) -> None:
    stream = b"".join(WIRE_REQUESTS[index] for index in order)
    cuts = data.draw(st.lists(st.integers(1, len(stream) - 1), max_size=20))
    whole = answers_to(stream, [])
    assert answers_to(stream, cuts) == whole
    # One answer per request up to the first that closes the connection.
    assert whole[0].count(b"HTTP/1.1 ") >= 1 and b"HTTP/1.1 5" not in whole[0]


@settings(max_examples=50, deadline=None)
@given(cuts=st.lists(st.integers(1, 599), max_size=10), extra=st.integers(0, 1))
def test_a_head_of_the_limit_is_read_and_one_byte_more_gets_431_however_it_arrives(cuts: list[int],
                                                                                   extra: int) -> None:
    limit = 600
    head = nginx_check("/" + "p" * 200)
    padding = limit - len(head) + extra  # one more header field fills the head to the limit (+ extra)
    field = b"X-Pad: " + b"x" * (padding - len(b"X-Pad: \r\n")) + b"\r\n"
    stream = head[:-2] + field + b"\r\n"
    assert len(stream) == limit + extra
    written, _ = answers_to(stream, [cut for cut in cuts if cut < len(stream)], max_header_bytes=limit)
    assert written.startswith(b"HTTP/1.1 431 " if extra else b"HTTP/1.1 200 ")
