"""Health probes on a listener of their own, answered by a thread.

During an attack the event loop has thousands of connections to accept and
parse before it reaches a probe's; a liveness probe that times out then
restarts a healthy Sluice exactly when it is needed. ``sluice serve
--health HOST:PORT`` answers ``/healthz`` and ``/readyz`` from a thread that
does not queue behind the event loop's work (it needs only the interpreter
lock, which the loop gives up every few milliseconds).

Liveness still means the loop is alive: the loop stamps a heartbeat every
``BEAT_SECONDS``, and ``/healthz`` answers 503 when the last one is older
than ``STALLED_SECONDS``, so a wedged loop is restarted all the same. The
main port keeps its own ``/healthz`` and ``/readyz`` as before.
"""

from __future__ import annotations

import asyncio
import http.server
import socket
import sys
import threading
import time
from collections.abc import Callable

BEAT_SECONDS = 0.25
# Far above a burst's delay of the loop (under a second for thousands of
# connections at once), far below what a liveness probe waits to restart.
STALLED_SECONDS = 5.0
SWITCH_INTERVAL_SECONDS = 0.001


class Heartbeat:
    """The event loop's sign of life, stamped by the loop itself."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last = clock()
        self._handle: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.last = self.clock()
        self._handle = loop.call_later(BEAT_SECONDS, self._beat, loop)

    def _beat(self, loop: asyncio.AbstractEventLoop) -> None:
        self.last = self.clock()
        self._handle = loop.call_later(BEAT_SECONDS, self._beat, loop)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    def stalled_for(self) -> float:
        """Seconds since the loop last ran its heartbeat, if over the limit; else 0."""
        age = self.clock() - self.last
        return age if age > STALLED_SECONDS else 0.0


class _ProbeHandler(http.server.BaseHTTPRequestHandler):
    server: HealthListener
    protocol_version = "HTTP/1.1"
    timeout = 5  # a probe that sends nothing does not keep a thread

    def do_GET(self) -> None:  # noqa: N802 (the http.server name)
        path = self.path.partition("?")[0]
        if path == "/healthz":
            stalled = self.server.heartbeat.stalled_for()
            status, body = (503, f"event loop stalled for {stalled:.1f} s\n") if stalled else (200, "ok\n")
        elif path == "/readyz":
            status, body = 200, self.server.readiness()
        else:
            status, body = 404, "not found: this listener answers /healthz and /readyz\n"
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":  # a body after HEAD's headers would be read as the next response
            self.wfile.write(data)

    do_HEAD = do_GET

    def log_message(self, format: str, *args: object) -> None:
        """Probes every few seconds are not worth a log line each."""


class HealthListener(http.server.ThreadingHTTPServer):
    """``/healthz`` and ``/readyz`` on their own socket and threads."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, host: str, port: int, heartbeat: Heartbeat, readiness: Callable[[], str],
                 reuse_port: bool = False) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.heartbeat = heartbeat
        self.readiness = readiness
        self.reuse_port = reuse_port  # several worker processes share the port
        super().__init__((host, port), _ProbeHandler)
        self._thread = threading.Thread(target=self.serve_forever, name="sluice-health", daemon=True)

    def server_bind(self) -> None:
        if self.reuse_port:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()

    def start(self) -> None:
        # The probe thread waits for the interpreter lock at each step of
        # an answer; a shorter switch interval keeps those waits short
        # while the loop is busy (at a cost too small to measure).
        sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
