"""Rules that react to behaviour, through every front door, with the memory
backend, a Redis and a Redis Cluster: a repeat ban lasts twice the first
(the first is lifted through the admin API instead of waited out), and an
address that trips a challenge rule's penalty again and again without
solving it is closed at the door, while one that solves it is not."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

import pytest

from devstack.launcher import Stack
from sidecar.challenge import solve
from tests.integration.clients import Client, assert_let_in_after_unban, assert_refused_by_closing
from tests.integration.conftest import fresh_client_address, front_door_port, stack_on_backend, wait_until
from tests.integration.test_challenge import challenge_of

pytestmark = pytest.mark.integration

HTML = {"Accept": "text/html"}
RULES = """\
challenge:
  difficulty: 4
  auto_ban: {challenges: 1000, per: 60s, ban: 1h}
rules:
  - id: scrapers
    match: {path: {prefix: /scrape/}}
    key: [ip]
    limit: {requests: 2, per: 1h}
    action: ban
    ban: {duration: 1h, increment: {factor: 2, max: 1d, remember: 1d}}
  - id: pages
    match: {path: {prefix: /pages/}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    penalty: 300ms
    action: challenge
    challenge: {ttl: 1h, then_ban_after: 2}
"""
PENALTY_DEADLINE_SECONDS = 5.0


@pytest.fixture(scope="module", params=["memory", "redis", "cluster"])
def reacting_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from stack_on_backend(request, tmp_path_factory, RULES)


def bans_of(stack: Stack, address: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{stack.sluice_url}/v1/admin/bans", timeout=5) as answer:
        return [ban for ban in json.load(answer) if ban["address"] == address]


def lift(stack: Stack, address: str) -> None:
    request = urllib.request.Request(f"{stack.sluice_url}/v1/admin/bans?address={quote(address)}",
                                     method="DELETE")
    with urllib.request.urlopen(request, timeout=5) as answer:
        assert answer.status == 204


def test_a_repeat_ban_lasts_twice_the_first(reacting_stack: Stack, front_door: str) -> None:
    address = fresh_client_address()
    client = Client(front_door_port(reacting_stack, front_door), address)
    listed = []
    for _ in range(2):
        assert [client.request("/scrape/page").status for _ in range(2)] == [200, 200]
        assert_refused_by_closing(client, "/scrape/page", front_door)
        assert_refused_by_closing(client, "/elsewhere", front_door)
        [ban] = bans_of(reacting_stack, address)
        listed.append(ban)
        lift(reacting_stack, address)
        assert_let_in_after_unban(client, "/elsewhere", front_door)
    assert [(ban["rule"], ban["step"], ban["duration_seconds"]) for ban in listed] == \
        [("scrapers", 0, 3600), ("scrapers", 1, 7200)]
    assert 3500 < listed[0]["remaining_seconds"] <= 3600
    assert 7100 < listed[1]["remaining_seconds"] <= 7200


def start_penalty(client: Client) -> None:
    """Poll until the rule's last penalty is over: the request that passes
    starts the next one (a threshold of 1). The requests in between are
    challenged within the penalty that counted already."""
    wait_until(lambda: client.request("/pages/a", headers=HTML).status == 200, "a penalty ended",
               PENALTY_DEADLINE_SECONDS)


def test_after_then_ban_after_unsolved_penalties_the_address_is_closed_at_the_door(
        reacting_stack: Stack, front_door: str) -> None:
    address = fresh_client_address()
    client = Client(front_door_port(reacting_stack, front_door), address)
    for _ in range(2):
        start_penalty(client)
        assert client.request("/pages/a", headers=HTML).status == 403
    assert bans_of(reacting_stack, address) == []
    # The third penalty's first challenged request bans the address.
    start_penalty(client)
    assert_refused_by_closing(client, "/pages/a", front_door)
    assert_refused_by_closing(client, "/scrape/other", front_door)
    [ban] = bans_of(reacting_stack, address)
    assert (ban["rule"], ban["duration_seconds"], ban["step"]) == ("pages", 3600, 0)


def test_a_client_that_solves_the_challenge_is_not_banned(reacting_stack: Stack, front_door: str) -> None:
    address = fresh_client_address()
    client = Client(front_door_port(reacting_stack, front_door), address)
    start_penalty(client)
    assert client.request("/pages/a", headers=HTML).status == 403
    start_penalty(client)
    challenge, difficulty = challenge_of(client.request("/pages/a", headers=HTML))
    answer = client.request("/.sluice/challenge", method="POST",
                            headers={"Content-Type": "application/x-www-form-urlencoded"},
                            body=urlencode({"challenge": challenge, "nonce": solve(challenge, difficulty)}).encode())
    assert answer.status == 303
    cookie = {**HTML, "Cookie": answer.headers["Set-Cookie"].split(";")[0]}
    # Long enough for several penalties of the rule: the credential passes
    # it, so none starts.
    until = time.monotonic() + 1.0
    while time.monotonic() < until:
        assert client.request("/pages/a", headers=cookie).status == 200
    assert bans_of(reacting_stack, address) == []
