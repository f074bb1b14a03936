"""The post-response hook: the proxy reports responses.

Two ways in, one meaning: a report carries the pending token Sluice gave at
request time, the response status and response headers.

* HTTP ``POST /v1/hook`` with ``x-sluice-pending``, ``x-sluice-status`` and
  each response header as ``x-sluice-response-NAME`` (Envoy's Lua filter
  sends this, asynchronously).
* UDP syslog datagrams whose message is one JSON object
  ``{"token": ..., "status": N, "headers": {...}}``: nginx's ``access_log
  syslog:`` writes them after the response has been sent, so the client
  never waits for Sluice, and a stopped Sluice costs nothing but the counts.

Anyone who can reach the port can send anything: a report that is not of
this shape (too long, nested, non-finite or fractional numbers, a status
other than 100-599, headers other than a flat object of strings) is refused
before or while parsing, counted in ``sluice_responses_refused`` and logged
at most once a minute, never with a traceback. Only a failure inside Sluice
counts as an internal error.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, NoReturn

from sidecar.engine import Engine
from sidecar.ratelog import RateLimitedLog

log = logging.getLogger("sluice")

RESPONSE_HEADER_PREFIX = "x-sluice-response-"

# A report is a token (at most sidecar.pending.MAX_TOKEN_LENGTH characters), a
# status and a few response headers: anything longer is not one of nginx's.
MAX_REPORT_BYTES = 16384
# Nesting deeper than this cannot be a report (which nests two levels); each
# "{" or "[" can open at most one level, so counting them before parsing
# keeps the JSON parser's recursion shallow whatever the datagram holds.
MAX_REPORT_BRACKETS = 64
MAX_REPORT_HEADERS = 64
# Integers in a report are statuses: a longer one is refused while parsing.
_MAX_INTEGER_DIGITS = 6

# A client can send bad reports as fast as it likes: they are counted in
# sluice_responses_refused, and said in the log at most once per minute.
refused_log = RateLimitedLog(log, 60.0)
failed_log = RateLimitedLog(log, 10.0)


class BadReport(Exception):
    """A report that is not the shape nginx or Envoy sends."""


def refuse(engine: Engine, why: str) -> None:
    """Count a malformed report as refused; said in the log once a minute."""
    engine.metrics.reports_refused.inc()
    refused_log.warning("response report refused: %s (counted in sluice_responses_refused; "
                        "reported once per minute)", why)


async def report_from_headers(engine: Engine, headers: dict[str, str]) -> int:
    status = _status(headers.get("x-sluice-status"))
    token = headers.get("x-sluice-pending", "")
    if status is None or not token:
        refuse(engine, "no token" if not token else "no status 100-599")
        return 0
    response_headers = {name[len(RESPONSE_HEADER_PREFIX):]: value for name, value in headers.items()
                        if name.startswith(RESPONSE_HEADER_PREFIX)}
    if len(response_headers) > MAX_REPORT_HEADERS:
        refuse(engine, f"more than {MAX_REPORT_HEADERS} response headers")
        return 0
    return await engine.record_response(token, status, response_headers)


def report_from_datagram(engine: Engine, data: bytes) -> int:
    """Count one syslog datagram's report, without an event loop (memory store)."""
    report = datagram_report(engine, data)
    return engine.record_response_now(*report) if report is not None else 0


def datagram_report(engine: Engine, data: bytes) -> tuple[str, int, dict[str, str]] | None:
    """The report in one syslog datagram from nginx (``<PRI>TIMESTAMP TAG:
    {json}``): token, status and response headers; None for a bad one,
    which is counted as refused (never raised, never a traceback)."""
    try:
        return _parse_datagram(data)
    except BadReport as exc:
        refuse(engine, str(exc))
        return None


def _parse_datagram(data: bytes) -> tuple[str, int, dict[str, str]]:
    if len(data) > MAX_REPORT_BYTES:
        raise BadReport(f"datagram longer than {MAX_REPORT_BYTES} bytes")
    start = data.find(b"{")
    if start == -1:
        raise BadReport("no JSON object in the datagram")
    body = data[start:]
    # Cheap checks first: the parser never sees deep nesting.
    if body.count(b"{") + body.count(b"[") > MAX_REPORT_BRACKETS:
        raise BadReport("too many nested objects or arrays")
    try:
        text = body.decode("utf-8")
        report: Any = json.loads(text, parse_float=_no_float, parse_constant=_no_float,
                                 parse_int=_small_int)
    except ValueError:  # also UnicodeDecodeError
        raise BadReport("not one JSON object") from None
    if not isinstance(report, dict):
        raise BadReport("not one JSON object")
    token, status, headers = report.get("token"), _status(report.get("status")), report.get("headers")
    if not isinstance(token, str) or not token:
        raise BadReport("no token")
    if status is None:
        raise BadReport("no status 100-599")
    if headers is None:
        headers = {}
    if not isinstance(headers, dict) or len(headers) > MAX_REPORT_HEADERS or \
            not all(isinstance(value, str) for value in headers.values()):
        raise BadReport("headers are not a flat object of strings")
    # nginx logs an absent header as an empty string.
    return token, status, {name.lower(): value for name, value in headers.items() if value != ""}


def _no_float(text: str) -> NoReturn:
    raise BadReport(f"a non-integer number ({text[:20]})")


def _small_int(text: str) -> int:
    if len(text) > _MAX_INTEGER_DIGITS:
        raise BadReport("an integer too long to be a status")
    return int(text)


def _status(value: Any) -> int | None:
    """An HTTP status 100-599: an integer, or its three digits as text
    (nginx's ``"$status"``, Envoy's header); None for anything else."""
    if isinstance(value, str):
        value = value.strip()
        if not (len(value) == 3 and value.isascii() and value.isdigit()):
            return None
        status = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        status = value
    else:
        return None
    return status if 100 <= status <= 599 else None


class HookDatagrams(asyncio.DatagramProtocol):
    """Receives nginx's syslog reports; a bad datagram is counted, never fatal."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._recording: set[asyncio.Task[int]] = set()  # strong references until done

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            report = datagram_report(self.engine, data)
            if report is None:
                return
            if self.engine.store.answers_at_once:
                self.engine.record_response_now(*report)
                return
            # The store answers later: count in a task of its own.
            task = asyncio.ensure_future(self.engine.record_response(*report))
            self._recording.add(task)
            task.add_done_callback(self._recorded)
        except Exception:  # a report must never take the listener down
            self._failed()

    def _recorded(self, task: asyncio.Task[int]) -> None:
        self._recording.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self._failed(error)

    def _failed(self, error: BaseException | bool = True) -> None:
        # A bug, not bad input (that is refused above): counted, and its
        # traceback logged at most every 10 s.
        self.engine.metrics.errors.inc()
        failed_log.error("response report failed inside Sluice", exc_info=error)


async def listen_for_reports(engine: Engine, host: str, port: int,
                             reuse_port: bool = False) -> asyncio.DatagramTransport:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: HookDatagrams(engine),
                                                       local_addr=(host, port), reuse_port=reuse_port)
    return transport
