"""The admin API's counters and bans, through the FastAPI app inside its
lifespan, as uvicorn runs it: a client's or a rule's counters listed and
reset, clients and networks banned and unbanned by hand, and every refusal
a 4xx that says why."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.admin import Admin
from sidecar.app import SluiceApp
from sidecar.engine import Engine
from sidecar.request import CheckRequest
from sidecar.rules import Ruleset

from .conftest import FakeClock, ruleset_from
from .test_fuzz_endpoints import assert_defined, metrics_fine, rules_file, sluice  # noqa: F401 (a fixture)

RULES = """
node: edge-1
exempt: [192.0.2.250/32]
rules:
  - id: login
    match: {path: {prefix: /login}}
    key: [ip]
    limit: {requests: 2, per: 1m}
    penalty: 10m
    action: block
  - id: pages
    match: {path: {prefix: /page}}
    key: [ip, path]
    limit: {tokens: 5, refill: 1/s}
    action: block
  - id: api-key
    match: {path: {prefix: /api/}}
    key: ["header:x-api-key", host]
    limit: {requests: 3, per: 1m}
    action: block
  - id: sessions
    match: {path: {prefix: /cart}}
    key: ["session:sid"]
    limit: {requests: 2, per: 1m}
    action: block
  - id: scrapers
    match: {path: {prefix: /catalog/}}
    key: [ip]
    limit: {requests: 1, per: 1m}
    action: ban
    ban: {duration: 10m}
"""

TOKEN = b"an-admin-token-long-enough"
CLIENT = "203.0.113.7"


class Sluice:
    """One Sluice on a fake clock: its engine decides requests, its app
    answers admin calls as uvicorn would send them."""

    def __init__(self, token: bytes | None = TOKEN, ruleset: Ruleset | None = None) -> None:
        self.clock = FakeClock()
        self.engine = Engine(ruleset or ruleset_from(RULES), clock=self.clock)
        self.admin = Admin(self.engine, None, token, loopback_listener=token is None)
        self.app = SluiceApp(self.engine, admin=self.admin)

    async def decide(self, ip: str = CLIENT, path: str = "/login", headers: dict[str, str] | None = None) -> str:
        request = CheckRequest("GET", "shop.example", path, dict(headers or {}),
                               self.engine.resolve_client(ip, None), "req-1")
        return str((await self.engine.decide(request)).outcome)

    async def call(self, method: str, path: str, query: Sequence[tuple[str, str]] = (), body: Any = None,
                   token: bytes | None = TOKEN, raw: bytes | None = None,
                   client: tuple[str, int] | None = ("127.0.0.1", 5000),
                   server: tuple[str, int | None] = ("127.0.0.1", 8181)) -> tuple[int, Any]:
        """(status, JSON answer or None) of one admin call from ``client``
        to ``server``, as uvicorn describes them."""
        data = raw if raw is not None else b"" if body is None else json.dumps(body).encode()
        headers = [(b"authorization", b"Bearer " + token)] if token is not None else []
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                 "method": method, "path": f"/v1/admin/{path}", "raw_path": f"/v1/admin/{path}".encode(),
                 "query_string": urlencode(query).encode(), "root_path": "", "headers": headers,
                 "client": client, "server": server}
        sent: list[dict] = []
        chunks = [data]

        async def receive() -> dict:
            return {"type": "http.request", "body": chunks.pop() if chunks else b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        await self.app(scope, receive, send)
        body_out = b"".join(message.get("body", b"") for message in sent[1:])
        return sent[0]["status"], json.loads(body_out) if body_out else None


def run(test: Callable[[Sluice], Awaitable[Any]], token: bytes | None = TOKEN, ruleset: Ruleset | None = None) -> Any:
    """``test`` in an event loop, inside the app's lifespan."""
    async def go() -> Any:
        s = Sluice(token, ruleset)
        async with s.app.api.router.lifespan_context(s.app.api):
            return await test(s)
    return asyncio.run(go())


# --------------------------------------------------------------------------
# Counters
# --------------------------------------------------------------------------


def test_the_counters_of_an_address_are_every_key_counted_for_it_with_its_numbers() -> None:
    async def test(s: Sluice) -> tuple:
        for _ in range(3):
            await s.decide(path="/login")
        s.clock.advance(30)
        await s.decide(path="/page/1")
        await s.decide(path="/cart")  # no session cookie: counted by the address
        await s.decide(path="/cart", headers={"cookie": f"sid={CLIENT}"})  # a cookie: not the address
        await s.decide(ip="203.0.113.8", path="/login")
        await s.decide(path="/api/x", headers={"x-api-key": "k1"})  # keyed without the address
        return await s.call("GET", "counters", [("ip", CLIENT)])
    status, answer = run(test)
    assert status == 200
    assert [(c["rule"], c["key"]) for c in answer["counters"]] == [
        ("login", f"ip={CLIENT}"), ("pages", f"ip={CLIENT} path=/page/1"),
        ("sessions", f"session:sid=('ip', '{CLIENT}')")]
    login, pages, sessions = answer["counters"]
    # Two requests reached the threshold of 2: ten minutes of penalty from then.
    assert (login["remaining"], login["penalty_seconds"], login["reset_seconds"]) == (0, 570.0, 570.0)
    assert login["limit"] == "2 per 1m (sliding window), penalty 10m"
    assert login["dimensions"] == {"ip": CLIENT}
    # One token of five taken; full again in a second.
    assert (pages["remaining"], pages["reset_seconds"], pages["penalty_seconds"], pages["window_seconds"]) == \
        (4, 1.0, 0.0, 5.0)
    assert sessions["dimensions"] == {"session:sid": {"ip": CLIENT}}
    assert (sessions["remaining"], answer["truncated"], answer["ban"]) == (1, False, None)


def test_one_key_of_a_rule_is_named_by_its_dimensions_values_in_any_order() -> None:
    async def test(s: Sluice) -> list:
        for key in ("k1", "k1", "k2"):
            await s.decide(path="/api/x", headers={"x-api-key": key})
        return [await s.call("GET", "counters", query) for query in (
            [("rule", "api-key"), ("key", "host=shop.example"), ("key", "header:X-Api-Key=k1")],
            [("rule", "api-key")],
            [("rule", "api-key"), ("key", "header:x-api-key=k3"), ("key", "host=shop.example")])]
    one, every, none = run(test)
    assert one[0] == 200 and [(c["key"], c["remaining"]) for c in one[1]["counters"]] == \
        [("header:x-api-key=k1 host=shop.example", 1)]
    assert [c["key"] for c in every[1]["counters"]] == \
        ["header:x-api-key=k1 host=shop.example", "header:x-api-key=k2 host=shop.example"]
    assert none == (200, {"counters": [], "truncated": False})


def test_an_ipv6_client_is_named_by_any_address_of_its_64() -> None:
    async def test(s: Sluice) -> tuple:
        await s.decide(ip="2001:db8:1:2::5", path="/login")
        return (await s.call("GET", "counters", [("ip", "2001:db8:1:2:ffff::1")]),
                await s.call("GET", "counters", [("rule", "login"), ("key", "ip=2001:db8:1:2::/64")]))
    (status, by_ip), (_, by_key) = run(test)
    assert status == 200
    assert [c["key"] for c in by_ip["counters"]] == ["ip=2001:db8:1:2::/64"] == \
        [c["key"] for c in by_key["counters"]]


def test_a_client_refused_by_a_rule_is_let_in_right_after_its_counters_are_reset() -> None:
    async def test(s: Sluice) -> tuple:
        refused = [await s.decide() for _ in range(3)]
        await s.decide(path="/page/1")
        status, answer = await s.call("DELETE", "counters", [("ip", CLIENT)])
        after = [await s.decide() for _ in range(3)]
        return refused, status, answer, after, await s.call("GET", "counters", [("ip", CLIENT)])
    refused, status, answer, after, (_, listing) = run(test)
    assert refused == ["allow", "allow", "deny"]
    assert (status, answer) == (200, {"reset": 2, "ban": None})
    # Counting starts again: the threshold of 2, then the penalty.
    assert after == ["allow", "allow", "deny"]
    assert [c["rule"] for c in listing["counters"]] == ["login"]


def test_a_reset_of_one_key_or_of_one_rule_leaves_the_others() -> None:
    async def test(s: Sluice) -> list:
        for key in ("k1", "k2"):
            for _ in range(4):
                await s.decide(path="/api/x", headers={"x-api-key": key})
        await s.decide(path="/login")
        one = await s.call("DELETE", "counters", [("rule", "api-key"), ("key", "header:x-api-key=k1"),
                                                  ("key", "host=shop.example")])
        outcomes = [await s.decide(path="/api/x", headers={"x-api-key": key}) for key in ("k1", "k2")]
        rule = await s.call("DELETE", "counters", [("rule", "api-key")])
        left = await s.call("GET", "counters", [("ip", CLIENT)])
        return [one, outcomes, rule, [c["rule"] for c in left[1]["counters"]]]
    assert run(test) == [(200, {"reset": 1}), ["allow", "deny"], (200, {"reset": 2}), ["login"]]


def test_a_listing_is_bounded_and_says_so() -> None:
    async def test(s: Sluice) -> tuple:
        for n in range(5):
            await s.decide(path=f"/page/{n}")
        return await s.call("GET", "counters", [("ip", CLIENT), ("limit", "3")])
    status, answer = run(test)
    assert (status, len(answer["counters"]), answer["truncated"]) == (200, 3, True)


@pytest.mark.parametrize(("query", "status", "message"), [
    ([], 422, "name the counters: ip=ADDRESS, or rule=RULE"),
    ([("ip", "203.0.113")], 422, "expected an IP address or a network (CIDR), got '203.0.113'"),
    ([("ip", "198.51.100.0/24")], 422, "'198.51.100.0/24' is a network; one client is an address, or a /32"),
    ([("rule", "nope")], 404, "no rule 'nope' runs now (rules: login, pages, api-key, sessions, scrapers)"),
    ([("key", "ip=203.0.113.7")], 422, "key=DIMENSION=VALUE needs rule=RULE"),
    ([("ip", CLIENT), ("rule", "login"), ("key", "ip=203.0.113.7")], 422, "give the address as one of the key's"),
    ([("rule", "api-key"), ("key", "header:x-api-key=k1")], 422,
     "rule api-key counts by header:x-api-key, host: give host=VALUE"),
    ([("rule", "api-key"), ("key", "ip=203.0.113.7")], 422, "rule api-key counts by header:x-api-key, host, not by ip"),
    ([("rule", "login"), ("key", "ip")], 422, "expected DIMENSION=VALUE, got 'ip'"),
    ([("rule", "login"), ("key", "colour=red")], 422, "unknown dimension 'colour'"),
    ([("rule", "login"), ("key", "ip=1.2.3.4"), ("key", "ip=1.2.3.5")], 422, "ip is given twice"),
    ([("rule", "login"), ("key", "ip=banana")], 422, "expected an IP address"),
])
def test_counters_that_cannot_be_named_are_refused_with_what_is_wrong(query, status, message) -> None:
    async def test(s: Sluice) -> list:
        return [await s.call(method, "counters", query) for method in ("GET", "DELETE")]
    for answered_status, answer in run(test):
        assert answered_status == status and message in answer["detail"], answer


def test_a_listing_limit_out_of_range_is_refused() -> None:
    async def test(s: Sluice) -> tuple:
        return await s.call("GET", "counters", [("ip", CLIENT), ("limit", "0")])
    status, answer = run(test)
    assert status == 422 and answer["detail"][0]["loc"] == ["query", "limit"]


# --------------------------------------------------------------------------
# Bans by hand
# --------------------------------------------------------------------------


def test_a_ban_by_hand_closes_the_client_is_listed_with_its_reason_and_unban_lets_it_in() -> None:
    async def test(s: Sluice) -> tuple:
        created = await s.call("POST", "bans", body={"address": CLIENT, "duration": "1h",
                                                     "reason": "credential stuffing"})
        banned = [await s.decide(path=path) for path in ("/", "/login", "/page/1")]
        neighbour = await s.decide(ip="203.0.113.8")
        s.clock.advance(60)
        listed = await s.call("GET", "bans")
        counters = await s.call("GET", "counters", [("ip", CLIENT)])
        lifted = await s.call("DELETE", "bans", [("address", CLIENT)])
        return created, banned, neighbour, listed, counters[1]["ban"], lifted, await s.decide(path="/")
    created, banned, neighbour, (status, listed), ban_of_client, lifted, after = run(test)
    assert created[0] == 201
    assert {k: created[1][k] for k in ("address", "scope", "rule", "reason", "node", "duration_seconds")} == {
        "address": CLIENT, "scope": "address", "rule": "manual", "reason": "credential stuffing",
        "node": "edge-1", "duration_seconds": 3600.0}
    assert banned == ["close"] * 3 and neighbour == "allow"
    assert status == 200 and [(b["address"], b["remaining_seconds"]) for b in listed] == [(CLIENT, 3540.0)]
    assert ban_of_client["reason"] == "credential stuffing"
    assert lifted == (204, None) and after == "allow"


def test_an_ipv6_address_is_banned_as_its_64_as_rules_count_it() -> None:
    async def test(s: Sluice) -> tuple:
        created = await s.call("POST", "bans", body={"address": "2001:db8:1:2::99", "duration": 600})
        return created[1]["address"], [await s.decide(ip=ip, path="/") for ip in (
            "2001:db8:1:2::1", "2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:3::1")]
    assert run(test) == ("2001:db8:1:2::/64", ["close", "close", "allow"])


def test_a_network_ban_closes_every_address_in_it_until_it_is_lifted() -> None:
    async def test(s: Sluice) -> tuple:
        created = await s.call("POST", "bans", body={"address": "198.51.100.0/24", "duration": "2h",
                                                     "reason": "scanner range"})
        inside = [await s.decide(ip=ip, path="/") for ip in ("198.51.100.1", "198.51.100.254")]
        outside = await s.decide(ip="198.51.101.1", path="/")
        listed = await s.call("GET", "bans")
        not_its_own = await s.call("DELETE", "bans", [("address", "198.51.100.7")])
        lifted = await s.call("DELETE", "bans", [("address", "198.51.100.0/24")])
        return created, inside, outside, listed[1], not_its_own, lifted, await s.decide(ip="198.51.100.1", path="/")
    created, inside, outside, listed, not_its_own, lifted, after = run(test)
    assert (created[0], created[1]["scope"], created[1]["address"]) == (201, "network", "198.51.100.0/24")
    assert inside == ["close", "close"] and outside == "allow"
    assert [(b["address"], b["scope"], b["rule"], b["reason"]) for b in listed] == \
        [("198.51.100.0/24", "network", "manual", "scanner range")]
    assert not_its_own == (404, {"detail": "no ban of 198.51.100.7; it is in the banned network "
                                           "198.51.100.0/24: lift that"})
    assert lifted == (204, None) and after == "allow"


def test_a_network_ban_ends_on_its_own_and_exempt_addresses_stay_exempt() -> None:
    async def test(s: Sluice) -> list:
        await s.call("POST", "bans", body={"address": "192.0.2.0/24", "duration": "1m"})
        outcomes = [await s.decide(ip="192.0.2.250", path="/"), await s.decide(ip="192.0.2.1", path="/")]
        s.clock.advance(60)
        return outcomes + [await s.decide(ip="192.0.2.1", path="/"), (await s.call("GET", "bans"))[1]]
    assert run(test) == ["allow", "close", "allow", []]


def test_earned_and_manual_bans_are_listed_side_by_side_and_either_can_be_lifted() -> None:
    async def test(s: Sluice) -> tuple:
        for _ in range(2):
            await s.decide(ip="203.0.113.9", path="/catalog/a")  # the second is banned by the rule
        await s.call("POST", "bans", body={"address": CLIENT, "duration": "1h", "reason": "r"})
        listed = (await s.call("GET", "bans"))[1]
        lifted = await s.call("DELETE", "bans", [("address", "203.0.113.9")])
        return [(b["address"], b["rule"], b["reason"], b["duration_seconds"]) for b in listed], lifted, \
            await s.decide(ip="203.0.113.9", path="/")
    assert run(test) == ([(CLIENT, "manual", "r", 3600.0), ("203.0.113.9", "scrapers", None, 600.0)],
                         (204, None), "allow")


def test_banning_again_replaces_the_ban() -> None:
    async def test(s: Sluice) -> list:
        await s.call("POST", "bans", body={"address": CLIENT, "duration": "1h", "reason": "first"})
        await s.call("POST", "bans", body={"address": f"{CLIENT}/32", "duration": "10m", "reason": "second"})
        _, listed = await s.call("GET", "bans")
        return [(b["address"], b["scope"], b["reason"], b["duration_seconds"]) for b in listed]
    assert run(test) == [(CLIENT, "address", "second", 600.0)]


@pytest.mark.parametrize(("body", "message"), [
    (b"", "expected a JSON object like"),
    (b"[1]", "expected a JSON object like"),
    (b'{"address": "1.2.3.4", "duration": NaN}', "expected a JSON object like"),
    (b"[" * 5000 + b"]" * 5000, "expected a JSON object like"),
    (b'{"address": "1.2.3.4", "duration": "1h", "colour": 1}', "unknown field 'colour'"),
    (b'{"duration": "1h"}', "address: expected an IP address or a network (CIDR), as a string"),
    (b'{"address": 7, "duration": "1h"}', "address: expected an IP address"),
    (b'{"address": "1.2.3.4"}', "duration: required"),
    (b'{"address": "1.2.3.4", "duration": "soon"}', "duration: expected a duration like '10s', got 'soon'"),
    (b'{"address": "1.2.3.4", "duration": 0}', "duration: a duration must be positive"),
    (b'{"address": "1.2.3.4", "duration": "2y"}', "duration: a ban lasts from 1s to 1y"),
    (b'{"address": "1.2.3.4", "duration": true}', "duration: expected a duration"),
    (b'{"address": "1.2.3.4", "duration": 1e400}', "duration: a duration must be positive"),
    (b'{"address": "1.2.3.4", "duration": 60, "reason": 5}', "reason: expected text"),
    (b'{"address": "1.2.3.4", "duration": 60, "reason": "a\\nb"}', "reason: expected text"),
    (b'{"address": "1.2.3.4", "duration": 60, "reason": "' + b"x" * 300 + b'"}', "reason: expected text"),
    (b'{"address": "1.2.3", "duration": 60}', "address: expected an IP address or a network (CIDR), got '1.2.3'"),
    (b'{"address": "198.51.100.7/24", "duration": 60}',
     "address: '198.51.100.7/24' has bits set after its /24: did you mean 198.51.100.0/24?"),
    (b'{"address": "0.0.0.0/0", "duration": 60}', "address: '0.0.0.0/0' is every address: refused"),
    (b'{"address": "::ffff:0:0/96", "duration": 60}', "IPv4-mapped addresses count as IPv4"),
    (b"\xff\xfe", "expected a JSON object like"),
    (b'{"address": "' + b"1" * 20_000 + b'"}', "of at most 16384 bytes"),
])
def test_a_ban_that_cannot_be_made_is_refused_with_what_is_wrong(body, message) -> None:
    async def test(s: Sluice) -> tuple:
        return await s.call("POST", "bans", raw=body), (await s.call("GET", "bans"))[1]
    (status, answer), listed = run(test)
    assert status == 422 and message in answer["detail"], answer
    assert listed == []


@pytest.mark.parametrize(("address", "status", "message"), [
    ("203.0.113.7", 404, "no ban of 203.0.113.7"),
    ("banana", 422, "address: expected an IP address or a network (CIDR), got 'banana'"),
    ("10.0.0.0/8", 404, "no ban of 10.0.0.0/8"),
])
def test_lifting_a_ban_that_is_not_there_says_so(address, status, message) -> None:
    async def test(s: Sluice) -> tuple:
        return await s.call("DELETE", "bans", [("address", address)])
    answered = run(test)
    assert answered[0] == status and message in answered[1]["detail"]


# --------------------------------------------------------------------------
# Access and the audit lines
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "query", "body"), [
    ("GET", "counters", [("ip", CLIENT)], None),
    ("DELETE", "counters", [("ip", CLIENT)], None),
    ("POST", "bans", [], {"address": CLIENT, "duration": 60}),
    ("DELETE", "bans", [("address", CLIENT)], None),
])
def test_the_new_calls_need_the_bearer_token_and_change_nothing_without_it(method, path, query, body) -> None:
    async def test(s: Sluice) -> tuple:
        for _ in range(3):
            await s.decide()
        missing = await s.call(method, path, query, body, token=None)
        wrong = await s.call(method, path, query, body, token=b"a-wrong-token-of-some-length")
        return missing[0], wrong[0], await s.decide(), (await s.call("GET", "bans"))[1]
    assert run(test) == (401, 401, "deny", [])


def test_without_a_token_a_peer_of_a_unix_socket_may_act_and_a_peer_without_an_address_may_not() -> None:
    """uvicorn gives a Unix socket's peer no address, and its server the
    socket's path without a port."""
    async def test(s: Sluice) -> list[int]:
        return [(await s.call("GET", "bans", token=None, client=None, server=server))[0]
                for server in (("/run/sluice.sock", None), ("127.0.0.1", 8181))]
    assert run(test, token=None) == [200, 403]


def test_without_a_token_a_loopback_peer_of_a_loopback_listener_may_act() -> None:
    async def test(s: Sluice) -> tuple:
        return await s.call("POST", "bans", body={"address": CLIENT, "duration": 60}, token=None)
    assert run(test, token=None)[0] == 201


def test_every_action_writes_one_audit_line_and_none_holds_the_token_or_a_keys_value(caplog) -> None:
    caplog.set_level(logging.INFO, logger="sluice.decisions")

    async def test(s: Sluice) -> None:
        await s.decide(path="/api/x", headers={"x-api-key": "secret-api-key"})
        await s.call("POST", "bans", body={"address": CLIENT, "duration": "1h", "reason": "stuffing"})
        await s.call("POST", "bans", body={"address": "198.51.100.0/24", "duration": 60})
        await s.call("DELETE", "bans", [("address", CLIENT)])
        await s.call("DELETE", "bans", [("address", CLIENT)])  # no ban: said too
        await s.call("DELETE", "counters", [("ip", "203.0.113.8")])
        await s.call("DELETE", "counters", [("rule", "api-key"), ("key", "header:x-api-key=secret-api-key"),
                                            ("key", "host=shop.example")])
        await s.call("GET", "counters", [("ip", CLIENT)])  # a look: no action
        await s.call("POST", "bans", raw=b"{}")  # refused before it is an action
    run(test)
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "sluice.decisions"]
    audits = [{k: v for k, v in line.items() if k not in ("time", "ts")} for line in lines if "audit" in line]
    assert audits[:5] == [
        {"audit": "ban", "who": "token", "result": "banned", "address": CLIENT, "duration": 3600.0,
         "reason": "stuffing", "node": "edge-1"},
        {"audit": "ban", "who": "token", "result": "banned", "address": "198.51.100.0/24", "duration": 60.0,
         "reason": "", "node": "edge-1"},
        {"audit": "unban", "who": "token", "result": "lifted", "address": CLIENT, "node": "edge-1"},
        {"audit": "unban", "who": "token", "result": "no ban", "address": CLIENT, "node": "edge-1"},
        {"audit": "reset", "who": "token", "result": "reset", "counters": 0, "ip": "203.0.113.8",
         "node": "edge-1"},
    ]
    reset_key = audits[5]
    assert (reset_key["audit"], reset_key["counters"], reset_key["rule"]) == ("reset", 1, "api-key")
    assert reset_key["key"].startswith("header:x-api-key=#") and len(audits) == 6
    text = caplog.text
    assert TOKEN.decode() not in text and "secret-api-key" not in text


# --------------------------------------------------------------------------
# The key named is the key the rule counts
# --------------------------------------------------------------------------

EVERY_DIMENSION = """
rules:
  - id: every
    key: [ip, host, method, path, uri, "header:x-k", "cookie:c", "query:q", "session:sid"]
    limit: {requests: 5, per: 1m}
    action: block
"""


@settings(max_examples=300, deadline=None)
@given(ip=st.one_of(st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(str)),
       host=st.text(max_size=12), method=st.sampled_from(["GET", "POST", "get"]),
       path=st.text(st.characters(blacklist_characters="?#"), max_size=20).map(lambda p: "/" + p),
       query=st.text(max_size=12), header=st.text(max_size=12),
       cookie=st.text(st.characters(blacklist_characters=";= "), min_size=1, max_size=12),
       session=st.one_of(st.none(), st.text(st.characters(blacklist_characters=";= "), min_size=1, max_size=12)))
def test_a_key_named_by_its_values_is_the_key_the_rule_counts_the_request_under(
        ip, host, method, path, query, header, cookie, session) -> None:
    from urllib.parse import quote

    from sidecar.counters import key_from_text

    engine = Engine(ruleset_from(EVERY_DIMENSION), clock=FakeClock())
    [rule] = engine.ruleset.rules
    cookies = f"c={cookie}" + (f"; sid={session}" if session is not None else "")
    request = CheckRequest(method, host, f"{path}?q={quote(query)}", {"x-k": header, "cookie": cookies},
                           engine.resolve_client(ip, None), "r")
    given = [f"ip={ip}", f"host={host}", f"method={method}", f"path={path}", f"uri={request.uri}",
             f"header:X-K={header}", f"cookie:c={request.cookies['c']}", f"query:q={request.query['q']}"]
    if session is not None:
        given.append(f"session:sid={request.cookies['sid']}")
        assert key_from_text(rule, engine.ruleset.resolver, given[::-1]) == rule.key(request)
    else:
        # Without its cookie a session counts by the address: named by ip=.
        with pytest.raises(ValueError, match="give session:sid=VALUE"):
            key_from_text(rule, engine.ruleset.resolver, given)


# --------------------------------------------------------------------------
# Fuzzing: whatever arrives, a defined answer
# --------------------------------------------------------------------------

# The fuzzing Sluice's rules (tests/unit/test_fuzz_endpoints.py): every
# dimension, session cookies, and rules of every algorithm.
FUZZ_RULES = ["blocked", "closer", "chal", "banned", "login", "marked", "score", "leaky", "tokens", "watch",
              "conc"]
DIMENSIONS = ["ip", "header:x-k", "cookie:s", "query:q", "session:sid", "host", "method", "path", "uri"]
texts = st.one_of(st.text(max_size=40), st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF),
                                                 max_size=8))
addresses_or_networks = st.one_of(texts, st.sampled_from([
    "192.0.2.200", "2001:db8::1", "2001:db8::/64", "2001:db8::/48", "198.51.100.0/24", "198.51.100.7/24",
    "::ffff:1.2.3.4", "fe80::1%eth0", "0.0.0.0/0", "10.0.0.0/33", " 192.0.2.1 ", "1" * 200]))
key_texts = st.one_of(texts, st.builds(lambda name, value: f"{name}={value}",
                                       st.one_of(st.sampled_from(DIMENSIONS), texts),
                                       st.one_of(addresses_or_networks, texts)))
counter_queries = st.lists(st.one_of(
    st.tuples(st.just("ip"), addresses_or_networks),
    st.tuples(st.just("rule"), st.one_of(st.sampled_from(FUZZ_RULES), texts)),
    st.tuples(st.just("key"), key_texts),
    st.tuples(st.just("limit"), st.one_of(st.integers(-5, 20_000).map(str), texts))), max_size=8)
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.floats(), st.integers(), texts),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(texts, inner, max_size=3)),
                           max_leaves=8)
ban_bodies = st.one_of(
    st.binary(max_size=80),
    st.fixed_dictionaries({"address": st.one_of(addresses_or_networks, json_values)},
                          optional={"duration": st.one_of(st.sampled_from(["1h", "90s", "0.5s", "1y", "2y", "1e3s"]),
                                                          json_values),
                                    "reason": st.one_of(texts, json_values),
                                    "extra": json_values}).map(lambda fields: json.dumps(fields).encode()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(query=counter_queries, method=st.sampled_from(["GET", "DELETE"]), traffic=st.booleans())
def test_counter_calls_answer_any_parameters(rules_file, query, method, traffic) -> None:  # noqa: F811
    with sluice(rules_file) as s:
        if traffic:
            check_some(s)
        # Lone surrogates go as the bytes of their UTF-8 form: invalid UTF-8.
        encoded = urlencode(query, errors="surrogatepass").encode()
        response = s.call("/v1/admin/counters", admin_headers(), method=method, query=encoded)
        assert_defined(response, {200, 404, 422})
        metrics_fine(s)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(body=ban_bodies, address=addresses_or_networks, lift_first=st.booleans())
def test_ban_calls_answer_any_body_and_address(rules_file, body, address, lift_first) -> None:  # noqa: F811
    lifting = urlencode([("address", address)], errors="surrogatepass").encode()
    with sluice(rules_file) as s:
        if lift_first:
            assert_defined(s.call("/v1/admin/bans", admin_headers(), method="DELETE",
                                  query=lifting), {204, 404, 422})
        assert_defined(s.call("/v1/admin/bans", admin_headers(), method="POST", body=[body]), {201, 422})
        assert_defined(s.call("/v1/admin/bans", admin_headers(), method="DELETE", query=lifting), {204, 404, 422})
        assert_defined(s.call("/v1/admin/bans", admin_headers()), {200})
        check_some(s)  # a ban of any shape is then looked up
        metrics_fine(s)


def admin_headers() -> list[tuple[bytes, bytes]]:
    from .test_fuzz_endpoints import ADMIN_TOKEN

    return [(b"authorization", b"Bearer " + ADMIN_TOKEN)]


def check_some(s: Any) -> None:
    """Requests that count under every rule's key, from an IPv4 and an IPv6 client."""
    from .test_fuzz_endpoints import check

    for addr in ("192.0.2.200", "2001:db8::1"):
        for uri in ("/b?q=1", "/login", "/t/x", "/k", "/ban"):
            check(s, "/v1/nginx/auth", uri, addr, [(b"x-k", b"v"), (b"cookie", b"s=v1")])
