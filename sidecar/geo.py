"""Country and autonomous system of a client, from local MaxMind-format
databases (the ``geoip:`` section; ``maxminddb``, with its C extension
when installed).

A rule keys on ``asn`` or ``country`` and tests them (``match: {asn: {in:
[...]}}``); the value is the client's resolved address looked up in the
file: the autonomous system's number as text (``"64500"``), or the
country's ISO code (``"DE"``). An address the database does not know, or a
database that cannot be read, gives the empty value, as a missing header
does.

A database is opened when the rules load. While Sluice runs, the file is
looked at (``os.stat``) at most once a second, on the clock given, and
opened again when it changed, so that a weekly GeoLite2 update is picked
up without a reload; a file that cannot be opened then keeps the last good
one (logged at most once a minute). What an address gave is remembered
from its second lookup lately (``sidecar.bounded.SeenLately``: a rotation
of addresses seen once each stores none of them), up to ``CACHE_SIZE``
addresses (the map is emptied when full or when the file changed), so
that a returning client's lookups cost a dictionary read.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import maxminddb

from sidecar.bounded import SeenLately
from sidecar.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from sidecar.request import CheckRequest

log = logging.getLogger("sluice")

CACHE_SIZE = 65_536
CHECK_EVERY = 1.0  # seconds between looks at the file


def asn_of(record: Mapping[str, Any]) -> str:
    """An ASN database's record: the system's number, as text."""
    number = record.get("autonomous_system_number")
    return str(number) if isinstance(number, int) and not isinstance(number, bool) else ""


def country_of(record: Mapping[str, Any]) -> str:
    """A Country or City database's record: the country's ISO code (the
    registered country's when the record has no other)."""
    for field in ("country", "registered_country"):
        found = record.get(field)
        if isinstance(found, Mapping) and isinstance(found.get("iso_code"), str):
            return str(found["iso_code"])
    return ""


def open_database(path: str) -> maxminddb.Reader:
    """The database at ``path``; ValueError, in words, when it cannot be read."""
    try:
        return maxminddb.open_database(path, maxminddb.MODE_AUTO)
    except FileNotFoundError:
        raise ValueError(f"no database at {path}") from None
    except (OSError, maxminddb.InvalidDatabaseError, ValueError) as exc:
        raise ValueError(f"{path} is not a MaxMind-format database ({exc})") from None


class GeoDatabase:
    """One database file and what its records say (``field``)."""

    def __init__(self, path: str, field: Callable[[Mapping[str, Any]], str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.field = field
        self.clock = clock
        self.reader: maxminddb.Reader | None = None
        self.problem: str | None = None  # why it could not be read at load
        self._stamp: tuple[int, int, int] | None = None
        self._next_look = 0.0
        self._cache: dict[str, str] = {}
        self._seen = SeenLately()  # what the cache stores: an address's second lookup lately
        self._log = RateLimitedLog(log, 60)
        try:
            self.reader = open_database(path)
            self._stamp = self._stat()
        except (OSError, ValueError) as exc:
            self.problem = str(exc) if isinstance(exc, ValueError) else f"cannot read {path}: {exc.strerror}"

    def _stat(self) -> tuple[int, int, int]:
        found = os.stat(self.path)
        return found.st_mtime_ns, found.st_size, found.st_ino

    def value_of(self, request: CheckRequest) -> str:
        """The request's client's value ("" for none)."""
        now = self.clock()
        if now >= self._next_look:
            self._next_look = now + CHECK_EVERY
            self._look()
        text = request.client.text
        value = self._cache.get(text)
        if value is None:
            value = self._lookup(text)
            # Under a rotation of addresses, one seen once is not stored
            # (see SeenLately): a returning client is, from its second request.
            self._seen.remember(self._cache, text, value, CACHE_SIZE)
        return value

    def _lookup(self, text: str) -> str:
        reader = self.reader
        if reader is None or not text:
            return ""
        try:
            record = reader.get(text)
        except ValueError:  # not an address (a client the proxy did not name)
            return ""
        return self.field(record) if isinstance(record, Mapping) else ""

    def _look(self) -> None:
        """Open the file again if it changed; keep the last good one."""
        try:
            stamp = self._stat()
        except OSError:
            return  # gone for now: the last good database stays
        if stamp == self._stamp:
            return
        try:
            reader = open_database(self.path)
        except ValueError as exc:
            self._log.warning("geoip: %s; keeping the database read before", exc)
            return
        old, self.reader, self._stamp = self.reader, reader, stamp
        self._cache.clear()  # the same dict: the filter keeps its generation by the cache (SeenLately.remember)
        if old is not None:
            old.close()
        log.info("geoip: %s changed and was read again", self.path)
