"""Reading nginx access logs for ``sluice replay``: combined format and JSON lines.

Each line becomes a ``LogEntry``: what nginx would have told Sluice about the
request (its connecting address, method, host, URI and the request headers the
log kept) and what the upstream answered (status, response headers), at the
line's own time. A line that is not a request Sluice would have been asked
about — garbage, a TLS handshake sent to a plain-HTTP port, a connection closed
before it sent a request line (``"-"``) — is counted and reported, never fatal.

Several logs are read as one stream in time order: they are merged by time,
and lines a little out of order (nginx workers writing buffered logs) are put
back in order within ``REORDER_WINDOW`` seconds of log time. A line older than
that is replayed at the time the replay has already reached, and counted.
"""

from __future__ import annotations

import gzip
import heapq
import io
import json
import math
import re
import sys
import zlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from functools import lru_cache
from operator import attrgetter
from typing import TextIO

from sidecar.request import strip_port

REORDER_WINDOW = 10.0  # seconds of log time
EXAMPLES = 5  # skipped lines kept, with their line numbers, per log


@dataclass(slots=True)
class LogEntry:
    time: float  # seconds since the epoch: the request's arrival, as far as the log tells
    peer: str  # $remote_addr: the address nginx accepted the connection from
    method: str
    host: str  # "" when the log does not record it (the combined format)
    uri: str
    headers: dict[str, str]  # request headers the log kept, lower-case names
    status: int | None
    response_headers: dict[str, str] = field(default_factory=dict)
    request_id: str = ""
    # $request_time when logged: the response ended this long after ``time``.
    duration: float = 0.0


class UnparsableLine(ValueError):
    """A line that is not a request Sluice would have been asked about."""


class LogError(Exception):
    """A log that cannot be read at all."""


# --------------------------------------------------------------------------
# One line
# --------------------------------------------------------------------------

# nginx escapes '"', '\' and bytes outside 32..126 as \xHH; other writers of
# the combined format escape a quote as \". Both are read.
_QUOTED = r'"((?:[^"\\]|\\.)*)"'
# $remote_addr - $remote_user [$time_local] "$request" $status $body_bytes_sent
# "$http_referer" "$http_user_agent", and optionally "$http_x_forwarded_for"
# (nginx's stock `main` format). Anything after that is ignored.
_COMBINED = re.compile(rf'(\S+) \S+ .*? \[([^\]]+)\] {_QUOTED} (\d{{3}}) \S+'
                       rf'(?: {_QUOTED} {_QUOTED}(?: {_QUOTED})?)?')
_ESCAPE = re.compile(r"\\x([0-9A-Fa-f]{2})")
_METHOD = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token
_TIME_LOCAL = re.compile(r"(\d{2})/([A-Z][a-z]{2})/(\d{4}):(\d{2}):(\d{2}):(\d{2}) ([+-])(\d{2})(\d{2})")
_MONTHS = {name: number for number, name in enumerate(
    ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1)}
# JSON time fields, most precise first.
_TIME_FIELDS = ("msec", "time_iso8601", "time_local", "timestamp", "@timestamp", "time")


def parse_line(line: str) -> LogEntry:
    """A JSON object or a combined-format line (the first character decides)."""
    return parse_json(line) if line.startswith("{") else parse_combined(line)


def parse_combined(line: str) -> LogEntry:
    match = _COMBINED.match(line)
    if match is None:
        raise UnparsableLine("not the combined format")
    peer, time_text, request, status, referer, agent, forwarded = match.groups()
    method, uri = parse_request_line(_unescape(request))
    headers = {}
    for name, value in (("referer", referer), ("user-agent", agent), ("x-forwarded-for", forwarded)):
        if value is not None and value != "-":  # nginx logs an empty value as "-"
            headers[name] = _unescape(value)
    return LogEntry(parse_time_local(time_text), peer, method, "", uri, headers, int(status))


def parse_json(line: str) -> LogEntry:
    """nginx ``log_format ... escape=json``: variables as fields of one object.

    ``http_NAME`` fields are request headers and ``upstream_http_NAME`` (or
    ``sent_http_NAME``) response headers, with nginx's underscores turned
    back into dashes; an empty value or "-" is an absent one. nginx logs a
    request when it ends: with ``request_time`` the entry's time is its
    arrival, that long before the line's time.
    """
    try:
        record = json.loads(line)
    except ValueError:
        raise UnparsableLine("invalid JSON") from None
    if not isinstance(record, dict):
        raise UnparsableLine("not a JSON object")
    fields: dict[str, str] = {}
    for name, value in record.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, str) and value not in ("", "-"):
            fields[name.lower()] = value
    peer = fields.get("remote_addr")
    if peer is None:
        raise UnparsableLine("no remote_addr")
    time_field = next((name for name in _TIME_FIELDS if name in fields), None)
    if time_field is None:
        raise UnparsableLine("no time (msec, time_iso8601 or time_local)")
    if "request_method" in fields and "request_uri" in fields:
        method, uri = fields["request_method"], fields["request_uri"]
    elif "request" in fields:
        method, uri = parse_request_line(fields["request"])
    else:
        raise UnparsableLine("no request (request, or request_method and request_uri)")
    headers = _prefixed(fields, "http_")
    # What the upstream sent wins over what nginx sent on: the hook reports
    # the upstream's headers ($upstream_http_x_score).
    response_headers = _prefixed(fields, "sent_http_") | _prefixed(fields, "upstream_http_")
    status = fields.get("status", "")
    duration = parse_request_time(fields["request_time"]) if "request_time" in fields else 0.0
    return LogEntry(
        time=parse_time(fields[time_field]) - duration,
        peer=peer,
        method=method,
        host=fields.get("host") or strip_port(headers.get("host", "")),
        uri=uri,
        headers=headers,
        status=int(status) if status.isascii() and status.isdigit() else None,
        response_headers=response_headers,
        request_id=fields.get("request_id", ""),
        duration=duration,
    )


def parse_request_time(text: str) -> float:
    """``$request_time``: seconds with milliseconds (``0.125``)."""
    try:
        seconds = float(text)
    except ValueError:
        raise UnparsableLine(f"unreadable request_time {text[:20]!r}") from None
    if not 0 <= seconds < math.inf:
        raise UnparsableLine(f"unreadable request_time {text[:20]!r}")
    return seconds


def _prefixed(fields: dict[str, str], prefix: str) -> dict[str, str]:
    return {name[len(prefix):].replace("_", "-"): value
            for name, value in fields.items() if name.startswith(prefix)}


def parse_request_line(line: str) -> tuple[str, str]:
    """``GET /path?q HTTP/1.1`` (or HTTP/0.9's ``GET /path``): method and URI."""
    if line in ("", "-"):
        raise UnparsableLine("no request line (the client sent none)")
    parts = line.split(" ")
    if len(parts) > 2 and parts[-1].startswith("HTTP/"):
        parts = [parts[0], " ".join(parts[1:-1])]
    if len(parts) != 2 or not parts[1] or not _METHOD.fullmatch(parts[0]):
        raise UnparsableLine("not an HTTP request line")
    return parts[0], parts[1]


def _unescape(text: str) -> str:
    """nginx's ``\\xHH`` escapes back to the bytes they stand for (UTF-8)."""
    if "\\x" not in text:
        return text
    unescaped = _ESCAPE.sub(lambda match: chr(int(match.group(1), 16)), text)
    try:
        return unescaped.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return unescaped


def parse_time(text: str) -> float:
    """``$msec`` (``1709287200.123``), ISO 8601 or ``$time_local``.

    ISO 8601 without an offset is taken as UTC (nginx's ``$time_iso8601``
    always has one).
    """
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise UnparsableLine(f"unreadable time {text!r}")
        return seconds
    if "/" in text:
        return parse_time_local(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise UnparsableLine(f"unreadable time {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


@lru_cache(maxsize=1024)  # every request of one second has the same text
def parse_time_local(text: str) -> float:
    """``$time_local``: ``01/Mar/2024:10:00:00 +0100``, English month names
    whatever the locale."""
    match = _TIME_LOCAL.fullmatch(text)
    month = _MONTHS.get(match.group(2)) if match else None
    if match is None or month is None:
        raise UnparsableLine(f"unreadable time {text!r}")
    day, _, year, hour, minute, second, sign, offset_hours, offset_minutes = match.groups()
    offset = timedelta(hours=int(offset_hours), minutes=int(offset_minutes))
    try:
        moment = datetime(int(year), month, int(day), int(hour), int(minute), int(second),
                          tzinfo=timezone(-offset if sign == "-" else offset))
    except ValueError:
        raise UnparsableLine(f"unreadable time {text!r}") from None
    return moment.timestamp()


# --------------------------------------------------------------------------
# Whole logs
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SkippedLine:
    log: str
    line: int
    reason: str
    text: str


class AccessLogs:
    """Several access logs read as one stream of entries in time order.

    Use as a context manager: entering opens every log (a log that cannot be
    opened raises ``LogError`` before anything is replayed). Gzip-compressed
    logs (``.gz``) are read as they are; ``-`` is standard input.
    """

    def __init__(self, names: Sequence[str], reorder_window: float = REORDER_WINDOW) -> None:
        self.names = list(names)
        self.reorder_window = reorder_window
        self.lines = 0  # non-blank lines read
        self.skipped = 0
        self.late = 0  # lines replayed later than their time (out of order beyond the window)
        self._examples: list[tuple[int, SkippedLine]] = []
        self._released = -math.inf  # the time of the latest entry handed out
        self._files = ExitStack()
        self._handles: list[TextIO] = []

    def __enter__(self) -> AccessLogs:
        with ExitStack() as opened:
            for name in self.names:
                self._handles.append(opened.enter_context(_open(name)))
            self._files = opened.pop_all()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._files.close()

    @property
    def examples(self) -> list[SkippedLine]:
        """The first skipped lines, in the order the logs were given."""
        return [example for _, example in sorted(self._examples, key=lambda e: (e[0], e[1].line))][:EXAMPLES]

    def __iter__(self) -> Iterator[LogEntry]:
        readers = [self._entries(index, handle) for index, handle in enumerate(self._handles)]
        return self._in_time_order(heapq.merge(*readers, key=attrgetter("time")))

    def _entries(self, index: int, handle: TextIO) -> Iterator[LogEntry]:
        name = self.names[index]
        kept = 0
        try:
            for number, line in enumerate(handle, 1):
                line = line.strip()
                if not line:
                    continue
                self.lines += 1
                try:
                    yield parse_line(line)
                except UnparsableLine as exc:
                    self.skipped += 1
                    if kept < EXAMPLES:
                        kept += 1
                        self._examples.append((index, SkippedLine(name, number, str(exc), line[:120])))
        except (OSError, EOFError, zlib.error) as exc:  # a truncated or corrupt .gz, an I/O error
            raise LogError(f"cannot read {name}: {exc}") from None

    def _in_time_order(self, entries: Iterable[LogEntry]) -> Iterator[LogEntry]:
        """Hold each entry until the log has moved ``reorder_window`` seconds
        past it, releasing the oldest first."""
        waiting: list[tuple[float, int, LogEntry]] = []
        newest = -math.inf
        for order, entry in enumerate(entries):
            heapq.heappush(waiting, (entry.time, order, entry))
            newest = max(newest, entry.time)
            while waiting and waiting[0][0] <= newest - self.reorder_window:
                yield self._not_before_released(heapq.heappop(waiting)[2])
        while waiting:
            yield self._not_before_released(heapq.heappop(waiting)[2])

    def _not_before_released(self, entry: LogEntry) -> LogEntry:
        """An entry older than one already released gets that time instead:
        the replay's clock never goes back."""
        if entry.time < self._released:
            self.late += 1
            entry.time = self._released
        else:
            self._released = entry.time
        return entry


def _open(name: str) -> TextIO:
    if name == "-":
        return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
    try:
        if name.endswith(".gz"):
            return gzip.open(name, "rt", encoding="utf-8", errors="replace")
        return open(name, encoding="utf-8", errors="replace")
    except OSError as exc:
        raise LogError(f"cannot read {name}: {exc.strerror or exc}") from None
