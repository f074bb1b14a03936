"""Sluice's request head limits (sidecar/server.py) against what the proxies forward.

Sluice answers 431 to a request head over --max-header-bytes or with more than
--max-headers fields, before it has buffered the head. The limits must stay
above anything nginx or Envoy (as the shipped templates configure them) pass
on in a check request: through nginx a 431 would let the request in
unchecked (auth_request fails open), through Envoy it would deny a
legitimate client. So: the largest request each door accepts, in several
shapes, still gets Sluice's decision, and the next larger one is refused by
the door itself.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devstack.launcher import ENVOY_ADMIN_HOST, FRONT_DOORS, Stack
from sidecar.server import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS
from tests.integration.clients import LOOPBACK
from tests.integration.conftest import fresh_client_address, front_door_port, start_stack

pytestmark = pytest.mark.integration

# Every client's first request is allowed, every later one refused (429) by
# Sluice: a 429 says Sluice read the request and decided.
RULES = """
rules:
  - id: everyone
    match: {path: {prefix: /}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
"""

CONNECTION_FAILED = (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("header-limits")
    rules = run_dir / "rules.yaml"
    rules.write_text(RULES)
    running = start_stack(run_dir / "stack", rules)
    yield running
    running.stop()


def exchange(port: int, source: str, head: bytes) -> tuple[int, bytes]:
    """Send one raw request head on a new connection; the status (0 when the
    server reset the connection instead of answering) and the body."""
    with socket.create_connection((LOOPBACK, port), timeout=10, source_address=(source, 0)) as connection:
        try:
            connection.sendall(head)
            response = http.client.HTTPResponse(connection)
            response.begin()
            return response.status, response.read()
        except CONNECTION_FAILED:
            return 0, b""


def request_head(path: str = "/limits", fields: tuple[str, ...] | list[str] = ()) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: limits.test", *fields]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# Request shapes, each growing with n, each up to past what either door takes.
SHAPES: dict[str, tuple[Callable[[int], bytes], int, int]] = {
    "one long header field": (lambda n: request_head(fields=[f"X-Long: {'a' * n}"]), 1, 150_000),
    "many header fields": (lambda n: request_head(fields=[f"a{i}:" for i in range(n)]), 1, 20_000),
    "long path": (lambda n: request_head(path="/limits/" + "p" * n), 1, 150_000),
    "many 1000-byte fields": (lambda n: request_head(fields=[f"h{i}: {'b' * 1000}" for i in range(n)]), 1, 150),
}


def envoy_authz_calls(stack: Stack, front_door: str) -> int:
    """How many check requests the Envoy of ``front_door`` ("envoy",
    "envoy-grpc") has made with ext_authz, whatever their outcome."""
    admin = stack.ports.envoy_grpc_admin if front_door == "envoy-grpc" else stack.ports.envoy_admin
    url = f"http://{ENVOY_ADMIN_HOST}:{admin}/stats?format=json&filter=front_door.ext_authz"
    with urllib.request.urlopen(url, timeout=5) as response:
        stats = json.load(response)["stats"]
    return sum(int(stat.get("value", 0)) for stat in stats
               if stat.get("name", "").rsplit(".", 1)[-1] in ("ok", "denied", "error", "failure_mode_allowed"))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("front_door", FRONT_DOORS)
def test_the_largest_request_a_door_accepts_gets_sluices_decision(stack: Stack, front_door: str,
                                                                  shape: str) -> None:
    port, source = front_door_port(stack, front_door), fresh_client_address()
    build, smallest, too_large = SHAPES[shape]
    assert exchange(port, source, request_head())[0] == 200  # the client's one allowed request

    def decided(n: int) -> bool:
        return exchange(port, source, build(n))[0] == 429

    assert decided(smallest)
    assert not decided(too_large)
    while too_large - smallest > 1:  # the largest n still decided
        middle = (smallest + too_large) // 2
        if decided(middle):
            smallest = middle
        else:
            too_large = middle

    # One more and the door refuses it by itself, without asking Sluice: the
    # limit found is the door's, not Sluice's 431 (which nginx would turn
    # into an unchecked 200, and Envoy into a refusal after a check).
    if front_door == "nginx":
        status, _ = exchange(port, source, build(too_large))
        assert status in (400, 414, 0), (smallest, status)
    else:
        calls = envoy_authz_calls(stack, front_door)
        assert calls > 0
        status, _ = exchange(port, source, build(too_large))
        assert status in (431, 0), (smallest, status)
        assert envoy_authz_calls(stack, front_door) == calls, f"Sluice was asked about n={too_large}"


def nginx_check_head(client: str, fields: list[str], uri: str = "/limits") -> bytes:
    """The check subrequest sluice.conf.template makes nginx send."""
    return request_head("/v1/nginx/auth", [
        *fields, f"X-Sluice-Client-Addr: {client}", "X-Original-Method: GET", f"X-Original-URI: {uri}",
        "X-Original-Host: limits.test", "X-Request-Id: 0123456789abcdef0123456789abcdef",
        "X-Sluice-Tls-Fingerprint: ",
    ])


def test_sluice_decides_what_an_nginx_without_max_headers_forwards(stack: Stack) -> None:
    # nginx before 1.29.8 (the nginx:1.27 image) limits only the bytes of
    # the head, 4 x 8k: 11,253 three-byte lines "a:<LF>", which it forwards
    # as "a: <CR><LF>" (measured). The installed nginx may count lines, so
    # this check request is sent as nginx would have sent it.
    client = fresh_client_address()
    head = nginx_check_head(client, ["a: "] * 11_253)
    assert len(head) > 56_000
    assert exchange(stack.ports.sluice, LOOPBACK, head)[0] == 200
    assert exchange(stack.ports.sluice, LOOPBACK, head)[0] == 403  # refused by the rule: decided


def test_a_head_of_max_header_bytes_is_read_and_one_byte_more_gets_431(stack: Stack) -> None:
    client = fresh_client_address()
    short = nginx_check_head(client, ["X-Pad: "])
    exact = nginx_check_head(client, ["X-Pad: " + "p" * (DEFAULT_MAX_HEADER_BYTES - len(short))])
    assert len(exact) == DEFAULT_MAX_HEADER_BYTES
    assert exchange(stack.ports.sluice, LOOPBACK, exact)[0] == 200
    over = nginx_check_head(client, ["X-Pad: " + "p" * (DEFAULT_MAX_HEADER_BYTES - len(short) + 1)])
    status, body = exchange(stack.ports.sluice, LOOPBACK, over)
    assert (status, body) == (431, b"Request Header Fields Too Large\n")


def test_more_than_max_headers_fields_get_431(stack: Stack) -> None:
    client = fresh_client_address()
    base = len(nginx_check_head(client, []).split(b"\r\n")) - 3  # fields besides the added ones (Host included)
    fields = ["a:"] * (DEFAULT_MAX_HEADERS - base)  # 4 bytes a field: far below the byte limit
    head = nginx_check_head(client, fields)
    assert len(head) < DEFAULT_MAX_HEADER_BYTES * 2 // 3
    assert exchange(stack.ports.sluice, LOOPBACK, head)[0] == 200
    status, body = exchange(stack.ports.sluice, LOOPBACK, nginx_check_head(client, [*fields, "a:"]))
    assert (status, body) == (431, b"Request Header Fields Too Large\n")


def _sluice_memory(stack: Stack, field: str) -> int:
    """VmRSS or VmHWM (the peak of VmRSS) of the Sluice process, in bytes."""
    pid = stack.components["sluice"].process.pid
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_huge_heads_get_431_without_sluice_holding_them(stack: Stack) -> None:
    """16 connections at once each send a 4 MB header field: each gets 431,
    and Sluice's peak memory shows it never held them (64 MB together, and
    more for the copies a parser makes of a field it takes in pieces)."""
    head = request_head("/v1/nginx/auth", ["X-Sluice-Client-Addr: 127.0.0.1", "X-Long: " + "a" * (4 << 20)])

    def flood() -> None:
        connections = [socket.create_connection((LOOPBACK, stack.ports.sluice), timeout=10) for _ in range(16)]
        try:
            # A piece to each in turn: all 16 heads are under way together.
            for offset in range(0, len(head), 256 * 1024):
                for connection in connections:
                    connection.sendall(head[offset:offset + 256 * 1024])
            for connection in connections:
                response = http.client.HTTPResponse(connection)
                response.begin()
                assert (response.status, response.read()) == (431, b"Request Header Fields Too Large\n")
        finally:
            for connection in connections:
                connection.close()

    flood()  # warm-up
    # Restart the peak from the present (proc(5), /proc/PID/clear_refs).
    Path(f"/proc/{stack.components['sluice'].process.pid}/clear_refs").write_text("5")
    peak_before = _sluice_memory(stack, "VmHWM")
    flood()
    growth = _sluice_memory(stack, "VmHWM") - peak_before
    assert growth < 16 * 1024 * 1024, f"Sluice's peak memory grew by {growth / 2**20:.1f} MiB"
    # And it goes on answering.
    assert exchange(stack.ports.sluice, LOOPBACK, request_head("/healthz"))[0] == 200


def test_the_serve_defaults_are_the_documented_limits() -> None:
    from sidecar.cli import serve

    defaults = {param.name: param.default for param in serve.params}
    assert (defaults["max_header_bytes"], defaults["max_headers"]) == (DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS)
