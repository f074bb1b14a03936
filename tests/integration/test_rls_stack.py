"""The fourth front door of `make run`: Envoy's ratelimit filter with the
shipped envoy-rls bootstrap and rate_limits, asking Sluice's Rate Limit
Service with examples/ratelimit/config (the package's default
configuration), unchanged. The RLS descriptors count in the same state as
the rules: a ban the Rate Limit Service issues closes the client at nginx."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.launcher import Stack
from tests.integration.clients import CONNECTION_CLOSED, Client
from tests.integration.conftest import fresh_client_address, sluice_metric, start_stack

pytestmark = pytest.mark.integration

EXAMPLE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "ratelimit" / "config"


@pytest.fixture(scope="module")
def rls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("rls-stack")
    rules = run_dir / "rules.yaml"
    rules.write_text("rules: []\n")  # the HTTP doors refuse only what is banned
    stack = start_stack(run_dir, rules, rls_config=EXAMPLE_CONFIG)
    try:
        yield stack
    finally:
        stack.stop()


def rls_client(stack: Stack) -> Client:
    return Client(stack.ports.envoy_rls, fresh_client_address())


def test_an_api_keys_token_bucket_passes_its_burst_then_429_with_the_draft_headers(rls_stack: Stack) -> None:
    client = rls_client(rls_stack)
    replies = [client.request("/items", headers={"x-api-key": "demo"}) for _ in range(12)]
    assert [reply.status for reply in replies] == [200] * 10 + [429] * 2
    first, refused = replies[0].headers, replies[-1].headers
    # The tightest limit is the key's bucket: 9 left after the first.
    assert (first["x-ratelimit-limit"], first["x-ratelimit-remaining"]) == ("2, 60;w=60, 2;w=1", "9")
    assert refused["x-envoy-ratelimited"] == "true" and refused["x-ratelimit-remaining"] == "0"
    # Another key of the same client has a bucket of its own.
    assert client.request("/items", headers={"x-api-key": "other"}).status == 200


def test_a_clients_requests_count_per_address_in_fixed_minutes(rls_stack: Stack) -> None:
    if time.time() % 60 > 45:  # start within a minute, so that all land in one window
        time.sleep(60 - time.time() % 60 + 0.1)
    client = rls_client(rls_stack)
    statuses = [client.request("/").status for _ in range(61)]
    assert statuses == [200] * 60 + [429]
    # Another address counts on its own.
    assert rls_client(rls_stack).request("/").status == 200


def test_a_login_ban_from_the_rate_limit_service_closes_the_client_at_nginx(rls_stack: Stack) -> None:
    address = fresh_client_address()
    client = Client(rls_stack.ports.envoy_rls, address)
    assert [client.request("/login", method="POST").status for _ in range(7)] == [200] * 5 + [429] * 2
    # nginx closes a banned client's connection without a response (444).
    with pytest.raises(CONNECTION_CLOSED):
        Client(rls_stack.ports.nginx, address).request("/")
    assert Client(rls_stack.ports.nginx, fresh_client_address()).request("/").status == 200
    with urllib.request.urlopen(f"{rls_stack.sluice_url}/v1/admin/bans", timeout=5) as answer:
        bans = json.load(answer)
    assert [(ban["address"], ban["rule"]) for ban in bans if ban["address"] == address] == \
        [(address, "sluice.path_login.remote_address")]
    assert sluice_metric(rls_stack, "ratelimit_service_rate_limit_over_limit",
                         'domain="sluice",key1="path_login",key2="remote_address"') >= 1


def test_the_health_paths_of_envoyproxy_ratelimit_answer(rls_stack: Stack) -> None:
    with urllib.request.urlopen(f"{rls_stack.sluice_url}/healthcheck", timeout=5) as answer:
        assert (answer.status, answer.read()) == (200, b"OK")
