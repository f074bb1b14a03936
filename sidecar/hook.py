"""The post-response hook: the proxy reports responses (SPEC §8).

Two ways in, one meaning: a report carries the pending token Sluice gave at
request time, the response status and response headers.

* HTTP ``POST /v1/hook`` with ``x-sluice-pending``, ``x-sluice-status`` and
  each response header as ``x-sluice-response-NAME`` (Envoy's Lua filter
  sends this, asynchronously).
* UDP syslog datagrams whose message is one JSON object
  ``{"token": ..., "status": N, "headers": {...}}``: nginx's ``access_log
  syslog:`` writes them after the response has been sent, so the client
  never waits for Sluice, and a stopped Sluice costs nothing but the counts.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from sidecar.engine import Engine

log = logging.getLogger("sluice")

RESPONSE_HEADER_PREFIX = "x-sluice-response-"


async def report_from_headers(engine: Engine, headers: dict[str, str]) -> int:
    status = _status(headers.get("x-sluice-status"))
    token = headers.get("x-sluice-pending", "")
    if status is None or not token:
        engine.metrics.reports_refused.inc()
        return 0
    response_headers = {name[len(RESPONSE_HEADER_PREFIX):]: value for name, value in headers.items()
                        if name.startswith(RESPONSE_HEADER_PREFIX)}
    return await engine.record_response_async(token, status, response_headers)


def report_from_datagram(engine: Engine, data: bytes) -> int:
    """Count one syslog datagram's report, with a memory store."""
    report = datagram_report(engine, data)
    return engine.record_response(*report) if report is not None else 0


def datagram_report(engine: Engine, data: bytes) -> tuple[str, int, dict[str, str]] | None:
    """The report in one syslog datagram from nginx (``<PRI>TIMESTAMP TAG:
    {json}``): token, status and response headers; None for a bad one."""
    start = data.find(b"{")
    try:
        report: Any = json.loads(data[start:]) if start != -1 else None
    except ValueError:
        report = None
    if not isinstance(report, dict):
        engine.metrics.reports_refused.inc()
        return None
    token, status, headers = report.get("token"), _status(report.get("status")), report.get("headers")
    if not isinstance(token, str) or not token or status is None:
        engine.metrics.reports_refused.inc()
        return None
    # nginx logs an absent header as an empty string.
    response_headers = {str(name).lower(): value for name, value in (headers or {}).items()
                        if isinstance(value, str) and value != ""} if isinstance(headers, dict) else {}
    return token, status, response_headers


def _status(value: Any) -> int | None:
    try:
        status = int(value)
    except (TypeError, ValueError):
        return None
    return status if 100 <= status <= 599 else None


class HookDatagrams(asyncio.DatagramProtocol):
    """Receives nginx's syslog reports; a bad datagram is counted, never fatal."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._recording: set[asyncio.Task] = set()  # strong references until done

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            if not self.engine.shared_store:
                report_from_datagram(self.engine, data)
                return
            report = datagram_report(self.engine, data)
            if report is None:
                return
            # A shared store answers later: count in a task of its own.
            task = asyncio.ensure_future(self.engine.record_response_async(*report))
            self._recording.add(task)
            task.add_done_callback(self._recorded)
        except Exception:  # a report must never take the listener down
            self._failed()

    def _recorded(self, task: asyncio.Task) -> None:
        self._recording.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._failed()

    def _failed(self) -> None:
        self.engine.metrics.errors.inc()
        log.error("response report failed", exc_info=True)


async def listen_for_reports(engine: Engine, host: str, port: int,
                             reuse_port: bool = False) -> asyncio.DatagramTransport:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: HookDatagrams(engine),
                                                       local_addr=(host, port), reuse_port=reuse_port)
    return transport
