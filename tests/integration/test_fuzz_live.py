"""Fuzzing a real `sluice serve`: raw bytes on its HTTP port and its UDP
report port (loopback only, a bounded number of cases).

Whatever arrives, Sluice (uvicorn with httptools) answers without a 5xx of
its own, counts no internal error, and its log holds no traceback. Every
datagram is counted exactly once, as a report or as a refused one.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.conftest import free_port, wait_until
from tests.processes import stop_process

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

RULES = """
headers: draft
challenge: {difficulty: 1}
client_ip: {trusted_proxies: [127.0.0.0/8]}
rules:
  - id: blocked
    match: {path: {prefix: /b}}
    key: [ip, "header:x-k", "cookie:s", "query:q"]
    limit: {requests: 2, per: 1h}
    action: block
    block: {status: 451, body: "<p>${{remote_addr}} at ${{http_host}} (${{request_id}})</p>"}
  - id: closer
    match: {path: {prefix: /x}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
    block: {close: true}
  - id: chal
    match: {path: {prefix: /c}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: challenge
  - id: login
    match: {path: {prefix: /login}}
    key: [ip]
    limit: {requests: 1000, per: 1h}
    count_on: {status: [401]}
    action: block
  - id: score
    match: {path: {prefix: /login}}
    key: [ip]
    limit: {score: 1000000, per: 1h, header: x-score}
    action: block
  - id: leaky
    match: {path: {prefix: /l}}
    key: [ip]
    limit: {rate: 1000r/s, burst: 3}
    action: block
  - id: tokens
    match: {path: {prefix: /t}}
    key: [ip, path]
    limit: {tokens: 2, refill: 1/s}
    action: block
"""

ADMIN_TOKEN = "live-fuzzing-admin-token-42"
TIMEOUT = 5.0


class LiveSluice:
    """`sluice serve` in a process of its own, its output in a log file."""

    def __init__(self, run_dir: Path) -> None:
        self.port = free_port()
        self.hook_port = free_port(socket.SOCK_DGRAM)
        rules = run_dir / "rules.yaml"
        rules.write_text(RULES)
        token_file = run_dir / "admin-token"
        token_file.write_text(ADMIN_TOKEN)
        self.log_path = run_dir / "sluice.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "sidecar", "serve", "--config", str(rules), "--host", "127.0.0.1",
                 "--port", str(self.port), "--hook-udp", f"127.0.0.1:{self.hook_port}",
                 "--admin-token-file", str(token_file), "--log-level", "info"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.statuses: list[tuple[int, bytes]] = []
        self.datagrams = 0
        try:
            wait_until(self.up, "sluice answers /healthz", 15)
        except BaseException:
            self.stop()
            raise

    def up(self) -> bool:
        if self.process.poll() is not None:
            pytest.fail(f"sluice exited: {self.log()[-2000:]}")
        try:
            return self.request(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")[0] == 200
        except OSError:
            return False

    def stop(self) -> None:
        stop_process(self.process)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, raw: bytes) -> tuple[int | None, bytes]:
        """Send raw bytes; (status or None when closed unanswered, response)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT) as connection:
            try:
                connection.sendall(raw)
            except (BrokenPipeError, ConnectionResetError):  # refused before the end
                pass
            chunks = []
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline:
                try:
                    chunk = connection.recv(65536)
                except (TimeoutError, ConnectionResetError):
                    break
                if not chunk:
                    break
                chunks.append(chunk)
        response = b"".join(chunks)
        found = re.match(rb"HTTP/1\.[01] (\d{3}) ", response)
        return (int(found.group(1)) if found else None), response

    def call(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
             body: bytes = b"") -> tuple[int | None, bytes]:
        head = [method + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1"]
        head += [name + b": " + value for name, value in headers]
        if body:
            head.append(b"Content-Length: " + str(len(body)).encode())
        head.append(b"Connection: close")
        status, response = self.request(b"\r\n".join(head) + b"\r\n\r\n" + body)
        if status is not None:
            self.statuses.append((status, target))
        return status, response

    def metric(self, name: str) -> float:
        status, response = self.call(b"GET", b"/metrics", [])
        assert status == 200
        found = re.search(rb"^" + re.escape(name.encode()) + rb" (\S+)$", response, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    def reports_seen(self) -> float:
        return self.metric("sluice_responses_reported_total") + self.metric("sluice_responses_refused_total")

    def datagram(self, data: bytes) -> None:
        """Send one report datagram and wait until Sluice has counted it."""
        before = self.reports_seen()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            sender.sendto(data, ("127.0.0.1", self.hook_port))
        self.datagrams += 1
        wait_until(lambda: self.reports_seen() >= before + 1, "the datagram is counted", TIMEOUT)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveSluice]:
    server = LiveSluice(tmp_path_factory.mktemp("fuzz-live"))
    yield server
    server.stop()
    # After everything the module sent: nothing failed inside Sluice.
    assert_clean_log(server.log())


ERROR_LINE = re.compile(r"^(ERROR:|\S+ \S+ ERROR |CRITICAL)", re.MULTILINE)


def assert_clean_log(log: str) -> None:
    """No traceback and nothing at ERROR, in Sluice's or uvicorn's format."""
    assert "Traceback" not in log, log[-4000:]
    assert ERROR_LINE.search(log) is None, log[-4000:]


# --------------------------------------------------------------------------
# What is sent
# --------------------------------------------------------------------------

# Bytes a client may put in a header value (the HTTP parser refuses control
# characters with a 400 before Sluice sees them: some cases try that too).
value_bytes = st.binary(max_size=60).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7f or c == 9))
values = st.one_of(
    value_bytes, value_bytes,
    st.sampled_from([b"1.2.3.4", b"::1", b"fe80::1%eth0", b"300.1.1.1", b"127.0.0.1, 203.0.113.5",
                     b"-1", b"1e400", b"Infinity", b"9" * 5000, b"\xff\xfe", b"\xc3\xa9", b"sluice_pass_chal=1.x",
                     b"429 1 10 5 chal 1.2.3.4", b"403 1 1 1 chal 1.2.3.4 1 a.b", b"451 -1 -1 -1 blocked -",
                     b"401", b"200", b"999"]),
    st.sampled_from([b"\x01", b"a\r\nx-evil: 1", b"\x7f"]),
    st.integers(4_000, 12_000).map(lambda n: b"a" * n),
)
header_names = st.one_of(st.sampled_from([
    b"X-Sluice-Client-Addr", b"X-Original-URI", b"X-Original-Method", b"X-Original-Host", b"X-Forwarded-For",
    b"X-Forwarded-Uri", b"X-Forwarded-Host", b"X-Forwarded-Proto", b"X-Request-Id", b"Cookie", b"X-K",
    b"X-Sluice-Deny", b"X-Sluice-Pending", b"X-Sluice-Status", b"X-Sluice-Response-X-Score",
    b"Authorization", b"X-Sluice-Tls-Fingerprint", b"Transfer-Encoding", b"Expect"]),
    st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).map(str.encode),
)
headers = st.lists(st.tuples(header_names, values), max_size=8)
ENDPOINTS = st.sampled_from([b"/v1/nginx/auth", b"/v1/check", b"/v1/envoy/auth", b"/v1/envoy/auth/b/x?q=1",
                     b"/v1/envoy/auth/c/%ff%00", b"/v1/envoy/auth/l", b"/v1/nginx/deny", b"/v1/challenge",
                     b"/v1/hook", b"/healthz", b"/readyz", b"/metrics", b"/v1/admin/rules",
                     b"/v1/admin/bans", b"/v1/admin/bans?address=%ff", b"/v1/admin/reload",
                     b"/v1/admin/bans?address=" + b"9" * 3000, b"*", b"//", b"/v1/nginx/auth?%%"])
# Mostly Sluice's endpoints, sometimes anything.
targets = st.one_of(
    ENDPOINTS, ENDPOINTS, ENDPOINTS, ENDPOINTS,
    st.text(max_size=30).map(lambda t: b"/" + quote(t).encode()),
    st.binary(max_size=20).map(lambda b: b"/v1/envoy/auth/" + quote(b).encode()),
    st.binary(max_size=20).map(lambda b: b"/v1/envoy/auth/" + b.replace(b" ", b"")),  # mostly a 400
)
methods = st.one_of(st.sampled_from([b"GET", b"POST"]), st.sampled_from([b"GET", b"POST", b"DELETE", b"HEAD",
                                                                    b"PUT", b"OPTIONS", b"G\xc3\x89T"]))
bodies = st.one_of(st.just(b""), st.binary(max_size=200), st.integers(8_000, 9_000).map(lambda n: b"a=" * n),
                   st.sampled_from([b"challenge=%ff&nonce=%00", b"challenge=a.b&nonce=" + b"9" * 40]))


def assert_no_5xx_of_its_own(status: int | None, target: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    if status is None or status < 500:
        return
    # The deny endpoint answers with the status its token names: a token
    # asking for 503 gets a 503 page. Anything else is Sluice failing.
    tokens = [value for name, value in headers if name.lower() == b"x-sluice-deny"]
    assert target.startswith(b"/v1/nginx/deny") and len(tokens) == 1 and \
        tokens[0].strip().split(b" ")[0] == str(status).encode(), (status, target, headers)


# --------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------


# What a front door sends for a check, so that the rules above are reached.
front_door_headers = st.lists(st.tuples(
    st.sampled_from([b"X-Sluice-Client-Addr", b"X-Original-URI", b"X-Forwarded-Uri", b"X-Original-Method"]),
    st.sampled_from([b"203.0.113.1", b"203.0.113.2", b"2001:db8::1", b"/b/1?q=2", b"/x", b"/c/page", b"/login",
                     b"/l", b"/t/a", b"POST"])), max_size=4) | st.lists(st.tuples(
    st.just(b"X-Sluice-Deny"),
    st.sampled_from([b"429 1 10 5 chal 1.2.3.4", b"403 1 1 1 chal 1.2.3.4 1 a.b", b"451 2 3600 3600 blocked -",
                     b"451 -1 -1 -1 blocked -", b"429 1 1 1 gone ::1 4 x.y", b"503 0 0 1 - -",
                     b"429 99999999999999999999999 1 1 blocked -",
                     b"429 1 1 1 blocked 1.2.3.4 " + b"9" * 5000 + b" a.b"])
    | value_bytes), min_size=1, max_size=1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(method=methods, target=targets, base=front_door_headers, sent=headers, body=bodies, admin=st.booleans())
def test_raw_http_requests_get_a_defined_answer(live, method, target, base, sent, body, admin):
    sent = base + sent
    if admin:
        sent = [(b"Authorization", b"Bearer " + ADMIN_TOKEN.encode()), *sent]
    status, response = live.call(method, target, sent, body)
    assert_no_5xx_of_its_own(status, target, sent)


def test_deny_tokens_of_a_real_check_get_their_page(live):
    headers = [(b"X-Sluice-Client-Addr", b"203.0.113.77"), (b"X-Original-URI", b"/c/page")]
    for _ in range(2):
        status, response = live.call(b"GET", b"/v1/nginx/auth", headers)
    assert status == 403
    token = re.search(rb"(?im)^x-sluice-deny: (.*?)\r$", response).group(1)
    assert len(token.split(b" ")) == 8
    status, page = live.call(b"GET", b"/v1/nginx/deny", [(b"X-Sluice-Deny", token)])
    assert status == 403 and b"data-challenge" in page
    # D4: the same rule's token without its challenge fields.
    status, page = live.call(b"GET", b"/v1/nginx/deny", [(b"X-Sluice-Deny", b" ".join(token.split(b" ")[:6]))])
    assert status == 403 and b"data-challenge" not in page
    # A reload between nginx's check and its page call: the challenge rule
    # now blocks, the block rule challenges.
    rules = live.log_path.parent / "rules.yaml"
    swapped = RULES.replace("    action: challenge\n", "    action: block\n    block: {status: 429}\n").replace(
        '    action: block\n    block: {status: 451, body: "<p>${{remote_addr}} at ${{http_host}} (${{request_id}})'
        '</p>"}\n', "    action: challenge\n")
    assert swapped.count("action: challenge") == 1 and "status: 451" not in swapped
    block_token = b"451 2 3600 3600 blocked 203.0.113.77"
    try:
        rules.write_text(swapped)
        assert live.call(b"POST", b"/v1/admin/reload",
                         [(b"Authorization", b"Bearer " + ADMIN_TOKEN.encode())])[0] == 200
        for stale, expected in ((token, 403), (block_token, 451)):
            status, page = live.call(b"GET", b"/v1/nginx/deny", [(b"X-Sluice-Deny", stale)])
            assert status == expected and b"data-challenge" not in page
    finally:
        rules.write_text(RULES)
        assert live.call(b"POST", b"/v1/admin/reload",
                         [(b"Authorization", b"Bearer " + ADMIN_TOKEN.encode())])[0] == 200


# --------------------------------------------------------------------------
# UDP reports
# --------------------------------------------------------------------------


def pending_token(live: LiveSluice) -> str:
    status, response = live.call(b"GET", b"/v1/nginx/auth", [(b"X-Sluice-Client-Addr", b"203.0.113.88"),
                                                             (b"X-Original-URI", b"/login")])
    assert status == 200
    return re.search(rb"(?im)^x-sluice-pending: (.*?)\r$", response).group(1).decode()


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
raw_values = st.one_of(
    json_values.map(json.dumps),
    st.sampled_from(["Infinity", "-Infinity", "NaN", "1e400", "1" + "0" * 4500, "401", '"401"', "401.0",
                     '{"x-score":1e400}', '{"x-score":{"a":1}}', '{"x-score":"5"}', "[]"]),
    st.builds(lambda depth, kind: kind * depth + {"[": "]", "{": "}"}[kind] * depth,
              st.integers(10, 6000), st.sampled_from(["[", "{"])),
)
prefixes = st.sampled_from([b"<190>Nov 30 04:53:59 sluice: ", b"<190>sluice: ", b"", b"\xff"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data(), prefix=prefixes, genuine=st.booleans(), raw=st.booleans())
def test_raw_report_datagrams_are_counted_or_refused(live, data, prefix, genuine, raw):
    if raw:
        payload = data.draw(st.one_of(st.binary(max_size=300), st.integers(20_000, 65_000).map(lambda n: b"{" * n)))
    else:
        token = json.dumps(pending_token(live)) if genuine else data.draw(raw_values)
        status = data.draw(st.one_of(st.sampled_from(["401", '"401"', "200", '"500"']), raw_values))
        headers = data.draw(st.one_of(st.sampled_from(['{"x-score":"7"}', '{"x-score":""}', "{}"]), raw_values))
        line = f'{{"token":{token},"status":{status},"headers":{headers}}}'
        payload = line.encode("utf-8", "surrogatepass")
    live.datagram(prefix + payload)


def test_nothing_failed_inside_sluice(live):
    """Runs after the fuzzing above (tests run in file order)."""
    if not live.statuses:  # this test alone: send one of each
        live.call(b"GET", b"/v1/nginx/deny", [(b"X-Sluice-Deny", b"429 1 10 5 chal 1.2.3.4")])
        live.datagram(b'<190>sluice: {"token":"x","status":Infinity}')
    assert live.metric("sluice_internal_errors_total") == 0
    assert live.metric("sluice_responses_refused_total") >= 1
    assert_clean_log(live.log())
    assert live.process.poll() is None
