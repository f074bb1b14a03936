"""Bursts of simultaneous requests: every connection is open before the first
request is written, then all requests leave at once."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping, Sequence

from tests.integration.clients import LOOPBACK

# What a connection closed without a response counts as (nginx's 444).
NO_RESPONSE = 0


async def _burst(targets: list[tuple[int, bytes]], source: str, timeout: float) -> list[int]:
    connections = await asyncio.gather(*(
        asyncio.open_connection(LOOPBACK, port, local_addr=(source, 0)) for port, _ in targets))
    for (_, writer), (_, request) in zip(connections, targets):
        writer.write(request)

    async def status(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        try:
            line = await reader.readline()
            return int(line.split()[1]) if line.startswith(b"HTTP/") else NO_RESPONSE
        except ConnectionError:
            return NO_RESPONSE
        finally:
            writer.close()

    return await asyncio.wait_for(asyncio.gather(*(status(*pair) for pair in connections)), timeout)


def burst(port: int, count: int, path: str = "/", headers: Mapping[str, str] | None = None,
          source: str = LOOPBACK, timeout: float = 60.0) -> collections.Counter[int]:
    """Send ``count`` GETs at once on ``count`` connections; the statuses counted."""
    return burst_over([port], count, path, headers, source, timeout)


def burst_over(ports: Sequence[int], count: int, path: str = "/", headers: Mapping[str, str] | None = None,
               source: str = LOOPBACK, timeout: float = 60.0) -> collections.Counter[int]:
    """``burst``, its requests dealt out over ``ports`` in turn."""
    def request(port: int) -> bytes:
        lines = [f"GET {path} HTTP/1.1", f"Host: {LOOPBACK}:{port}", "Connection: close"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    targets = [(port, request(port)) for port in ports]
    return collections.Counter(asyncio.run(_burst([targets[n % len(targets)] for n in range(count)],
                                                  source, timeout)))
