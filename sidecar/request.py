"""The neutral description of one request, whichever proxy asked about it.

Adapters (nginx, Envoy, forward-auth) build a ``CheckRequest`` at the edge,
with ``check_request`` for what every proxy sends the same way; nothing
beyond it knows which proxy sent the request (STYLE: adapters at the edges).
Cookies and query parameters are parsed only when a rule asks.
"""

from __future__ import annotations

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

import math
import os
import posixpath
from collections.abc import Hashable
from typing import TYPE_CHECKING
from urllib.parse import unquote

from sidecar.challenge import FINGERPRINT_HEADER
from sidecar.clientip import ClientAddress

if TYPE_CHECKING:
    from sidecar.identity import TokenRead

# The client of a request described by a front door and not yet decided
# (see CheckRequest): never the same object as a resolved client.
UNRESOLVED = ClientAddress(None, "")
# The proxy's stamp of when it sent the check (the shipped templates set
# it), for late checks (sidecar.overload).
SENT_HEADER = "x-sluice-sent"


def normalise_path(raw_path: str) -> str:
    """The path as nginx matches locations: decoded, slashes merged, dots resolved.

    Matching rules on the raw path would let ``/api/%6Cogin`` or
    ``//api/./login`` slip past a rule on ``/api/login``.
    """
    path = unquote(raw_path, errors="replace") if "%" in raw_path else raw_path
    if "//" in path or "/." in path or not path.startswith("/"):
        trailing = path.endswith(("/", "/.", "/.."))
        path = posixpath.normpath("/" + path)
        if path.startswith("//"):
            path = path[1:]
        if trailing and path != "/":
            path += "/"
    return path


def strip_port(host: str) -> str:
    if host.startswith("["):
        end = host.find("]")
        return host[: end + 1] if end != -1 else host
    return host.partition(":")[0] if host.count(":") == 1 else host


class CheckRequest:
    """Method, host, URI, headers (lower-case names), the resolved client and
    the TLS fingerprint the proxy passed on ("" for none), and when the
    proxy sent the check (Unix seconds; 0.0 when it did not say, see
    sidecar.overload). A front door describes the client as the proxy
    names it, ``peer`` and ``forwarded_for`` (its X-Forwarded-For), with
    ``client`` left ``UNRESOLVED``: the engine resolves it, once, when it
    decides. A refusal that holds for every request of the client
    says until when (``refused_until``, on the engine's clock) and how it is
    counted (``refused_as``: rule id or "" for a ban, action, decision-log
    key), for ``sidecar.overload.AddressRefusals``, and the last Unix second
    nginx may answer it from its cache (``proxy_expires``; 0 for none)."""

    __slots__ = ("method", "host", "uri", "path", "query_string", "headers",
                 "client", "peer", "forwarded_for", "request_id", "tls_fingerprint", "sent",
                 "refused_until", "refused_as", "proxy_expires", "credential", "token", "_cookies", "_query")

    def __init__(
        self,
        method: str,
        host: str,
        uri: str,
        headers: dict[str, str],
        client: ClientAddress,
        request_id: str,
        *,
        tls_fingerprint: str = "",
        sent: float = 0.0,
        peer: str = "",
        forwarded_for: str | None = None,
    ) -> None:
        self.method = method
        self.host = host
        self.uri = uri
        raw_path, _, self.query_string = uri.partition("?")
        self.path = normalise_path(raw_path)
        self.headers = headers
        self.client = client
        self.peer = peer
        self.forwarded_for = forwarded_for
        self.request_id = request_id
        self.tls_fingerprint = tls_fingerprint
        self.sent = sent
        self.refused_until = 0.0
        self.refused_as: tuple[str, str, Hashable | None] = ("", "", None)
        self.proxy_expires = 0
        self.credential = False
        # What its token gave, once a rule read it (sidecar.identity).
        self.token: TokenRead | None = None
        self._cookies: dict[str, str] | None = None
        self._query: dict[str, str] | None = None

    @property
    def cookies(self) -> dict[str, str]:
        return cookies_of(self)

    @property
    def query(self) -> dict[str, str]:
        return query_of(self)


def cookies_of(request: CheckRequest) -> dict[str, str]:
    """The request's cookies (``CheckRequest.cookies``), parsed on first use.
    A function, which the compiled core calls in C (sidecar.matching)."""
    cookies = request._cookies
    if cookies is None:
        headers = request.headers
        # Compiled: a dict's field read in C (the front doors' headers are dicts).
        field = cython.cast(dict, headers).get("cookie", "") if type(headers) is dict else headers.get("cookie", "")
        cookies = request._cookies = parse_cookies(field)
    return cookies


def query_of(request: CheckRequest) -> dict[str, str]:
    """The request's query parameters (``CheckRequest.query``), parsed on first use."""
    query = request._query
    if query is None:
        query = request._query = parse_query(request.query_string)
    return query


def query_value(request: CheckRequest, name: str) -> str | None:
    """``request.query.get(name)``: from the parsed parameters when they
    were parsed already; else, when nothing in the query string is
    escaped, the first field named ``name`` found in place (no dict, and
    no slice but its value's). The program's read of a parameter
    (sidecar.matching)."""
    query = request._query
    if query is not None:
        return query.get(name)
    text = request.query_string
    if "%" in text or "+" in text or "=" in name:
        return query_of(request).get(name)  # a name to unquote, or one no field has: as parsed
    size = len(name)
    end = len(text)
    start = 0
    while start < end:
        stop = text.find("&", start)
        if stop < 0:
            stop = end
        # A field's name is its text up to its first "=" (an empty field has none).
        if stop > start and text.startswith(name, start, stop):
            after = start + size
            if after == stop:
                return ""
            if text[after] == "=":
                return text[after + 1:stop]
        start = stop + 1
    return None


def cookie_value(request: CheckRequest, name: str) -> str | None:
    """``request.cookies.get(name)``: from the parsed cookies when they were
    parsed already; else the first cookie named ``name`` found in place in
    the Cookie field (no dict). The program's read of a cookie."""
    cookies = request._cookies
    if cookies is not None:
        return cookies.get(name)
    if not name or "=" in name:
        return cookies_of(request).get(name)  # names no cookie has: as parsed
    headers = request.headers
    field = cython.cast(dict, headers).get("cookie", "") if type(headers) is dict else headers.get("cookie", "")
    size = len(name)
    end = len(field)
    start = 0
    while start < end:
        stop = field.find(";", start)
        if stop < 0:
            stop = end
        # A cookie is its part stripped: its name up to its first "=".
        first = start
        while first < stop and field[first].isspace():
            first += 1
        after = first + size
        if after < stop and field[after] == "=" and field.startswith(name, first, stop):
            value = field[after + 1:stop]
            return value.strip()
        start = stop + 1
    return None


def check_request(headers: dict[str, str], method: str, host: str | None, uri: str, peer: str,
                  host_field: str = "host") -> CheckRequest:
    """A CheckRequest with what every proxy sends the same way: the headers,
    the request id, the TLS fingerprint, the time the proxy sent it, and
    the client as the proxy names it (``peer``, the address the request
    came from, and X-Forwarded-For), which the engine resolves. ``host``
    None: the check's ``host_field`` (else its own Host field), without its
    port.

    Everything a front door's description needs of this module is done in
    this one call: a check passes through the module once."""
    if host is None:
        host = strip_port(headers.get(host_field) or headers.get("host", ""))
    sent = headers.get(SENT_HEADER)
    return CheckRequest(method, host, uri, headers, UNRESOLVED, headers.get("x-request-id") or new_request_id(),
                        tls_fingerprint=headers.get(FINGERPRINT_HEADER, ""),
                        sent=parse_sent(sent) if sent else 0.0,
                        peer=peer, forwarded_for=headers.get("x-forwarded-for"))


def new_request_id() -> str:
    return os.urandom(10).hex()


def request_id_of(headers: dict[str, str]) -> str:
    """The proxy's request id, or a new one."""
    return headers.get("x-request-id") or new_request_id()


def parse_sent(value: str | None) -> float:
    """The proxy's send stamp (Unix seconds, as ``1700000000.123``); 0.0
    for none or anything else (never trusted blindly: see sidecar.overload)."""
    if not value or len(value) > 24:
        return 0.0
    try:
        sent = float(value)
    except ValueError:
        return 0.0
    return sent if math.isfinite(sent) and sent > 0 else 0.0


def parse_cookies(field: str) -> dict[str, str]:
    """A Cookie field's cookies by name, the first of each name: in each
    part between semicolons, stripped, the name before its first "=" (not
    empty) and the value after it, stripped."""
    cookies: dict[str, str] = {}
    if not field:
        return cookies  # no Cookie field: most checks
    for part in field.split(";"):
        cookie = part.strip()
        # Found and sliced, not partitioned: no tuple, no separator string
        # (compiled: str methods called in C).
        equals = cookie.find("=")
        if equals > 0:
            name = cookie[:equals]
            if name not in cookies:
                value = cookie[equals + 1:]
                cookies[name] = value.strip()
    return cookies


def parse_query(query_string: str) -> dict[str, str]:
    """Query parameters, the first value of each: what ``parse_qsl`` with
    blank values gives, without its per-field overhead when nothing in a
    field is escaped."""
    query: dict[str, str] = {}
    end = len(query_string)
    start = 0
    # Each field between "&"s found and its name and value sliced from the
    # whole (no list of fields, no partition's tuple); empty fields skipped.
    while start < end:
        stop = query_string.find("&", start)
        if stop < 0:
            stop = end
        if stop > start:
            equals = query_string.find("=", start, stop)
            if equals < 0:
                name, value = query_string[start:stop], ""
            else:
                name, value = query_string[start:equals], query_string[equals + 1:stop]
            if "%" in name or "+" in name:
                name = unquote(name.replace("+", " "), errors="replace")
            if name not in query:
                if "%" in value or "+" in value:
                    value = unquote(value.replace("+", " "), errors="replace")
                query[name] = value
        start = stop + 1
    return query
