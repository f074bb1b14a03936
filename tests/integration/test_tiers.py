"""Tiers through every front door: an API key's tier, from the tiers file
or assigned at run time through the admin API, sets the threshold its
requests are counted against, whatever address they come from."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest

from devstack.launcher import Stack
from tests.integration.clients import LOOPBACK, Client
from tests.integration.conftest import fresh_client_address, front_door_port, stack_on, unique_path

pytestmark = pytest.mark.integration

RULES = """
tiers:
  names: [free, pro]
  default: free
  identity: header:x-api-key
  file: tiers.yaml
rules:
  - id: metered
    match: {path: {prefix: /metered/}}
    key: ["header:x-api-key", path]
    limit: {requests: 2, per: 1h}
    tiers: {pro: 5}
    action: block
"""


@pytest.fixture(scope="module")
def tiers_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("tiers-stack")
    (directory / "tiers.yaml").write_text("pro: [key-from-file]\n")
    with stack_on(directory, RULES) as stack:
        yield stack


def statuses(stack: Stack, front_door: str, path: str, key: str, times: int) -> list[int]:
    """The statuses of ``times`` requests with the API key, each from a new address."""
    port = front_door_port(stack, front_door)
    return [Client(port, fresh_client_address()).request(path, headers={"X-Api-Key": key}).status
            for _ in range(times)]


def admin(stack: Stack, method: str, body: dict[str, str]) -> int:
    """An admin call to the stack's Sluice (a loopback listener: no token)."""
    connection = http.client.HTTPConnection(LOOPBACK, stack.ports.sluice, timeout=5)
    try:
        connection.request(method, "/v1/admin/tiers", body=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        return connection.getresponse().status
    finally:
        connection.close()


@pytest.mark.parametrize("front_door", ["nginx", "envoy", "envoy-grpc"])
def test_a_keys_tier_sets_its_threshold_and_an_assignment_at_run_time_takes_effect_at_once(
        tiers_stack: Stack, front_door: str) -> None:
    path = unique_path("/metered/")

    assert statuses(tiers_stack, front_door, path, "key-from-file", 6) == [200] * 5 + [429]
    assert statuses(tiers_stack, front_door, path, "key-unknown", 3) == [200] * 2 + [429]  # free

    fresh = f"key-{front_door}"
    assert admin(tiers_stack, "POST", {"identity": fresh, "tier": "pro"}) == 200
    assert statuses(tiers_stack, front_door, path, fresh, 6) == [200] * 5 + [429]
    assert admin(tiers_stack, "DELETE", {"identity": fresh}) == 204
    assert statuses(tiers_stack, front_door, unique_path("/metered/"), fresh, 3) == [200] * 2 + [429]
