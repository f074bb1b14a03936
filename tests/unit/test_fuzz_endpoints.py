"""Property-based fuzzing of every endpoint, in process through the ASGI app.

Whatever arrives (check headers for each front door, deny tokens, challenge
solutions, response reports over HTTP and UDP, admin calls), Sluice answers
with a defined response, never a 5xx of its own making, logs no traceback
and nothing at ERROR, and counts no internal error: bad input is refused or
answered, not a failure inside Sluice.

Each example runs against a fresh Sluice whose rules reach every code path:
block with a page, block with close, challenge, ban, count_on, a score
budget, a token and a leaky bucket, overrides, verified bots, draft headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.admin import Admin
from sidecar.app import SluiceApp
from sidecar.challenge import solve, solves
from sidecar.engine import Engine
from sidecar.hook import HookDatagrams
from sidecar.rules import Ruleset

from .conftest import FakeClock, ruleset_from

RULES = """
headers: draft
challenge: {difficulty: 1}
client_ip: {trusted_proxies: [127.0.0.0/8, "::1/128"]}
verified_bots:
  - {cidrs: [192.0.2.0/28], user_agent: "(?i)goodbot"}
overrides:
  - {cidrs: [198.51.100.0/24], rules: [blocked], multiply: 2}
tiers: {names: [free, pro], default: free, identity: "header:x-k"}
rules:
  - id: blocked
    match: {any: [{path: {prefix: /b}}, {header: {name: x-k, present: true}}, {cookie: {name: s, prefix: v}}]}
    key: [ip, "header:x-k", "cookie:s", "query:q", "session:sid", host, method]
    limit: {requests: 2, per: 10s}
    action: block
    block: {status: 451, body: "<p>${{remote_addr}} at ${{http_host}} (${{request_id}})</p>"}
  - id: closer
    match: {path: {prefix: /x}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    tiers: {pro: 3}
    action: block
    block: {close: true}
  - id: chal
    match: {path: {prefix: /c}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: challenge
  - id: banned
    match: {path: {prefix: /ban}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: ban
    ban: {duration: 1m}
  - id: login
    match: {path: {prefix: /login}}
    key: [ip, uri]
    limit: {requests: 1, per: 10s}
    count_on: {status: [401, 403]}
    action: block
  - id: marked
    match: {path: {prefix: /login}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    count_on: {header: {name: x-mark, equals: high}}
    action: block
  - id: score
    match: {path: {prefix: /s}}
    key: [ip]
    limit: {score: 100, per: 10s, header: x-score}
    action: block
  - id: leaky
    match: {path: {prefix: /l}}
    key: [ip]
    limit: {rate: 1000r/s, burst: 2}
    action: block
  - id: tokens
    match: {path: {prefix: /t}}
    key: [ip, path]
    limit: {tokens: 2, refill: 1/s}
    action: block
  - id: watch
    key: [path]
    limit: {rate: 5r/s, burst: 1, nodelay: true}
    action: log
    penalty: 5s
  - id: conc
    match: {path: {prefix: /k}}
    key: [ip, "header:x-k"]
    limit: {concurrent: 1, lease: 5s}
    action: block
"""

# What a reload between nginx's check and its page call may turn the rules
# into: a block rule becomes a challenge and back, a rule goes.
BLOCKED_ACTION = ('    action: block\n'
                  '    block: {status: 451, body: "<p>${{remote_addr}} at ${{http_host}} (${{request_id}})</p>"}\n')
RELOADED = (RULES.replace("    action: challenge\n", "    action: block\n    block: {status: 429}\n")
            .replace(BLOCKED_ACTION, "    action: challenge\n")
            .replace("id: closer", "id: closer-renamed"))

ADMIN_TOKEN = b"fuzzing-admin-token-0123456789"

SLUICE_LOGGERS = ("sluice", "sluice.decisions")
UNSENDABLE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


# --------------------------------------------------------------------------
# Calling the app
# --------------------------------------------------------------------------


class Capture(logging.Handler):
    """Every record of Sluice's loggers (a handler of their own: the decision
    log may not propagate to the root logger caplog listens on)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._seen: set[int] = set()

    def emit(self, record: logging.LogRecord) -> None:
        # A decision record reaches this handler on both loggers.
        if id(record) not in self._seen:
            self._seen.add(id(record))
            self.records.append(record)

    def problems(self) -> list[str]:
        return [f"{r.name} {r.levelname}: {r.getMessage()[:300]}" for r in self.records
                if r.exc_info or r.levelno >= logging.ERROR]


@contextlib.contextmanager
def captured_logs() -> Iterator[Capture]:
    capture = Capture()
    loggers = [logging.getLogger(name) for name in SLUICE_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(capture)
        logger.setLevel(logging.DEBUG)
    try:
        yield capture
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(capture)
            logger.setLevel(level)


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


class Sluice:
    """A fresh Sluice on a fake clock, called in process like uvicorn would."""

    def __init__(self, rules_file: Path, token: bytes | None = ADMIN_TOKEN) -> None:
        # Compiled once: a ruleset holds no counting state (the store does).
        self.engine = Engine(compiled(RULES), clock=FakeClock())
        self.admin = Admin(self.engine, str(rules_file), token, loopback_listener=token is None)
        self.app = SluiceApp(self.engine, admin=self.admin)
        self.datagrams = HookDatagrams(self.engine)

    def call(self, path: str, headers: list[tuple[bytes, bytes]] = (), method: str = "GET",
             body: list[bytes] | None = None, query: bytes = b"", raw_path: bytes | None = None,
             client: tuple[str, int] | None = ("127.0.0.1", 5000)) -> Response:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                 "method": method, "path": path, "query_string": query, "root_path": "",
                 "raw_path": raw_path if raw_path is not None else path.encode("latin-1", "replace"),
                 "client": client, "server": ("127.0.0.1", 8181), "headers": list(headers)}
        chunks = list(body or [b""])

        async def exchange() -> list[dict]:
            sent: list[dict] = []
            forever = asyncio.Event()

            async def receive() -> dict:
                if chunks:
                    chunk = chunks.pop(0)
                    return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
                await forever.wait()  # the proxy keeps the connection open
                return {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                sent.append(message)

            await asyncio.wait_for(self.app(scope, receive, send), timeout=5)
            return sent

        sent = asyncio.run(exchange())
        assert sent and sent[0]["type"] == "http.response.start", f"no answer for {path!r}"
        start = sent[0]
        body_out = b"".join(m.get("body", b"") for m in sent[1:] if m["type"] == "http.response.body")
        response = Response(start["status"], {k.decode("latin-1"): v.decode("latin-1")
                                              for k, v in start["headers"]}, body_out)
        return response

    def datagram(self, data: bytes) -> None:
        self.datagrams.datagram_received(data, ("127.0.0.1", 40000))

    def reload(self, text: str) -> None:
        self.engine.reload(compiled(text))


@functools.cache
def compiled(text: str) -> Ruleset:
    return ruleset_from(text)


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fuzz") / "rules.yaml"
    path.write_text(RULES)
    return path


@contextlib.contextmanager
def sluice(rules_file: Path, token: bytes | None = ADMIN_TOKEN) -> Iterator[Sluice]:
    """A fresh Sluice; afterwards: nothing failed inside it, nothing at ERROR,
    no traceback in the log."""
    instance = Sluice(rules_file, token)
    with captured_logs() as capture:
        yield instance
    assert instance.engine.metrics.errors.value == 0, "internal errors counted"
    assert capture.problems() == []


def assert_defined(response: Response, allowed: set[int] | None = None) -> None:
    assert 100 <= response.status <= 599
    if allowed is not None:
        assert response.status in allowed, (response.status, response.body[:200])
    else:
        assert response.status < 500, (response.status, response.body[:200])
    for name, value in response.headers.items():
        # What uvicorn refuses to send (it would answer 500 instead).
        assert not UNSENDABLE.search(value), (name, value)
    length = response.headers.get("content-length")
    if length is not None:
        assert int(length) == len(response.body)


# --------------------------------------------------------------------------
# What arrives
# --------------------------------------------------------------------------

latin1 = st.text(st.characters(min_codepoint=0, max_codepoint=255), max_size=40)
raw_bytes = st.binary(max_size=60)
huge = st.integers(5_000, 70_000).map(lambda n: b"9" * n)
junk_numbers = st.sampled_from([
    "0", "-1", "-0", "+5", " 5", "5_0", "0x1f", "1e400", "1e3", "Infinity", "-Infinity", "NaN", "nan",
    "4294967296", "18446744073709551616", "9" * 30, "9" * 5000, "\u00b2", "\u0663", "\uff15", "",
    "429", "599", "600", "399", "200", "001",
])
addresses = st.one_of(
    st.ip_addresses().map(str),
    st.sampled_from(["::ffff:1.2.3.4", "fe80::1%eth0", "1.2.3.4, junk", " ", "300.1.1.1", "192.0.2.3",
                     "198.51.100.9", "::1", "127.0.0.1", "-", "unix:", "1.2.3.4:80", "[::1]:80"]),
    latin1,
)
rule_ids = st.sampled_from(["blocked", "closer", "chal", "banned", "login", "score", "leaky", "tokens",
                            "watch", "gone", "-", "", "bl\u00f6cked", "a" * 65, "chal\n"])
# The challenge credential cookie is checked for the challenge rule.
cookies = st.one_of(
    latin1,
    st.builds(lambda v: f"sluice_pass_chal={v}", st.one_of(
        latin1, junk_numbers.map(lambda n: f"{n}.sig"),
        st.sampled_from(["99999999999.x", "1.", ".", "9999999999999.abc", "\u00ff.\u00ff"]))),
    st.builds(lambda v: f"s=v{v}; sid={v}", latin1),
)
value_text = st.one_of(latin1, addresses, junk_numbers, cookies)
values = st.one_of(value_text.map(lambda t: t.encode("latin-1", "replace")), raw_bytes, huge)

CHECK_HEADERS = ["x-sluice-client-addr", "x-original-uri", "x-original-method", "x-original-host",
                 "x-forwarded-for", "x-forwarded-method", "x-forwarded-host", "x-forwarded-uri",
                 "x-forwarded-proto", "x-request-id", "host", "cookie", "user-agent", "x-k",
                 "x-sluice-tls-fingerprint", "x-sluice-deny", "x-sluice-pending", "authorization"]
header_names = st.one_of(st.sampled_from(CHECK_HEADERS),
                         raw_bytes.filter(bool).map(bytes.lower))
raw_headers = st.lists(st.tuples(header_names.map(lambda n: n if isinstance(n, bytes) else n.encode()),
                                 values), max_size=10)
uris = st.one_of(
    st.sampled_from(["/b", "/b/x?q=1&q=%FF", "/x", "/c/page", "/ban", "/login", "/s/1", "/l", "/t/a", "/k",
                     "//b/./x", "/%62", "/c/%2e%2e/", "/\u00ff", "*", "", "?", "/b?" + "q=1&" * 50]),
    latin1,
)


def check_headers(uri: str, addr: str, extra: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers each front door sends, then the fuzzed ones."""
    base = {"x-sluice-client-addr": addr, "x-original-uri": uri, "x-original-method": "GET",
            "x-original-host": "shop.example", "x-forwarded-uri": uri, "x-forwarded-host": "shop.example",
            "x-forwarded-method": "POST", "host": "shop.example:10000"}
    return [(k.encode(), v.encode("latin-1", "replace")) for k, v in base.items()] + extra


FRONT_DOORS = {
    # path: the statuses a check may answer with
    "/v1/nginx/auth": {200, 401, 403},
    "/v1/check": {200, 403, 429, 451},
    "/v1/envoy/auth": {200, 403, 429, 451},
}


def check(s: Sluice, door: str, uri: str, addr: str, extra: list[tuple[bytes, bytes]],
          query: bytes = b"", peer: str = "127.0.0.1", method: str = "GET") -> Response:
    if door == "/v1/envoy/auth":
        path = door + (uri.partition("?")[0] if uri.startswith("/") else "/" + uri)
    else:
        path = door
    response = s.call(path, check_headers(uri, addr, extra), method=method, query=query,
                      client=(peer, 4000))
    assert_defined(response, FRONT_DOORS[door])
    return response


def deny_page(s: Sluice, token: bytes | str, extra: list[tuple[bytes, bytes]] = ()) -> Response:
    raw = token if isinstance(token, bytes) else token.encode("latin-1", "replace")
    response = s.call("/v1/nginx/deny", [(b"x-sluice-deny", raw), (b"x-original-host", b"shop.example"),
                                         *extra])
    # A page for the status nginx was told, or the built-in 429 for a bad
    # token: a 5xx only when the token itself says so.
    assert 400 <= response.status <= 599
    if response.status >= 500:
        assert raw.split(b" ")[0] == str(response.status).encode()
    assert response.headers["content-type"].startswith("text/html")
    assert int(response.headers["retry-after"]) >= 0
    assert response.body.startswith(b"<")
    return response


def token_of(response: Response) -> str | None:
    return response.headers.get("x-sluice-deny")


# --------------------------------------------------------------------------
# Check endpoints (nginx, forward-auth, Envoy) and the tokens they give
# --------------------------------------------------------------------------


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(door=st.sampled_from(sorted(FRONT_DOORS)), uri=uris, addr=addresses, extra=raw_headers,
       query=raw_bytes, peer=addresses, method=st.sampled_from(["GET", "POST", "DELETE", "G\u00c9T"]),
       repeats=st.integers(1, 4), reload_before_page=st.booleans())
def test_check_endpoints_answer_any_request(rules_file, door, uri, addr, extra, query, peer, method,
                                            repeats, reload_before_page):
    with sluice(rules_file) as s:
        for _ in range(repeats):
            response = check(s, door, uri, addr, extra, query, peer, method)
        token = token_of(response)
        if token is not None:
            # nginx asks for the page next; the rules may have been reloaded.
            if reload_before_page:
                s.reload(RELOADED)
            deny_page(s, token)
        pending = response.headers.get("x-sluice-pending")
        if pending is not None:
            hook = s.call("/v1/hook", [(b"x-sluice-pending", pending.encode()), (b"x-sluice-status", b"401"),
                                       (b"x-sluice-response-x-score", b"50")], method="POST")
            assert_defined(hook, {204})


def test_reloaded_rules_differ_where_the_stale_tokens_need_it():
    """The fuzzing above relies on RELOADED swapping block and challenge."""
    before, after = ruleset_from(RULES).by_id, ruleset_from(RELOADED).by_id
    assert before["blocked"].challenge is None and after["blocked"].challenge is not None
    assert before["chal"].challenge is not None and after["chal"].challenge is None
    assert "closer" not in after


# --------------------------------------------------------------------------
# The deny endpoint: any token
# --------------------------------------------------------------------------

token_fields = st.one_of(junk_numbers, rule_ids, addresses, latin1,
                         st.sampled_from(["4", "24", "abc.def", "a" * 3000 + ".b", "\u00e9.\u00e9"]))
structured_tokens = st.builds(
    lambda status, numbers, rule_id, client, more: " ".join([status, *numbers, rule_id, client, *more]),
    st.one_of(st.sampled_from(["429", "451", "403", "503", "400", "599"]), junk_numbers),
    st.lists(st.one_of(st.sampled_from(["1", "10", "0"]), junk_numbers), min_size=3, max_size=3),
    rule_ids, st.one_of(st.sampled_from(["1.2.3.4", "-", "2001:db8::1"]), addresses),
    st.lists(token_fields, max_size=3))
any_token = st.one_of(structured_tokens.map(lambda t: t.encode("latin-1", "replace")), raw_bytes, huge,
                      st.lists(token_fields, max_size=12).map(" ".join).map(lambda t: t.encode("latin-1",
                                                                                                 "replace")))


@settings(max_examples=200, deadline=None)
@given(token=any_token, reload=st.booleans(), extra=raw_headers)
def test_deny_endpoint_answers_a_page_for_any_token(rules_file, token, reload, extra):
    with sluice(rules_file) as s:
        if reload:
            s.reload(RELOADED)
        deny_page(s, token, extra)


@pytest.mark.parametrize("token", [
    "429 1 10 5 chal 1.2.3.4",  # D4: a challenge rule's token without the challenge
    "403 1 10 5 blocked 1.2.3.4 1 abc.def",  # a block rule's token with one
    "429 1 10 5 gone 1.2.3.4 1 abc.def",
    "429 -1 -10 -5 blocked 1.2.3.4",
    "429 " + "9" * 400 + " 1 1 blocked 1.2.3.4",
    "429 1 1 1 blocked 1.2.3.4 " + "9" * 5000 + " abc.def",
    "429 1 1 1 blocked 1.2.3.4 -3 abc.def",
    "\u0664\u0662\u0669 1 1 1 blocked -",
    "429 1 1 1 bl\u00f6cked -",
    "429 1 1 1 blocked <script>",
    "429 \u00b2 1 1 blocked -",
    "429 1 1 1 blocked 1.2.3.4 1 <script>.x",
    "429 1 10 5 chal 1.2.3.4 ",
    "",
])
def test_malformed_or_stale_tokens_get_a_refusal_page(rules_file, token):
    with sluice(rules_file) as s:
        response = deny_page(s, token)
        assert response.status in (403, 429)
        assert b"<script>" not in response.body


def test_challenge_token_made_stale_by_a_reload_gets_the_built_in_page(rules_file):
    """D4: a reload turns a block rule into a challenge rule between nginx's
    check and its page call; the page is the built-in one, not a 500."""
    with sluice(rules_file) as s:
        for _ in range(3):
            response = check(s, "/v1/nginx/auth", "/b", "203.0.113.5", [])
        token = token_of(response)
        assert token is not None and token.split(" ")[:5] == ["451", "2", "10", "10", "blocked"]
        s.reload(RELOADED)  # "blocked" now challenges
        page = deny_page(s, token)
        assert page.status == 451 and b"451" in page.body and b"data-challenge" not in page.body
        # The other way round: a challenge token whose rule now blocks.
        s.reload(RULES)
        for _ in range(2):
            response = check(s, "/v1/nginx/auth", "/c", "203.0.113.6", [])
        token = token_of(response)
        assert token is not None and len(token.split(" ")) == 8
        assert b"data-challenge" in deny_page(s, token).body
        s.reload(RELOADED)
        page = deny_page(s, token)
        assert page.status == 403 and b"data-challenge" not in page.body


# --------------------------------------------------------------------------
# The challenge solution form
# --------------------------------------------------------------------------


def issued_challenge(s: Sluice, addr: str) -> str:
    for _ in range(2):
        response = check(s, "/v1/nginx/auth", "/c/page?x=1", addr, [])
    token = token_of(response)
    assert token is not None
    return token.split(" ")[7]


form_values = st.one_of(latin1, junk_numbers, huge.map(lambda b: b.decode()))
bodies = st.one_of(
    raw_bytes, huge, st.binary(min_size=8000, max_size=8400),
    st.dictionaries(st.sampled_from(["challenge", "nonce", "x"]), form_values, max_size=3)
    .map(lambda d: urlencode(d).encode()),
    st.sampled_from([b"challenge=%FF%FE&nonce=%00", b"challenge=\xff\xfe&nonce=\x80", b"&&&&==&=",
                     b"nonce=" + b"9" * 30, b"challenge=a.b&nonce=1&challenge=c.d"]),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, method=st.sampled_from(["POST", "GET", "PUT"]), mode=st.sampled_from(
    ["fuzzed", "genuine-challenge", "solved", "other-client"]), chunks=st.integers(1, 4),
       extra=raw_headers, addr=addresses)
def test_challenge_endpoint_answers_any_solution(rules_file, body, method, mode, chunks, extra, addr):
    with sluice(rules_file) as s:
        client = [(b"x-sluice-client-addr", b"203.0.113.9")]
        if mode != "fuzzed":
            challenge = issued_challenge(s, "203.0.113.9")
            nonce = solve(challenge, 1) if mode == "solved" else \
                next(str(n) for n in range(64) if not solves(challenge, str(n), 1))
            body = urlencode({"challenge": challenge, "nonce": nonce}).encode() + b"&" + body[:100]
            if mode == "other-client":
                client = [(b"x-sluice-client-addr", addr.encode("latin-1", "replace"))]
        size = max(1, len(body) // chunks)
        parts = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
        response = s.call("/v1/challenge", client + extra, method=method, body=parts)
        assert_defined(response, {303, 403})
        if response.status == 303:
            # Only a genuine, solved challenge passes; then its cookie does.
            assert mode in ("solved", "other-client") and method == "POST"
            cookie = response.headers["set-cookie"].split(";")[0]
            passed = check(s, "/v1/nginx/auth", "/c/page", "203.0.113.9",
                           [(b"cookie", cookie.encode())])
            assert passed.status == 200


# --------------------------------------------------------------------------
# Response reports: HTTP hook and UDP datagrams
# --------------------------------------------------------------------------


def pending_token(s: Sluice, path: str = "/login") -> str:
    response = check(s, "/v1/nginx/auth", path, "203.0.113.20", [])
    token = response.headers.get("x-sluice-pending")
    assert token is not None
    return token


def metrics_fine(s: Sluice) -> None:
    text = s.call("/metrics")
    assert_defined(text, {200})
    assert b"sluice_internal_errors_total 0.0" in text.body


report_headers = st.lists(st.tuples(
    st.one_of(st.sampled_from(["x-sluice-status", "x-sluice-pending", "x-sluice-response-x-score",
                               "x-sluice-response-x-mark", "x-sluice-response-"]),
              latin1.map(lambda n: "x-sluice-response-" + n)).map(lambda n: n.encode("latin-1")),
    st.one_of(values, st.sampled_from([b"high", b"401", b"403", b"200", b"1000000", b"1000001"]))),
    max_size=10)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers=report_headers, genuine=st.booleans(), status=st.one_of(junk_numbers, st.integers(0, 999)
                                                                       .map(str)),
       many=st.booleans(), method=st.sampled_from(["POST", "GET"]), token_path=st.sampled_from(["/login", "/k"]))
def test_http_hook_answers_any_report(rules_file, headers, genuine, status, many, method, token_path):
    with sluice(rules_file) as s:
        sent = list(headers)
        if genuine:
            # A token of pending counts, or of a concurrency slot.
            sent = [(b"x-sluice-pending", pending_token(s, token_path).encode()),
                    (b"x-sluice-status", status.encode("latin-1", "replace"))] + sent
        if many:
            sent += [(f"x-sluice-response-h{i}".encode(), b"v") for i in range(100)]
        response = s.call("/v1/hook", sent, method=method)
        assert_defined(response, {204})


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), latin1,
                         st.text(max_size=20), huge.map(lambda b: b.decode()))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
statuses = st.one_of(json_values, st.sampled_from([401, 403, "401", " 401", "4O1", 401.0, 1e400, -401,
                                                   True, 10 ** 30, "9" * 5000]))


def nested(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "[" else ('{"a":' * depth + "1" + "}" * depth)


raw_json_values = st.one_of(
    json_values.map(lambda v: json.dumps(v)),
    st.sampled_from(["Infinity", "-Infinity", "NaN", "1e400", "-1e400", "1" + "0" * 4000, "4.01e2",
                     "401", '"401"', "[401]", '{"x":401}', "null", "true"]),
    st.builds(nested, st.integers(50, 6000), st.sampled_from(["[", "{"])),
)


def datagram(token: str, status: str, headers: str, prefix: bytes, tail: bytes) -> bytes:
    line = f'{{"token":{token},"status":{status},"headers":{headers}}}'
    return prefix + line.encode("utf-8", "surrogatepass") + tail


prefixes = st.sampled_from([b"<190>Nov 30 04:53:59 sluice: ", b"<190>sluice: ", b"", b"{", b"<190>\xff\xfe: "])
tails = st.one_of(st.just(b""), raw_bytes, st.sampled_from([b"\xff", b"\n", b"}", b"\x00"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), prefix=prefixes, tail=tails, genuine=st.booleans(),
       token_path=st.sampled_from(["/login", "/k"]))
def test_udp_report_datagrams_are_counted_or_refused(rules_file, data, prefix, tail, genuine, token_path):
    with sluice(rules_file) as s:
        token = json.dumps(pending_token(s, token_path)) if genuine else data.draw(raw_json_values, "token")
        status = data.draw(st.one_of(statuses.map(lambda v: json.dumps(v, allow_nan=True)), raw_json_values),
                           "status")
        headers = data.draw(st.one_of(
            raw_json_values,
            st.dictionaries(st.sampled_from(["x-score", "x-mark", "X-Score"]) | st.text(max_size=8),
                            json_values, max_size=4).map(json.dumps)), "headers")
        before = s.engine.metrics.reports.value + s.engine.metrics.reports_refused.value
        s.datagram(datagram(token, status, headers, prefix, tail))
        # Every datagram is either a report or a refused one, counted once.
        assert s.engine.metrics.reports.value + s.engine.metrics.reports_refused.value == before + 1
        if data.draw(st.booleans(), "raw"):
            s.datagram(data.draw(st.one_of(raw_bytes, huge, st.binary(min_size=1000, max_size=5000)), "raw"))


@pytest.mark.parametrize("payload", [
    b'{"token":"x","status":Infinity}',
    b'{"token":"x","status":-Infinity}',
    b'{"token":"x","status":NaN}',
    b'{"token":"x","status":1e400}',
    b'{"token":"x","status":401,"headers":{"x-score":1e400}}',
    b'{"token":' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"token":"x","status":401,"headers":' + b'{"a":' * 5000 + b"1" + b"}" * 5001,
    b'{"token":"x","status":1' + b"0" * 5000 + b"}",
    b'{"token":"x","status":401,"headers":{"x-score":{"a":"b"}}}',
    b'{"token":"x","status":401,"headers":["x-score"]}',
    b'{"token":"x","status":401.0}',
    b'{"token":"x","status":true}',
    b'{"token":"x","status":"+401"}',
    b'{"token":"\xff\xfe","status":401}',
    b'{"token":"x","status":401,"pad":"' + b"a" * 70_000 + b'"}',
])
def test_bad_report_datagrams_are_refused_without_a_traceback(rules_file, payload):
    """D5: counted as refused, not as internal errors; no traceback."""
    with sluice(rules_file) as s:
        s.datagram(b"<190>Nov 30 04:53:59 sluice: " + payload)
        assert s.engine.metrics.reports_refused.value == 1
        assert s.engine.metrics.reports.value == 0


# --------------------------------------------------------------------------
# FastAPI routes: health, metrics, admin
# --------------------------------------------------------------------------

ADMIN_PATHS = ["/v1/admin/rules", "/v1/admin/bans", "/v1/admin/tiers", "/v1/admin/reload", "/v1/admin/", "/v1/admin",
               "/healthz", "/readyz", "/metrics", "/", "/v1/nginx", "/v1/envoy/authx", "/v1/hooks"]
authorizations = st.one_of(
    st.none(), values,
    st.sampled_from([b"Bearer " + ADMIN_TOKEN, b"bearer  " + ADMIN_TOKEN + b" ", b"Bearer",
                     b"Basic " + ADMIN_TOKEN, b"Bearer " + ADMIN_TOKEN + b"\xff", b"Bearer \xe9"]),
)
admin_queries = st.one_of(
    raw_bytes,
    st.builds(lambda v: b"address=" + v, st.one_of(values, st.sampled_from(
        [b"192.0.2.1", b"2001:db8::/64", b"%FF", b"%00", b"::ffff:1.2.3.4"]))),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.one_of(st.sampled_from(ADMIN_PATHS), latin1.map(lambda p: "/v1/admin/" + p)),
       method=st.sampled_from(["GET", "POST", "DELETE", "PUT", "HEAD"]), authorization=authorizations,
       query=admin_queries, extra=raw_headers, token=st.sampled_from([ADMIN_TOKEN, None]),
       peer=st.one_of(st.none(), addresses), banned_first=st.booleans(),
       body=st.one_of(raw_bytes, huge, st.builds(
           lambda identity, tier: json.dumps({"identity": identity, "tier": tier}).encode(),
           st.one_of(st.text(max_size=300), st.integers(), st.none()),
           st.one_of(st.sampled_from(["free", "pro", "gold", ""]), st.text(max_size=40), st.none()))))
def test_admin_and_api_routes_answer_any_call(rules_file, path, method, authorization, query, extra, token,
                                              peer, banned_first, body):
    with sluice(rules_file, token) as s:
        if banned_first:  # so there is a ban to list and lift
            for _ in range(2):
                check(s, "/v1/nginx/auth", "/ban", "192.0.2.200", [])
        headers = list(extra) + ([(b"authorization", authorization)] if authorization is not None else [])
        response = s.call(path, headers, method=method, query=query, body=[body],
                          client=(peer, 5000) if peer is not None else None)
        assert_defined(response)
        metrics_fine(s)
