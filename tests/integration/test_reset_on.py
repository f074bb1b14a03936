"""Reset on success through every front door's response reports, with the
memory and the Redis backend: a successful login (200) wipes the failed-login
count, so an honest user who mistyped twice is not refused after a third
typo; without the success, the fourth failure is refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devstack.launcher import Stack
from tests.integration.clients import Client
from tests.integration.conftest import (
    fresh_client_address,
    front_door_port,
    sluice_metric,
    stack_on_backend,
    wait_until,
)

pytestmark = pytest.mark.integration

RULES = """\
rules:
  - id: login
    match: {path: {prefix: /login}}
    key: [ip]
    limit: {requests: 3, per: 1h}
    action: block
    count_on: {status: [401]}
    reset_on: {status: [200]}
"""
REPORT_DEADLINE_SECONDS = 5.0


@pytest.fixture(scope="module", params=["memory", "redis"])
def reset_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from stack_on_backend(request, tmp_path_factory, RULES)


def metric(stack: Stack, name: str) -> float:
    return sluice_metric(stack, name)


def attempt(stack: Stack, client: Client, status: int) -> int:
    """One login answered with ``status`` by the application; returns the
    status the client got, once Sluice has the response's report."""
    resets = metric(stack, "sluice_keys_reset_total")
    hits = sluice_metric(stack, "sluice_rule_hits_total", 'rule="login"')
    reply = client.request(f"/login?status={status}")
    if reply.status == 429:
        return 429
    if status == 401:
        wait_until(lambda: sluice_metric(stack, "sluice_rule_hits_total", 'rule="login"') > hits,
                   "the failed login counted", REPORT_DEADLINE_SECONDS)
    else:
        wait_until(lambda: metric(stack, "sluice_keys_reset_total") > resets, "the success reset the count",
                   REPORT_DEADLINE_SECONDS)
    return reply.status


def test_a_successful_login_wipes_the_failed_login_count(reset_stack: Stack, front_door: str) -> None:
    client = Client(front_door_port(reset_stack, front_door), fresh_client_address())
    statuses = [attempt(reset_stack, client, status) for status in (401, 401, 200, 401, 401, 401)]
    assert statuses == [401, 401, 200, 401, 401, 401]
    # Three failures since the success: the next attempt is refused.
    assert client.request("/login?status=401").status == 429


def test_without_a_success_the_fourth_failure_is_refused(reset_stack: Stack, front_door: str) -> None:
    client = Client(front_door_port(reset_stack, front_door), fresh_client_address())
    assert [attempt(reset_stack, client, 401) for _ in range(4)] == [401, 401, 401, 429]
