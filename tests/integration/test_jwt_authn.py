"""Tokens Envoy verified: its jwt_authn filter checks the signature and
forwards the payload in a header, and Sluice reads the claims from that
header without verifying them again (``verified_by_proxy: true``,
``token: {payload_header: ...}``).

The stack's Envoy bootstrap is given, ahead of Sluice's filters, a
header_mutation filter that removes any payload header the client sent,
then jwt_authn with the issuer's keys inline, letting requests without a
valid token through without the header. Each user is then counted apart
whatever address they come from; a client that forges the payload header
is counted under its address, as is one whose token Envoy refused.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.integration.clients import Client
from tests.integration.conftest import another_envoy, fresh_client_address, stack_on, unique_path
from tests.jwks import Issuer

pytestmark = pytest.mark.integration

ISSUER = Issuer()
PAYLOAD_HEADER = "x-jwt-payload"
RULES = f"""
jwt:
  token: {{payload_header: {PAYLOAD_HEADER}}}
  verified_by_proxy: true
rules:
  - id: per-user
    match: {{path: {{prefix: /authn/}}}}
    key: ["jwt:sub", path]
    limit: {{requests: 2, per: 1h}}
    action: block
"""


def envoy_filters() -> list[dict[str, Any]]:
    """The two filters a site puts ahead of Sluice's: the client's own
    payload header removed, then the token verified."""
    return [
        {"name": "envoy.filters.http.header_mutation", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": PAYLOAD_HEADER}]}}},
        {"name": "envoy.filters.http.jwt_authn", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {"issuer": {
                "local_jwks": {"inline_string": json.dumps(ISSUER.jwks(("RS256",)))},
                "forward": True,
                "forward_payload_header": PAYLOAD_HEADER,
            }},
            "rules": [{"match": {"prefix": "/"}, "requires": {"requires_any": {"requirements": [
                {"provider_name": "issuer"}, {"allow_missing_or_failed": {}}]}}}],
        }},
    ]


def with_jwt_authn(bootstrap_text: str) -> str:
    bootstrap = yaml.safe_load(bootstrap_text)
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"][:0] = envoy_filters()
    return yaml.safe_dump(bootstrap)


@pytest.fixture(scope="module")
def authn_envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    directory = tmp_path_factory.mktemp("jwt-authn")
    with stack_on(directory, RULES) as stack, \
            another_envoy(with_jwt_authn((stack.run_dir / "envoy.yaml").read_text()), directory,
                          "envoy-jwt-authn") as port:
        yield port


def statuses(port: int, path: str, headers: dict[str, str], times: int, new_address: bool = True) -> list[int]:
    address = fresh_client_address()
    return [Client(port, fresh_client_address() if new_address else address).request(path, headers=headers).status
            for _ in range(times)]


def bearer(sub: str) -> dict[str, str]:
    return {"Authorization": "Bearer " + ISSUER.token({"sub": sub}, "RS256")}


def test_each_user_envoy_verified_is_counted_apart_whatever_address(authn_envoy: int) -> None:
    path = unique_path("/authn/")
    assert statuses(authn_envoy, path, bearer("alice"), 3) == [200, 200, 429]
    assert statuses(authn_envoy, path, bearer("bob"), 2) == [200, 200]


def test_a_forged_payload_header_is_removed_and_the_client_counted_by_its_address(authn_envoy: int) -> None:
    path = unique_path("/authn/")
    forged = base64.urlsafe_b64encode(json.dumps({"sub": "victim"}).encode()).rstrip(b"=").decode()
    # From new addresses each time: were the header believed, the third
    # would be refused as the victim's.
    assert statuses(authn_envoy, path, {PAYLOAD_HEADER: forged}, 3) == [200, 200, 200]
    assert statuses(authn_envoy, path, {PAYLOAD_HEADER: forged}, 3, new_address=False) == [200, 200, 429]
    assert statuses(authn_envoy, path, bearer("victim"), 2) == [200, 200]  # the victim's own count is whole


def test_a_token_envoy_refused_counts_under_the_address(authn_envoy: int) -> None:
    path = unique_path("/authn/")
    wrong = {"Authorization": "Bearer " + Issuer().token({"sub": "alice"}, "RS256")}  # another issuer's key
    assert statuses(authn_envoy, path, wrong, 3) == [200, 200, 200]
    assert statuses(authn_envoy, path, wrong, 3, new_address=False) == [200, 200, 429]
