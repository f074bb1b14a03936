"""One pipeline for every front door: a front door describes, the engine
decides (resolving the client once, and owning fail open or closed, bans,
metrics and the decision log), the front door answers."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from sidecar.engine import ALLOW, DENY, Engine
from sidecar.frontdoors.envoy import describe_envoy
from sidecar.frontdoors.forward_auth import describe_forward_auth
from sidecar.frontdoors.messages import OK, OVER_LIMIT, RateLimitRequest
from sidecar.frontdoors.nginx import describe_nginx
from sidecar.frontdoors.rls import RateLimitService
from sidecar.request import UNRESOLVED
from sidecar.rls import RlsConfig, compile_domain, parse_rls_text
from sidecar.state import Check
from sidecar.store import StoreUnavailable
from sidecar.store.memory import MemoryStore

from .conftest import FakeClock, ruleset_from

TRUSTING = ruleset_from("client_ip: {trusted_proxies: [127.0.0.0/8]}\nrules:\n"
                        "  - {id: per-ip, key: [ip], limit: {requests: 2, per: 10s}, action: block}\n")
PROXIED = {"x-sluice-client-addr": "127.0.0.1", "x-forwarded-for": "203.0.113.7",
           "x-original-uri": "/", "host": "shop.example"}


def scope_of(path: str, headers: dict[str, str]) -> dict[str, Any]:
    return {"type": "http", "path": path, "raw_path": path.encode(), "method": "GET",
            "client": ("127.0.0.1", 5000), "query_string": b"",
            "headers": [(name.encode(), value.encode()) for name, value in headers.items()]}


@pytest.mark.parametrize("describe, path", [(describe_nginx, "/v1/nginx/auth"),
                                            (describe_envoy, "/v1/envoy/auth/"),
                                            (describe_forward_auth, "/v1/check")])
def test_a_front_door_names_the_client_as_the_proxy_does_and_the_engine_resolves_it(describe: Any,
                                                                                     path: str) -> None:
    engine = Engine(TRUSTING, clock=FakeClock())
    request = describe(scope_of(path, PROXIED), dict(PROXIED))
    assert request.client is UNRESOLVED
    assert (request.peer, request.forwarded_for) == ("127.0.0.1", "203.0.113.7")

    engine.decide_now(request)

    # The peer is a trusted proxy: the client is the address it names.
    assert request.client.text == "203.0.113.7"


def test_an_invalid_client_address_is_counted_once_per_check() -> None:
    engine = Engine(TRUSTING, clock=FakeClock())
    headers = {**PROXIED, "x-sluice-client-addr": "not an address", "x-forwarded-for": ""}
    for _ in range(3):
        engine.decide_now(describe_nginx(scope_of("/v1/nginx/auth", headers), dict(headers)))
    assert engine.metrics.invalid_address.value == 3


def test_a_request_the_engine_was_given_resolved_is_not_resolved_again() -> None:
    engine = Engine(TRUSTING, clock=FakeClock())
    request = describe_nginx(scope_of("/v1/nginx/auth", PROXIED), dict(PROXIED))
    request.client = engine.resolve_client("192.0.2.44", None)
    engine.decide_now(request)
    assert request.client.text == "192.0.2.44"


EDGE = """\
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 1}
    sluice: {ban: 10m}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 1}
    shadow_mode: true
"""


class Recording(Engine):
    """An engine that keeps what the Rate Limit Service asks of it."""

    asked: list[tuple[list[Check], str, list[bool], str]]

    async def decide_checks(self, checks: list[Check], client: str, shadow: Any, domain: str) -> Any:
        self.asked.append((checks, client, list(shadow), domain))
        return await super().decide_checks(checks, client, shadow, domain)


def rls_over(engine: Engine) -> RateLimitService:
    service = RateLimitService(engine, None)
    model = parse_rls_text(EDGE, "edge.yaml")
    service.config = RlsConfig({model.domain: compile_domain(model)})
    return service


def should_rate_limit(service: RateLimitService, *descriptors: tuple[str, str]) -> Any:
    request = RateLimitRequest(domain="edge")
    for key, value in descriptors:
        request.descriptors.add().entries.add(key=key, value=value)
    return asyncio.run(service.answer(request))


def test_the_rate_limit_service_is_decided_by_the_engine_once_per_request() -> None:
    clock = FakeClock()
    engine = Recording(ruleset_from("rules: []\n"), store=MemoryStore(100, "node", clock), clock=clock)
    engine.asked = []
    service = rls_over(engine)

    should_rate_limit(service, ("remote_address", "2001:db8:1:2::7"), ("path", "/a"))

    [(checks, client, shadow, domain)] = engine.asked
    # The client a ban goes to is counted as the rules count it (its /64).
    assert (client, shadow, domain) == ("2001:db8:1:2::/64", [False, True], "edge")
    assert [check.rule_id for check in checks] == ["edge.remote_address", "edge.path"]


def test_the_engine_counts_and_logs_what_the_rate_limit_service_refuses_or_observes(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    engine = Engine(ruleset_from("rules: []\n"), store=MemoryStore(100, "node", clock), clock=clock)
    service = rls_over(engine)
    with caplog.at_level(logging.INFO, logger="sluice.decisions"):
        first = should_rate_limit(service, ("path", "/a"))
        second = should_rate_limit(service, ("path", "/a"))
        should_rate_limit(service, ("remote_address", "192.0.2.1"))
        banned = should_rate_limit(service, ("remote_address", "192.0.2.1"))
        after_the_ban = should_rate_limit(service, ("remote_address", "192.0.2.1"))

    assert [first.overall_code, second.overall_code] == [OK, OK]  # shadow_mode: observed only
    assert [banned.overall_code, after_the_ban.overall_code] == [OVER_LIMIT, OVER_LIMIT]
    metrics = engine.metrics
    assert metrics.checks.value == 5 and metrics.banned_requests.value == 1
    lines = [json.loads(record.getMessage()) for record in caplog.records]
    assert [(line["rule"], line["action"], line["outcome"]) for line in lines] == [
        ("edge.path", "shadow", "observe"), ("edge.remote_address", "ban", "deny"),
        ("edge.remote_address", "ban", "deny")]


@pytest.mark.parametrize("fail, outcome", [("open", ALLOW), ("closed", DENY)])
def test_a_store_that_does_not_answer_fails_as_the_rules_say_for_every_front_door(fail: str, outcome: str) -> None:
    class Down(MemoryStore):
        async def evaluate(self, *args: Any, **kwargs: Any) -> Any:
            raise StoreUnavailable("down")

    clock = FakeClock()
    rules = ruleset_from(f"state: {{fail: {fail}}}\nrules:\n"
                         "  - {id: per-ip, key: [ip], limit: {requests: 2, per: 10s}, action: block}\n")
    engine = Engine(rules, store=Down(100, "node", clock), clock=clock)
    service = rls_over(engine)

    decision = engine.decide_now(describe_nginx(scope_of("/v1/nginx/auth", PROXIED), dict(PROXIED)))
    answer = should_rate_limit(service, ("path", "/a"))

    assert decision.outcome == outcome
    assert answer.overall_code == (OK if outcome == ALLOW else OVER_LIMIT)
    assert engine.metrics.store_errors.value == 2
