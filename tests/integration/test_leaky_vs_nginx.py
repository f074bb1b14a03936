"""Sluice's leaky bucket against nginx's own limit_req, burst for burst.

A plain nginx of this module's own limits requests with `limit_req` zones
and proxies to the demo upstream; the Sluice stack (rules/buckets.yaml) has
the equivalent rules under the same paths. The same two bursts go to nginx
and, at the same moments, to Sluice through both its front doors, each side
from an address of its own so that every side starts from an empty bucket:
a burst of requests sent at once on connections opened beforehand, then,
after a known pause, a second burst that finds the debt of the first. Both
must pass and refuse as many requests, and hold the passed ones as long.

Opening all connections first and sending every request at the same moment
gives both sides the same arrival pattern. nginx reads its clock once per
event-loop turn and Sluice once per decision, so the two may see arrivals
a few milliseconds apart; that moves a hold by as much, well within the
tolerance, and changes no decision as long as no arrival lies near a
whole request of drained excess, which the pauses below avoid.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from devstack.launcher import START_TIMEOUT_SECONDS, Component, Stack, accepts_connections, find_nginx
from sidecar.rendering import nginx_main_config
from tests.integration.clients import LOOPBACK, Client, TimedReply, send_at_once
from tests.integration.conftest import free_port, fresh_client_address

pytestmark = pytest.mark.integration

# How far apart the holds of nginx and Sluice may be: real clocks, the
# extra trip through a front door to Sluice, thread scheduling.
TOLERANCE_SECONDS = 0.06


@dataclass(frozen=True)
class Variant:
    """One limit_req zone, the paths it limits and the bursts sent to it.

    rules/buckets.yaml has the equivalent Sluice rule for the same paths.
    """

    name: str
    rate: str  # limit_req_zone's rate=
    options: str  # limit_req's burst=, delay= or nodelay
    burst_size: int
    # From the first burst's sending to the second's; chosen so that the
    # drained excess is half a request away from a whole one.
    pause: float

    @property
    def prefix(self) -> str:
        return f"/limit-req/{self.name}/"


VARIANTS = [
    # Burst 1: excess 0..2 pass at once, 3..5 are held 0.1, 0.2, 0.3 s, the
    # other six are refused. After 0.45 s the excess is 0.5: four more pass
    # (held 0, 0.05, 0.15, 0.25 s), eight are refused.
    Variant("delay", "10r/s", "burst=5 delay=2", burst_size=12, pause=0.45),
    # The same without holds: nodelay still leaves the debt, so the second
    # burst gets four places, not six.
    Variant("nodelay", "10r/s", "burst=5 nodelay", burst_size=12, pause=0.45),
    # 700r/m is 11666 thousandths of a request per second, truncated, in
    # both. Burst 1: three at once, two held 0.085 and 0.171 s; after 0.3 s
    # the excess is 0.5: three pass (held 0, 0.042, 0.128 s).
    Variant("per-minute", "700r/m", "burst=4 delay=2", burst_size=10, pause=0.3),
]


def plain_nginx_site(port: int, upstream_port: int) -> str:
    zones = "".join(
        f"limit_req_zone $binary_remote_addr zone={variant.name}:1m rate={variant.rate};\n" for variant in VARIANTS
    )
    locations = "".join(
        f"    location {variant.prefix} {{\n"
        f"        limit_req zone={variant.name} {variant.options};\n"
        "        proxy_pass http://demo_upstream;\n"
        "    }\n"
        for variant in VARIANTS
    )
    return (
        f"{zones}"
        "limit_req_status 429;\n"
        "upstream demo_upstream {\n"
        f"    server {LOOPBACK}:{upstream_port};\n"
        "    keepalive 16;\n"
        "}\n"
        "server {\n"
        f"    listen {LOOPBACK}:{port};\n"
        "    proxy_http_version 1.1;\n"
        '    proxy_set_header Connection "";\n'
        f"{locations}"
        "}\n"
    )


@pytest.fixture(scope="module")
def plain_nginx(buckets_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """nginx with limit_req in front of the stack's demo upstream; its port."""
    run_dir = tmp_path_factory.mktemp("plain-nginx")
    for directory in ("logs", "tmp"):
        (run_dir / directory).mkdir()
    port = free_port()
    site = run_dir / "limit_req.conf"
    site.write_text(plain_nginx_site(port, buckets_stack.ports.upstream))
    config = run_dir / "nginx.conf"
    config.write_text(nginx_main_config(run_dir, site))
    nginx = Component(
        "nginx",
        [find_nginx(), "-p", str(run_dir), "-c", str(config), "-g", "daemon off;"],
        run_dir / "logs" / "nginx.log",
        dict(os.environ),
    )
    try:
        nginx.wait_until_ready(lambda: accepts_connections(LOOPBACK, port), START_TIMEOUT_SECONDS)
        yield port
    finally:
        nginx.stop()


@dataclass(frozen=True)
class Outcome:
    """What one side did with one burst."""

    passed: int
    refused: int
    holds: list[float]  # the latencies of the passed requests, sorted

    @classmethod
    def of(cls, replies: list[TimedReply]) -> Outcome:
        statuses = [reply.status for reply in replies]
        assert set(statuses) <= {200, 429}, statuses
        return cls(statuses.count(200), statuses.count(429),
                   sorted(round(reply.seconds, 3) for reply in replies if reply.status == 200))


def assert_same(nginx: Outcome, sluice: Outcome, what: str) -> None:
    assert (sluice.passed, sluice.refused) == (nginx.passed, nginx.refused), f"{what}: nginx {nginx}, Sluice {sluice}"
    assert all(abs(ours - theirs) <= TOLERANCE_SECONDS for ours, theirs in zip(sluice.holds, nginx.holds)), \
        f"{what}: nginx {nginx}, Sluice {sluice}"


@pytest.mark.parametrize("variant", VARIANTS, ids=[variant.name for variant in VARIANTS])
def test_sluice_passes_refuses_and_holds_like_nginx_limit_req(
    variant: Variant, plain_nginx: int, buckets_stack: Stack
) -> None:
    sides = {
        "nginx limit_req": Client(plain_nginx, fresh_client_address()),
        "Sluice behind nginx": Client(buckets_stack.ports.nginx, fresh_client_address()),
        "Sluice behind Envoy": Client(buckets_stack.ports.envoy, fresh_client_address()),
    }
    # Every side's requests interleaved, so that none is always woken first.
    requests = [(client, f"{variant.prefix}{number}") for number in range(variant.burst_size)
                for client in sides.values()]
    start = time.monotonic() + 0.05

    bursts = [send_at_once(requests, at) for at in (start, start + variant.pause)]

    for number, replies in enumerate(bursts, 1):
        outcomes = {name: Outcome.of(replies[index::len(sides)]) for index, name in enumerate(sides)}
        reference = outcomes.pop("nginx limit_req")
        # Not a vacuous comparison: nginx passed some and refused some.
        assert reference.passed and reference.refused, reference
        for name, outcome in outcomes.items():
            assert_same(reference, outcome, f"burst {number}, {name}")
