"""The request pipeline on a fake clock."""

import json
import logging

import pytest

from sidecar import core
from sidecar.at_once import run_at_once
from sidecar.clientip import NetworkSet
from sidecar.engine import ALLOW, CLOSE, DENY

from .conftest import Harness, ruleset_from

AXISNOW = """
rules:
  - id: api-key
    key: [ip, "header:x-api-key"]
    limit: {requests: 2, per: 10s}
    action: block
"""


def test_axisnow_five_requests_only_key_a_is_blocked():
    """The seed's worked example: ip + x-api-key, 2 per 10 s, block.
    Requests are sorted into counters by key; key A reaches 2 and its next
    request is blocked while keys B and C are unaffected."""
    h = Harness(AXISNOW)
    key_a = dict(ip="203.0.113.7", headers={"x-api-key": "A"})
    key_b = dict(ip="203.0.113.7", headers={"x-api-key": "B"})
    key_c = dict(ip="198.51.100.9", headers={"x-api-key": "A"})
    sequence = [key_a, key_b, key_a, key_c, key_a]
    results = []
    for request in sequence:
        results.append(h.decide_now(**request).outcome)
        h.clock.advance(1)
    assert results == [ALLOW, ALLOW, ALLOW, ALLOW, DENY]


def test_block_decision_carries_limit_reset_and_retry_after():
    h = Harness(AXISNOW)
    h.outcomes(2, headers={"x-api-key": "k"})
    h.clock.advance(3.2)
    decision = h.decide_now(headers={"x-api-key": "k"})
    assert decision.outcome == DENY
    assert decision.page.status == 429
    assert decision.limit == 2
    assert decision.rule.reset == 10
    assert decision.retry_after == 7  # 10 - 3.2 = 6.8, rounded up


def test_penalty_ends_and_counting_resumes():
    h = Harness(AXISNOW)
    assert h.outcomes(3, headers={"x-api-key": "k"}) == [ALLOW, ALLOW, DENY]
    h.clock.advance(10)
    assert h.decide_now(headers={"x-api-key": "k"}).outcome == ALLOW


def test_custom_status_and_close():
    h = Harness("""
rules:
  - id: busy
    match: {path: {prefix: /busy}}
    limit: {requests: 1, per: 10s}
    action: block
    block: {status: 503, body: "busy, ${{remote_addr}}"}
  - id: quiet
    match: {path: {prefix: /quiet}}
    limit: {requests: 1, per: 10s}
    action: block
    block: {close: true}
""")
    assert h.outcomes(2, path="/busy") == [ALLOW, DENY]
    decision = h.decide_now(path="/busy")
    assert decision.page.status == 503
    assert decision.page.template.render("<1>", "h", "r") == b"busy, &lt;1&gt;"
    assert h.outcomes(2, path="/quiet") == [ALLOW, CLOSE]


BAN = """
rules:
  - id: scrapers
    match: {path: {prefix: /scrape}}
    key: [ip]
    limit: {requests: 2, per: 60s}
    action: ban
    ban: {duration: 5m}
  - id: everything
    key: [ip]
    limit: {requests: 1000, per: 60s}
    action: block
"""


def test_ban_closes_trigger_and_every_later_request_of_the_address():
    h = Harness(BAN)
    assert h.outcomes(3, path="/scrape") == [ALLOW, ALLOW, CLOSE]
    assert h.decide_now(path="/anything-else", host="other.example").outcome == CLOSE
    assert h.decide_now(ip="192.0.2.99", path="/scrape").outcome == ALLOW
    [ban] = h.engine.store.bans_in_force(h.clock())
    assert (ban.address, ban.rule_id, ban.duration) == ("192.0.2.1", "scrapers", 300)


def test_banned_requests_are_not_evaluated_counted_or_logged(caplog):
    h = Harness(BAN)
    h.outcomes(3, path="/scrape")
    caplog.set_level(logging.INFO, logger="sluice.decisions")
    caplog.clear()
    before = h.engine.metrics.checks.value
    for _ in range(50):
        assert h.decide_now(path="/x").outcome == CLOSE
    assert caplog.records == []
    assert h.engine.metrics.banned_requests.value == 50
    # The per-IP rule saw none of them: after the ban it has its full budget.
    assert h.engine.metrics.checks.value == before + 50
    assert h.engine.store.tracked_keys() == 1  # only "everything" from before


def test_ban_expires_and_counting_starts_afresh():
    h = Harness(BAN)
    h.outcomes(3, path="/scrape")
    h.clock.advance(299.9)
    assert h.decide_now(path="/scrape").outcome == CLOSE
    h.clock.advance(0.1)
    # The triggering key's counters were cleared when the ban was issued.
    assert h.outcomes(3, path="/scrape") == [ALLOW, ALLOW, CLOSE]


def test_verified_bot_is_never_banned_and_evaluation_continues():
    h = Harness("""
verified_bots:
  - cidrs: [66.249.64.0/19]
    user_agent: Googlebot
rules:
  - id: scrapers
    key: [ip]
    limit: {requests: 1, per: 60s}
    action: ban
  - id: strict
    match: {path: {prefix: /strict}}
    key: [ip]
    limit: {requests: 1, per: 60s}
    action: block
""")
    bot = dict(ip="66.249.66.1", headers={"user-agent": "Mozilla/5.0 (compatible; Googlebot/2.1)"})
    assert h.outcomes(3, **bot) == [ALLOW] * 3
    assert h.engine.store.bans_in_force(h.clock()) == []
    # block still applies to verified bots
    assert h.outcomes(2, path="/strict", **bot) == [ALLOW, DENY]
    # same address without the user agent is not a verified bot
    assert h.outcomes(2, ip="66.249.66.1") == [CLOSE, CLOSE]


def test_observe_never_interferes_and_reports_first_over_limit_log_rule(caplog):
    h = Harness("""
rules:
  - id: watch-a
    key: [ip]
    limit: {requests: 1, per: 60s}
    action: log
  - id: watch-b
    key: [ip]
    limit: {requests: 1, per: 30s}
    action: log
""")
    caplog.set_level(logging.INFO, logger="sluice.decisions")
    assert h.decide_now().rule is None
    decision = h.decide_now()
    assert decision.outcome == ALLOW
    assert (decision.rule.id, decision.limit, decision.rule.reset) == ("watch-a", 1, 60)
    lines = [json.loads(r.getMessage()) for r in caplog.records]
    assert [(line["rule"], line["outcome"]) for line in lines] == [("watch-a", "observe"), ("watch-b", "observe")]


def test_block_ends_evaluation_so_later_rules_are_not_counted():
    h = Harness("""
rules:
  - id: first
    key: [ip]
    limit: {requests: 1, per: 60s}
    action: block
  - id: second
    key: [ip]
    limit: {requests: 2, per: 60s}
    action: block
""")
    assert h.outcomes(5) == [ALLOW, DENY, DENY, DENY, DENY]
    h.clock.advance(60)
    # "second" counted only the first request, so one more passes before it limits.
    assert h.decide_now().outcome == ALLOW
    assert h.decide_now().rule.id == "first"


def test_headers_describe_the_stopping_rule_even_after_an_observe_rule():
    h = Harness("""
rules:
  - id: watch
    key: [ip]
    limit: {requests: 1, per: 60s}
    action: log
  - id: stop
    key: [ip]
    limit: {requests: 1, per: 5s}
    action: block
""")
    h.decide_now()
    decision = h.decide_now()
    assert decision.outcome == DENY and decision.rule.id == "stop"


def test_exempt_addresses_are_never_limited_or_counted():
    h = Harness("""
exempt: [10.0.0.0/8, "2001:db8::/32"]
rules:
  - id: all
    key: [ip]
    limit: {requests: 1, per: 60s}
    action: block
""")
    assert h.outcomes(10, ip="10.1.2.3") == [ALLOW] * 10
    assert h.outcomes(10, ip="2001:db8::5") == [ALLOW] * 10
    assert h.engine.store.tracked_keys() == 0
    assert h.outcomes(2, ip="11.0.0.1") == [ALLOW, DENY]


def test_an_exempt_client_is_decided_as_the_resolver_found_and_looked_up_anew_after_a_reload(monkeypatch):
    """The resolver tells a client it makes whether the exempt networks hold
    it, and the engine asks them nothing more; a client made for other
    rules (before a reload) is looked up in the new networks."""
    h = Harness(EXEMPT_RULES.format(exempt="10.0.0.0/8"))
    inside, outside = h.request(ip="10.1.2.3"), h.request(ip="11.1.2.3")
    assert (inside.client.exempt, outside.client.exempt) == (True, False)

    def unasked(networks, client):
        raise AssertionError("the exempt networks were asked")

    with monkeypatch.context() as patched:
        patched.setattr(NetworkSet, "holds", unasked)
        assert [h.engine.decide_now(inside).outcome for _ in range(3)] == [ALLOW] * 3
        assert [h.engine.decide_now(outside).outcome for _ in range(2)] == [ALLOW, DENY]
    h.engine.reload(ruleset_from(EXEMPT_RULES.format(exempt="11.0.0.0/8")))
    assert h.engine.decide_now(outside).outcome == ALLOW  # exempt now, though made before
    assert [h.engine.decide_now(inside).outcome for _ in range(2)] == [ALLOW, DENY]


EXEMPT_RULES = """
exempt: [{exempt}]
rules:
  - id: all
    key: [ip]
    limit: {{requests: 1, per: 60s}}
    action: block
"""


def test_override_multiplies_threshold_for_listed_networks():
    h = Harness("""
overrides:
  - cidrs: [203.0.113.0/24]
    rules: [pages]
    multiply: 10
rules:
  - id: pages
    key: [ip]
    limit: {requests: 2, per: 60s}
    action: block
""")
    assert h.outcomes(21, ip="203.0.113.5")[-2:] == [ALLOW, DENY]
    assert h.decide_now(ip="203.0.113.5").limit == 20
    assert h.outcomes(3, ip="192.0.2.5") == [ALLOW, ALLOW, DENY]


def test_xff_is_ignored_without_trusted_proxies():
    h = Harness(AXISNOW)
    results = [h.decide_now(headers={"x-api-key": "k"}, forwarded_for=f"198.51.100.{i}").outcome
               for i in range(4)]
    assert results == [ALLOW, ALLOW, DENY, DENY]


def test_xff_is_used_through_a_trusted_proxy():
    h = Harness("""
client_ip: {trusted_proxies: [127.0.0.0/8]}
rules:
  - id: per-ip
    key: [ip]
    limit: {requests: 1, per: 60s}
    action: block
""")
    assert h.decide_now(ip="127.0.0.1", forwarded_for="198.51.100.1").outcome == ALLOW
    assert h.decide_now(ip="127.0.0.1", forwarded_for="198.51.100.2").outcome == ALLOW
    assert h.decide_now(ip="127.0.0.1", forwarded_for="198.51.100.1").outcome == DENY


def test_ipv6_clients_in_one_64_share_a_counter():
    h = Harness(AXISNOW.replace('[ip, "header:x-api-key"]', "[ip]"))
    assert h.decide_now(ip="2001:db8:1:2::1").outcome == ALLOW
    assert h.decide_now(ip="2001:DB8:1:2:ffff:0:0:9").outcome == ALLOW
    assert h.decide_now(ip="2001:db8:1:2:0000::77").outcome == DENY
    assert h.decide_now(ip="2001:db8:1:3::1").outcome == ALLOW


def test_invalid_client_address_counts_as_the_empty_value():
    h = Harness(AXISNOW.replace('[ip, "header:x-api-key"]', "[ip]"))
    assert [h.decide_now(ip=bad).outcome for bad in ("", "junk", "999.1.1.1")] == [ALLOW, ALLOW, DENY]
    assert h.engine.metrics.invalid_address.value == 3


def test_ban_of_an_unknown_address_closes_but_bans_nobody():
    h = Harness(BAN)
    assert h.outcomes(3, ip="", path="/scrape") == [ALLOW, ALLOW, CLOSE]
    assert h.engine.store.bans_in_force(h.clock()) == []


def test_memory_stays_bounded_under_address_rotation():
    h = Harness("""
state: {max_keys: 100}
rules:
  - id: per-ip
    key: [ip]
    limit: {requests: 5, per: 60s}
    action: block
""")
    for i in range(5000):
        h.decide_now(ip=f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}")
    assert h.engine.store.tracked_keys() <= 100


def test_expired_keys_are_evicted_before_live_ones():
    h = Harness("""
state: {max_keys: 3}
rules:
  - id: per-ip
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: block
""")
    h.decide_now(ip="192.0.2.1")  # in penalty for 10 s
    h.clock.advance(5)
    h.decide_now(ip="192.0.2.2")
    h.decide_now(ip="192.0.2.3")
    h.clock.advance(6)  # .1 has expired (penalty over, window gone); .2/.3 still in penalty
    h.decide_now(ip="192.0.2.4")
    assert h.decide_now(ip="192.0.2.2").outcome == DENY
    assert h.decide_now(ip="192.0.2.3").outcome == DENY


def test_a_full_map_drops_a_key_past_its_own_limiters_expiry_before_older_live_ones():
    # Two limiters of different lives: the key of the short one, stored
    # between two keys of the long one, has expired when the map is full
    # and goes, not the oldest (each key filed under its own limiter's
    # expiry as it is stored).
    h = Harness("""
state: {max_keys: 3}
rules:
  - id: short
    match: {path: {equals: /short}}
    key: [ip]
    limit: {requests: 100, per: 1s}
    action: block
  - id: long
    match: {path: {equals: /long}}
    key: [ip]
    limit: {requests: 100, per: 1h}
    action: block
""")
    h.decide_now(ip="192.0.2.1", path="/long")
    h.decide_now(ip="192.0.2.2", path="/short")
    h.decide_now(ip="192.0.2.3", path="/long")
    h.clock.advance(5)  # the short window and the one after it are past
    h.decide_now(ip="192.0.2.4", path="/long")
    kept = sorted(key[1] for key in h.engine.store.table.states.data)
    assert kept == ["192.0.2.1", "192.0.2.3", "192.0.2.4"]


@pytest.mark.skipif(core.PURE, reason="the compiled map's hints: the compiled core only")
def test_keys_hinted_by_the_matching_program_are_counted_as_the_keys_read():
    # The program hints each check's key to the compiled map as it makes it
    # (once the map is large enough), and the reads take the hashes the
    # hints kept. Rounds of the clients in turn, hinted (the map lowered to
    # take hints from its first key) and not, in turn: each client's fourth
    # request is its first refused, under two rules.
    h = Harness("""
rules:
  - id: per-ip
    key: [ip]
    limit: {requests: 3, per: 60s}
    action: block
  - id: per-path
    key: [ip, path]
    limit: {requests: 100, per: 60s}
    action: block
""")
    h.decide_now(ip="192.0.2.250")  # the engine learns its store's policy
    states = h.engine.store.table.states
    clients = [f"10.0.{number // 256}.{number % 256}" for number in range(300)]
    outcomes = []
    for hinted in (True, False, True, False):
        states.expect_from = 0 if hinted else 10 ** 9
        outcomes.append([h.decide_now(ip=client, path="/a").outcome for client in clients])
    assert outcomes == [[ALLOW] * 300] * 3 + [[DENY] * 300]


def test_bounded_map_keeps_recently_read_keys_over_older_ones():
    from sidecar.bounded import BoundedMap

    clock = [0.0]
    bounded = BoundedMap(10, lambda value: 1e9, lambda: clock[0])  # nothing ever expires
    for key in range(10):
        bounded[key] = str(key)
    assert bounded.get(0) == "0"  # 0 is now the most recently used
    bounded[10] = "10"  # full: the oldest go (a hundredth of the map, at least one)
    assert bounded.get(0) == "0" and bounded.get(1) is None
    assert len(bounded) <= 10


DRAFT = """
headers: draft
rules:
  - id: api
    key: [ip]
    limit: {requests: 5, per: 10s, window: fixed}
    action: block
  - id: tokens
    key: [ip]
    limit: {tokens: 4, refill: 2/s, cost: 2}
    action: block
  - id: watch
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: log
"""


def test_draft_headers_report_each_enforcing_rules_remaining_budget():
    h = Harness(DRAFT)
    h.clock.now = 1003.0  # 3 s into a 10 s window
    first = h.decide_now()
    assert first.quota == ('"api";q=5;w=10, "tokens";q=4;w=2', '"api";r=4;t=7, "tokens";r=1;t=1')
    second = h.decide_now()
    assert second.quota == ('"api";q=5;w=10, "tokens";q=4;w=2', '"api";r=3;t=7, "tokens";r=0;t=2')


def test_without_draft_headers_there_is_no_quota():
    h = Harness(DRAFT.replace("headers: draft\n", ""))
    assert h.decide_now().quota is None


def test_a_decision_line_shows_a_bounded_part_of_a_huge_key_value(caplog):
    h = Harness("""
decision_log: {keys: clear}
rules:
  - id: keyed
    key: ["header:x-k"]
    limit: {requests: 1, per: 60s}
    action: block
""")
    caplog.set_level(logging.INFO, logger="sluice.decisions")
    huge = "v" * 60_000
    assert h.outcomes(2, headers={"x-k": huge}) == [ALLOW, DENY]
    entry = json.loads(caplog.records[-1].getMessage())
    assert entry["rule"] == "keyed" and entry["key"].startswith("header:x-k=vvv")
    assert len(entry["key"]) <= 257


def test_networks_are_looked_up_without_making_a_new_clients_address_object():
    """Exempt networks, a network ban, an override, an ``ip`` condition and
    a verified bot's networks all ask about every request's address: for a
    client resolved from canonical IPv4 text they read its value, and its
    ``ipaddress`` object (as dear as the rest of resolving) is never made.
    The answers stay those of the networks."""
    h = Harness("""
exempt: [172.16.0.0/12]
overrides:
  - cidrs: [198.51.100.0/24]
    rules: [per-ip]
    multiply: 2
verified_bots:
  - cidrs: [66.249.64.0/19]
rules:
  - id: internal
    match: {ip: {in: [10.0.0.0/8]}}
    key: [ip]
    limit: {requests: 1, per: 60s}
    action: block
  - id: per-ip
    key: [ip]
    limit: {requests: 2, per: 60s}
    action: ban
    ban: {duration: 1h}
""")
    run_at_once(h.engine.store.ban_network(h.clock(), "203.0.113.0/24", 3600, "test"))
    cases = {"172.16.9.9": [ALLOW] * 5,  # exempt
             "203.0.113.9": [CLOSE] * 5,  # its network is banned
             "198.51.100.9": [ALLOW] * 4 + [CLOSE],  # the override doubles the threshold
             "10.1.1.1": [ALLOW] + [DENY] * 4,  # the ip condition's rule
             "192.0.2.9": [ALLOW] * 2 + [CLOSE] * 3}
    requests = {ip: [h.request(ip=ip) for _ in range(5)] for ip in cases}
    assert {ip: [h.engine.decide_now(request).outcome for request in requests[ip]] for ip in cases} == cases
    assert all(request.client._address is None for made in requests.values() for request in made)
