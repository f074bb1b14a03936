"""Concurrency limits through nginx and Envoy, and across two Sluice
processes sharing one Redis.

Rules: rules/concurrent.yaml. A slot is given back when the front door
reports the response (asynchronously, after the client has it), so the
tests wait with a deadline for Sluice's metrics to show the report before
they rely on the slot being free; the demo upstream's ``?sleep=S`` keeps
requests in flight.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from devstack.launcher import Stack
from tests.integration.burst import burst, burst_over
from tests.integration.clients import LOOPBACK, Client
from tests.integration.conftest import (
    RULES,
    free_port,
    fresh_client_address,
    front_door_port,
    sluice_metric,
    start_stack,
    wait_until,
)
from tests.integration.redis_server import RedisServer

pytestmark = pytest.mark.integration

DEADLINE_SECONDS = 5.0
# Long enough for every check of a burst to be decided while the admitted
# requests are still at the upstream, on a loaded 2-core machine.
BURST_SLEEP_SECONDS = 3
BURST, LIMIT = 300, 20


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("concurrent-stack"), RULES / "concurrent.yaml",
                        # A burst's checks wait for Sluice longer than the
                        # templates' 1 s, which would let them in unchecked.
                        {"SLUICE_READ_TIMEOUT": "20s", "SLUICE_CHECK_TIMEOUT": "20s"})
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def dead_hook_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Reports go nowhere: nginx's to a UDP port nobody listens on, Envoy's
    to a TCP port that refuses connections."""
    stack = start_stack(tmp_path_factory.mktemp("concurrent-dead-hook"), RULES / "concurrent.yaml", {
        "SLUICE_HOOK_ADDR": f"{LOOPBACK}:{free_port(socket.SOCK_DGRAM)}",
        "SLUICE_HOOK_HOST": LOOPBACK,
        "SLUICE_HOOK_PORT": str(free_port()),
    })
    yield stack
    stack.stop()


def metric(stack: Stack, name: str, labels: str = "") -> float:
    return sluice_metric(stack, name, labels)


def test_slow_requests_hold_the_limit_and_their_reports_make_room_again(stack: Stack, front_door: str) -> None:
    port, source = front_door_port(stack, front_door), fresh_client_address()
    admitted_before = metric(stack, "sluice_rule_hits_total", 'rule="slow"')
    released_before = metric(stack, "sluice_concurrency_released_total")
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(Client(port, source).request, "/slow/export?sleep=3") for _ in range(2)]
        wait_until(lambda: metric(stack, "sluice_rule_hits_total", 'rule="slow"') >= admitted_before + 2,
                   "both slow requests admitted", DEADLINE_SECONDS)

        refused = Client(port, source).request("/slow/export")
        still_running = not any(request.done() for request in running)
        replies = [request.result() for request in running]

    assert still_running and [reply.status for reply in replies] == [200, 200]
    assert refused.status == 429
    assert refused.headers["X-RateLimit-Limit"] == "2"
    # The shortest remaining lease of 30 s, rounded up.
    assert 27 <= int(refused.headers["Retry-After"]) <= 30
    assert refused.headers["X-RateLimit-Reset"] == refused.headers["Retry-After"]
    # Once both reports are in, both slots are free again.
    wait_until(lambda: metric(stack, "sluice_concurrency_released_total") >= released_before + 2,
               "both slots given back", DEADLINE_SECONDS)
    assert [Client(port, source).request("/slow/export").status for _ in range(2)] == [200, 200]
    assert metric(stack, "sluice_internal_errors_total") == 0


def test_a_streamed_response_holds_its_slot_until_its_body_has_ended(stack: Stack, front_door: str) -> None:
    port, source = front_door_port(stack, front_door), fresh_client_address()
    released_before = metric(stack, "sluice_concurrency_released_total")
    connection = Client(port, source).connect()
    try:
        # The headers and the echo come at once; the body ends 2 s later.
        connection.request("GET", "/streamed/export?stream=2")
        streaming = connection.getresponse()
        assert streaming.status == 200

        refused = Client(port, source).request("/streamed/export")
        body = streaming.read()
    finally:
        connection.close()

    assert refused.status == 429 and b'"path": "/streamed/export"' in body
    wait_until(lambda: metric(stack, "sluice_concurrency_released_total") > released_before,
               "the slot given back", DEADLINE_SECONDS)
    assert Client(port, source).request("/streamed/export").status == 200


def test_a_slot_whose_report_never_comes_is_freed_by_its_lease(dead_hook_stack: Stack, front_door: str) -> None:
    client = Client(front_door_port(dead_hook_stack, front_door), fresh_client_address())

    assert client.request("/leased/a").status == 200
    # Its report is lost: the slot is held for its 2 s lease.
    refused = client.request("/leased/a")
    assert refused.status == 429 and 1 <= int(refused.headers["Retry-After"]) <= 2
    started = time.monotonic()
    wait_until(lambda: client.request("/leased/a").status == 200, "the lease ended", DEADLINE_SECONDS)
    # Not before the lease could have ended (the first request took a moment).
    assert time.monotonic() - started > 1.0
    assert metric(dead_hook_stack, "sluice_responses_reported_total") == 0
    assert metric(dead_hook_stack, "sluice_concurrency_released_total") == 0


def test_a_burst_admits_exactly_the_limit_while_the_admitted_requests_run(stack: Stack, front_door: str) -> None:
    port = front_door_port(stack, front_door)
    statuses = burst(port, BURST, f"/burst/{uuid.uuid4().hex}?sleep={BURST_SLEEP_SECONDS}",
                     source=fresh_client_address())
    assert statuses == {200: LIMIT, 429: BURST - LIMIT}
    assert metric(stack, "sluice_internal_errors_total") == 0
    assert "Traceback" not in (stack.run_dir / "logs" / "sluice.log").read_text()


# -- two Sluice processes, one Redis ------------------------------------------------


class SluiceProcess:
    """``sluice serve`` on a port of its own, with no report port."""

    def __init__(self, rules: Path) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", "--config", str(rules), "--port", str(self.port),
             "--hook-udp", "off"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def ready(self) -> bool:
        assert self.process.poll() is None, self.process.stderr.read().decode() if self.process.stderr else ""
        try:
            connection = http.client.HTTPConnection(LOOPBACK, self.port, timeout=1)
            connection.request("GET", "/readyz")
            return connection.getresponse().status == 200
        except OSError:
            return False

    def metric(self, name: str) -> float:
        connection = http.client.HTTPConnection(LOOPBACK, self.port, timeout=2)
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
        return next((float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)

    def stop(self) -> str:
        self.process.terminate()
        _, errors = self.process.communicate(timeout=20)
        return errors.decode()


@pytest.fixture(scope="module")
def two_sluices(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[list[SluiceProcess]]:
    rules = tmp_path_factory.mktemp("two-sluices") / "rules.yaml"
    rules.write_text(f"""\
state: {{backend: redis, url: "{redis_server.url}", fail: closed}}
rules:
  - id: exports
    key: ["header:x-k"]
    limit: {{concurrent: {LIMIT}, lease: 30s}}
    action: block
""")
    sluices = [SluiceProcess(rules), SluiceProcess(rules)]
    try:
        for sluice in sluices:
            wait_until(sluice.ready, "sluice serve ready", 20)
        yield sluices
    finally:
        logs = [sluice.stop() for sluice in sluices]
        assert not any("Traceback" in log for log in logs), logs


def test_a_burst_over_two_sluice_processes_on_one_redis_admits_exactly_the_limit(
        two_sluices: list[SluiceProcess], redis_server: RedisServer) -> None:
    key = uuid.uuid4().hex
    # Straight to each Sluice, as nginx's check subrequest asks; no report
    # ever comes, so every admitted request keeps its slot for its lease.
    statuses = burst_over([sluice.port for sluice in two_sluices], BURST, "/v1/nginx/auth",
                            {"X-Sluice-Client-Addr": "10.70.0.1", "X-Original-URI": "/export", "x-k": key},
                            source=fresh_client_address())

    assert statuses == {200: LIMIT, 403: BURST - LIMIT}
    assert all(sluice.metric("sluice_store_errors_total") == 0 for sluice in two_sluices)
    assert all(sluice.metric("sluice_internal_errors_total") == 0 for sluice in two_sluices)
    # Both processes admitted some: the count is shared, not per process.
    assert all(sluice.metric("sluice_checks_total") > 0 for sluice in two_sluices)
    # The key: a sorted set of the admitted requests' lease ids, expiring
    # with the longest lease.
    client = redis_server.client()
    [name] = [name for name in client.keys("sluice:*:count:*") if key in name]
    assert client.type(name) == "zset" and client.zcard(name) == LIMIT
    assert 25_000 < client.pttl(name) <= 30_000
