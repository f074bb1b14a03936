"""Sluice's HTTP protocol (sidecar/server.py) on a loopback port, and
HTTP/1.1 answers read off the wire, for the protocol's unit tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from uvicorn.config import Config
from uvicorn.server import ServerState

from sidecar.server import LimitedHttpProtocol

LOOPBACK = "127.0.0.1"


@contextlib.asynccontextmanager
async def serving(app: Any, keep_alive: float = 5.0) -> AsyncIterator[tuple[int, ServerState]]:
    """``app`` served by the protocol on a loopback port: the port, and the
    server state the connections share."""
    config = Config(app=app, lifespan="off", log_level="warning", proxy_headers=False,
                    timeout_keep_alive=keep_alive)
    config.load()
    state = ServerState()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: LimitedHttpProtocol(config=config, server_state=state, app_state={}, _loop=loop), LOOPBACK, 0)
    try:
        yield server.sockets[0].getsockname()[1], state
    finally:
        server.close()
        for connection in list(state.connections):
            connection.transport.close()  # type: ignore[union-attr]


async def read_answer(reader: asyncio.StreamReader, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One answer: status, header fields (each at most once) and the body,
    by content-length or chunked."""
    status_line = await reader.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        assert name.lower() not in headers, f"{name} twice"
        headers[name.lower()] = value.strip()
    if head_only:
        return int(status_line.split()[1]), headers, b""
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int((await reader.readline()).strip(), 16):
            body += await reader.readexactly(size)
            assert await reader.readexactly(2) == b"\r\n"
        assert await reader.readexactly(2) == b"\r\n"
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


async def closed_by_server(reader: asyncio.StreamReader, within: float = 5.0) -> bool:
    """Whether the server closes the connection (nothing more is sent) within ``within`` seconds."""
    try:
        return await asyncio.wait_for(reader.read(1), within) == b""
    except (TimeoutError, ConnectionError):
        return False


def request(path: str, method: str = "GET", version: str = "1.1", body: bytes = b"", **fields: str) -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: sluice"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in fields.items()]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
