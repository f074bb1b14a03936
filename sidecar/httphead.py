# cython: boundscheck=False, wraparound=False
# Compiled, an index of the data is not checked again (nor read from its end):
# read_head tests that a position is within the data before it reads there.
"""A check's request head read in one call, for the heads that need no more.

A check from nginx or Envoy is a GET with a dozen header fields and no body.
httptools reads it through some fourteen Python callbacks (the request
line, each field, the end of the head and of the message); ``read_head``
reads such a head in one call, and the compiled core runs it in C (the
``.pxd`` beside this file). sidecar.server gives a read's complete heads to
it first, and every other head, or any head it is not sure of, to
httptools exactly as before.

It is deliberately narrow, and never more lenient than httptools: a head it
reads is one httptools reads the same way (method, request target, header
fields, keep-alive), and anything else it leaves alone, returning None. It
reads only

* ``GET`` or ``HEAD``, one space, an origin-form target (``/`` then
  letters, digits and ``-._~!$&'()*+,;=:@/?%``), one space, ``HTTP/1.1``;
* header fields written ``name: value`` with a token for a name, optional
  spaces or tabs before the value, a value of visible ASCII with inner
  spaces and tabs, nothing after it, and CRLF after each line and the head;
* no name twice (header_map joins a repeated name's values, from the
  fields as httptools gives them);
* no field that frames a body or changes the connection: Content-Length,
  Transfer-Encoding, Upgrade, Expect, Connection and Proxy-Connection send
  the head to httptools (which decides the request's length and whether the
  connection stays open), so a request with a body is never split by this
  reader (no request smuggling).

Such a request has no body and keeps the connection open (HTTP/1.1 without
a Connection field). tests/unit/test_httphead.py holds the reader to
httptools on generated and mutated heads.
"""

from __future__ import annotations

# The fields that frame a body or change the connection: a head with any of
# them is httptools' to read.
FRAMING_FIELDS = frozenset({b"content-length", b"transfer-encoding", b"upgrade", b"expect", b"connection",
                            b"proxy-connection"})
# A head read: its method; its target's path as text (percent escapes not
# yet decoded), as bytes, and its query (b"" for none), as httptools'
# parse_url splits the target; its header fields as text by name (names in
# lower case, values as sent: what sidecar.frontdoors.common.header_map
# makes of them, as no name comes twice); and the offset just past its end.
# The fields as ASGI lists them are made only when asked (``field_list``):
# a check answered by the protocol never needs them.
Head = tuple[str, str, bytes, bytes, dict[str, str], int]

_REQUEST_VERSION = b" HTTP/1.1\r\n"

# Header names as sent, with their names in lower case: the proxies send
# the same dozen names with every check, each then read with one lookup,
# and its text's hash already made for the lookups that follow. At most
# NAMES_KEPT, the first seen (junk names only miss it).
_NAMES: dict[str, str] = {}
NAMES_KEPT = 256
# The names of the last heads read, field by field: the Nth field's name as
# sent, and in lower case. A proxy sends the same names in the same order
# with every check, so each is recognised by one comparison of its bytes
# where the data are, with no text made or looked up. At most NAMES_KEPT
# fields; a name that differs replaces its field's.
_LAST_NAMES: list[tuple[bytes, str]] = []


def is_token(byte: int) -> bool:
    """A byte of a header field's name (RFC 9110 section 5.6.2: tchar)."""
    return 48 <= byte <= 57 or 65 <= byte <= 90 or 97 <= byte <= 122 or byte in b"!#$%&'*+-.^_`|~"


def is_target(byte: int) -> bool:
    """A byte of the origin-form request targets read here."""
    return 48 <= byte <= 57 or 65 <= byte <= 90 or 97 <= byte <= 122 or byte in b"-._~!$&'()*+,;=:@/?%"


def is_value(byte: int) -> bool:
    """A byte of a header field's value read here: visible ASCII, space, tab."""
    return 32 <= byte <= 126 or byte == 9


def names_kept() -> int:
    """How many header names are kept (at most NAMES_KEPT each: by name,
    and by the field they came in last)."""
    return max(len(_NAMES), len(_LAST_NAMES))


def read_head(data: bytes, start: int, max_headers: int) -> Head | None:
    """The request head that starts at ``data[start]`` when it is whole in
    ``data``, of at most ``max_headers`` fields, and of the kind this module
    reads; None otherwise (httptools reads it)."""
    end = len(data)
    if start < 0:
        return None
    position = start
    if data.startswith(b"GET ", position):
        method = "GET"
        position += 4
    elif data.startswith(b"HEAD ", position):
        method = "HEAD"
        position += 5
    else:
        return None
    target_start = position
    if position >= end or data[position] != 47:  # "/"
        return None
    path_end = -1  # where the query starts, at the first "?"
    while position < end and is_target(data[position]):
        if path_end < 0 and data[position] == 63:  # "?"
            path_end = position
        position += 1
    target_end = position
    if path_end < 0:
        path_end = target_end
    if not data.startswith(_REQUEST_VERSION, position):
        return None
    position += 11
    fields: dict[str, str] = {}
    count = 0
    while True:
        if position + 1 >= end:
            return None  # the head goes on past this read
        if data[position] == 13 and data[position + 1] == 10:
            position += 2
            break
        name_start = position
        sent_name = None  # the field's name as sent, when not the last head's
        last: tuple[bytes, str] | None = _LAST_NAMES[count] if count < len(_LAST_NAMES) else None
        if last is not None and not (data.startswith(last[0], position) and position + len(last[0]) < end
                                     and data[position + len(last[0])] == 58):  # ":"
            last = None
        if last is not None:
            position += len(last[0])
            text = last[1]
        else:
            while position < end and is_token(data[position]):
                position += 1
            if position == name_start or position >= end or data[position] != 58:  # ":"
                return None
            # Read as text straight from the data (all of it ASCII here).
            sent = data[name_start:position].decode("latin-1")
            known = _NAMES.get(sent)
            if known is not None:
                text = known
            else:
                text = sent.lower()
                if data[name_start] in b"cCtTuUeEpP" and text.encode("latin-1") in FRAMING_FIELDS:
                    return None
                if len(_NAMES) < NAMES_KEPT:
                    _NAMES[sent] = text
            sent_name = sent.encode("latin-1")
        position += 1
        while position < end and (data[position] == 32 or data[position] == 9):
            position += 1
        value_start = position
        while position < end and is_value(data[position]):
            position += 1
        value_end = position
        if position + 1 >= end or data[position] != 13 or data[position + 1] != 10:
            return None
        if value_end > value_start and (data[value_end - 1] == 32 or data[value_end - 1] == 9):
            return None  # trailing whitespace: left to httptools
        position += 2
        if sent_name is not None:
            # Remembered as its field's name for the heads that follow.
            if count < len(_LAST_NAMES):
                _LAST_NAMES[count] = (sent_name, text)
            elif count < NAMES_KEPT:
                _LAST_NAMES.append((sent_name, text))
        count += 1
        if count > max_headers:
            return None
        fields[text] = data[value_start:value_end].decode("latin-1")
        if len(fields) < count:
            return None  # a name repeated: header_map joins its values
    path = data[target_start:path_end].decode("ascii")
    query = data[path_end + 1:target_end] if path_end + 1 < target_end else b""
    return method, path, path.encode("ascii"), query, fields, position


def field_list(fields: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """A head's fields as an ASGI scope lists them (names in lower case,
    values as sent, in the order sent), for a check that leaves the
    protocol for the ASGI path."""
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in fields.items()]
