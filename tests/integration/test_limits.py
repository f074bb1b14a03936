"""What a client of nginx or Envoy sees with Sluice deciding.

Rules: rules/limits.yaml, one rule per path prefix. Every test sends from
its own loopback address and to paths of its own, and runs once through each
front door (the `front_door` fixture).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from devstack.launcher import Stack
from tests.integration.clients import Client, assert_default_block, assert_observed, assert_refused_by_closing
from tests.integration.conftest import fresh_client_address, unique_path

pytestmark = pytest.mark.integration


# Envoy's ext_authz takes any 5xx answer of the check for a failure of Sluice
# and, failing open, lets the request in. The template restores a 5xx
# status that Sluice sends as 403 with `x-sluice-status`; Sluice does not yet.

def test_allowed_request_reaches_the_upstream_with_the_original_request(new_client: Callable[..., Client]) -> None:
    client = new_client()

    reply = client.request("/hello/world?a=1&b=2", method="POST", headers={"X-Demo": "yes"}, body=b"payload")

    assert reply.status == 200
    echo = reply.echo()
    assert (echo["method"], echo["path"], echo["query"]) == ("POST", "/hello/world", "a=1&b=2")
    assert echo["headers"]["x-demo"] == "yes"
    assert echo["headers"]["x-forwarded-for"] == client.source
    assert echo["headers"]["x-request-id"]
    assert echo["body_bytes"] == len(b"payload")
    assert "X-RateLimit" not in reply.headers


def test_block_answers_429_with_headers_and_built_in_page_after_the_threshold(
    new_client: Callable[..., Client], upstream: Client
) -> None:
    client = new_client()
    path = unique_path("/block/")

    assert [client.request(path).status for _ in range(3)] == [200, 200, 200]
    blocked = client.request(path)

    assert_default_block(blocked, limit=3, reset=3600)
    # The upstream saw the three allowed requests; this one is its fourth.
    assert upstream.request(path).echo()["hits"] == 4


def test_block_keeps_refusing_the_key_while_other_addresses_pass(new_client: Callable[..., Client]) -> None:
    client, neighbour = new_client(), new_client()
    path = unique_path("/block/")

    statuses = [client.request(path).status for _ in range(6)]

    assert statuses == [200, 200, 200, 429, 429, 429]
    assert neighbour.request(path).status == 200


def test_block_with_custom_status_and_inline_page_escapes_substituted_values(
    new_client: Callable[..., Client], front_door: str
) -> None:
    client = new_client()
    path = unique_path("/busy/")
    # Envoy refuses a Host with < or >; & and ' are valid in a host name.
    host = "shop.example&b'"

    assert [client.request(path, headers={"Host": host}).status for _ in range(2)] == [200, 200]
    blocked = client.request(path, headers={"Host": host})

    assert blocked.status == 503
    assert blocked.body == f"busy, {client.source} at shop.example&amp;b&#x27;".encode()
    assert blocked.headers["X-RateLimit-Limit"] == "2"
    assert blocked.headers["Cache-Control"] == "no-store"


def test_block_with_page_file_renders_the_template(new_client: Callable[..., Client]) -> None:
    client = new_client()
    path = unique_path("/page/")

    assert client.request(path).status == 200
    blocked = client.request(path)

    assert blocked.status == 451
    request_id = blocked.headers["X-Request-Id"]
    assert f"Refused for {client.source}, request {request_id}.".encode() in blocked.body


def test_block_with_close_refuses_by_closing_the_connection(
    new_client: Callable[..., Client], upstream: Client, front_door: str
) -> None:
    client = new_client()
    path = unique_path("/close/")

    assert [client.request(path).status for _ in range(2)] == [200, 200]
    assert_refused_by_closing(client, path, front_door)
    assert upstream.request(path).echo()["hits"] == 3


def test_ban_refuses_every_later_request_of_the_address_only(
    new_client: Callable[..., Client], front_door: str
) -> None:
    client, neighbour = new_client(), new_client()
    path = unique_path("/ban/")

    assert [client.request(path).status for _ in range(2)] == [200, 200]
    assert_refused_by_closing(client, path, front_door)
    for other_path in ("/", unique_path("/elsewhere/"), unique_path("/observe/")):
        assert_refused_by_closing(client, other_path, front_door)
    assert neighbour.request(path).status == 200
    assert neighbour.request("/").status == 200


def test_observe_lets_over_limit_requests_through_with_over_limit_headers(
    new_client: Callable[..., Client],
) -> None:
    client = new_client()
    path = unique_path("/observe/")

    under = [client.request(path) for _ in range(2)]
    over = [client.request(path) for _ in range(2)]

    assert all(reply.status == 200 and "X-RateLimit" not in reply.headers for reply in under)
    for reply in over:
        assert_observed(reply, limit=2, reset=600)
        assert reply.echo()["path"] == path


def test_exempt_address_is_never_limited(new_client: Callable[..., Client]) -> None:
    exempt = new_client("127.0.99.7")  # exempt: [127.0.99.0/24]

    assert [exempt.request(unique_path("/block/")).status for _ in range(6)] == [200] * 6
    ban_path = unique_path("/ban/")
    assert [exempt.request(ban_path).status for _ in range(4)] == [200] * 4


def test_client_supplied_x_forwarded_for_gets_no_new_budget(new_client: Callable[..., Client]) -> None:
    client = new_client()
    path = unique_path("/block/")

    statuses = [
        client.request(path, headers={"X-Forwarded-For": f"203.0.113.{n}"}).status for n in range(1, 6)
    ]

    assert statuses == [200, 200, 200, 429, 429]


def test_client_supplied_sluice_client_address_gets_no_new_budget(new_client: Callable[..., Client]) -> None:
    client = new_client()
    path = unique_path("/block/")

    statuses = [
        client.request(path, headers={"X-Sluice-Client-Addr": f"203.0.113.{n}"}).status for n in range(1, 6)
    ]

    assert statuses == [200, 200, 200, 429, 429]


def test_x_forwarded_for_from_a_trusted_proxy_names_the_client(new_client: Callable[..., Client]) -> None:
    proxy = new_client("127.0.98.5")  # trusted_proxies: [127.0.98.0/24]
    path = unique_path("/block/")
    # Addresses of this test only: both front doors send as the same proxy.
    behind_proxy = [fresh_client_address() for _ in range(7)]

    rotating = [proxy.request(path, headers={"X-Forwarded-For": address}).status for address in behind_proxy[:6]]
    one_client = [proxy.request(path, headers={"X-Forwarded-For": behind_proxy[6]}).status for _ in range(4)]

    assert rotating == [200] * 6
    assert one_client == [200, 200, 200, 429]


def test_original_request_headers_reach_sluice_for_keys(new_client: Callable[..., Client]) -> None:
    client = new_client()
    path = unique_path("/keyed/")
    first_key, second_key = uuid.uuid4().hex, uuid.uuid4().hex

    first = [client.request(path, headers={"X-Api-Key": first_key}).status for _ in range(3)]
    second = client.request(path, headers={"X-Api-Key": second_key}).status

    assert first == [200, 200, 429]
    assert second == 200


def test_upstream_error_status_reaches_the_client_unchanged(new_client: Callable[..., Client]) -> None:
    client = new_client()

    for status in (500, 401, 403, 503):
        reply = client.request(f"/app-error?status={status}")
        assert reply.status == status
        assert reply.echo()["query"] == f"status={status}"


def test_nginx_internal_check_location_is_not_reachable_from_outside(limits_stack: Stack) -> None:
    client = Client(limits_stack.ports.nginx, fresh_client_address())

    assert client.request("/_sluice/auth").status == 404


def test_envoy_never_checks_the_health_route(limits_stack: Stack) -> None:
    client = Client(limits_stack.ports.envoy, fresh_client_address())

    health = [client.request(path) for path in ("/healthz", "/healthz", "/healthz/deep", "/healthz?full=1")]
    # Only the separated prefix is exempt: the rule applies to /healthzilla.
    beside = [client.request("/healthzilla").status for _ in range(2)]

    assert [(reply.status, reply.echo()["path"]) for reply in health] == [
        (200, "/healthz"),
        (200, "/healthz"),
        (200, "/healthz/deep"),
        (200, "/healthz"),
    ]
    assert beside == [200, 429]


def test_envoy_checks_paths_that_only_start_like_the_health_route(limits_stack: Stack) -> None:
    client = Client(limits_stack.ports.envoy, fresh_client_address())
    target = unique_path("/block/")
    disguised = [
        f"/healthz/..{target}",
        f"/healthz/%2e%2e{target}",
        f"/healthz/./..{target}",
        f"//healthz/.%2E{target}",
    ]

    replies = [client.request(path) for path in disguised]
    escaped_slash = client.request(f"/healthz/..%2F{target[1:]}")

    assert [reply.status for reply in replies] == [200, 200, 200, 429]
    assert [reply.echo()["path"] for reply in replies[:3]] == [target] * 3
    # Redirected to the path it names once unescaped and resolved.
    assert (escaped_slash.status, escaped_slash.headers["Location"]) == (307, target)
