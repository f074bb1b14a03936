"""Response-phase counting through nginx and Envoy: the post-response hook.

Rules: rules/limits.yaml, the response-phase rules at its end. A response
is counted when the front door reports it to Sluice, after the client has
its response: nginx with a syslog datagram, Envoy with an asynchronous HTTP
call. Reports are asynchronous by design, so before each next request the
tests wait (with a deadline) until Sluice's metrics show the report
processed; otherwise the next check could run before the count it depends on.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping

import pytest

from devstack.launcher import Stack
from tests.integration.clients import LOOPBACK, Client, Reply
from tests.integration.conftest import (
    RULES,
    free_port,
    fresh_client_address,
    front_door_port,
    sluice_metric,
    start_stack,
    wait_until,
)

pytestmark = pytest.mark.integration

# Sluice processes a report within milliseconds of the response; this long
# only on a machine that is badly overloaded.
REPORT_DEADLINE_SECONDS = 5.0


class ReportedClient:
    """A client of one front door whose requests' responses are reported to Sluice."""

    def __init__(self, stack: Stack, front_door: str) -> None:
        self.stack = stack
        self.client = Client(front_door_port(stack, front_door), fresh_client_address())

    def reported(self) -> float:
        return sluice_metric(self.stack, "sluice_responses_reported_total")

    def hits(self, rule: str) -> float:
        return sluice_metric(self.stack, "sluice_rule_hits_total", f'rule="{rule}"')

    def request(self, path: str, method: str = "GET", headers: Mapping[str, str] | None = None) -> Reply:
        """A request that is allowed with a pending token: returns once Sluice has its report."""
        before = self.reported()
        reply = self.client.request(path, method=method, headers=headers)
        wait_until(lambda: self.reported() > before, f"the report of {method} {path}", REPORT_DEADLINE_SECONDS)
        return reply

    def unreported(self, path: str, method: str = "GET") -> Reply:
        """A request without pending counts (refused at request phase, or
        matching no response-phase rule): there is no report to wait for."""
        return self.client.request(path, method=method)

    def wait_for_hits(self, rule: str, hits: float) -> None:
        # A report is counted as processed before its hits are.
        wait_until(lambda: self.hits(rule) >= hits, f"{hits:.0f} hits of {rule}", REPORT_DEADLINE_SECONDS)

    def statuses(self, *paths: str) -> list[int]:
        return [self.request(path).status for path in paths]


@pytest.fixture
def reported_client(limits_stack: Stack, front_door: str) -> ReportedClient:
    return ReportedClient(limits_stack, front_door)


def test_failed_logins_count_and_the_request_after_the_threshold_never_reaches_the_upstream(
    reported_client: ReportedClient, upstream: Client
) -> None:
    # The seeds' worked example: 401 -> 1, 200 -> still 1, 401 -> 2 (the
    # penalty starts), the 4th is refused whatever it would have returned.
    client = reported_client

    first, second, third = (client.request(f"/api/login{query}") for query in ("?status=401", "", "?status=401"))
    fourth = client.unreported("/api/login")

    assert [first.status, second.status, third.status, fourth.status] == [401, 200, 401, 429]
    assert fourth.headers["X-RateLimit-Limit"] == "2"
    # The upstream's count for the path: the third request, then this one.
    assert upstream.request("/api/login").echo()["hits"] == third.echo()["hits"] + 1


def test_only_failed_logins_are_counted(reported_client: ReportedClient) -> None:
    client = reported_client
    hits_before = client.hits("login-failures")

    assert client.statuses("/api/login", "/api/login?status=403", "/api/login?status=500") == [200, 403, 500]
    assert client.statuses("/api/login?status=401") == [401]

    client.wait_for_hits("login-failures", hits_before + 1)
    assert client.hits("login-failures") == hits_before + 1
    # One failure so far, of two allowed.
    assert client.statuses("/api/login?status=401") == [401]
    assert client.unreported("/api/login").status == 429


def test_a_score_budget_refuses_the_request_after_the_scores_exceed_it(reported_client: ReportedClient) -> None:
    # The seeds' score example: 100 + 200 + 150 = 450 > 400.
    client = reported_client
    path = f"/score/{uuid.uuid4().hex}"

    assert client.statuses(f"{path}?score=100", f"{path}?score=200", f"{path}?score=150") == [200, 200, 200]

    # Refused from now on, for the penalty period.
    assert [client.unreported(path).status for _ in range(2)] == [429, 429]


def test_scores_out_of_range_or_missing_do_not_count(reported_client: ReportedClient) -> None:
    client = reported_client
    path = f"/score/{uuid.uuid4().hex}"

    not_scores = ("0", "1000001", "abc", "-5", "12.5")
    assert client.statuses(*(f"{path}?score={score}" for score in not_scores), path) == [200] * 6
    # A total of exactly the budget does not exceed it.
    assert client.statuses(f"{path}?score=400", f"{path}?score=1") == [200, 200]

    assert client.unreported(path).status == 429


def test_a_response_header_condition_counts_only_matching_responses(reported_client: ReportedClient) -> None:
    client = reported_client
    path = f"/marked/{uuid.uuid4().hex}"

    assert client.statuses(f"{path}?score=low", path, f"{path}?score=high") == [200, 200, 200]
    # Any status: the rule tests the header only.
    assert client.statuses(f"{path}?score=high&status=500") == [500]

    assert client.unreported(path).status == 429


def test_a_rule_with_request_conditions_counts_only_responses_to_matching_requests(
    reported_client: ReportedClient,
) -> None:
    client = reported_client
    path = f"/posts/{uuid.uuid4().hex}"
    # GET does not match the rule: no pending count, so nothing to report.
    assert [client.unreported(f"{path}?status=401").status for _ in range(3)] == [401] * 3
    hits_before = client.hits("failed-posts")

    assert client.request(f"{path}?status=401", method="POST").status == 401
    assert client.request(f"{path}?status=200", method="POST").status == 200
    client.wait_for_hits("failed-posts", hits_before + 1)
    assert client.hits("failed-posts") == hits_before + 1
    assert client.request(f"{path}?status=403", method="POST").status == 403

    assert client.unreported(path, method="POST").status == 429
    assert client.unreported(path).status == 200


def test_the_pending_token_reaches_neither_the_client_nor_the_application(reported_client: ReportedClient) -> None:
    reply = reported_client.request("/api/login")

    assert reply.status == 200
    assert "X-Sluice-Pending" not in reply.headers
    assert "x-sluice-pending" not in reply.echo()["headers"]


def test_a_token_sent_by_the_client_is_neither_reported_nor_passed_on(reported_client: ReportedClient) -> None:
    refused_before = sluice_metric(reported_client.stack, "sluice_responses_refused_total")

    # The front door reports Sluice's token for this request, not the client's.
    reply = reported_client.request("/api/login", headers={"X-Sluice-Pending": "forged.token"})

    assert reply.status == 200
    assert "x-sluice-pending" not in reply.echo()["headers"]
    assert sluice_metric(reported_client.stack, "sluice_responses_refused_total") == refused_before


# -- Sluice's hook gone: clients are not delayed ---------------------------

# A report that waited for the dead hook would wait at least Envoy's report
# timeout (1 s); an answer from the loopback demo upstream takes milliseconds.
PROMPT_SECONDS = 0.5
REQUESTS = 5


class UnansweringServer:
    """A TCP listener that takes connections and requests and never answers."""

    def __init__(self) -> None:
        self._listener = socket.create_server((LOOPBACK, 0))
        self._listener.settimeout(0.05)
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._received: list[bytes] = []
        self._connections: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def received(self) -> list[bytes]:
        with self._lock:
            return list(self._received)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        for connection in self._connections:
            connection.close()
        self._listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            self._connections.append(connection)
            connection.settimeout(1.0)
            try:
                data = connection.recv(65536)
            except OSError:
                continue
            with self._lock:
                self._received.append(data)


@pytest.fixture(scope="module")
def dead_hook() -> Iterator[UnansweringServer]:
    server = UnansweringServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def dead_hook_stack(tmp_path_factory: pytest.TempPathFactory, dead_hook: UnansweringServer) -> Iterator[Stack]:
    """The limits stack, with nginx's reports sent to a UDP port nobody
    listens on and Envoy's to a server that never answers."""
    stack = start_stack(
        tmp_path_factory.mktemp("dead-hook-stack"),
        RULES / "limits.yaml",
        variables={
            # Free, so closed: nobody listens there.
            "SLUICE_HOOK_ADDR": f"{LOOPBACK}:{free_port(socket.SOCK_DGRAM)}",
            "SLUICE_HOOK_HOST": LOOPBACK,
            "SLUICE_HOOK_PORT": str(dead_hook.port),
        },
    )
    yield stack
    stack.stop()


def test_responses_are_not_delayed_when_the_hook_is_dead(
    dead_hook_stack: Stack, dead_hook: UnansweringServer, front_door: str
) -> None:
    connection = http.client.HTTPConnection(
        LOOPBACK, front_door_port(dead_hook_stack, front_door), timeout=5.0,
        source_address=(fresh_client_address(), 0),
    )
    reports_before = len(dead_hook.received())
    durations, statuses = [], []
    try:
        # One kept-alive connection: the next request must not wait for the
        # previous report either.
        for _ in range(REQUESTS):
            started = time.monotonic()
            connection.request("GET", "/api/login?status=401")
            response = connection.getresponse()
            response.read()
            durations.append(time.monotonic() - started)
            statuses.append(response.status)
    finally:
        connection.close()

    assert max(durations) < PROMPT_SECONDS, durations
    # No report arrived, so no failure was counted: lost reports cost counts,
    # never requests.
    assert statuses == [401] * REQUESTS
    assert sluice_metric(dead_hook_stack, "sluice_responses_reported_total") == 0
    if front_door != "nginx":
        # Envoy did send its reports, to a hook that never answers.
        wait_until(lambda: len(dead_hook.received()) >= reports_before + REQUESTS, "Envoy's reports",
                   REPORT_DEADLINE_SECONDS)
        assert all(report.startswith(b"POST /v1/hook ") for report in dead_hook.received())
