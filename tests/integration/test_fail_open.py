"""With Sluice gone or stuck, nginx and Envoy let traffic through."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

import pytest

from devstack.launcher import Stack
from tests.integration.clients import LOOPBACK, Client, Reply
from tests.integration.conftest import front_door_port

pytestmark = pytest.mark.integration

# Both front doors give up on Sluice after 1 s at most (nginx: 100 ms to
# connect, 1 s for the answer; Envoy: 1 s for the whole check); a request
# slower than this waited for something it should not have.
PROMPT_SECONDS = 3.0


def timed_request(client: Client, path: str, method: str = "GET", body: bytes | None = None) -> Reply:
    started = time.monotonic()
    reply = client.request(path, method=method, body=body)
    assert time.monotonic() - started < PROMPT_SECONDS
    return reply


def test_requests_reach_the_upstream_promptly_after_sluice_is_killed(own_stack: Stack, front_door: str) -> None:
    client = Client(front_door_port(own_stack, front_door), "127.2.0.1")
    assert [client.request("/block/before").status for _ in range(4)] == [200, 200, 200, 429]

    own_stack.kill_sluice()

    for attempt in range(5):
        reply = timed_request(client, f"/block/after-{attempt}")
        assert reply.status == 200
        assert reply.echo()["path"] == f"/block/after-{attempt}"
    posted = timed_request(client, "/block/form", method="POST", body=b"name=value")
    assert posted.status == 200
    assert (posted.echo()["method"], posted.echo()["body_bytes"]) == ("POST", len(b"name=value"))


def test_upstream_error_status_still_reaches_the_client_when_failing_open(own_stack: Stack, front_door: str) -> None:
    own_stack.kill_sluice()

    reply = timed_request(Client(front_door_port(own_stack, front_door), "127.2.0.2"), "/anything?status=500")

    assert reply.status == 500
    assert reply.echo()["query"] == "status=500"


def test_failing_open_keeps_the_client_connection_open(own_stack: Stack, front_door: str) -> None:
    own_stack.kill_sluice()
    connection = http.client.HTTPConnection(
        LOOPBACK, front_door_port(own_stack, front_door), timeout=PROMPT_SECONDS, source_address=("127.2.0.3", 0)
    )
    try:
        for attempt in range(3):
            connection.request("GET", f"/kept/{attempt}")
            response = connection.getresponse()
            response.read()
            assert response.status == 200
            assert not response.will_close
    finally:
        connection.close()


def test_a_stuck_sluice_delays_requests_by_the_read_timeout_only(own_stack: Stack, front_door: str) -> None:
    client = Client(front_door_port(own_stack, front_door), "127.2.0.4")
    assert [client.request("/block/before").status for _ in range(4)] == [200, 200, 200, 429]
    sluice_pid = own_stack.components["sluice"].process.pid

    os.kill(sluice_pid, signal.SIGSTOP)
    try:
        replies = [timed_request(client, f"/block/stuck-{attempt}") for attempt in range(2)]
    finally:
        os.kill(sluice_pid, signal.SIGCONT)

    assert [reply.status for reply in replies] == [200, 200]


# Killing Sluice while requests are in flight: how many clients send, how
# many answers to wait for before and after the kill, and the bounds that
# keep the test finite whatever happens.
TRAFFIC_CLIENTS = 3
ANSWERS_BEFORE_KILL = 30
ANSWERS_AFTER_KILL = 90
MAX_REQUESTS_PER_CLIENT = 400
TRAFFIC_SECONDS = 15.0


class Traffic:
    """Clients sending requests back to back, each on one kept-alive connection."""

    def __init__(self, port: int, clients: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self._lock = threading.Lock()
        # (path asked for, status, body) of every answer; errors of the clients.
        self.answers: list[tuple[str, int, bytes]] = []
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._send, args=(f"127.2.1.{number}",), daemon=True)
            for number in range(1, clients + 1)
        ]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(PROMPT_SECONDS * 2)

    def answered(self) -> int:
        with self._lock:
            return len(self.answers)

    def wait_for_answers(self, count: int, deadline: float) -> None:
        """Until `count` answers in all, a client fails, or the deadline passes."""
        while self.answered() < count and not self.errors and time.monotonic() < deadline:
            if not any(thread.is_alive() for thread in self._threads):
                return
            time.sleep(0.01)

    def _send(self, source: str) -> None:
        connection = http.client.HTTPConnection(
            LOOPBACK, self.port, timeout=PROMPT_SECONDS, source_address=(source, 0)
        )
        try:
            for number in range(MAX_REQUESTS_PER_CLIENT):
                if self.stop.is_set():
                    return
                path = f"/traffic/{source}/{number}"
                connection.request("GET", path)
                response = connection.getresponse()
                answer = (path, response.status, response.read())
                with self._lock:
                    self.answers.append(answer)
        except (OSError, http.client.HTTPException) as error:
            with self._lock:
                self.errors.append(f"{source}: {error!r}")
        finally:
            connection.close()


# Envoy's own refusal past its limit on the requests it lets in unchecked
# (sluice-unchecked-filter.yaml).
ENVOY_UNCHECKED_LIMITED = (429, b"local_rate_limited")


def _not_from_the_upstream(answers: list[tuple[str, int, bytes]], front_door: str) -> list[tuple[str, int]]:
    """The answers that are neither the application's nor, with Envoy, its
    limit on unchecked requests: ext_authz cannot tell a dead Sluice from a
    late one, so a dead Sluice's requests go through that limit too (for
    limits.yaml, 10 a second per address in bursts of 20; nginx lets them
    all in)."""
    def echoed(path: str, body: bytes) -> bool:
        try:
            return bool(json.loads(body)["path"] == path)
        except (ValueError, KeyError):
            return False

    limited = {ENVOY_UNCHECKED_LIMITED} if front_door.startswith("envoy") else set()
    return [(path, status) for path, status, body in answers
            if (status, body) not in limited and (status != 200 or not echoed(path, body))]


def test_killing_sluice_under_traffic_costs_no_request(own_stack: Stack, front_door: str) -> None:
    deadline = time.monotonic() + TRAFFIC_SECONDS

    with Traffic(front_door_port(own_stack, front_door), TRAFFIC_CLIENTS) as traffic:
        traffic.wait_for_answers(ANSWERS_BEFORE_KILL, deadline)
        own_stack.kill_sluice()
        answered_at_kill = traffic.answered()
        traffic.wait_for_answers(answered_at_kill + ANSWERS_AFTER_KILL, deadline)

    assert traffic.errors == []
    assert answered_at_kill >= ANSWERS_BEFORE_KILL
    assert len(traffic.answers) >= answered_at_kill + ANSWERS_AFTER_KILL
    assert _not_from_the_upstream(traffic.answers, front_door) == []
