"""CrowdSec, both ways (sidecar.crowdsec, the crowdsec: section): the
decision stream read and applied, its failures, the engine's lookup, and
Sluice's bans queued as alerts. The LAPI is a fake here; the integration
tests run the real one."""

from __future__ import annotations

import collections
import ipaddress
import json
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.challenge import solve
from sidecar.config import ConfigError
from sidecar.crowdsec import (
    ALERT_BATCH,
    BAN,
    CAPTCHA,
    AlertPusher,
    CrowdSecBouncer,
    CrowdSecDecision,
    DecisionTable,
    alert_of,
    parse_go_duration,
    parse_stream,
)
from sidecar.engine import CLOSED, Engine
from sidecar.request import CheckRequest
from sidecar.state import BanRecord
from tests.unit.conftest import FakeClock, ruleset_from

NOW = 1000.0
# Nothing listens there: a bouncer an engine starts polls it and fails,
# keeping the table a test gives it.
CLOSED_URL = "http://127.0.0.1:9"


def entry(value: str, kind: str = "ban", duration: str = "1h", scope: str | None = None, id: int = 1,
          scenario: str = "crowdsecurity/ssh-bf", origin: str = "crowdsec") -> dict[str, Any]:
    return {"id": id, "duration": duration, "origin": origin, "scenario": scenario,
            "scope": scope or ("Range" if "/" in value else "Ip"), "type": kind, "value": value}


def stream(new: list[dict[str, Any]] | None = None, deleted: list[dict[str, Any]] | None = None) -> bytes:
    return json.dumps({"new": new, "deleted": deleted}).encode()


class FakeLapi:
    """Answers a bouncer's requests with what a test queued, and records them."""

    def __init__(self) -> None:
        self.answers: list[bytes | Exception] = []
        self.asked: list[str] = []
        self.headers: list[dict[str, str]] = []

    def request(self, path: str, headers: dict[str, str], body: Any = None, limit: int = 0) -> bytes:
        self.asked.append(path)
        self.headers.append(dict(headers))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def bouncer(clock: FakeClock, captcha: str = "challenge",
            max_decisions: int = 1000) -> tuple[CrowdSecBouncer, FakeLapi]:
    made = CrowdSecBouncer("http://lapi", "the-key", 10.0, 2.0, captcha, max_decisions, "node-a")
    made.clock = clock
    lapi = FakeLapi()
    made.client = lapi  # type: ignore[assignment]
    return made, lapi


def address(text: str) -> Any:
    return ruleset_from("rules: []").resolver.resolve(text, None)


# -- the stream ----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "seconds"), [
    ("59m59.5s", 3599.5), ("4h0m0s", 14400.0), ("-5.197448ms", -0.005197448), ("1h2m3s", 3723.0),
    ("250ms", 0.25), ("0", 0.0), ("3µs", 3e-6),
])
def test_a_go_duration_is_read_in_seconds(text: str, seconds: float) -> None:
    assert parse_go_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "1x", "h", "1h 2m", "10", None, 3600, "1h-2m", "s" * 100])
def test_what_is_no_go_duration_gives_none(text: object) -> None:
    assert parse_go_duration(text) is None


def test_bans_ranges_and_captchas_of_both_versions_are_read_with_their_expiry() -> None:
    changes = parse_stream(stream([entry("203.0.113.7", id=1), entry("198.51.100.0/24", id=2),
                                   entry("2001:db8::/48", "captcha", "30m", id=3),
                                   entry("::ffff:192.0.2.9", id=4)],
                                  [entry("192.0.2.1", duration="-1s", id=9)]), NOW, "challenge")

    assert [(d.id, d.kind, d.value, d.expires) for d in changes.new] == [
        (1, BAN, "203.0.113.7", NOW + 3600), (2, BAN, "198.51.100.0/24", NOW + 3600),
        (3, CAPTCHA, "2001:db8::/48", NOW + 1800), (4, BAN, "192.0.2.9", NOW + 3600)]
    assert changes.deleted == [9]
    assert not changes.ignored


@pytest.mark.parametrize(("captcha", "kind", "reason"), [("challenge", CAPTCHA, ""), ("ban", BAN, ""),
                                                         ("ignore", None, "type")])
def test_a_captcha_decision_becomes_what_the_section_says(captcha: str, kind: str | None, reason: str) -> None:
    changes = parse_stream(stream([entry("203.0.113.7", "captcha")]), NOW, captcha)

    assert [d.kind for d in changes.new] == ([kind] if kind else [])
    assert changes.ignored == (collections.Counter({reason: 1}) if reason else collections.Counter())


def test_other_scopes_types_malformed_ended_and_own_decisions_are_counted_not_applied() -> None:
    changes = parse_stream(stream([
        entry("AS64500", scope="AS"), entry("FR", scope="Country"), entry("203.0.113.7", "throttle"),
        entry("not an address"), entry("0.0.0.0/0"), entry("203.0.113.7", duration="forever"),
        {"id": "7", "scope": "Ip", "type": "ban", "value": "203.0.113.7", "duration": "1h"}, "a string", None,
        entry("203.0.113.7", duration="-2s"), entry("203.0.113.8", scenario="sluice/node-a/login"),
        entry("203.0.113.9", scenario="sluice/node-b/login"),
    ]), NOW, "challenge", own_scenarios="sluice/node-a/")

    assert [d.value for d in changes.new] == ["203.0.113.9"]  # another node's ban is applied
    assert changes.ignored == {"scope": 2, "type": 1, "invalid": 6, "expired": 1, "own": 1}


@pytest.mark.parametrize("body", [b"", b"<html>502 Bad Gateway</html>", b"[]", b"null", b'{"new": {}}',
                                  b'{"deleted": "x"}', b"\xff\xfe", b"[" * 100_000])
def test_what_is_not_a_stream_is_refused_with_a_value_error(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_stream(body, NOW, "challenge")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=4), max_leaves=20)
FIELD = st.sampled_from(["id", "duration", "scope", "type", "value", "scenario", "origin"])
PLAUSIBLE = st.fixed_dictionaries({
    "id": st.integers(-2, 2**70) | JSON,
    "duration": st.sampled_from(["1h", "-1s", "99999999999h", "1e9h", "0", "59m59.9s", ""]) | JSON,
    "scope": st.sampled_from(["Ip", "Range", "ip", "AS", ""]) | JSON,
    "type": st.sampled_from(["ban", "captcha", "BAN", "x"]) | JSON,
    "value": st.sampled_from(["203.0.113.7", "10.0.0.0/8", "::/0", "2001:db8::/129", "999.1.1.1",
                              "fe80::1%eth0", "1.2.3.4/33", " 1.2.3.4 "]) | JSON,
}, optional={"scenario": JSON, "origin": JSON})


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.builds(lambda v: json.dumps(v).encode(), JSON),
                 st.builds(lambda new, deleted: json.dumps({"new": new, "deleted": deleted}).encode(),
                           st.lists(PLAUSIBLE | JSON, max_size=8) | JSON, st.lists(PLAUSIBLE | JSON, max_size=4))))
def test_any_payload_gives_decisions_a_value_error_or_counted_ignores_never_a_crash(body: bytes) -> None:
    clock = FakeClock(NOW)
    made, lapi = bouncer(clock, max_decisions=5)
    lapi.answers.append(body)

    result = made.poll()

    assert result in ("succeeded", "garbage")
    assert len(made.table) <= 5
    for decision in made.table.decisions:
        assert decision.kind in (BAN, CAPTCHA) and decision.network.prefixlen > 0
        assert NOW < decision.expires < float("inf")
        assert made.table.find_client(address(str(decision.network.network_address)), NOW) is not None


# -- the table ---------------------------------------------------------------------


def decision(value: str, kind: str = BAN, expires: float = NOW + 60, id: int = 1) -> CrowdSecDecision:
    return CrowdSecDecision(id, kind, ipaddress.ip_network(value), "s", "o", expires)


def test_a_ban_wins_over_a_captcha_and_each_ends_at_its_expiry() -> None:
    table = DecisionTable([decision("198.51.100.0/24", CAPTCHA, NOW + 600, 1),
                           decision("198.51.100.7", BAN, NOW + 60, 2), decision("198.51.100.7", CAPTCHA, NOW + 900, 3)])

    assert table.find_client(address("198.51.100.7"), NOW).kind == BAN  # type: ignore[union-attr]
    assert table.find_client(address("198.51.100.9"), NOW).kind == CAPTCHA  # type: ignore[union-attr]
    assert table.find_client(address("198.51.100.7"), NOW + 60).kind == CAPTCHA  # type: ignore[union-attr]
    assert table.find_client(address("198.51.100.7"), NOW + 600) is None
    assert table.find_client(address("203.0.113.1"), NOW) is None
    assert table.find_client(address("not an address"), NOW) is None
    assert table.counts == {BAN: 1, CAPTCHA: 1}


# -- polling ----------------------------------------------------------------------


def test_the_whole_list_first_then_what_changed_with_the_key_in_its_header() -> None:
    clock = FakeClock(NOW)
    made, lapi = bouncer(clock)
    lapi.answers += [stream([entry("203.0.113.7", id=1), entry("198.51.100.0/24", "captcha", id=2)]),
                     stream([entry("192.0.2.1", id=3)], [entry("203.0.113.7", id=1)])]

    assert made.poll() == "succeeded"
    assert made.table.find_client(address("203.0.113.7"), NOW) is not None
    clock.advance(10)
    assert made.poll() == "succeeded"

    assert [path.split("&")[0] for path in lapi.asked] == ["/v1/decisions/stream?startup=true",
                                                          "/v1/decisions/stream?startup=false"]
    assert all(headers == {"X-Api-Key": "the-key"} for headers in lapi.headers)
    assert made.table.find_client(address("203.0.113.7"), clock()) is None
    assert made.table.find_client(address("192.0.2.1"), clock()).kind == BAN  # type: ignore[union-attr]
    assert made.table.find_client(address("198.51.100.3"), clock()).kind == CAPTCHA  # type: ignore[union-attr]


@pytest.mark.parametrize(("failure", "result"), [
    (urllib.error.URLError(ConnectionRefusedError(111, "refused")), "failed"),
    (TimeoutError("timed out"), "failed"),
    (urllib.error.HTTPError("http://lapi", 500, "oops", {}, None), "failed"),  # type: ignore[arg-type]
    (urllib.error.HTTPError("http://lapi", 403, "no", {}, None), "refused"),  # type: ignore[arg-type]
    (b"<html>not json</html>", "garbage"),
])
def test_a_failed_poll_keeps_the_last_decisions_and_asks_for_the_whole_list_next(failure: Any, result: str,
                                                                                 caplog: pytest.LogCaptureFixture
                                                                                 ) -> None:
    clock = FakeClock(NOW)
    made, lapi = bouncer(clock)
    lapi.answers += [stream([entry("203.0.113.7")]), failure, failure,
                     stream([entry("192.0.2.1", id=2)])]
    made.poll()

    assert made.poll() == result
    assert made.poll() == result
    assert made.table.find_client(address("203.0.113.7"), NOW) is not None
    assert made.polls == {"succeeded": 1, result: 2, **{name: 0 for name in made.polls if name not in
                                                         ("succeeded", result)}}
    assert len([r for r in caplog.records if "crowdsec" in r.getMessage()]) == 1  # once a minute at most
    assert "the-key" not in caplog.text

    assert made.poll() == "succeeded"
    assert lapi.asked[-1].startswith("/v1/decisions/stream?startup=true")
    # The whole list replaced what was held: the ban it no longer has is gone.
    assert made.table.find_client(address("203.0.113.7"), NOW) is None
    assert made.table.find_client(address("192.0.2.1"), NOW) is not None


def test_decisions_over_the_maximum_are_counted_not_held() -> None:
    made, lapi = bouncer(FakeClock(NOW), max_decisions=3)
    lapi.answers += [stream([entry(f"203.0.113.{n}", id=n) for n in range(10)]),
                     stream([entry("192.0.2.1", id=99)], [entry("203.0.113.0", id=0)])]

    made.poll()
    assert len(made.table) == 3 and made.ignored["over_max"] == 7
    made.poll()  # a deletion makes room
    assert len(made.table) == 3 and made.ignored["over_max"] == 7
    assert made.table.find_client(address("192.0.2.1"), NOW) is not None


def test_decisions_end_at_their_duration_on_the_engine_clock_between_polls() -> None:
    clock = FakeClock(NOW)
    made, lapi = bouncer(clock)
    lapi.answers += [stream([entry("203.0.113.7", duration="30s"), entry("203.0.113.8", duration="2h", id=2)]),
                     stream()]
    made.poll()

    clock.advance(30)
    assert made.table.find_client(address("203.0.113.7"), clock()) is None
    assert made.table.find_client(address("203.0.113.8"), clock()) is not None
    made.poll()
    assert len(made.table) == 1  # ended decisions leave the table at the next poll


def test_several_workers_sharing_a_key_ask_for_the_whole_list_every_time() -> None:
    made, lapi = bouncer(FakeClock(NOW))
    made.whole_list = True
    lapi.answers += [stream([entry("203.0.113.7")]), stream([entry("192.0.2.1", id=2)])]

    made.poll()
    made.poll()

    assert all(path.startswith("/v1/decisions/stream?startup=true") for path in lapi.asked)
    assert made.table.find_client(address("203.0.113.7"), NOW) is None


# -- the engine ----------------------------------------------------------------------

RULES = f"""
crowdsec: {{url: "{CLOSED_URL}", key_env: SLUICE_TEST_CROWDSEC_KEY, poll: 1h}}
challenge: {{difficulty: 1}}
rules:
  - id: login
    match: {{path: {{prefix: /login}}}}
    key: [ip]
    limit: {{requests: 1, per: 1m}}
    action: ban
"""


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    monkeypatch.setenv("SLUICE_TEST_CROWDSEC_KEY", "k")
    made = Engine(ruleset_from(RULES), clock=FakeClock(NOW))
    made.close()  # its bouncer's thread stops: the tests set its table
    assert made.ruleset.crowdsec is not None
    made.ruleset.crowdsec.table = DecisionTable([decision("203.0.113.7", BAN, NOW + 60, 1),
                                                 decision("2001:db8::/48", BAN, NOW + 60, 2),
                                                 decision("198.51.100.0/24", CAPTCHA, NOW + 60, 3)])
    yield made


def check(engine: Engine, ip: str, path: str = "/", cookie: str = "") -> Any:
    headers = {"cookie": cookie} if cookie else {}
    return engine.decide_now(CheckRequest("GET", "h", path, headers, engine.resolve_client(ip, None), "r"))


def test_a_banned_address_and_an_address_of_a_banned_range_are_closed(engine: Engine) -> None:
    assert check(engine, "203.0.113.7") is CLOSED
    assert check(engine, "2001:db8:0:42::1") is CLOSED
    assert str(check(engine, "203.0.113.8").outcome) == "allow"
    assert engine.metrics.crowdsec_requests == {"ban": 2}
    engine.clock.advance(60)  # type: ignore[attr-defined]
    assert str(check(engine, "203.0.113.7").outcome) == "allow"


def test_a_captcha_decision_gets_the_challenge_and_its_credential_lets_the_client_on_to_the_rules(
        engine: Engine) -> None:
    refused = check(engine, "198.51.100.9")

    assert str(refused.outcome) == "deny" and refused.challenge is not None and refused.page.status == 403
    assert refused.rule.id == "crowdsec" and refused.rule.challenge.cookie == "sluice_pass_crowdsec"
    ticket, problem = engine.challenges.verify(refused.challenge.text, solve(refused.challenge.text, 1),
                                               engine.resolve_client("198.51.100.9", None).key, "")
    assert ticket is not None and not problem and engine.ruleset.by_id[ticket.rule_id].challenge is not None
    credential = engine.challenges.credential("crowdsec", engine.resolve_client("198.51.100.9", None).key, "",
                                              engine.ruleset.crowdsec_rule.challenge.ttl)  # type: ignore[union-attr]
    passed = check(engine, "198.51.100.9", cookie=f"sluice_pass_crowdsec={credential}")
    assert str(passed.outcome) == "allow"
    check(engine, "198.51.100.9", "/login", cookie=f"sluice_pass_crowdsec={credential}")
    banned = check(engine, "198.51.100.9", "/login", cookie=f"sluice_pass_crowdsec={credential}")
    assert str(banned.outcome) == "close" and banned.rule.id == "login"  # the rules decided
    # Another address's credential does not pass.
    assert str(check(engine, "198.51.100.10", cookie=f"sluice_pass_crowdsec={credential}").outcome) == "deny"
    assert engine.metrics.crowdsec_requests == {"captcha": 2, "captcha_passed": 3}


def test_sluices_own_bans_are_queued_as_alerts_and_crowdsecs_are_not(engine: Engine, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_TEST_CROWDSEC_PASSWORD", "p")
    pushing = Engine(ruleset_from(RULES.replace(
        "poll: 1h}", "poll: 1h, push_bans: {machine_id: sluice, password_env: SLUICE_TEST_CROWDSEC_PASSWORD}}")),
        clock=FakeClock(NOW))
    pushing.close()
    push = pushing.ruleset.crowdsec_push
    assert push is not None
    pushing.ruleset.crowdsec.table = engine.ruleset.crowdsec.table  # type: ignore[union-attr]

    for _ in range(3):
        check(pushing, "192.0.2.44", "/login")
        check(pushing, "203.0.113.7", "/login")  # CrowdSec's ban: not Sluice's to push

    assert push.waiting == 1
    alert = push._queue[0]
    assert alert["source"] == {"scope": "Ip", "value": "192.0.2.44", "ip": "192.0.2.44"}
    assert alert["decisions"][0] | {"scenario": ""} == {"origin": "sluice", "type": "ban", "scope": "Ip",
                                                         "value": "192.0.2.44", "duration": "3600s",
                                                         "scenario": "", "simulated": False}
    assert alert["scenario"] == f"sluice/{pushing.ruleset.node}/login"


def test_an_ipv6_clients_ban_is_its_network_and_a_full_queue_drops_and_counts() -> None:
    ban = BanRecord("2001:db8:1:2::/64", "login", "n", 1.7e9, NOW + 60, 60.0)
    assert alert_of(ban, 59.2, "n")["decisions"][0] | {"scenario": ""} == {
        "origin": "sluice", "type": "ban", "scope": "Range", "value": "2001:db8:1:2::/64", "duration": "60s",
        "scenario": "", "simulated": False}

    push = AlertPusher("http://lapi", "m", "p", 1.0, 2, "n")
    for _ in range(5):
        push.offer(ban, 60)
    assert push.waiting == 2 and push.results["dropped"] == 3


def test_alerts_are_sent_in_batches_after_a_login_and_kept_while_the_lapi_is_down() -> None:
    push = AlertPusher("http://lapi", "m", "p", 1.0, 1000, "n")
    lapi = FakeLapi()
    push.client = lapi  # type: ignore[assignment]
    ban = BanRecord("192.0.2.1", "login", "n", 1.7e9, NOW + 60, 60.0)
    for _ in range(ALERT_BATCH + 5):
        push.offer(ban, 60)

    lapi.answers += [OSError("down")]
    assert not push.send_batch() and push.waiting == ALERT_BATCH + 5
    lapi.answers += [json.dumps({"token": "t1"}).encode(), b'["1"]',
                     urllib.error.HTTPError("http://lapi", 401, "expired", {}, None),  # type: ignore[arg-type]
                     json.dumps({"token": "t2"}).encode(), b'["2"]']
    assert push.send_batch() and push.send_batch() and push.waiting == 0

    assert lapi.asked == ["/v1/watchers/login", "/v1/watchers/login", "/v1/alerts", "/v1/alerts",
                          "/v1/watchers/login", "/v1/alerts"]
    assert lapi.headers[3] == {"Authorization": "Bearer t1"} and lapi.headers[5] == {"Authorization": "Bearer t2"}
    assert push.results == {"sent": ALERT_BATCH + 5, "failed": ALERT_BATCH, "dropped": 0}


# -- the rules file --------------------------------------------------------------------


@pytest.mark.parametrize(("section", "says"), [
    ("{url: http://127.0.0.1:8080, key_file: missing.key}",
     "test.yaml:4: crowdsec.key_file: cannot read the bouncer key file 'missing.key': No such file or directory"),
    ("{url: http://127.0.0.1:8080, key_file: empty.key}", "test.yaml:4: crowdsec.key_file: the bouncer key file "
                                                          "'empty.key' is empty"),
    ("{url: http://127.0.0.1:8080, key_file: key, key_env: K}",
     "test.yaml:4: crowdsec: expected exactly one of key_file, key_env"),
    ("{url: 127.0.0.1:8080, key_env: K}", "test.yaml:4: crowdsec.url: the Local API's URL is http://"),
    ("{url: http://h, key_env: K, captcha: block}",
     "test.yaml:4: crowdsec.captcha: should be 'challenge', 'ban' or 'ignore', got 'block'"),
    ("{url: http://h, key_env: K, poll: 100ms}", "test.yaml:4: crowdsec.poll: decisions are polled every 1s to 1h"),
    ("{url: http://h, key_env: K, push_bans: {machine_id: m, password: inline}}",
     "test.yaml:4: crowdsec.push_bans.password: unknown field (did you mean 'password_env'?)"),
    ("{url: http://h, key_env: K, push_bans: {machine_id: m}}",
     "test.yaml:4: crowdsec.push_bans: expected exactly one of password_file, password_env"),
])
def test_a_wrong_section_is_an_error_at_its_line(section: str, says: str, tmp_path: Path) -> None:
    (tmp_path / "key").write_text("k\n")
    (tmp_path / "empty.key").write_text("\n")
    text = f"rules: []\n\n\ncrowdsec: {section}\n"
    with pytest.raises(ConfigError) as raised:
        ruleset_from(text, tmp_path)
    assert says in str(raised.value)


def test_a_rule_named_crowdsec_is_refused_beside_the_section(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K", "k")
    with pytest.raises(ConfigError, match=r"test.yaml:3: rules\[0\]\(crowdsec\).id: the rule id 'crowdsec' "
                                          "is the crowdsec: section's"):
        ruleset_from("crowdsec: {url: http://h, key_env: K}\nrules:\n  - id: crowdsec\n    limit: {requests: 1, "
                     "per: 1s}\n    action: block\n")


def test_an_unset_variable_and_a_captcha_challenge_without_a_challenge_secret_are_warnings(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SLUICE_UNSET_KEY", raising=False)
    (tmp_path / "key").write_text("from-a-file\n")

    unset = ruleset_from("crowdsec: {url: http://h, key_env: SLUICE_UNSET_KEY}\nrules: []\n")
    from_file = ruleset_from("crowdsec: {url: http://h, key_file: key, captcha: ban}\nrules: []\n", tmp_path)

    assert any("SLUICE_UNSET_KEY (the bouncer key) is not set" in note for note in unset.notes)
    assert any("crowdsec.captcha: challenge" in note and "set challenge.secret_file" in note for note in unset.notes)
    assert not any("crowdsec.captcha" in note for note in ruleset_from(
        "challenge: {secret_file: key}\ncrowdsec: {url: http://h, key_file: key}\nrules: []\n", tmp_path).notes)
    assert from_file.notes == () and from_file.crowdsec is not None
    assert from_file.crowdsec.same_source == ("http://h", "from-a-file", "ban")


def test_replay_leaves_the_section_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.replay.simulate import Replay

    monkeypatch.setenv("SLUICE_TEST_CROWDSEC_KEY", "k")
    replay = Replay(ruleset_from(RULES))

    assert replay.ruleset.crowdsec is None and replay.ruleset.crowdsec_push is None
    assert [rule.id for rule in replay.ruleset.rules] == ["login"]


def test_the_admin_shows_an_addresss_crowdsec_decisions_and_says_where_to_lift_them(engine: Engine) -> None:
    import asyncio

    from sidecar.admin import Admin

    admin = Admin(engine, None)
    listing = asyncio.run(admin.counters("2001:db8:0:7::1", None, []))

    assert listing["ban"] is None
    assert listing["crowdsec"] == [{"value": "2001:db8::/48", "type": "ban", "scenario": "s", "origin": "o",
                                    "remaining_seconds": 60.0}]
    assert admin.no_ban("203.0.113.7") == ("no ban of 203.0.113.7; CrowdSec bans 203.0.113.7: delete that in "
                                           "CrowdSec (cscli decisions delete)")
    assert admin.no_ban("192.0.2.1") == "no ban of 192.0.2.1"
