"""Shadow mode through every front door, with the memory and the Redis backend: a shadow rule over its limit lets
the request through with the over-limit headers and X-RateLimit-Shadow;
the same rule switched to enforcing by a reload refuses the very next
request, because its counters and its penalty stayed."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.launcher import Stack
from tests.integration.clients import Client
from tests.integration.conftest import fresh_client_address, front_door_port, sluice_metric, start_stack, state_for

pytestmark = pytest.mark.integration

SHADOW_RULES = """\
rules:
  - id: api
    match: {path: {prefix: /api/}}
    key: [ip]
    limit: {requests: 2, per: 1h}
    action: block
    shadow: true
  - id: scrapers
    match: {path: {prefix: /scrape/}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: ban
    ban: {duration: 1h}
    shadow: true
"""


@pytest.fixture(scope="module", params=["memory", "redis"])
def shadow_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[Stack, Path, str]]:
    directory = tmp_path_factory.mktemp(f"shadow-{request.param}")
    rules = directory / "rules.yaml"
    state = state_for(request, request.param)
    rules.write_text(state + SHADOW_RULES)
    stack = start_stack(directory / "stack", rules)
    try:
        yield stack, rules, state
    finally:
        stack.stop()


def reload(stack: Stack) -> None:
    request = urllib.request.Request(f"{stack.sluice_url}/v1/admin/reload", method="POST")
    with urllib.request.urlopen(request, timeout=5) as answer:
        assert answer.status == 200


def test_a_shadow_rule_lets_requests_through_and_enforcing_it_refuses_the_next(
        shadow_stack: tuple[Stack, Path, str], front_door: str) -> None:
    stack, rules, state = shadow_stack
    client = Client(front_door_port(stack, front_door), fresh_client_address())
    before = sluice_metric(stack, "sluice_shadow_actions_total", 'action="block",rule="api"')
    replies = [client.request("/api/items") for _ in range(4)]
    assert [reply.status for reply in replies] == [200] * 4
    # The second request reaches the limit (and is allowed as when enforcing); 3 and 4 are over it.
    assert [reply.headers.get("x-ratelimit-shadow") for reply in replies] == [None, None, "true", "true"]
    assert replies[-1].headers["x-ratelimit-limit"] == "2"
    assert sluice_metric(stack, "sluice_shadow_actions_total", 'action="block",rule="api"') == before + 2
    try:
        rules.write_text(state + SHADOW_RULES.replace("    shadow: true\n", ""))
        reload(stack)
        assert client.request("/api/items").status == 429
    finally:
        rules.write_text(state + SHADOW_RULES)
        reload(stack)


def test_a_shadow_ban_closes_nothing_and_is_listed_as_shadow(shadow_stack: tuple[Stack, Path, str],
                                                              front_door: str) -> None:
    stack, _, _ = shadow_stack
    address = fresh_client_address()
    client = Client(front_door_port(stack, front_door), address)
    assert [client.request("/scrape/page").status for _ in range(3)] == [200] * 3
    with urllib.request.urlopen(f"{stack.sluice_url}/v1/admin/bans", timeout=5) as answer:
        bans = [ban for ban in json.load(answer) if ban["address"] == address]
    assert [(ban["rule"], ban["shadow"]) for ban in bans] == [("scrapers", True)]
