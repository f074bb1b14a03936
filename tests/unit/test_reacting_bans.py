"""Rules that react to behaviour, on the memory store and a fake clock:
escalating bans (``ban.increment``) and challenge first, then ban
(``challenge.then_ban_after``); their validation, listing and logging."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest

from sidecar.admin import Admin
from sidecar.at_once import run_at_once
from sidecar.challenge import cookie_name, solve
from sidecar.config import ConfigError, parse_rules_text
from sidecar.engine import ALLOW, CLOSE, DENY
from sidecar.state import BanIncrement

from .conftest import Harness, ruleset_from

ESCALATING = """\
rules:
  - id: scrapers
    match: {path: {prefix: /scrape}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: ban
    ban: {duration: 5m, increment: {factor: 2, max: 30m, remember: 1h}}
  - id: flood
    match: {path: {prefix: /flood}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: ban
    ban: {duration: 5m}
"""


def ban_now(harness: Harness, path: str = "/scrape", ip: str = "192.0.2.1") -> tuple[float, int]:
    """Trip the ban rule of ``path``: its (duration, step)."""
    assert harness.outcomes(2, path=path, ip=ip) == [ALLOW, CLOSE]
    [ban] = [ban for ban in harness.engine.store.bans_in_force(harness.clock()) if ban.address == ip]
    return ban.duration, ban.step


def sit_out(harness: Harness, extra: float = 1.0) -> None:
    """Wait until every ban has ended, and ``extra`` seconds more."""
    bans = harness.engine.store.bans_in_force(harness.clock())
    harness.clock.now = max(ban.expires for ban in bans) + extra


# --------------------------------------------------------------------------
# Escalating bans
# --------------------------------------------------------------------------


def test_each_repeat_ban_lasts_twice_the_last_up_to_max() -> None:
    harness = Harness(ESCALATING)
    seen = []
    for _ in range(5):
        seen.append(ban_now(harness))
        sit_out(harness)
    assert seen == [(300.0, 0), (600.0, 1), (1200.0, 2), (1800.0, 3), (1800.0, 4)]


def test_a_ban_more_than_remember_after_the_last_ended_is_a_first_ban_again() -> None:
    harness = Harness(ESCALATING)
    assert ban_now(harness) == (300.0, 0)
    sit_out(harness, 3599)
    assert ban_now(harness) == (600.0, 1)
    sit_out(harness, 3600)
    assert ban_now(harness) == (300.0, 0)


def test_bans_escalate_per_address_and_per_rule() -> None:
    harness = Harness(ESCALATING + """\
  - id: other-scrapers
    match: {path: {prefix: /other}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: ban
    ban: {duration: 5m, increment: {factor: 2, max: 30m, remember: 1h}}
""")
    assert ban_now(harness) == (300.0, 0)
    sit_out(harness)
    assert ban_now(harness, "/other") == (300.0, 0)
    assert ban_now(harness, ip="192.0.2.2") == (300.0, 0)
    sit_out(harness)
    assert ban_now(harness) == (600.0, 1)


def test_a_rule_without_increment_bans_for_its_duration_every_time() -> None:
    harness = Harness(ESCALATING)
    for _ in range(3):
        assert ban_now(harness, "/flood") == (300.0, 0)
        sit_out(harness)


def test_a_lifted_ban_is_remembered() -> None:
    harness = Harness(ESCALATING)
    assert ban_now(harness) == (300.0, 0)
    assert harness.decide_now(path="/").outcome == CLOSE
    assert run_at_once(harness.engine.lift_ban("192.0.2.1"))
    assert harness.decide_now(path="/").outcome == ALLOW
    harness.clock.advance(10)
    assert ban_now(harness) == (600.0, 1)


def test_the_following_ban_never_falls_below_the_rules_duration_nor_exceeds_max() -> None:
    increment = BanIncrement(factor=1.5, longest=1000.0, remember=60.0)
    assert increment.following(300.0, None) == (0, 300.0)
    assert increment.following(300.0, (0, 300.0)) == (1, 450.0)
    assert increment.following(300.0, (4, 900.0)) == (5, 1000.0)
    # A reload made the rule's ban longer than what the history says.
    assert increment.following(800.0, (1, 450.0)) == (2, 800.0)
    assert increment.lua_spec(300.0) == "300.0 1.5 1000.0 60.0"


def test_the_admin_api_lists_each_bans_step() -> None:
    harness = Harness(ESCALATING)
    admin = Admin(harness.engine, None)
    ban_now(harness)
    sit_out(harness)
    ban_now(harness)
    [listed] = run_at_once(admin.bans())
    assert (listed["rule"], listed["duration_seconds"], listed["step"], listed["remaining_seconds"]) == \
        ("scrapers", 600.0, 1, 600.0)


def test_the_decision_line_of_an_escalated_ban_has_its_length_and_step(caplog) -> None:
    caplog.set_level(logging.INFO, logger="sluice.decisions")
    harness = Harness(ESCALATING)
    ban_now(harness)
    sit_out(harness)
    ban_now(harness)
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "sluice.decisions"]
    assert [(line["ban_seconds"], line.get("ban_step")) for line in lines] == [(300.0, None), (600.0, 1)]


@pytest.mark.parametrize(("increment", "field", "message"), [
    ("{factor: 1, max: 1h, remember: 1d}", "rules[0].ban.increment.factor", "greater than 1"),
    ("{factor: 0.5, max: 1h, remember: 1d}", "rules[0].ban.increment.factor", "greater than 1"),
    ("{factor: 2, max: 1m, remember: 1d}", "rules[0].ban.increment",
     "max 1m is shorter than the ban's duration 5m"),
    ("{factor: 2, max: 2y, remember: 1d}", "rules[0].ban.increment.max", "from 1s to 1y"),
    ("{factor: 2, max: 1h, remember: 500ms}", "rules[0].ban.increment.remember", "from 1s to 1y"),
    ("{factor: 2, max: 1h}", "rules[0].ban.increment.remember", "field required"),
    ("{factor: 2, remember: 1d}", "rules[0].ban.increment.max", "field required"),
    ("{factor: 2, max: 1h, remember: 1d, forget: 2d}", "rules[0].ban.increment.forget", "unknown field"),
])
def test_a_bad_increment_is_reported_at_its_line(increment: str, field: str, message: str) -> None:
    text = textwrap.dedent(f"""\
        rules:
          - id: scrapers
            key: [ip]
            limit: {{requests: 1, per: 10s}}
            action: ban
            ban:
              duration: 5m
              increment: {increment}
        """)
    with pytest.raises(ConfigError) as error:
        parse_rules_text(text, "rules.yaml", Path("."))
    [issue] = error.value.issues
    assert (issue.file, issue.line, issue.field) == ("rules.yaml", 8, field)
    assert message in issue.message
    assert str(issue).startswith(f"rules.yaml:8: {field.replace('rules[0]', 'rules[0](scrapers)')}: ")


def test_an_increment_takes_factor_2_by_default_and_any_max_from_the_duration_up() -> None:
    [rule] = ruleset_from("""\
rules:
  - id: scrapers
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: ban
    ban: {duration: 5m, increment: {max: 5m, remember: 1s}}
""").rules
    assert rule.ban_increment == BanIncrement(factor=2.0, longest=300.0, remember=1.0)


# --------------------------------------------------------------------------
# Challenge first, then ban
# --------------------------------------------------------------------------

CHALLENGE_THEN_BAN = """\
challenge:
  difficulty: 4
  auto_ban: {challenges: 1000, per: 60s, ban: 15m}
verified_bots:
  - cidrs: [198.51.100.0/24]
rules:
  - id: pages
    key: [ip]
    limit: {requests: 2, per: 10s, window: fixed}
    action: challenge
    challenge: {ttl: 1h, then_ban_after: 3}
"""


def penalty(harness: Harness, ip: str = "192.0.2.1", challenged: int = 3) -> list[str]:
    """One penalty of the rule: two requests pass (the second starts it),
    then ``challenged`` requests in it; then wait until it is over (and
    the fixed window too)."""
    outcomes = harness.outcomes(2 + challenged, ip=ip, path="/page")
    harness.clock.advance(11)
    return outcomes


def test_past_then_ban_after_unsolved_penalties_the_address_is_banned_for_the_auto_ban_duration() -> None:
    harness = Harness(CHALLENGE_THEN_BAN)
    for _ in range(3):
        assert penalty(harness) == [ALLOW, ALLOW, DENY, DENY, DENY]
    # The first challenged request of the fourth penalty bans.
    assert penalty(harness) == [ALLOW, ALLOW, CLOSE, CLOSE, CLOSE]
    [ban] = harness.engine.store.bans_in_force(harness.clock())
    assert (ban.rule_id, ban.duration) == ("pages", 900.0)
    assert harness.decide_now(path="/anywhere").outcome == CLOSE


def test_each_penalty_counts_once_however_many_requests_it_challenges() -> None:
    harness = Harness(CHALLENGE_THEN_BAN)
    assert penalty(harness, challenged=50) == [ALLOW, ALLOW] + [DENY] * 50
    assert penalty(harness, challenged=50) == [ALLOW, ALLOW] + [DENY] * 50
    assert penalty(harness, challenged=1) == [ALLOW, ALLOW, DENY]
    assert penalty(harness, challenged=1) == [ALLOW, ALLOW, CLOSE]


def test_penalties_count_per_address() -> None:
    harness = Harness(CHALLENGE_THEN_BAN)
    for ip in ("192.0.2.1", "192.0.2.2", "192.0.2.3") * 3:
        assert penalty(harness, ip=ip, challenged=1) == [ALLOW, ALLOW, DENY]
    assert harness.engine.store.bans_in_force(harness.clock()) == []


def test_penalties_are_counted_over_a_day() -> None:
    harness = Harness(CHALLENGE_THEN_BAN)
    for _ in range(3):
        assert penalty(harness, challenged=1) == [ALLOW, ALLOW, DENY]
    # Two days on, yesterday's penalties no longer weigh in.
    harness.clock.advance(2 * 86400)
    for _ in range(3):
        assert penalty(harness, challenged=1) == [ALLOW, ALLOW, DENY]


def test_a_client_that_solves_the_challenge_earns_no_more_penalties() -> None:
    harness = Harness(CHALLENGE_THEN_BAN)
    for _ in range(2):
        assert penalty(harness, challenged=1) == [ALLOW, ALLOW, DENY]
    # The third penalty: the client solves its challenge.
    assert harness.outcomes(2, path="/page") == [ALLOW, ALLOW]
    decision = harness.decide_now(path="/page")
    assert decision.outcome == DENY and decision.challenge is not None
    challenges = harness.engine.challenges
    ticket, problem = challenges.verify(decision.challenge.text, solve(decision.challenge.text, 4), "192.0.2.1", "")
    assert problem == "" and ticket is not None
    cookie = {"cookie": f"{cookie_name('pages')}={challenges.credential('pages', '192.0.2.1', '', 3600)}"}
    # With the credential it passes the rule, window after window.
    for _ in range(5):
        assert harness.outcomes(20, path="/page", headers=cookie) == [ALLOW] * 20
        harness.clock.advance(11)
    assert harness.engine.store.bans_in_force(harness.clock()) == []
    # Without it, three penalties stand: the next one bans.
    assert penalty(harness, challenged=1) == [ALLOW, ALLOW, CLOSE]


def test_a_verified_bot_is_challenged_but_never_banned_for_its_penalties() -> None:
    harness = Harness(CHALLENGE_THEN_BAN)
    for _ in range(6):
        assert penalty(harness, ip="198.51.100.7", challenged=1) == [ALLOW, ALLOW, DENY]
    assert harness.engine.store.bans_in_force(harness.clock()) == []


def test_a_shadow_challenge_counts_no_penalties() -> None:
    harness = Harness(CHALLENGE_THEN_BAN.replace("then_ban_after: 3}", "then_ban_after: 3}\n    shadow: true"))
    for _ in range(6):
        assert penalty(harness, challenged=1) == [ALLOW, ALLOW, ALLOW]
    assert harness.engine.store.bans_in_force(harness.clock()) == []


def test_then_ban_after_and_the_auto_ban_count_apart_and_either_bans() -> None:
    # The auto-ban counts every challenge page: 4 within a minute ban on the fifth.
    harness = Harness(CHALLENGE_THEN_BAN.replace("challenges: 1000", "challenges: 4"))
    assert penalty(harness, challenged=4) == [ALLOW, ALLOW, DENY, DENY, DENY, DENY]
    assert penalty(harness, challenged=1) == [ALLOW, ALLOW, CLOSE]


@pytest.mark.parametrize("key", ["[path]", "['header:x-api-key']", "[host, path]"])
def test_then_ban_after_needs_the_rule_keyed_by_ip(key: str) -> None:
    text = textwrap.dedent(f"""\
        rules:
          - id: pages
            key: {key}
            limit: {{requests: 2, per: 10s}}
            action: challenge
            challenge:
              ttl: 1h
              then_ban_after: 3
        """)
    with pytest.raises(ConfigError) as error:
        parse_rules_text(text, "rules.yaml", Path("."))
    [issue] = error.value.issues
    assert str(issue).startswith("rules.yaml:8: rules[0](pages).challenge.then_ban_after: ")
    assert "must include ip" in issue.message


@pytest.mark.parametrize("key", ["", "key: [ip]\n", "key: [ip, path]\n", "key: []\n"])
def test_then_ban_after_is_accepted_with_ip_in_the_key_or_the_default_key(key: str) -> None:
    [rule] = ruleset_from("rules:\n  - id: pages\n    " + key.replace("\n", "\n    ") +
                          "limit: {requests: 2, per: 10s}\n    action: challenge\n"
                          "    challenge: {then_ban_after: 2}\n").rules
    assert rule.penalty_ban is not None and rule.penalty_ban.threshold == 2


@pytest.mark.parametrize("value", ["0", "-1", "true", "'3'", "2.5"])
def test_then_ban_after_is_a_whole_number_from_1(value: str) -> None:
    text = "rules:\n  - id: pages\n    key: [ip]\n    limit: {requests: 2, per: 10s}\n" \
           f"    action: challenge\n    challenge: {{then_ban_after: {value}}}\n"
    with pytest.raises(ConfigError) as error:
        parse_rules_text(text, "rules.yaml", Path("."))
    [issue] = error.value.issues
    assert (issue.line, issue.field) == (6, "rules[0].challenge.then_ban_after")
