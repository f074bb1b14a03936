"""Response-phase counting and score budgets on a fake clock."""

import asyncio
import json

import pytest

from sidecar.engine import ALLOW, DENY
from sidecar.hook import report_from_datagram, report_from_headers
from sidecar.pending import Pending, PendingTokens
from sidecar.rules import parse_score

from .conftest import Harness

LOGIN = """
rules:
  - id: login
    match: {path: {equals: /api/login}}
    key: [ip]
    limit: {requests: 2, per: 60s}
    count_on: {status: [401]}
    action: block
"""

SCORE = """
rules:
  - id: heavy
    key: [ip]
    limit: {score: 400, per: 60s, header: x-score}
    action: block
    penalty: 10m
"""


def exchange(h: Harness, status: int, response_headers=None, **request):
    """One request through the check and, when allowed, its response report."""
    decision = h.decide_now(**request)
    if decision.outcome == ALLOW and decision.pending:
        h.engine.record_response_now(decision.pending, status, response_headers or {})
    return decision.outcome


def test_login_worked_example_counts_only_401s():
    """401, 200, 401 pass; the 4th is refused at request phase."""
    h = Harness(LOGIN)
    results = [exchange(h, status, path="/api/login") for status in (401, 200, 401, 200)]
    assert results == [ALLOW, ALLOW, ALLOW, DENY]


def test_response_phase_rule_counts_nothing_at_request_time():
    h = Harness(LOGIN)
    for _ in range(10):
        assert h.decide_now(path="/api/login").outcome == ALLOW  # no reports: nothing counted
    assert h.engine.store.tracked_keys() == 0


def test_non_matching_responses_are_neither_counted_nor_affected():
    h = Harness(LOGIN)
    assert [exchange(h, 200, path="/api/login") for _ in range(20)] == [ALLOW] * 20


def test_score_worked_example_blocks_after_the_total_exceeds_the_budget():
    h = Harness(SCORE)
    outcomes = [exchange(h, 200, {"x-score": score}) for score in ("100", "200", "150")]
    assert outcomes == [ALLOW] * 3
    assert h.decide_now().outcome == DENY
    h.clock.advance(599)
    decision = h.decide_now()
    assert decision.outcome == DENY and decision.limit == 400 and decision.rule.reset == 600
    h.clock.advance(1)
    assert h.decide_now().outcome == ALLOW


def test_score_equal_to_the_budget_is_not_over_it():
    h = Harness(SCORE)
    exchange(h, 200, {"x-score": "400"})
    assert h.decide_now().outcome == ALLOW


@pytest.mark.parametrize("score", ["0", "1000001", "abc", "", "-5", "1.5", " ", "١٢"])
def test_out_of_range_or_invalid_scores_do_not_count(score):
    h = Harness(SCORE)
    for _ in range(5):
        exchange(h, 200, {"x-score": score})
    exchange(h, 200, {"x-score": "400"})
    assert h.decide_now().outcome == ALLOW


def test_score_limits():
    assert [parse_score(v) for v in ("1", "1000000", " 7 ", None)] == [1, 1_000_000, 7, 0]


def test_header_based_count_on():
    h = Harness("""
rules:
  - id: flagged
    key: [ip]
    limit: {requests: 1, per: 60s}
    count_on: {header: {name: X-Suspicious, equals: "yes"}}
    action: block
""")
    assert exchange(h, 200, {"x-suspicious": "no"}) == ALLOW
    assert exchange(h, 200, {}) == ALLOW
    assert exchange(h, 200, {"x-suspicious": "yes"}) == ALLOW
    assert h.decide_now().outcome == DENY


def test_status_and_header_conditions_must_both_hold():
    h = Harness("""
rules:
  - id: both
    key: [ip]
    limit: {requests: 1, per: 60s}
    count_on: {status: [404], header: {name: x-cache, present: false}}
    action: block
""")
    assert exchange(h, 404, {"x-cache": "HIT"}) == ALLOW
    assert exchange(h, 200, {}) == ALLOW
    assert exchange(h, 404, {}) == ALLOW
    assert h.decide_now().outcome == DENY


def test_request_conditions_and_count_on_together():
    h = Harness(LOGIN)
    # 401s elsewhere do not count for the login rule.
    for _ in range(5):
        assert exchange(h, 401, path="/api/other") == ALLOW
    assert exchange(h, 401, path="/api/login") == ALLOW
    assert exchange(h, 401, path="/api/login") == ALLOW
    assert h.decide_now(path="/api/login").outcome == DENY
    assert h.decide_now(path="/api/other").outcome == ALLOW


def test_a_request_phase_block_leaves_no_pending_token():
    h = Harness(LOGIN + """
  - id: all
    key: [ip]
    limit: {requests: 1, per: 60s}
    action: block
""")
    assert h.decide_now(path="/api/login").pending
    decision = h.decide_now(path="/api/login")
    assert decision.outcome == DENY and decision.pending is None


def test_reports_arriving_after_the_penalty_started_do_not_count():
    h = Harness(LOGIN)
    tokens = [h.decide_now(path="/api/login").pending for _ in range(5)]  # five in flight
    counted = [h.engine.record_response_now(token, 401, {}) for token in tokens]
    assert counted == [1, 1, 0, 0, 0]


def test_forged_or_stale_tokens_are_refused():
    h = Harness(LOGIN)
    token = h.decide_now(path="/api/login").pending
    payload, signature = token.split(".")
    assert h.engine.record_response_now(payload + "." + signature[::-1], 401, {}) == 0
    assert h.engine.record_response_now("garbage", 401, {}) == 0
    other = PendingTokens(b"another secret")
    assert h.engine.record_response_now(other.issue([("login", 2.0, ("192.0.2.1",))]), 401, {}) == 0
    assert h.engine.metrics.reports_refused.value == 3


def test_tokens_expire():
    now = [1_000_000.0]
    tokens = PendingTokens(b"k", max_age=600, wall_clock=lambda: now[0])
    token = tokens.issue([("r", 1.0, ("a", ("ip", "b")))])
    assert tokens.open(token) == Pending([("r", 1.0, ("a", ("ip", "b")))])
    now[0] += 601
    assert tokens.open(token) is None


def test_overlong_pending_state_is_dropped_not_carried():
    h = Harness("""
rules:
  - id: per-key
    key: ["header:x-api-key"]
    limit: {requests: 1, per: 60s}
    count_on: {status: [401]}
    action: block
""")
    decision = h.decide_now(headers={"x-api-key": "k" * 10_000})
    assert decision.outcome == ALLOW and decision.pending is None
    assert h.engine.metrics.unreportable.value == 1


def test_report_from_envoy_headers():
    h = Harness(SCORE)
    token = h.decide_now().pending
    counted = asyncio.run(report_from_headers(h.engine, {"x-sluice-pending": token, "x-sluice-status": "200",
                                                         "x-sluice-response-x-score": "500"}))
    assert counted == 1 and h.decide_now().outcome == DENY


def test_report_from_nginx_syslog_datagram():
    h = Harness(LOGIN)
    for _ in range(2):
        token = h.decide_now(path="/api/login").pending
        line = json.dumps({"token": token, "status": 401, "headers": {"x-score": ""}})
        datagram = f"<190>Nov 30 04:53:59 sluice: {line}".encode()
        assert report_from_datagram(h.engine, datagram) == 1
    assert h.decide_now(path="/api/login").outcome == DENY


@pytest.mark.parametrize("datagram", [b"", b"<190>junk", b"<190>x: {not json", b'{"token": 5, "status": 200}',
                                      b'{"token": "a.b", "status": "x"}', b"[1, 2]"])
def test_malformed_reports_are_counted_not_fatal(datagram):
    h = Harness(LOGIN)
    assert report_from_datagram(h.engine, datagram) == 0
    assert h.engine.metrics.reports_refused.value == 1
