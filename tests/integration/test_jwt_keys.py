"""JWT claims as keys and conditions, through every front door.

Sluice verifies tokens against a JWKS served on loopback by the test
(tests/jwks.py), fetched in the background every second; the server
rotates its keys while the stack runs. Each user is counted apart under
``jwt:sub`` whatever address they come from, a rule for the free plan
reads a claim, and a request without a valid token is counted under its
address, never refused for it nor answered with a 5xx.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from devstack.launcher import Stack
from tests.integration.clients import Client
from tests.integration.conftest import (
    fresh_client_address,
    front_door_port,
    sluice_metric,
    stack_on,
    unique_path,
    wait_until,
)
from tests.jwks import Issuer, JwksServer

pytestmark = pytest.mark.integration

ISSUER = Issuer()
# Every request is counted by the second rule; the first counts free-plan
# users only, and lower.
RULES = """
jwt:
  keys: {{url: "{url}", refresh: 1s}}
  algorithms: [RS256, ES256]
  audience: api
rules:
  - id: free-plan
    match: {{all: [{{path: {{prefix: /jwt/}}}}, {{jwt: {{claim: plan, equals: free}}}}]}}
    key: ["jwt:sub", path]
    limit: {{requests: 2, per: 1h}}
    action: block
  - id: per-user
    match: {{path: {{prefix: /jwt/}}}}
    key: ["jwt:sub", path]
    limit: {{requests: 4, per: 1h}}
    action: block
"""


@pytest.fixture(scope="module")
def jwks() -> Iterator[JwksServer]:
    server = JwksServer(ISSUER.jwks(("RS256", "ES256")))
    yield server
    server.close()


@pytest.fixture(scope="module")
def jwt_stack(tmp_path_factory: pytest.TempPathFactory, jwks: JwksServer) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("jwt-stack")
    with stack_on(directory, RULES.format(url=jwks.url)) as stack:
        wait_until(lambda: sluice_metric(stack, "sluice_jwt_keys") == 2, "Sluice fetched the JWKS", 15)
        yield stack


def token(sub: str, plan: str, algorithm: str = "RS256", generation: int = 0) -> str:
    return ISSUER.token({"sub": sub, "plan": plan, "aud": "api"}, algorithm, generation)


def statuses(stack: Stack, front_door: str, path: str, bearer: str | None, times: int,
             new_address: bool = False) -> list[int]:
    """The statuses of ``times`` requests, each from the same address or a new one."""
    port = front_door_port(stack, front_door)
    address = fresh_client_address()
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    found = []
    for _ in range(times):
        client = Client(port, fresh_client_address() if new_address else address)
        found.append(client.request(path, headers=headers).status)
    return found


@pytest.mark.parametrize("front_door", ["nginx", "envoy", "envoy-grpc"])
def test_each_user_is_counted_apart_whatever_address_they_come_from(jwt_stack: Stack, front_door: str) -> None:
    path = unique_path("/jwt/")
    alice, bob = token("alice", "free"), token("bob", "pro", "ES256")

    assert statuses(jwt_stack, front_door, path, alice, 3, new_address=True) == [200, 200, 429]
    assert statuses(jwt_stack, front_door, path, bob, 5, new_address=True) == [200] * 4 + [429]
    assert statuses(jwt_stack, front_door, path, token("carol", "free"), 1) == [200]


@pytest.mark.parametrize("front_door", ["nginx", "envoy"])
def test_a_request_without_a_valid_token_is_counted_under_its_address(jwt_stack: Stack, front_door: str) -> None:
    path = unique_path("/jwt/")
    invalid = ["junk", token("mallory", "free")[:-4] + "AAAA", None, Issuer().token({"sub": "x", "aud": "api"})]
    before = sluice_metric(jwt_stack, "sluice_jwt_tokens_total", 'outcome="malformed"')
    port = front_door_port(jwt_stack, front_door)
    client = Client(port, fresh_client_address())

    answers = [client.request(path, headers={"Authorization": f"Bearer {text}"} if text else {}).status
               for text in invalid + ["junk"]]

    assert answers == [200, 200, 200, 200, 429]  # one address's budget of four
    assert Client(port, fresh_client_address()).request(path, headers={"Authorization": "Bearer junk"}).status == 200
    assert sluice_metric(jwt_stack, "sluice_jwt_tokens_total", 'outcome="malformed"') >= before + 3


def test_keys_rotated_by_the_identity_provider_are_followed(jwt_stack: Stack, jwks: JwksServer) -> None:
    rotated = token(f"dave-{uuid.uuid4().hex}", "free", generation=1)
    unknown = sluice_metric(jwt_stack, "sluice_jwt_tokens_total", 'outcome="unknown_key"')
    # Not a key of the set yet: the user is counted under the address.
    assert statuses(jwt_stack, "nginx", unique_path("/jwt/"), rotated, 3, new_address=True) == [200, 200, 200]
    assert sluice_metric(jwt_stack, "sluice_jwt_tokens_total", 'outcome="unknown_key"') == unknown + 3

    fetched = sluice_metric(jwt_stack, "sluice_jwt_key_fetches_total", 'result="succeeded"')
    jwks.rotate(ISSUER.jwks(("RS256", "ES256"), generation=1))
    try:
        # Two fetches after the rotation: at least one began after it.
        wait_until(lambda: sluice_metric(jwt_stack, "sluice_jwt_key_fetches_total", 'result="succeeded"')
                   >= fetched + 2, "the rotated keys were fetched", 15)
        assert statuses(jwt_stack, "nginx", unique_path("/jwt/"), rotated, 3, new_address=True) == [200, 200, 429]
        assert statuses(jwt_stack, "envoy", unique_path("/jwt/"), token("erin", "free"), 1) == [200]
    finally:
        jwks.rotate(ISSUER.jwks(("RS256", "ES256")))  # back, for the other tests


def test_the_last_keys_are_kept_while_the_jwks_server_fails(jwt_stack: Stack, jwks: JwksServer) -> None:
    fetched = sluice_metric(jwt_stack, "sluice_jwt_key_fetches_total", 'result="succeeded"')
    wait_until(lambda: sluice_metric(jwt_stack, "sluice_jwt_key_fetches_total", 'result="succeeded"')
               >= fetched + 2, "the served keys were fetched", 15)  # what the test before left served
    failed = sluice_metric(jwt_stack, "sluice_jwt_key_fetches_total", 'result="failed"')
    jwks.answering = False
    try:
        wait_until(lambda: sluice_metric(jwt_stack, "sluice_jwt_key_fetches_total", 'result="failed"') >= failed + 1,
                   "a fetch failed", 15)
        assert sluice_metric(jwt_stack, "sluice_jwt_keys") == 2
        assert statuses(jwt_stack, "nginx", unique_path("/jwt/"), token("frank", "free"), 3,
                        new_address=True) == [200, 200, 429]
    finally:
        jwks.answering = True
