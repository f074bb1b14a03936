"""A refusal that holds for every request of a client is answered again from
its stored bytes (sidecar.overload.AddressRefusals), byte for byte as the
decision would have answered it, and counted as the decision would have
been: held to an engine that stores nothing, over random traffic."""

from __future__ import annotations

import asyncio
import io
import logging
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.config import Config
from uvicorn.server import ServerState

from sidecar.app import SluiceApp
from sidecar.decisionlog import configure_decision_log
from sidecar.engine import Engine
from sidecar.server import LimitedHttpProtocol
from tests.unit.conftest import FakeClock, RecordingTransport, ruleset_from

RULESETS = {
    "block": """
rules:
  - id: per-address
    key: [ip]
    limit: {requests: 3, per: 10s}
    action: block
  - id: api
    match: {path: {prefix: /api/}}
    key: [ip]
    limit: {requests: 2, per: 10s}
    action: block
    block: {status: 503, body: "<p>${{http_host}} asks ${{remote_addr}} to wait (${{request_id}})</p>"}
""",
    "ban": """
rules:
  - id: bans
    key: [ip]
    limit: {requests: 2, per: 10s}
    action: ban
    ban: {duration: 5s}
""",
    # A challenge after the address-wide rule: its credential passes the
    # rules from its own on, never the first.
    "challenge": """
rules:
  - id: per-address
    key: [ip]
    limit: {requests: 3, per: 10s}
    action: block
  - id: human
    match: {path: {prefix: /login}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: challenge
""",
    "close": """
client_ip: {trusted_proxies: [192.0.2.0/24]}
rules:
  - id: closes
    key: [ip]
    limit: {requests: 2, per: 3s}
    action: block
    block: {close: true}
""",
}


class Node:
    """One Sluice behind one connection, on a fake clock; ``stores`` says
    whether refusals are stored."""

    def __init__(self, rules: str, clock: FakeClock, stores: bool, loop: asyncio.AbstractEventLoop) -> None:
        # The wall clock moves with the engine's: nginx's cache is told Unix seconds.
        wall = 1_800_000_000.25 - clock()
        self.engine = Engine(ruleset_from(rules), clock=clock, wall_clock=lambda: wall + clock(), secret=b"s" * 32)
        if not stores:
            self.engine.address_refusals.capacity = 0
        self.config = Config(app=SluiceApp(self.engine), lifespan="off", log_level="warning", proxy_headers=False)
        self.config.load()
        self.loop = loop
        self.connect()

    def connect(self) -> None:
        self.protocol = LimitedHttpProtocol(config=self.config, server_state=ServerState(), app_state={},
                                            _loop=self.loop)
        self.transport = RecordingTransport()
        self.protocol.connection_made(self.transport)

    def ask(self, request: bytes) -> bytes:
        """The answer on the connection, or on a new one after a close."""
        if self.transport.closing:
            self.protocol.connection_lost(None)
            self.connect()
        before = len(self.transport.written)
        self.protocol.data_received(request)
        return b"".join(self.transport.written[before:])

    def counts(self) -> dict[str, Any]:
        metrics = self.engine.metrics
        return {"checks": metrics.checks.value, "banned": metrics.banned_requests.value,
                "over": {rule.id: metrics.over_limit_of(rule.id) for rule in self.engine.ruleset.rules},
                "decisions": dict(metrics.decisions), "latency": sum(metrics.latency.counts),
                "credentials": metrics.credentials.value}


def check(door: str, method: str, client: str, request_id: str, host: str, path: str, forwarded: str | None,
          cookie: str | None = None) -> bytes:
    if door == "nginx":
        lines = [f"{method} /v1/nginx/auth HTTP/1.1", "Host: sluice", f"X-Original-URI: {path}",
                 f"X-Original-Host: {host}"]
    else:
        lines = [f"{method} /v1/envoy/auth{path} HTTP/1.1", f"Host: {host}"]
    lines += [f"X-Sluice-Client-Addr: {client}", f"X-Request-Id: {request_id}"]
    if forwarded is not None:
        lines.append(f"X-Forwarded-For: {forwarded}")
    if cookie is not None:
        lines.append(f"Cookie: {cookie}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# A few clients whose requests repeat (a flood), and their variations: the
# other door, HEAD, another host, a forwarded chain, a request id of another
# length or one that cannot be spliced; and with the challenge's credential
# (CREDENTIALS: whose it is).
REQUESTS: list[tuple[str, str, str, str, str, str, str | None]] = [
    ("nginx", "GET", "192.0.2.1", "0123456789abcdef0123456789abcdef", "shop.example", "/", None),
    ("nginx", "GET", "192.0.2.1", "fedcba9876543210fedcba9876543210", "shop.example", "/api/items", None),
    ("nginx", "GET", "192.0.2.1", "3b1f2c4e-9a7d-4e21-8c55-0f6a2b9d1e07", "shop.example", "/", None),
    ("nginx", "GET", "192.0.2.1", "short", "shop.example", "/", None),
    ("nginx", "HEAD", "192.0.2.1", "0123456789abcdef0123456789abcdef", "shop.example", "/", None),
    ("nginx", "GET", "192.0.2.1", "0123456789abcdef0123456789abcdef", "api.example", "/", None),
    ("nginx", "GET", "192.0.2.1", "0123456789abcdef0123456789abcdef", "shop.example", "/", "203.0.113.9"),
    ("nginx", "GET", "2001:db8::1", "0123456789abcdef0123456789abcdef", "shop.example", "/login", None),
    ("envoy", "GET", "192.0.2.1", "3b1f2c4e-9a7d-4e21-8c55-0f6a2b9d1e07", "shop.example", "/", None),
    ("envoy", "HEAD", "192.0.2.2", "3b1f2c4e-9a7d-4e21-8c55-0f6a2b9d1e07", "shop.example", "/api/x", None),
    ("envoy", "GET", "192.0.2.2", "0123456789abcdef0123456789abcdef", "api.example", "/", "203.0.113.9, 198.51.100.4"),
    ("nginx", "GET", "192.0.2.1", "0123456789abcdef0123456789abcdef", "shop.example", "/login", None),
    ("nginx", "GET", "192.0.2.1", "fedcba9876543210fedcba9876543210", "shop.example", "/login", None),
    ("envoy", "GET", "192.0.2.2", "0123456789abcdef0123456789abcdef", "shop.example", "/login/form", None),
    ("nginx", "GET", "192.0.2.2", "0123456789abcdef0123456789abcdef", "shop.example", "/login", None),
]
# The client a request's credential was issued to, by index in REQUESTS:
# its own, or another client's (not accepted).
CREDENTIALS = {12: "192.0.2.1", 13: "192.0.2.1", 14: "192.0.2.1", 1: "192.0.2.1"}
# A challenge's ticket: signed JSON, base64url.
TICKET = re.compile(rb"Wy[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
steps = st.lists(st.tuples(st.integers(0, len(REQUESTS) - 1), st.sampled_from([0.0, 0.0, 0.0, 0.3, 0.7, 1.5, 4.0])),
                 min_size=1, max_size=60)


@pytest.mark.parametrize("rules", RULESETS)
@settings(max_examples=150, deadline=None)
@given(traffic=steps)
def test_a_stored_refusal_is_the_decisions_answer_byte_for_byte_and_counted_alike(rules: str, traffic: list) -> None:
    """Every answer, every count and every decision-log line is the same
    with stored refusals as without."""
    log = io.StringIO()

    def written(node: Node, request: bytes) -> tuple[bytes, str]:
        start = log.tell()
        # A challenge's ticket is signed over a nonce of its own, never stored.
        answer = TICKET.sub(b"TICKET", node.ask(request))
        return answer, log.getvalue()[start:]

    async def run() -> None:
        loop = asyncio.get_running_loop()
        clock = FakeClock()
        stored, decided = Node(RULESETS[rules], clock, True, loop), Node(RULESETS[rules], clock, False, loop)
        cookies = {index: f"sluice_pass_human={stored.engine.challenges.credential('human', client, '', 3600)}"
                   for index, client in CREDENTIALS.items()}
        for index, wait in traffic:
            clock.advance(wait)
            request = check(*REQUESTS[index], cookie=cookies.get(index))
            assert written(stored, request) == written(decided, request)
        assert stored.counts() == decided.counts()
        assert len(decided.engine.address_refusals) == 0

    decisions = logging.getLogger("sluice.decisions")
    saved = decisions.handlers[:], decisions.level, decisions.propagate
    configure_decision_log(log)
    try:
        asyncio.run(run())
    finally:
        decisions.handlers[:], decisions.level, decisions.propagate = saved


def test_a_flood_of_one_over_limit_client_is_answered_from_the_stored_refusal() -> None:
    async def run() -> tuple[int, int]:
        clock = FakeClock()
        node = Node(RULESETS["block"], clock, True, asyncio.get_running_loop())
        request = check("nginx", "GET", "192.0.2.1", "0123456789abcdef0123456789abcdef", "shop.example", "/", None)
        answers = [node.ask(request) for _ in range(100)]
        return sum(answer.startswith(b"HTTP/1.1 403") for answer in answers), len(node.engine.address_refusals)

    refused, stored = asyncio.run(run())
    assert refused == 97 and stored == 1


def test_a_ban_lifted_by_hand_is_not_answered_again() -> None:
    async def run() -> list[bytes]:
        clock = FakeClock()
        node = Node(RULESETS["ban"], clock, True, asyncio.get_running_loop())
        request = check("nginx", "GET", "192.0.2.1", "0123456789abcdef0123456789abcdef", "shop.example", "/", None)
        before = [node.ask(request)[:12] for _ in range(4)]
        await node.engine.lift_ban("192.0.2.1")
        return before + [node.ask(request)[:12]]

    assert asyncio.run(run()) == [b"HTTP/1.1 200", b"HTTP/1.1 200", b"HTTP/1.1 401", b"HTTP/1.1 401", b"HTTP/1.1 200"]
