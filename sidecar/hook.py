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


def report_from_headers(engine: Engine, headers: dict[str, str]) -> int:
    status = _status(headers.get("x-sluice-status"))
    token = headers.get("x-sluice-pending", "")
    if status is None or not token:
        engine.metrics.reports_refused.inc()
        return 0
    response_headers = {name[len(RESPONSE_HEADER_PREFIX):]: value for name, value in headers.items()
                        if name.startswith(RESPONSE_HEADER_PREFIX)}
    return engine.record_response(token, status, response_headers)


def report_from_datagram(engine: Engine, data: bytes) -> int:
    """One syslog datagram from nginx: ``<PRI>TIMESTAMP TAG: {json}``."""
    start = data.find(b"{")
    try:
        report: Any = json.loads(data[start:]) if start != -1 else None
    except ValueError:
        report = None
    if not isinstance(report, dict):
        engine.metrics.reports_refused.inc()
        return 0
    token, status, headers = report.get("token"), _status(report.get("status")), report.get("headers")
    if not isinstance(token, str) or not token or status is None:
        engine.metrics.reports_refused.inc()
        return 0
    # nginx logs an absent header as an empty string.
    response_headers = {str(name).lower(): value for name, value in (headers or {}).items()
                        if isinstance(value, str) and value != ""} if isinstance(headers, dict) else {}
    return engine.record_response(token, status, response_headers)


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

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            report_from_datagram(self.engine, data)
        except Exception:  # a report must never take the listener down
            self.engine.metrics.errors.inc()
            log.exception("response report failed")


async def listen_for_reports(engine: Engine, host: str, port: int) -> asyncio.DatagramTransport:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: HookDatagrams(engine),
                                                       local_addr=(host, port))
    return transport
