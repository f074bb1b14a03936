"""Sluice's memory does not grow with the size of X-Forwarded-For (D3).

Thousands of requests, each with a different X-Forwarded-For of about 50 KB,
through Envoy (which passes up to 60 KiB on) and straight to Sluice's nginx
endpoint, must leave Sluice's resident memory where a warm-up left it: the
client address resolution may remember nothing keyed on the header. Before the
fix, a cache keyed on the whole header kept every one of them (100 MB per
2,000).
"""

from __future__ import annotations

import http.client
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.launcher import Stack
from tests.integration.clients import LOOPBACK
from tests.integration.conftest import fresh_client_address, start_stack

pytestmark = pytest.mark.integration

# Every request is checked; after the first, every one is refused by Sluice
# itself, so that the application never sees (or echoes) the large headers.
RULES = """
rules:
  - id: everyone
    match: {path: {prefix: /}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
"""
TRUSTED = "client_ip:\n  trusted_proxies: [127.0.0.0/8]\n"

HEADER_BYTES = 50_000
REQUESTS = 2_000
WARM_UP = 300
# Resident memory Sluice may gain over REQUESTS requests through each door
# after the warm-up: allocator noise, never the headers (REQUESTS x 50 KB is
# 100 MB a door).
GROWTH_LIMIT_BYTES = 20 * 1024 * 1024

_numbers = itertools.count()


def forwarded_for() -> str:
    """A new ~50 KB X-Forwarded-For: distinct on the left, one client on the
    right (203.0.113.7, untrusted), so that with trusted proxies every
    request resolves to the same single counting key."""
    number = next(_numbers)
    filler = "x" * (HEADER_BYTES - 40)
    return f"{number}{filler}, 203.0.113.7"


def sluice_rss(stack: Stack) -> int:
    """VmRSS of the Sluice process (one worker: the process the launcher started)."""
    pid = stack.components["sluice"].process.pid
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/PID/status")


class Door:
    """One persistent connection, through Envoy or straight to Sluice."""

    def __init__(self, stack: Stack, via: str) -> None:
        self.via = via
        port = stack.ports.envoy if via == "envoy" else stack.ports.sluice
        self.connection = http.client.HTTPConnection(LOOPBACK, port, timeout=10,
                                                     source_address=(fresh_client_address(), 0))

    def send(self) -> int:
        if self.via == "envoy":
            path, headers = "/memory", {"X-Forwarded-For": forwarded_for()}
        else:
            # What nginx's check subrequest carries (sluice.conf.template).
            path, headers = "/v1/nginx/auth", {
                "X-Sluice-Client-Addr": "127.0.0.1", "X-Original-Method": "GET",
                "X-Original-URI": "/memory", "X-Original-Host": "example.test",
                "X-Forwarded-For": forwarded_for(),
            }
        self.connection.request("GET", path, headers=headers)
        response = self.connection.getresponse()
        response.read()
        return response.status

    def close(self) -> None:
        self.connection.close()


@pytest.fixture(scope="module", params=["no trusted proxies", "trusted proxies 127.0.0.0/8"])
def memory_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("header-memory")
    rules = run_dir / "rules.yaml"
    rules.write_text((TRUSTED if "trusted proxies 127" in request.param else "") + RULES)
    stack = start_stack(run_dir / "stack", rules)
    yield stack
    stack.stop()


def test_distinct_large_forwarded_for_values_do_not_grow_sluice(memory_stack: Stack) -> None:
    doors = [Door(memory_stack, "envoy"), Door(memory_stack, "sluice")]
    try:
        # The first request of each client is allowed, the rest refused:
        # either way Sluice resolved the client from this very request.
        for door in doors:
            statuses = {door.send() for _ in range(WARM_UP)}
            assert statuses <= {200, 403, 429}, (door.via, statuses)
            assert statuses & {403, 429}, (door.via, statuses)  # Sluice decided
        before = sluice_rss(memory_stack)

        for door in doors:
            # A fresh connection: the other door's turn may have outlasted
            # uvicorn's keep-alive timeout (5 s) for this idle one.
            door.connection.close()
            statuses = {door.send() for _ in range(REQUESTS)}
            # Still Sluice's refusals: no request went unchecked or failed.
            assert statuses == ({429} if door.via == "envoy" else {403}), (door.via, statuses)

        growth = sluice_rss(memory_stack) - before
    finally:
        for door in doors:
            door.close()
    assert growth < GROWTH_LIMIT_BYTES, f"Sluice grew by {growth / 2**20:.1f} MiB"
