"""The HTTP protocol's own check answers (sidecar/server.py) against a fake
transport: a client that sends checks without reading the answers is not
read from until it takes them, so its answers cannot pile up in memory."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.config import Config
from uvicorn.server import ServerState

from sidecar.app import SluiceApp
from sidecar.engine import Engine
from sidecar.server import LimitedHttpProtocol
from tests.unit.conftest import ruleset_from

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
