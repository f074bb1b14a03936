"""Refusals in JSON through real nginx and Envoy (HTTP and gRPC ext_authz)
and forward-auth: the client gets ``Content-Type: application/json`` and a
body it can parse when its Accept header prefers JSON or the rule always
sends JSON, and the HTML page when a browser asks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from devstack.launcher import FRONT_DOORS, Stack
from tests.integration.clients import Client, Reply
from tests.integration.conftest import fresh_client_address, front_door_port, sluice_metric, start_stack, unique_path

pytestmark = pytest.mark.integration

# The first rule holds for a whole address once over its limit: nginx then
# answers the client's checks from its cache of refusals, one answer per
# Accept header. The others are one per path prefix; every test sends from
# addresses of its own, at most five requests each.
RULES = """
rules:
  - id: everyone
    key: [ip]
    limit: {requests: 5, per: 1h}
    action: block
  - id: auto
    match: {path: {prefix: /auto/}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
  - id: always-json
    match: {path: {prefix: /json/}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
    block: {content_type: application/json}
  - id: own-json
    match: {path: {prefix: /own/}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
    block: {status: 503, content_type: application/json, body: '{"busy": true, "id": "${{request_id}}"}'}
"""

BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"
JSON = "application/json"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("json-refusals")
    rules = run_dir / "rules.yaml"
    rules.write_text(RULES)
    running = start_stack(run_dir / "stack", rules)
    yield running
    running.stop()


def refused(client: Client, path: str, accept: str | None) -> Reply:
    """The refusal of ``path``'s rule: its one allowed request, then the next."""
    headers = {"Accept": accept} if accept is not None else {}
    assert client.request(path, headers=headers).status == 200
    return client.request(path, headers=headers)


def assert_json_refusal(reply: Reply, status: int, rule: str) -> None:
    assert reply.status == status
    assert reply.headers["Content-Type"] == "application/json"
    body = json.loads(reply.body)
    assert (body["status"], body["rule"], body["error"]) == (status, rule, "rate_limited")
    assert body["retry_after"] == int(reply.headers["Retry-After"])
    assert body["request_id"] == reply.headers["X-Request-Id"]


def assert_html_refusal(reply: Reply) -> None:
    assert reply.status == 429
    assert reply.headers["Content-Type"].startswith("text/html")
    assert reply.body.startswith(b"<!doctype html>")


@pytest.mark.parametrize("front_door", FRONT_DOORS)
def test_a_client_preferring_json_gets_a_json_429(stack: Stack, front_door: str) -> None:
    client = Client(front_door_port(stack, front_door), fresh_client_address())
    assert_json_refusal(refused(client, unique_path("/auto/"), "application/json, text/plain, */*"), 429, "auto")


@pytest.mark.parametrize("front_door", FRONT_DOORS)
def test_a_browser_gets_the_html_page(stack: Stack, front_door: str) -> None:
    client = Client(front_door_port(stack, front_door), fresh_client_address())
    assert_html_refusal(refused(client, unique_path("/auto/"), BROWSER))


@pytest.mark.parametrize("front_door", FRONT_DOORS)
def test_a_rule_that_always_sends_json_sends_it_to_a_browser_too(stack: Stack, front_door: str) -> None:
    client = Client(front_door_port(stack, front_door), fresh_client_address())
    assert_json_refusal(refused(client, unique_path("/json/"), BROWSER), 429, "always-json")


@pytest.mark.parametrize("front_door", FRONT_DOORS)
def test_a_json_page_of_ones_own_with_a_5xx_status_reaches_the_client_as_written(stack: Stack,
                                                                                  front_door: str) -> None:
    client = Client(front_door_port(stack, front_door), fresh_client_address())
    reply = refused(client, unique_path("/own/"), None)
    assert (reply.status, reply.headers["Content-Type"]) == (503, "application/json")
    assert json.loads(reply.body) == {"busy": True, "id": reply.headers["X-Request-Id"]}


@pytest.mark.parametrize("front_door", FRONT_DOORS)
def test_refusals_of_one_address_follow_each_requests_accept_header(stack: Stack, front_door: str) -> None:
    """Once over ``everyone``, every request of the address is refused,
    from nginx's cache or Sluice's stored answers: each still as its own
    Accept header asks."""
    client = Client(front_door_port(stack, front_door), fresh_client_address())
    path = unique_path("/")
    assert [client.request(path).status for _ in range(5)] == [200] * 5
    for accept in (JSON, BROWSER, JSON, JSON, BROWSER, BROWSER, JSON):
        reply = client.request(path, headers={"Accept": accept})
        if accept == JSON:
            assert_json_refusal(reply, 429, "everyone")
        else:
            assert_html_refusal(reply)


def test_forward_auth_answers_json_itself(stack: Stack) -> None:
    client = Client(stack.ports.sluice, fresh_client_address())
    headers = {"X-Forwarded-Method": "GET", "X-Forwarded-Host": "shop.example",
               "X-Forwarded-Uri": unique_path("/auto/"), "Accept": JSON}
    assert client.request("/v1/check", headers=headers).status == 200
    assert_json_refusal(client.request("/v1/check", headers=headers), 429, "auto")


def test_no_check_failed_inside_sluice(stack: Stack) -> None:
    client = Client(front_door_port(stack, "nginx"), fresh_client_address())
    refused(client, unique_path("/auto/"), "application/json;q=oops")
    assert sluice_metric(stack, "sluice_internal_errors_total") == 0
