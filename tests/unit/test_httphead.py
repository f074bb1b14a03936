"""sidecar.httphead reads a check's head in one call, and never reads a
head otherwise than httptools does: whatever it reads, httptools reads as
the same request (method, target, header fields, no body, the connection
kept open), ending at the same byte; whatever httptools refuses, it leaves
alone. And the HTTP protocol answers a connection's bytes the same whether
it reads heads with it or gives them all to httptools."""

from __future__ import annotations

import asyncio

import httptools
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.config import Config
from uvicorn.server import ServerState

from sidecar import server
from sidecar.app import SluiceApp
from sidecar.engine import Engine
from sidecar.httphead import FRAMING_FIELDS, NAMES_KEPT, field_list, names_kept, read_head
from sidecar.server import LimitedHttpProtocol
from tests.unit.conftest import FakeClock, RecordingTransport, ruleset_from

CHECK = (b"GET /v1/nginx/auth HTTP/1.1\r\nHost: sluice\r\nX-Sluice-Client-Addr: 192.0.2.7\r\n"
         b"X-Original-URI: /shop/cart?id=3\r\nX-Request-Id: 0123456789abcdef0123456789abcdef\r\n"
         b"X-Sluice-Tls-Fingerprint: \r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n")


class Request:
    """What httptools reads of one request."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.complete = False


class Reader:
    """httptools' reading of some bytes: the requests, and whether it
    refused them (an error, or an upgrade it stops at)."""

    def __init__(self, data: bytes) -> None:
        self.requests: list[Request] = []
        self.keep_alive: list[bool] = []
        self.methods: list[bytes] = []
        self.refused = False
        self.parser = httptools.HttpRequestParser(self)
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self.refused = True

    def on_message_begin(self) -> None:
        self.requests.append(Request())

    def on_url(self, url: bytes) -> None:
        self.requests[-1].url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.requests[-1].headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.methods.append(self.parser.get_method())
        self.keep_alive.append(self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        self.requests[-1].body += body

    def on_message_complete(self) -> None:
        self.requests[-1].complete = True


def assert_read_as_httptools(data: bytes) -> None:
    """read_head on ``data`` agrees with httptools (see the module)."""
    head = read_head(data, 0, 100)
    if head is None:
        return
    method, path, raw_path, query, fields, end = head
    whole = Reader(data[:end])
    assert not whole.refused
    assert len(whole.requests) == 1 and whole.requests[0].complete
    request = whole.requests[0]
    # The fields, in order, as httptools reads them; no name twice.
    assert (whole.methods[0], request.headers, request.body) == (method.encode("ascii"), field_list(fields), b"")
    # The target, split as the protocol splits httptools' (parse_url).
    url = httptools.parse_url(request.url)
    assert (url.path, url.query or b"") == (raw_path, query)
    assert path == raw_path.decode("ascii")
    assert whole.keep_alive == [True]
    # Nothing of the head is left for later: httptools, given one byte
    # less, has not finished the request.
    short = Reader(data[:end - 1])
    assert short.refused or not any(request.complete for request in short.requests)
    # And what follows is read as httptools reads it after this request.
    assert_rest_read_the_same(data, end)


def assert_rest_read_the_same(data: bytes, end: int) -> None:
    """httptools reads ``data`` as the request before ``end`` then the rest."""
    together, rest = Reader(data), Reader(data[end:])
    assert together.requests[0].complete
    later = together.requests[1:]
    assert [(r.url, r.headers, r.body, r.complete) for r in later] == \
        [(r.url, r.headers, r.body, r.complete) for r in rest.requests]
    assert together.refused == rest.refused


token = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_!#$%&'*+.^`|~",
                min_size=1, max_size=12)
value = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=255), max_size=16)
field_name = st.one_of(token, st.sampled_from(sorted(name.decode() for name in FRAMING_FIELDS)),
                       st.sampled_from(["Content-Length", "Transfer-Encoding", "Host", "X-Request-Id", "Connection",
                                        "content-length ", " host", "Host\t", "X Y"]))
separator = st.sampled_from([": ", ":", ":\t", ":  ", " : ", ":\r\n "])
line_end = st.sampled_from(["\r\n", "\r\n", "\r\n", "\n", "\r", " \r\n"])
method = st.sampled_from(["GET", "GET", "HEAD", "POST", "PUT", "get", "CONNECT", "OPTIONS", "PRI"])
target = st.one_of(st.sampled_from(["/v1/nginx/auth", "/", "/v1/envoy/auth/a/b?c=d&e", "//x", "/%41?%zz",
                                    "*", "http://h/x", "/a#frag", "/a b", "/a\x7f"]),
                   st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255), max_size=12).map(
                       lambda text: "/" + text))
version = st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.10", "http/1.1", "HTTP/1.1 "])


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    """Request heads, most of them a check's, many with something wrong."""
    lines = [f"{draw(method)} {draw(target)} {draw(version)}{draw(line_end)}"]
    for _ in range(draw(st.integers(0, 6))):
        lines.append(f"{draw(field_name)}{draw(separator)}{draw(value)}{draw(line_end)}")
    lines.append(draw(line_end))
    body = draw(st.sampled_from(["", "", "0\r\n\r\n", "5\r\nhello", "GET / HTTP/1.1\r\n\r\n"]))
    return ("".join(lines) + body).encode("latin-1")


@settings(max_examples=1500, deadline=None)
@given(heads())
def test_a_generated_head_is_read_as_httptools_reads_it(data: bytes) -> None:
    assert_read_as_httptools(data)


@st.composite
def mutated_checks(draw: st.DrawFn) -> bytes:
    """A check's head with a few bytes replaced, inserted or removed."""
    data = bytearray(CHECK + draw(st.sampled_from([b"", CHECK, b"POST / HTTP/1.1\r\nContent-Length: 1\r\n\r\nx"])))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data) - 1))
        byte = draw(st.one_of(st.integers(0, 255), st.sampled_from(list(b"\r\n :\t\x00\x7f\x80"))))
        change = draw(st.sampled_from(["replace", "insert", "delete"]))
        if change == "replace":
            data[at] = byte
        elif change == "insert":
            data.insert(at, byte)
        else:
            del data[at]
    return bytes(data)


@settings(max_examples=1500, deadline=None)
@given(mutated_checks())
def test_a_mutated_check_is_read_as_httptools_reads_it_or_left_to_it(data: bytes) -> None:
    assert_read_as_httptools(data)


def test_a_check_is_read_whole_with_its_fields_by_name() -> None:
    method, path, raw_path, query, fields, end = read_head(CHECK + CHECK, 0, 100) or pytest.fail("not read")
    assert (method, path, raw_path, query, end) == ("GET", "/v1/nginx/auth", b"/v1/nginx/auth", b"", len(CHECK))
    assert list(fields)[:2] == ["host", "x-sluice-client-addr"] and fields["x-sluice-tls-fingerprint"] == ""
    assert fields["x-original-uri"] == "/shop/cart?id=3"
    assert field_list(fields)[0] == (b"host", b"sluice") and (b"x-sluice-tls-fingerprint", b"") in field_list(fields)
    assert read_head(CHECK + CHECK, end, 100) == (method, path, raw_path, query, fields, 2 * len(CHECK))
    assert read_head(CHECK.replace(b"auth", b"auth?a=1?b"), 0, 100)[1:4] == ("/v1/nginx/auth", b"/v1/nginx/auth",
                                                                           b"a=1?b")


@pytest.mark.parametrize("field", sorted(FRAMING_FIELDS))
def test_a_field_that_frames_a_body_or_the_connection_leaves_the_head_to_httptools(field: bytes) -> None:
    data = CHECK.replace(b"Accept: */*", field.title() + b": 0")
    assert read_head(data, 0, 100) is None


@pytest.mark.parametrize("value", [b"", b"1", b"a"])
def test_a_name_sent_twice_leaves_the_head_to_httptools_whatever_its_values(value: bytes) -> None:
    """header_map joins a repeated name's values, from httptools' fields."""
    assert read_head(CHECK.replace(b"Accept: */*", b"X-Twice: " + value + b"\r\nX-TWICE: " + value), 0, 100) is None
    assert read_head(CHECK.replace(b"Accept: */*", b"X-Twice: " + value + b"\r\nX-Once: " + value), 0, 100)


def test_names_kept_are_bounded_whatever_names_a_client_sends() -> None:
    for number in range(2 * NAMES_KEPT):
        head = read_head(CHECK.replace(b"Accept: */*", b"X-Junk-%d: 1" % number), 0, 100)
        assert head is not None and head[4][f"x-junk-{number}"] == "1"
    assert names_kept() <= NAMES_KEPT
    # A name kept answers as it was read; a framing field is never kept.
    for _ in range(2):
        assert read_head(CHECK.replace(b"Accept: */*", b"X-JUNK-1: 2"), 0, 100)[4]["x-junk-1"] == "2"
        assert read_head(CHECK.replace(b"Accept: */*", b"Content-Length: 0"), 0, 100) is None


def test_names_kept_by_field_are_bounded_however_many_fields_a_head_has() -> None:
    last = 2 * NAMES_KEPT - 1
    many = b"".join(b"X-Field-%d: %d\r\n" % (number, number) for number in range(last + 1))
    for _ in range(2):
        head = read_head(CHECK.replace(b"Accept: */*\r\n", many), 0, 4 * NAMES_KEPT)
        assert head is not None and head[4][f"x-field-{last}"] == str(last)
    assert names_kept() <= NAMES_KEPT


@pytest.mark.parametrize("name", [b"X-Foobar", b"X-Fo", b"x-foo", b"X-Foo-", b"Content-Length", b"Connection"])
def test_a_name_that_differs_from_the_last_heads_at_its_field_is_read_as_its_own(name: bytes) -> None:
    """The last head's name at a field is recognised where the data hold
    exactly it and then its colon: a longer or shorter name, another case,
    or a field that frames a body is read as any other."""
    last = CHECK.replace(b"Host: sluice", b"X-Foo: 1")
    assert read_head(last, 0, 100)[4]["x-foo"] == "1"
    head = read_head(last.replace(b"X-Foo: 1", name + b": 2"), 0, 100)
    if name.lower() in FRAMING_FIELDS:
        assert head is None
    else:
        assert head is not None and list(head[4].items())[0] == (name.decode().lower(), "2")
        assert ("x-foo" in head[4]) == (name.lower() == b"x-foo")
    assert list(read_head(last, 0, 100)[4].items())[0] == ("x-foo", "1")  # and the last head's is read again


@pytest.mark.parametrize("data", [
    CHECK[:-1],  # not whole yet
    CHECK.replace(b"HTTP/1.1", b"HTTP/1.0"),  # closes the connection
    CHECK.replace(b"GET", b"POST"),
    CHECK.replace(b"\r\nHost", b"\nHost"),  # a bare LF
    CHECK.replace(b"curl/8.5.0", b"curl/8.5.0 "),  # trailing whitespace
    CHECK.replace(b"curl/8.5.0", b"curl/\xe98.5.0"),  # beyond ASCII
    CHECK.replace(b"Host:", b"Host :"),
    b"\r\n" + CHECK,
], ids=["partial", "http-1.0", "post", "bare-lf", "trailing-space", "obs-text", "space-before-colon",
        "leading-crlf"])
def test_anything_else_is_left_to_httptools(data: bytes) -> None:
    assert read_head(data, 0, 100) is None


def test_more_fields_than_allowed_are_left_to_httptools() -> None:
    assert CHECK.count(b"\r\n") - 2 == 7
    assert read_head(CHECK, 0, 6) is None
    assert read_head(CHECK, 0, 7) is not None


# -- the protocol, reading heads or not ------------------------------------------------

RULES = """
rules:
  - id: low
    key: [ip]
    limit: {requests: 2, per: 1h}
    action: block
"""


def answers(reads: list[bytes], reads_heads: bool, monkeypatch: pytest.MonkeyPatch,
            rules: str = RULES, protocol_class: type[LimitedHttpProtocol] = LimitedHttpProtocol
            ) -> tuple[list[bytes], bool]:
    """What the protocol (``protocol_class``) writes for these reads of one
    connection (the checks it answers at once), and whether it closed the
    connection."""
    monkeypatch.setattr(server, "READS_HEADS", reads_heads)
    # Both clocks stand still: the answers (X-Accel-Expires, reset) are the
    # same in both runs.
    engine = Engine(ruleset_from(rules), clock=FakeClock(), wall_clock=FakeClock(1_800_000_000.25))
    config = Config(app=SluiceApp(engine), lifespan="off", log_level="warning", proxy_headers=False)
    config.load()
    loop = asyncio.new_event_loop()
    try:
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={}, _loop=loop,
                                  max_header_bytes=600, max_headers=12)
        transport = RecordingTransport()
        protocol.connection_made(transport)
        for data in reads:
            protocol.data_received(data)
        protocol.connection_lost(None)
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.wait(tasks))
    finally:
        loop.close()
    return transport.written, transport.closing


CHECKS_AND_MORE = [
    CHECK,
    CHECK.replace(b"192.0.2.7", b"192.0.2.8"),
    CHECK.replace(b"0123456789abcdef", b"fedcba9876543210"),
    CHECK.replace(b"GET", b"HEAD"),
    CHECK.replace(b"/v1/nginx/auth", b"/v1/nginx/auth?x=1"),
    CHECK.replace(b"/v1/nginx/auth", b"/v1/envoy/auth/shop%2Fcart"),
    CHECK.replace(b"Accept: */*", b"Accept: */*\r\nAccept: text/html"),
    CHECK.replace(b"Accept: */*", b"Connection: close"),
    CHECK.replace(b"Accept: */*", b"Content-Length: 3") + b"abc",
    CHECK.replace(b"HTTP/1.1", b"HTTP/1.0"),
    CHECK.replace(b"Accept: */*", b"X-Long: " + b"a" * 400),
    CHECK.replace(b"Accept: */*", b"A: 1\r\nB: 2\r\nC: 3\r\nD: 4\r\nE: 5"),
    b"GET /nowhere HTTP/1.1\r\nHost: sluice\r\n\r\n",
    b"GET /v1/nginx/auth HTTP/1.1\r\nHost: a\r\nBad Header: x\r\n\r\n",
]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(CHECKS_AND_MORE), min_size=1, max_size=5), st.lists(st.integers(1, 2000), max_size=4))
def test_the_protocol_answers_the_same_reading_heads_or_not(requests: list[bytes], cuts: list[int]) -> None:
    data = b"".join(requests)
    points = sorted({0, len(data), *(cut % len(data) for cut in cuts)})
    reads = [data[start:end] for start, end in zip(points, points[1:]) if end > start]
    with pytest.MonkeyPatch.context() as monkeypatch:
        with_reader = answers(reads, True, monkeypatch)
        without = answers(reads, False, monkeypatch)
    assert with_reader == without


@pytest.mark.parametrize("reads_heads", [True, False])
def test_a_read_of_whole_checks_never_reaches_the_parser_when_heads_are_read(
        reads_heads: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above compares two different readings: with the
    reader, checks read whole are answered without one parser callback."""
    urls: list[bytes] = []

    class Counting(LimitedHttpProtocol):
        def on_url(self, url: bytes) -> None:
            urls.append(url)
            super().on_url(url)

    written, _ = answers([CHECK + CHECK.replace(b"GET", b"HEAD")], reads_heads, monkeypatch,
                         protocol_class=Counting)
    assert len(written) == 2 and all(answer.startswith(b"HTTP/1.1 200 OK\r\n") for answer in written)
    assert urls == ([] if reads_heads else [b"/v1/nginx/auth", b"/v1/nginx/auth"])


HOLDING = """
rules:
  - id: smooth
    key: [ip]
    limit: {rate: 1r/s, burst: 5}
    action: block
"""


@pytest.mark.parametrize("reads_heads", [True, False])
def test_a_check_that_leaves_for_the_asgi_path_lists_its_fields_as_httptools_reads_them(
        reads_heads: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A check the protocol does not answer itself (here held by a leaky
    bucket) goes to the ASGI path with the scope's header fields, in order,
    however its head was read."""
    scopes: list[dict[str, object]] = []
    exchange = server.AsgiExchange

    def recorded(scope: dict[str, object], *args: object) -> object:
        scopes.append(scope)
        return exchange(scope, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(server, "AsgiExchange", recorded)
    written, _ = answers([CHECK + CHECK], reads_heads, monkeypatch, HOLDING)
    assert len(written) == 1 and written[0].startswith(b"HTTP/1.1 200 OK\r\n")  # the second waits its turn
    assert len(scopes) == 1
    assert scopes[0]["headers"] == Reader(CHECK).requests[0].headers
