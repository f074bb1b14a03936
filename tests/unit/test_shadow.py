"""Shadow mode: a rule evaluates, counts, starts penalties and decides as
when enforcing, but its block, ban or challenge is not applied: the request
is allowed, and the would-be action is logged, counted and announced in
X-RateLimit-Shadow. Counters survive the switch to enforcing by reload."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from sidecar.actions import allow_headers
from sidecar.engine import ALLOW, CLOSE, DENY

from .conftest import Harness, ruleset_from

RULES = """\
rules:
  - id: api
    key: [ip]
    limit: {requests: 3, per: 60s}
    action: block
    shadow: true
  - id: scrapers
    match: {path: {prefix: /scrape}}
    key: [ip]
    limit: {requests: 2, per: 60s}
    action: ban
    ban: {duration: 10m}
    shadow: true
  - id: after
    key: [ip]
    limit: {requests: 100, per: 60s}
    action: block
"""


def metric(h: Harness, name: str, labels: dict[str, str]) -> float:
    return h.engine.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_shadow_rule_over_its_limit_allows_with_the_over_limit_headers_and_counts_the_action(
        caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(RULES)
    with caplog.at_level(logging.INFO, logger="sluice.decisions"):
        decisions = [h.decide_now(ip="192.0.2.1") for _ in range(5)]
    assert [d.outcome for d in decisions] == [ALLOW] * 5
    # Requests 1-3 are counted; the third starts the penalty, 4 and 5 are in it.
    assert [d.over_limit for d in decisions] == [False, False, False, True, True]
    assert allow_headers(decisions[3]) == [("X-RateLimit", "true"), ("X-RateLimit-Limit", "3"),
                                           ("X-RateLimit-Reset", "60"), ("X-RateLimit-Shadow", "true")]
    assert metric(h, "sluice_shadow_actions_total", {"rule": "api", "action": "block"}) == 2
    assert metric(h, "sluice_over_limit_total", {"rule": "api", "action": "block"}) == 0
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "sluice.decisions"]
    # Within one second, the second line is folded into the next one's "repeated".
    assert [(line["rule"], line["action"], line["shadow"], line["outcome"]) for line in lines] == \
        [("api", "block", True, "allow")]
    h.clock.advance(1)
    with caplog.at_level(logging.INFO, logger="sluice.decisions"):
        h.decide_now(ip="192.0.2.1")
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "sluice.decisions"]
    assert len(lines) == 2 and lines[1]["repeated"] == 1


def test_rules_after_a_shadow_rule_still_count_as_the_request_was_allowed() -> None:
    h = Harness(RULES)
    for _ in range(6):
        h.decide_now(ip="192.0.2.2")
    assert h.engine.metrics.hits_of("after") == 6


def test_a_shadow_ban_refuses_nobody_and_is_listed_as_shadow() -> None:
    h = Harness(RULES)
    outcomes = [h.decide_now(ip="192.0.2.3", path="/scrape").outcome for _ in range(4)]
    assert outcomes == [ALLOW] * 4
    assert h.decide_now(ip="192.0.2.3").outcome == ALLOW
    bans = asyncio.run(h.engine.active_bans())
    assert [(b.address, b.rule_id, b.shadow, b.duration) for b in bans] == [("192.0.2.3", "scrapers", True, 600.0)]
    assert metric(h, "sluice_shadow_actions_total", {"rule": "scrapers", "action": "ban"}) == 2
    assert asyncio.run(h.engine.lift_ban("192.0.2.3")) is True
    assert asyncio.run(h.engine.active_bans()) == []


def test_switching_to_enforcing_by_reload_keeps_the_counters_and_a_penalty_refuses_at_once() -> None:
    h = Harness(RULES)
    for _ in range(4):
        assert h.decide_now(ip="192.0.2.4").outcome == ALLOW
    h.engine.reload(ruleset_from(RULES.replace("    shadow: true\n", "")))
    assert h.decide_now(ip="192.0.2.4").outcome == DENY
    # Back in shadow: allowed again, still over its limit.
    h.engine.reload(ruleset_from(RULES))
    decision = h.decide_now(ip="192.0.2.4")
    assert (decision.outcome, decision.over_limit) == (ALLOW, True)


def test_the_whole_file_and_the_command_line_put_every_rule_in_shadow_mode() -> None:
    enforcing = RULES.replace("    shadow: true\n", "")
    for ruleset in (ruleset_from("mode: shadow\n" + enforcing), ruleset_from(enforcing, shadow=True)):
        assert all(rule.shadow for rule in ruleset.rules)
    h = Harness("mode: shadow\n" + enforcing)
    assert [h.decide_now(ip="192.0.2.5", path="/scrape").outcome for _ in range(4)] == [ALLOW] * 4
    h = Harness(enforcing)
    assert [h.decide_now(ip="192.0.2.5", path="/scrape").outcome for _ in range(3)] == [ALLOW, ALLOW, CLOSE]


def test_a_shadow_challenge_is_not_issued_and_a_shadow_leaky_bucket_holds_nobody() -> None:
    h = Harness("""\
rules:
  - id: human
    key: [ip]
    limit: {requests: 1, per: 60s}
    action: challenge
    shadow: true
  - id: paced
    key: [ip]
    limit: {rate: 1r/s, burst: 5}
    action: block
    shadow: true
""")
    decisions = [h.decide_now(ip="192.0.2.6") for _ in range(8)]
    assert all(d.outcome == ALLOW and d.delay == 0 and d.challenge is None for d in decisions)
    assert h.engine.metrics.challenges_issued.value == 0
    assert metric(h, "sluice_shadow_actions_total", {"rule": "paced", "action": "block"}) == 2


# -- reset on success ----------------------------------------------------------

LOGIN = """\
rules:
  - id: login
    match: {path: {equals: /login}}
    key: [ip]
    limit: {requests: 3, per: 1h}
    action: block
    count_on: {status: [401]}
    reset_on: {status: [200, 204]}
  - id: api
    match: {path: {prefix: /items}}
    key: [ip]
    limit: {requests: 3, per: 1h}
    action: block
    reset_on: {status: [205]}
"""


def login(h: Harness, status: int, ip: str = "192.0.2.40", path: str = "/login") -> str:
    decision = h.decide_now(ip=ip, path=path)
    if decision.outcome != ALLOW:
        return decision.outcome
    assert decision.pending is not None
    h.engine.record_response_now(decision.pending, status, {})
    return decision.outcome


def test_a_successful_login_wipes_the_failed_login_count() -> None:
    h = Harness(LOGIN)
    assert [login(h, 401) for _ in range(2)] + [login(h, 200)] + [login(h, 401) for _ in range(3)] == \
        [ALLOW] * 6
    # Without the success: three failures, then refused.
    assert [login(h, 401, ip="192.0.2.41") for _ in range(4)] == [ALLOW] * 3 + [DENY]
    assert h.engine.metrics.resets.value == 1


def test_a_reset_ends_the_penalty_of_a_request_phase_rule() -> None:
    h = Harness(LOGIN)
    outcomes = [login(h, 200, ip="192.0.2.42", path="/items") for _ in range(4)]
    assert outcomes == [ALLOW] * 3 + [DENY]
    # The third request started the penalty; a 205 to an allowed request
    # (reported late) clears the key: the next one passes.
    decision = h.decide_now(ip="192.0.2.43", path="/items")
    for _ in range(3):
        h.decide_now(ip="192.0.2.43", path="/items")
    assert h.decide_now(ip="192.0.2.43", path="/items").outcome == DENY
    h.engine.record_response_now(decision.pending, 205, {})
    assert h.decide_now(ip="192.0.2.43", path="/items").outcome == ALLOW


def test_reset_on_and_count_on_cannot_name_the_same_status() -> None:
    from sidecar.config import ConfigError

    with pytest.raises(ConfigError, match="status 401 both counts"):
        ruleset_from(LOGIN.replace("[200, 204]", "[200, 401]"))
