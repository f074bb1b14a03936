"""Tiers (sidecar.tiers, the tiers: section and a rule's tiers:): a
request's identity names its tier, from a run-time assignment, the tiers
file, a verified token's claim or the default, and a rule's threshold comes
from the tier. Every mistake in the files is reported at its line."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import tiers
from sidecar.config import ConfigError
from sidecar.engine import Engine
from sidecar.request import CheckRequest
from sidecar.rules import Ruleset
from sidecar.tiers import read_assignments
from tests.jwks import Issuer
from tests.unit.conftest import FakeClock, refused_by, ruleset_from

NOW = 1_800_000_000.0
ISSUER = Issuer()

RULES = """
jwt:
  keys: {file: jwks.json}
  algorithms: [RS256]
tiers:
  names: [free, pro, partner]
  default: free
  identity: header:x-api-key
  claim: plan
  file: tiers.yaml
rules:
  - id: api
    key: ["header:x-api-key"]
    limit: {requests: 2, per: 1m}
    tiers: {pro: 5, partner: 8/1m}
    action: block
"""

TIERS_FILE = """\
pro: [key-pro, key-also-pro]
partner:
  - key-partner
"""


def files(tmp_path: Path, rules: str = RULES, tiers_file: str = TIERS_FILE) -> Path:
    (tmp_path / "jwks.json").write_text(json.dumps(ISSUER.jwks()))
    (tmp_path / "tiers.yaml").write_text(tiers_file)
    (tmp_path / "rules.yaml").write_text(rules)
    return tmp_path


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    return Engine(ruleset_from(RULES, files(tmp_path)), clock=FakeClock(), wall_clock=lambda: NOW)


def allowed(engine: Engine, headers: dict[str, str], address: str = "192.0.2.1") -> int:
    """How many requests in a row are let in, up to 20."""
    for count in range(20):
        if refused_by(engine, address, headers) != "allow":
            return count
    return 20


def token(claims: dict[str, object]) -> str:
    return "Bearer " + ISSUER.token({"sub": "alice", "exp": NOW + 600, **claims}, "RS256")


def test_the_threshold_is_the_tiers_and_a_tier_the_rule_does_not_list_keeps_the_limit(engine: Engine) -> None:
    assert allowed(engine, {"x-api-key": "key-pro"}) == 5
    assert allowed(engine, {"x-api-key": "key-also-pro"}) == 5
    assert allowed(engine, {"x-api-key": "key-partner"}) == 8
    assert allowed(engine, {"x-api-key": "key-unknown"}) == 2  # the default tier, free: the rule's own limit
    assert allowed(engine, {}) == 2  # no identity: the default


def test_the_refusal_says_the_tiers_limit(engine: Engine) -> None:
    request = CheckRequest("GET", "h", "/", {"x-api-key": "key-pro"}, engine.resolve_client("192.0.2.1", None), "r")
    decisions = [engine.decide_now(request) for _ in range(6)]
    assert [str(decision.outcome) for decision in decisions] == ["allow"] * 5 + ["deny"]
    assert decisions[-1].limit == 5  # X-RateLimit-Limit


def test_a_verified_tokens_claim_names_the_tier_of_an_identity_not_assigned(engine: Engine) -> None:
    assert allowed(engine, {"x-api-key": "key-a", "authorization": token({"plan": "partner"})}) == 8
    assert allowed(engine, {"x-api-key": "key-b", "authorization": token({"plan": "gold"})}) == 2  # no such tier
    # An assignment comes before the claim.
    assert allowed(engine, {"x-api-key": "key-pro", "authorization": token({"plan": "partner"})}) == 5
    # An unverified token names nothing.
    forged = token({"plan": "partner"})[:-4] + "AAAA"
    assert allowed(engine, {"x-api-key": "key-c", "authorization": forged}) == 2


def test_a_run_time_assignment_comes_first_and_its_removal_gives_the_files_back(engine: Engine) -> None:
    store = engine.store
    asyncio.run(store.assign_tier("key-pro", "partner"))
    asyncio.run(store.assign_tier("key-new", "pro"))

    assert allowed(engine, {"x-api-key": "key-pro"}) == 8
    assert allowed(engine, {"x-api-key": "key-new"}) == 5
    assert asyncio.run(store.unassign_tier("key-pro")) is True
    assert asyncio.run(store.unassign_tier("key-pro")) is False
    assert engine.ruleset.tiers is not None
    assert engine.ruleset.tiers.tier_of_identity("key-pro") == ("pro", "file")
    assert engine.ruleset.tiers.tier_of_identity("key-new") == ("pro", "run time")
    assert engine.ruleset.tiers.tier_of_identity("key-none") == ("free", "default")


def test_a_client_whose_tier_changes_keeps_its_count(engine: Engine) -> None:
    assert refused_by(engine, headers={"x-api-key": "key-up"}) == "allow"  # one of free's 2
    asyncio.run(engine.store.assign_tier("key-up", "pro"))
    assert allowed(engine, {"x-api-key": "key-up"}) == 4  # the 5 of pro, one of them counted already


def test_a_penalty_earned_in_one_tier_is_kept_in_the_next(engine: Engine) -> None:
    assert allowed(engine, {"x-api-key": "key-late"}) == 2  # the second reached free's threshold: penalized
    asyncio.run(engine.store.assign_tier("key-late", "pro"))
    assert refused_by(engine, headers={"x-api-key": "key-late"}) == "api"


def test_a_reload_reads_the_file_again_and_keeps_the_run_time_assignments(engine: Engine, tmp_path: Path) -> None:
    asyncio.run(engine.store.assign_tier("key-kept", "partner"))
    engine.reload(ruleset_from(RULES, files(tmp_path, tiers_file="partner: [key-pro]\n")))

    assert allowed(engine, {"x-api-key": "key-pro"}) == 8
    assert allowed(engine, {"x-api-key": "key-kept"}) == 8


def test_the_matcher_says_where_the_threshold_comes_from(engine: Engine) -> None:
    text = engine.ruleset.match_source.text
    assert "tier = tier_of(request)" in text
    assert "spec = rule_api.spec_for_tier(tier, spec)  # api (line 15): the threshold of the request's tier" in text


def test_a_rule_without_tiers_costs_no_tier_lookup(tmp_path: Path) -> None:
    ruleset = ruleset_from(RULES.replace("    tiers: {pro: 5, partner: 8/1m}\n", ""), files(tmp_path))
    assert "tier" not in ruleset.match_source.text.split("def match", 1)[1]


@given(st.text(max_size=400), st.sampled_from(["x-api-key", "authorization", "cookie"]))
@settings(max_examples=150, deadline=None)
def test_whatever_a_client_sends_its_tier_is_one_of_the_names(value: str, field: str) -> None:
    ruleset = ruleset_from(RULES, FILES)
    engine = Engine(ruleset, clock=FakeClock(), wall_clock=lambda: NOW)
    request = CheckRequest("GET", "h", "/", {field: value}, engine.resolve_client("192.0.2.1", None), "r")
    assert ruleset.tiers is not None
    assert ruleset.tiers.tier_of(request) in ruleset.tiers.names
    assert str(engine.decide_now(request).outcome) == "allow"


@pytest.fixture(scope="module", autouse=True)
def _module_files(tmp_path_factory: pytest.TempPathFactory) -> None:
    global FILES
    FILES = files(tmp_path_factory.mktemp("tiers"))


FILES: Path


# -- mistakes, at their lines --------------------------------------------------------


def errors(tmp_path: Path, rules: str, tiers_file: str = TIERS_FILE) -> str:
    with pytest.raises(ConfigError) as info:
        ruleset_from(rules, files(tmp_path, rules, tiers_file))
    return str(info.value)


@pytest.mark.parametrize(("change", "says"), [
    (("tiers: {pro: 5, partner: 8/1m}", "tiers: {gold: 5}"),
     "test.yaml:15: rules[0](api).tiers.gold: no tier 'gold'; the tiers are free, pro, partner (tiers.names)"),
    (("tiers: {pro: 5, partner: 8/1m}", "tiers: {pro: 5/1h}"),
     "test.yaml:15: rules[0](api).tiers.pro: the rule counts per 1m (limit.per): write 5, or 5/1m"),
    (("tiers: {pro: 5, partner: 8/1m}", "tiers: {pro: lots}"),
     "test.yaml:15: rules[0](api).tiers.pro: a tier's threshold is a number (2000), or a number per the "
     "rule's period (2000/1m), got 'lots'"),
    (("limit: {requests: 2, per: 1m}", "limit: {tokens: 3, refill: 1/s}"),
     "test.yaml:15: rules[0](api).tiers: tiers set a request or score threshold; a bucket or concurrent rule "
     "cannot have tiers"),
    (("  default: free\n", "  default: gold\n"),
     "test.yaml:7: tiers.default: no tier 'gold'; the tiers are free, pro, partner (tiers.names)"),
    (("  identity: header:x-api-key\n  claim: plan\n", ""),
     "test.yaml:5: tiers: say how a request's tier is found"),
    (("  identity: header:x-api-key\n", "  identity: path\n"),
     "test.yaml:8: tiers.identity: an identity is header:NAME, cookie:NAME or jwt:CLAIM, got 'path'"),
    (("jwt:\n  keys: {file: jwks.json}\n  algorithms: [RS256]\n", ""),
     "test.yaml:6: tiers.claim: a token's claim needs the jwt: section"),
    (("  file: tiers.yaml\n", "  file: nowhere.yaml\n"),
     "test.yaml:10: tiers.file: cannot read the tiers file"),
])
def test_a_mistake_in_the_rules_file_is_reported_at_its_line(tmp_path: Path, change: tuple[str, str],
                                                              says: str) -> None:
    old, new = change
    assert old in RULES
    assert says in errors(tmp_path, RULES.replace(old, new))


def test_rule_tiers_without_the_section_is_an_error_at_the_rule(tmp_path: Path) -> None:
    rules = RULES.split("rules:\n", 1)[1]
    assert "test.yaml:5: rules[0](api).tiers: tiers need the tiers: section" in errors(tmp_path, "rules:\n" + rules)


def test_tiers_and_overrides_on_one_rule_is_an_error(tmp_path: Path) -> None:
    overrides = "overrides:\n  - cidrs: [10.0.0.0/8]\n    multiply: 2\n    rules: [api]\n"
    rules = RULES.replace("rules:\n", overrides + "rules:\n")
    assert "rules[0](api).tiers: a rule takes its threshold from its tiers or from overrides, not both" \
        in errors(tmp_path, rules)


@pytest.mark.parametrize(("text", "says"), [
    ("gold: [a]\n", "tiers.yaml:1: gold: no tier 'gold'"),
    ("pro: key-a\n", "tiers.yaml:1: pro: expected a list of identities"),
    ("pro: [a]\npartner: [b, a]\n", "tiers.yaml:2: partner[1]: already in tier 'pro'"),
    ("pro:\n  - 5\n", "tiers.yaml:2: pro[0]: expected an identity as text"),
    ("pro: ['" + "k" * 300 + "']\n", "tiers.yaml:1: pro[0]: an identity is at most 256 characters"),
    ("- a\n", "tiers.yaml:1: expected each tier's identities"),
    ("pro: [a\n", "tiers.yaml:2: invalid YAML"),
])
def test_a_mistake_in_the_tiers_file_is_reported_at_its_line(tmp_path: Path, text: str, says: str) -> None:
    found = errors(tmp_path, RULES, text)
    assert says in found
    assert str(tmp_path / "tiers.yaml") in found


def test_every_mistake_of_a_tiers_file_is_reported_at_once() -> None:
    assigned, issues = read_assignments("t.yaml", "gold: [a]\npro: [b, b]\n", ("free", "pro"))
    assert assigned == {"b": "pro"}
    assert [issue.line for issue in issues] == [1, 2]


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=4),
                    max_leaves=12))
@settings(max_examples=200, deadline=None)
def test_any_tiers_file_is_read_or_refused_with_lines(data: object) -> None:
    import yaml

    assigned, issues = read_assignments("t.yaml", yaml.safe_dump(data), ("free", "pro"))
    assert all(tier in ("free", "pro") for tier in assigned.values())
    assert all(len(identity) <= tiers.MAX_IDENTITY_CHARS for identity in assigned)
    assert all(issue.line >= 1 for issue in issues)


# -- the admin API ------------------------------------------------------------------


def admin_run(test: Callable[[Any], Awaitable[Any]], ruleset: Ruleset) -> Any:
    from tests.unit.test_admin_api import run

    return run(test, ruleset=ruleset)


def test_an_identity_is_assigned_listed_and_removed_through_the_admin_api(tmp_path: Path) -> None:
    async def test(s: Any) -> Any:
        before = [await s.decide(path="/", headers={"x-api-key": "key-new"}) for _ in range(3)]
        assigned = await s.call("POST", "tiers", body={"identity": "key-new", "tier": "partner"})
        after = [await s.decide(ip="192.0.2.9", headers={"x-api-key": "key-new"}) for _ in range(7)]
        listed = await s.call("GET", "tiers")
        removed = await s.call("DELETE", "tiers", body={"identity": "key-new"})
        again = await s.call("DELETE", "tiers", body={"identity": "key-new"})
        of_file = await s.call("DELETE", "tiers", body={"identity": "key-pro"})
        return before, assigned, after, listed, removed, again, of_file

    before, assigned, after, listed, removed, again, of_file = admin_run(test, ruleset_from(RULES, files(tmp_path)))
    assert before == ["allow", "allow", "deny"]  # free
    assert assigned == (200, {"identity": "key-new", "tier": "partner"})
    # The key's count goes on (2 of partner's 8 taken), and its penalty of the
    # rule's period too: the key was refused once already.
    assert after == ["deny"] * 7
    assert listed == (200, {"names": ["free", "pro", "partner"], "default": "free", "identity": "header:x-api-key",
                            "assignments": [
                                {"identity": "key-new", "tier": "partner", "from": "run time"},
                                {"identity": "key-also-pro", "tier": "pro", "from": "file"},
                                {"identity": "key-partner", "tier": "partner", "from": "file"},
                                {"identity": "key-pro", "tier": "pro", "from": "file"}],
                            "truncated": False})
    assert removed == (204, None)
    assert again == (404, {"detail": "no run-time assignment of that identity; it is in tier 'free' (default)"})
    assert of_file == (404, {"detail": "no run-time assignment of that identity; it is in tier 'pro' (file)"})


def test_a_run_time_assignment_raises_a_fresh_keys_threshold_at_once(tmp_path: Path) -> None:
    async def test(s: Any) -> Any:
        await s.call("POST", "tiers", body={"identity": "key-fresh", "tier": "partner"})
        return [await s.decide(headers={"x-api-key": "key-fresh"}) for _ in range(9)]

    assert admin_run(test, ruleset_from(RULES, files(tmp_path))) == ["allow"] * 8 + ["deny"]


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"identity": "k", "tier": "gold"}, 422, "no tier 'gold'; the tiers are free, pro, partner"),
    ({"identity": "", "tier": "pro"}, 422, "identity: expected the value of tiers.identity"),
    ({"identity": "k" * 300, "tier": "pro"}, 422, "an identity is at most 256 characters"),
    ({"identity": "k\n", "tier": "pro"}, 422, "an identity is printable text"),
    ({"identity": "k"}, 422, "tier: expected one of tiers.names"),
    ({"identity": "k", "tier": "pro", "for": "1h"}, 422, "unknown field 'for'"),
    ([1], 422, "expected a JSON object"),
])
def test_a_wrong_assignment_is_refused_with_its_reason(tmp_path: Path, body: object, status: int,
                                                       says: str) -> None:
    async def test(s: Any) -> Any:
        return await s.call("POST", "tiers", body=body)

    answer = admin_run(test, ruleset_from(RULES, files(tmp_path)))
    assert answer[0] == status and says in answer[1]["detail"]


def test_without_tiers_or_an_identity_the_api_says_why(tmp_path: Path) -> None:
    async def test(s: Any) -> Any:
        return [await s.call("GET", "tiers"), await s.call("POST", "tiers", body={"identity": "k", "tier": "pro"})]

    none = admin_run(test, ruleset_from("rules: []\n"))
    assert none == [(409, {"detail": "the rules file has no tiers: section"})] * 2
    claim_only = RULES.replace("  identity: header:x-api-key\n", "").replace("  file: tiers.yaml\n", "")
    listing, assigning = admin_run(test, ruleset_from(claim_only, files(tmp_path)))
    assert listing[0] == 200 and listing[1]["identity"] is None
    assert assigning[0] == 409 and "tiers.identity is not set" in assigning[1]["detail"]


def test_the_run_time_assignments_a_store_holds_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar import admin

    monkeypatch.setattr(admin, "MAX_ASSIGNMENTS", 3)

    async def test(s: Any) -> Any:
        return [(await s.call("POST", "tiers", body={"identity": f"k{n}", "tier": "pro"}))[0] for n in range(4)] + \
            [(await s.call("POST", "tiers", body={"identity": "k0", "tier": "partner"}))[0]]

    assert admin_run(test, ruleset_from(RULES, files(tmp_path))) == [200, 200, 200, 409, 200]


def test_the_audit_line_names_an_identity_by_a_keyed_hash_only(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="sluice.decisions")

    async def test(s: Any) -> Any:
        await s.call("POST", "tiers", body={"identity": "sk_live_secret", "tier": "pro"})
        await s.call("DELETE", "tiers", body={"identity": "sk_live_secret"})

    admin_run(test, ruleset_from(RULES, files(tmp_path)))
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "sluice.decisions"]
    audits = [line for line in lines if "audit" in line]
    assert [(line["audit"], line["result"], line["tier"] if "tier" in line else None) for line in audits] == \
        [("tier", "assigned", "pro"), ("untier", "removed", None)]
    assert audits[0]["identity"] == audits[1]["identity"] and len(audits[0]["identity"]) == 16
    assert "sk_live_secret" not in caplog.text


# -- replay ----------------------------------------------------------------------------


def test_replay_counts_each_key_by_its_tiers_threshold(tmp_path: Path) -> None:
    """A JSON access log that keeps $http_x_api_key: replay reads the tiers
    file, and each key is refused past its own tier's threshold."""
    from sidecar.replay.simulate import replay_logs

    start = 1_709_287_200.0
    lines = [json.dumps({"remote_addr": "198.51.100.7", "msec": f"{start + n:.3f}", "request": "GET / HTTP/1.1",
                         "status": "200", "http_x_api_key": key})
             for n in range(10) for key in ("key-pro", "key-free")]
    (files(tmp_path) / "access.log").write_text("\n".join(lines) + "\n")

    report = replay_logs(ruleset_from(RULES, tmp_path), [str(tmp_path / "access.log")])

    [api] = report["rules"]
    # Ten of each key: pro lets 5 in, the default tier (free) 2.
    assert (api["matched"], api["allowed"], api["blocked"]) == (20, 7, 13)
