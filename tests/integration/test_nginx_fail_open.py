"""With Sluice gone or stuck, nginx lets traffic through (SPEC §9 fail open, §11)."""

from __future__ import annotations

import http.client
import os
import signal
import time

import pytest

from sidecar.launcher import Stack
from tests.integration.clients import LOOPBACK, Client, Reply

pytestmark = pytest.mark.integration

# nginx gives up on Sluice after 100 ms (connect) or 1 s (answer); a request
# slower than this waited for something it should not have.
PROMPT_SECONDS = 3.0


def timed_request(client: Client, path: str, method: str = "GET", body: bytes | None = None) -> Reply:
    started = time.monotonic()
    reply = client.request(path, method=method, body=body)
    assert time.monotonic() - started < PROMPT_SECONDS
    return reply


def test_requests_reach_the_upstream_promptly_after_sluice_is_killed(own_stack: Stack) -> None:
    client = Client(own_stack.ports.nginx, "127.2.0.1")
    assert [client.request("/block/before").status for _ in range(4)] == [200, 200, 200, 429]

    own_stack.kill_sluice()

    for attempt in range(5):
        reply = timed_request(client, f"/block/after-{attempt}")
        assert reply.status == 200
        assert reply.echo()["path"] == f"/block/after-{attempt}"
    posted = timed_request(client, "/block/form", method="POST", body=b"name=value")
    assert posted.status == 200
    assert (posted.echo()["method"], posted.echo()["body_bytes"]) == ("POST", len(b"name=value"))


def test_upstream_error_status_still_reaches_the_client_when_failing_open(own_stack: Stack) -> None:
    own_stack.kill_sluice()

    reply = timed_request(Client(own_stack.ports.nginx, "127.2.0.2"), "/anything?status=500")

    assert reply.status == 500
    assert reply.echo()["query"] == "status=500"


def test_failing_open_keeps_the_client_connection_open(own_stack: Stack) -> None:
    own_stack.kill_sluice()
    connection = http.client.HTTPConnection(
        LOOPBACK, own_stack.ports.nginx, timeout=PROMPT_SECONDS, source_address=("127.2.0.3", 0)
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


def test_a_stuck_sluice_delays_requests_by_the_read_timeout_only(own_stack: Stack) -> None:
    client = Client(own_stack.ports.nginx, "127.2.0.4")
    assert [client.request("/block/before").status for _ in range(4)] == [200, 200, 200, 429]
    sluice_pid = own_stack.components["sluice"].process.pid

    os.kill(sluice_pid, signal.SIGSTOP)
    try:
        replies = [timed_request(client, f"/block/stuck-{attempt}") for attempt in range(2)]
    finally:
        os.kill(sluice_pid, signal.SIGCONT)

    assert [reply.status for reply in replies] == [200, 200]
