"""Steady traffic of checks: concurrent clients, each on a kept-alive
connection, sending one request after another; every answer is timed.

The clients run in an event loop of their own thread, so the test can
kill, fail over and restart servers while they send.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from tests.integration.clients import LOOPBACK

# Sluice's check as nginx's auth_request subrequest asks for it.
NGINX_CHECK = "/v1/nginx/auth"

# A token bucket no test empties, read after every decision (headers:
# draft): an answer that carries its RateLimit field was decided by Redis
# and tells the tokens left; one without it failed open.
COUNTED_TOKENS = 1_000_000
COUNTED_RULES = f"""\
headers: draft
rules:
  - id: budget
    key: ["header:x-k"]
    limit: {{tokens: {COUNTED_TOKENS}, refill: 0.001/m}}
    action: block
"""


@dataclass(frozen=True)
class Answer:
    sent: float  # time.monotonic() when the request left
    took: float  # seconds until its answer was read
    status: int  # 0: no answer within the client's timeout, or the connection failed
    headers: dict[str, str]  # lower-case names

    @property
    def answered(self) -> float:
        return self.sent + self.took


def remaining(answer: Answer) -> int | None:
    """The tokens left after the decision (COUNTED_RULES), or None: it failed open."""
    found = re.search(r";r=(\d+)", answer.headers.get("ratelimit", ""))
    return int(found.group(1)) if found else None


def percentile(values: list[float], share: float) -> float:
    """The value ``share`` (0..1) of the values are at or below (nearest rank)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


class CheckLoad:
    """``clients`` clients sending GET ``path`` with ``headers`` to ``port``
    (each ``pause`` seconds apart) from entering the block to leaving it."""

    def __init__(self, port: int, clients: int, headers: Mapping[str, str], path: str = NGINX_CHECK,
                 pause: float = 0.0, timeout: float = 2.0) -> None:
        lines = [f"GET {path} HTTP/1.1", f"Host: {LOOPBACK}:{port}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self.request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self.port = port
        self.clients = clients
        self.pause = pause
        self.timeout = timeout
        self._answers: list[Answer] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> CheckLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout * 3)
        assert not self._thread.is_alive(), "the clients did not stop"

    def answers(self) -> list[Answer]:
        with self._lock:
            return list(self._answers)

    def count(self) -> int:
        with self._lock:
            return len(self._answers)

    async def _run(self) -> None:
        await asyncio.gather(*(self._client() for _ in range(self.clients)))

    async def _client(self) -> None:
        connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                if connection is None:
                    connection = await asyncio.wait_for(asyncio.open_connection(LOOPBACK, self.port),
                                                        self.timeout)
                    sent = time.monotonic()
                reader, writer = connection
                writer.write(self.request)
                status, headers = await asyncio.wait_for(_read_answer(reader), self.timeout)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
                status, headers = 0, {}
            answer = Answer(sent, time.monotonic() - sent, status, headers)
            with self._lock:
                self._answers.append(answer)
            if (status == 0 or headers.get("connection") == "close") and connection is not None:
                connection[1].close()
                connection = None
            if self.pause:
                await asyncio.sleep(self.pause)
        if connection is not None:
            connection[1].close()


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers
