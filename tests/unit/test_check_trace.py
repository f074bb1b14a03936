"""A check through Sluice's HTTP protocol (nginx's, Envoy's) enters each
of Sluice's modules at most once: down the call stack and back up, no
module asked twice, no callback into a module the check is still in.

The check is real: raw HTTP bytes, as the shipped templates send them, fed
to ``LimitedHttpProtocol`` over the memory store and one window rule.
``sys.setprofile`` records each Python frame entered during it; a module is
*entered* when a frame of its file starts from a frame of another of
Sluice's files (frames of the standard library, of third-party packages and
of the rules' compiled matcher are skipped over: the nearest of Sluice's
frames below them is the caller). The files entered, in order, are the
check's path; each may come once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType

import pytest

import sidecar
from sidecar import actions, core, request
from sidecar.engine import Engine
from sidecar.server import LimitedHttpProtocol
from sidecar.state import BanRecord
from tests.unit.conftest import FakeClock, RecordingTransport, connection_to, ruleset_from

PACKAGE = os.path.dirname(os.path.abspath(sidecar.__file__)) + os.sep

# The trace reads Python frames: the compiled core's modules make none, so
# the check's path is traced on the pure-Python twin (make test runs the
# unit suite again with SLUICE_PURE_PYTHON=1).
pytestmark = pytest.mark.skipif(not core.PURE, reason="traces Python frames: the pure-Python core only")

RULES = """
rules:
  - id: everyone
    key: [ip]
    limit: {requests: 1000000, per: 1h}
    action: block
"""

# What sluice-server.conf's check location sends (its empty fields, which
# nginx leaves out, left out).
NGINX_CHECK = (b"GET /v1/nginx/auth HTTP/1.1\r\nHost: 127.0.0.1:8181\r\n"
               b"X-Sluice-Client-Addr: 192.0.2.7\r\nX-Original-Method: GET\r\nX-Original-URI: /shop/cart?id=3\r\n"
               b"X-Original-Host: shop.example\r\nX-Request-Id: 0123456789abcdef0123456789abcdef\r\n"
               b"X-Sluice-Scheme: https\r\nX-Sluice-Then-Auth: off\r\nX-Sluice-Sent: 1800000000.125\r\n"
               b"User-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n")
# What the shipped Envoy template's HTTP ext_authz sends.
ENVOY_CHECK = (b"GET /v1/envoy/auth/shop/cart?id=3 HTTP/1.1\r\nHost: shop.example\r\n"
               b"X-Sluice-Client-Addr: 192.0.2.8\r\nX-Request-Id: 3b1f2c4e-9a7d-4e21-8c55-0f6a2b9d1e07\r\n"
               b"X-Sluice-Sent: 1800000000.125\r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n")
# What Traefik's or Caddy's forward auth sends (the client is the peer).
FORWARD_AUTH_CHECK = (b"GET /v1/check HTTP/1.1\r\nHost: 127.0.0.1:8181\r\nX-Forwarded-Method: GET\r\n"
                      b"X-Forwarded-Proto: https\r\nX-Forwarded-Host: shop.example:8443\r\n"
                      b"X-Forwarded-Uri: /shop/cart?id=3\r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n")


def sluice_file(frame: FrameType | None) -> tuple[str | None, FrameType | None]:
    """The file (relative to the package) of the nearest of Sluice's frames
    from ``frame`` down, and that frame."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(PACKAGE):
            return filename[len(PACKAGE):], frame
        frame = frame.f_back
    return None, None


def files_entered(run: Callable[[], object]) -> list[str]:
    """The files of Sluice's modules entered while ``run`` runs, in order:
    each time a frame of one starts from a frame of another (or of none)."""
    entered: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        callee, _ = sluice_file(frame)
        if callee is None:
            return
        caller, _ = sluice_file(frame.f_back)
        if caller != callee:
            entered.append(callee)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return entered


def traced(module: str) -> bool:
    """Whether the trace sees a module's frames: not when it runs as a
    module of the compiled core (sidecar.core), whose functions make no
    Python frames."""
    name = "sidecar." + module.removesuffix(".py").replace("/", ".")
    return str(sys.modules[name].__file__).endswith(".py")


def entered_again(entered: list[str]) -> list[str]:
    """The files entered more than once."""
    return sorted({name for name in entered if entered.count(name) > 1})


# One request an hour for each client: its second check is refused, and so
# is every later one. A refusal that holds for every request of the client
# (its address alone is the key) is kept, and its later checks answered
# from the kept bytes; one whose key names more than the address is
# decided each time.
STORED_REFUSAL_RULES = """
rules:
  - id: low
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
"""
DECIDED_REFUSAL_RULES = """
rules:
  - id: low
    key: [ip, header:user-agent]
    limit: {requests: 1, per: 1h}
    action: block
"""


def connection(rules: str = RULES) -> tuple[LimitedHttpProtocol, RecordingTransport]:
    """Sluice's protocol on one connection, over the memory store."""
    return connection_to(Engine(ruleset_from(rules), clock=FakeClock()))


def warm_up(protocol, check: bytes) -> None:
    """The checks before the one traced: what is made once (caches,
    counters) is made. The address resolver stores a field the second
    time it comes (SeenLately): two of them."""
    for _ in range(2):
        protocol.data_received(check)


@pytest.mark.parametrize(("check", "front_door"), [(NGINX_CHECK, "frontdoors/nginx.py"),
                                                   (ENVOY_CHECK, "frontdoors/envoy.py"),
                                                   (FORWARD_AUTH_CHECK, "frontdoors/forward_auth.py")],
                         ids=["nginx", "envoy", "forward-auth"])
def test_a_check_enters_each_module_once_down_and_back_up(check: bytes, front_door: str) -> None:
    protocol, transport = connection()
    warm_up(protocol, check)
    del transport.written[:]

    entered = files_entered(lambda: protocol.data_received(check))

    assert transport.written == [b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"]
    # The check's whole way, protocol to answer, was traced (a bare answer
    # is written by the protocol itself, without exchange.py's encoding)...
    assert entered[0] == "server.py"
    for module in ("app.py", front_door, "request.py", "engine.py", "clientip.py"):
        assert module in entered or not traced(module), entered
    # ...no module on it was entered twice...
    assert entered_again(entered) == [], entered
    # ...and without --then-auth, nothing of the next auth service's runs.
    assert "chain.py" not in entered


# A refusal answered again is counted by the metrics in one call
# (refused_again); a decided one has its latency observed.
@pytest.mark.parametrize(("rules", "check", "status", "counted_in"), [
    (STORED_REFUSAL_RULES, NGINX_CHECK, b"403 Forbidden", "metrics.py"),
    (DECIDED_REFUSAL_RULES, NGINX_CHECK, b"403 Forbidden", "latency.py"),
    (DECIDED_REFUSAL_RULES, ENVOY_CHECK, b"429 Too Many Requests", "latency.py"),
    (DECIDED_REFUSAL_RULES, FORWARD_AUTH_CHECK, b"429 Too Many Requests", "latency.py"),
], ids=["nginx-stored", "nginx-decided", "envoy-decided", "forward-auth-decided"])
def test_a_refused_check_enters_each_module_once(rules: str, check: bytes, status: bytes, counted_in: str) -> None:
    protocol, transport = connection(rules)
    for _ in range(3):  # allowed, refused (and kept, when it holds for the client), refused
        protocol.data_received(check)
    assert transport.written[0].startswith(b"HTTP/1.1 200 OK\r\n")
    del transport.written[:]

    entered = files_entered(lambda: protocol.data_received(check))

    assert len(transport.written) == 1 and transport.written[0].startswith(b"HTTP/1.1 " + status + b"\r\n")
    assert entered[0] == "server.py"
    for module in ("app.py", "engine.py", counted_in):
        assert module in entered, entered
    assert entered_again(entered) == [], entered


@pytest.mark.parametrize(("network", "status"), [("192.0.2.0/24", b"401 Unauthorized"),
                                                 ("198.51.100.0/24", b"200 OK")], ids=["banned", "not-banned"])
def test_a_check_with_networks_banned_enters_each_module_once(network: str, status: bytes) -> None:
    protocol, transport = connection()
    # A network banned by hand: nginx's check from 192.0.2.7 is in it, or not.
    engine = protocol.checks.engine if protocol.checks is not None else None
    assert isinstance(engine, Engine)
    engine.store.network_bans.add(BanRecord(network, "", "node", 0.0, 1e12, 1e12, reason="by hand"))
    warm_up(protocol, NGINX_CHECK)
    del transport.written[:]

    entered = files_entered(lambda: protocol.data_received(NGINX_CHECK))

    assert len(transport.written) == 1 and transport.written[0].startswith(b"HTTP/1.1 " + status + b"\r\n")
    assert "networkbans.py" in entered, entered
    assert entered_again(entered) == [], entered


def test_an_exempt_client_s_check_enters_each_module_once() -> None:
    protocol, transport = connection("exempt: [192.0.2.0/24]\n" + RULES)  # nginx's client is 192.0.2.7
    warm_up(protocol, NGINX_CHECK)
    del transport.written[:]

    entered = files_entered(lambda: protocol.data_received(NGINX_CHECK))

    assert transport.written == [b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"]
    assert "clientip.py" in entered and "policy.py" not in entered, entered  # decided without a rule
    assert entered_again(entered) == [], entered


def test_a_module_entered_twice_is_found() -> None:
    """The trace sees a check that goes back and forth between modules:
    request.py, left for actions.py, entered again."""

    def back_and_forth() -> None:
        request.strip_port("shop.example:443")
        actions.over_limit_headers(10, 30)
        request.strip_port("shop.example")

    entered = files_entered(back_and_forth)

    assert entered == ["request.py", "actions.py", "request.py"]
    assert entered_again(entered) == ["request.py"]
