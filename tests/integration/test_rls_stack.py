"""The fourth front door of `make run`: Envoy's ratelimit filter with the
shipped envoy-rls bootstrap and rate_limits, asking Sluice's Rate Limit
Service with examples/ratelimit/config (the package's default
configuration), unchanged. The RLS descriptors count in the same state as
the rules: a ban the Rate Limit Service issues closes the client at nginx."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.launcher import ENVOY_ADMIN_HOST, Stack
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
        wait_until_the_rls_answers(stack)
        yield stack
    finally:
        stack.stop()


# Envoy's ratelimit filter counts the calls it let through unchecked here.
FAILED_OPEN = r"ratelimit\.(error|failure_mode_allowed)$"
RLS_ANSWER_SECONDS = 10.0


def envoy_stats(stack: Stack, pattern: str) -> dict[str, int]:
    """The counters of envoy-rls's admin /stats whose names match ``pattern``."""
    connection = http.client.HTTPConnection(ENVOY_ADMIN_HOST, stack.ports.envoy_rls_admin, timeout=2.0)
    try:
        connection.request("GET", f"/stats?filter={pattern}")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    stats: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.isdigit():
            stats[name] = int(value)
    return stats


def failed_open(stack: Stack) -> int:
    return sum(envoy_stats(stack, FAILED_OPEN).values())


def why_unanswered(stack: Stack) -> str:
    """What envoy-rls and Sluice say about the Rate Limit Service's calls."""
    counted = {name: value for name, value in envoy_stats(stack, "ratelimit|sluice_grpc").items() if value}
    logs = stack.run_dir / "logs"
    tails = "\n".join(f"--- {name}:\n" + "\n".join((logs / name).read_text(errors="replace").splitlines()[-15:])
                      for name in ("envoy-rls.log", "sluice.log") if (logs / name).is_file())
    return f"Envoy's counters: {counted}\n{tails}"


def wait_until_the_rls_answers(stack: Stack) -> None:
    """Until a request through envoy-rls carries the headers of Sluice's
    answer. The filter fails open (failure_mode_deny: false): a stack
    whose Rate Limit Service does not answer yet lets every request
    through, which the tests below would take for counts gone wrong. The
    probe's address is one no test sends from."""
    probe = rls_client(stack)
    deadline = time.monotonic() + RLS_ANSWER_SECONDS
    while "x-ratelimit-limit" not in probe.request("/").headers:
        if time.monotonic() > deadline:
            pytest.fail(f"no answer of Sluice's Rate Limit Service through envoy-rls within "
                        f"{RLS_ANSWER_SECONDS} s\n{why_unanswered(stack)}")
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def envoy_never_fails_open(rls_stack: Stack) -> Iterator[None]:
    """Each test: no request let through because Sluice's Rate Limit
    Service did not answer, or answered with an error."""
    before = failed_open(rls_stack)
    yield
    assert failed_open(rls_stack) == before, why_unanswered(rls_stack)


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
