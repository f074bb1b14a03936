"""Counting keys, conditions and path normalisation."""

from __future__ import annotations

from ipaddress import ip_address
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from sidecar import config
from sidecar.clientip import ClientAddress, ClientIPResolver
from sidecar.config import parse_rules_text
from sidecar.request import CheckRequest, normalise_path
from sidecar.rules import compile_condition, compile_key, compile_rules

CLIENT = ClientIPResolver().resolve("192.0.2.10", None)
OTHER_CLIENT = ClientIPResolver().resolve("192.0.2.11", None)


def request(
    uri: str = "/",
    *,
    method: str = "GET",
    host: str = "example.com",
    headers: dict[str, str] | None = None,
    cookies: dict[str, str] | None = None,
    client: ClientAddress = CLIENT,
) -> CheckRequest:
    all_headers = dict(headers or {})
    if cookies is not None:
        all_headers["cookie"] = "; ".join(f"{name}={value}" for name, value in cookies.items())
    return CheckRequest(method, host, uri, all_headers, client, "req-1")


def key_of(dimensions: list[str], req: CheckRequest, rule_id: str = "rule") -> object:
    _, builder = compile_key(rule_id, dimensions)
    key = builder(req)
    hash(key)  # keys index the state tables
    return key


# Values that contain the characters a naive "join with a separator" key would use.
SEPARATORS = "|:=, \x00;/\\\"'[](){}"
tricky_text = st.text(alphabet=st.sampled_from(SEPARATORS) | st.characters(codec="utf-8"), max_size=12)
# What may travel inside one cookie value: no ';', no surrounding blanks.
cookie_text = st.text(alphabet=st.sampled_from("|:=,\x00/ab1.") | st.characters(
    codec="ascii", exclude_characters=";"), min_size=1, max_size=12).filter(
    lambda value: value == value.strip())

ALL_DIMENSIONS = ["ip", "host", "method", "path", "uri", "header:x-api-key", "cookie:sid",
                  "query:q", "session:sid"]


# --------------------------------------------------------------------------
# Counting keys
# --------------------------------------------------------------------------


@given(st.permutations(ALL_DIMENSIONS))
def test_dimension_order_does_not_change_the_key(order: list[str]) -> None:
    req = request("/a/b?q=1", headers={"x-api-key": "k"}, cookies={"sid": "s"})
    names, _ = compile_key("rule", order)  # (rule id, sorted names)
    assert names == compile_key("rule", ALL_DIMENSIONS)[0]
    assert key_of(order, req) == key_of(ALL_DIMENSIONS, req)


def test_ip_and_path_key_equals_path_and_ip_key() -> None:
    req = request("/login")
    assert key_of(["ip", "path"], req) == key_of(["path", "ip"], req)


@pytest.mark.parametrize(("dimension", "first", "second"), [
    ("header:x-api-key", request(headers={"x-api-key": "Key"}), request(headers={"x-api-key": "key"})),
    ("cookie:sid", request(cookies={"sid": "ABC"}), request(cookies={"sid": "abc"})),
    ("query:q", request("/?q=ABC"), request("/?q=abc")),
    ("session:sid", request(cookies={"sid": "ABC"}), request(cookies={"sid": "abc"})),
    ("path", request("/Login"), request("/login")),
    ("uri", request("/login?A=1"), request("/login?a=1")),
    ("method", request(method="get"), request(method="GET")),
])
def test_values_are_case_sensitive(dimension: str, first: CheckRequest, second: CheckRequest) -> None:
    assert key_of([dimension], first) != key_of([dimension], second)


@pytest.mark.parametrize(("dimension", "missing", "empty"), [
    ("header:x-api-key", request(headers={"x-other": "v"}), request(headers={"x-api-key": ""})),
    ("cookie:sid", request(cookies={"other": "v"}), request(cookies={"sid": ""})),
    ("cookie:sid", request(), request(cookies={"sid": ""})),
    ("query:q", request("/path?other=1"), request("/path?q=")),
    ("query:q", request("/path"), request("/path?q")),
])
def test_missing_value_is_the_empty_value(dimension: str, missing: CheckRequest, empty: CheckRequest) -> None:
    assert key_of([dimension], missing) == key_of([dimension], empty)


@given(st.lists(st.tuples(st.sampled_from(["/a", "/b/c", "/"]), st.sampled_from(["GET", "POST"]),
                          st.sampled_from(["x-other", "user-agent"]), tricky_text), min_size=2, max_size=5))
def test_all_requests_without_the_header_share_one_key(variants: list[tuple[str, str, str, str]]) -> None:
    keys = {key_of(["header:x-api-key"], request(path, method=method, headers={other: value}))
            for path, method, other, value in variants}
    assert len(keys) == 1


def test_missing_header_key_differs_from_a_present_value() -> None:
    assert key_of(["header:x-api-key"], request()) != \
        key_of(["header:x-api-key"], request(headers={"x-api-key": "k"}))


def test_header_dimension_name_is_case_insensitive_through_the_rules_file() -> None:
    loaded = parse_rules_text(
        "rules:\n"
        "  - id: r\n"
        "    key: ['header:X-Api-Key']\n"
        "    limit: {requests: 1, per: 1s}\n"
        "    action: log\n", "r.yaml", Path("."))
    rule = compile_rules(loaded).rules[0]
    with_key = request(headers={"x-api-key": "secret"})
    assert rule.key(with_key) != rule.key(request())
    assert rule.key(with_key) == rule.key(request(uri="/elsewhere", headers={"x-api-key": "secret"}))


def test_no_dimensions_counts_by_host_and_ip() -> None:
    (_, names), _ = compile_key("rule", [])
    assert set(names) == {"host", "ip"}
    base = request("/a")
    assert key_of([], base) == key_of(["host", "ip"], base)
    assert key_of([], base) == key_of([], request("/b?x=1", method="POST", headers={"x-y": "z"}))
    assert key_of([], base) != key_of([], request("/a", host="other.example"))
    assert key_of([], base) != key_of([], request("/a", client=OTHER_CLIENT))


@given(st.lists(st.sampled_from(ALL_DIMENSIONS), unique=True),
       st.text(min_size=1, max_size=10), st.text(min_size=1, max_size=10))
def test_different_rule_ids_give_different_keys(dimensions: list[str], first: str, second: str) -> None:
    assume(first != second)
    req = request("/x?q=1", headers={"x-api-key": "k"}, cookies={"sid": "s"})
    assert key_of(dimensions, req, first) != key_of(dimensions, req, second)


def test_different_dimension_sets_with_equal_values_give_different_keys() -> None:
    req = request(headers={"a": "v", "b": "v"})
    assert key_of(["header:a"], req) != key_of(["header:b"], req)
    assert key_of(["host"], request(host="x")) != key_of(["method"], request(method="x"))


@given(st.tuples(tricky_text, tricky_text, tricky_text), st.tuples(tricky_text, tricky_text, tricky_text))
def test_different_value_tuples_never_share_a_key(first: tuple[str, ...], second: tuple[str, ...]) -> None:
    assume(first != second)

    def build(values: tuple[str, ...]) -> CheckRequest:
        header_a, header_b, query = values
        return request(f"/p?q={quote(query, safe='')}", headers={"x-a": header_a, "x-b": header_b})

    assert build(first).query["q"] == first[2]
    dimensions = ["header:x-a", "header:x-b", "query:q"]
    assert key_of(dimensions, build(first)) != key_of(dimensions, build(second))


@given(st.tuples(tricky_text, tricky_text), st.tuples(tricky_text, tricky_text))
def test_two_header_values_with_separators_never_collide(first: tuple[str, str], second: tuple[str, str]) -> None:
    assume(first != second)
    dimensions = ["header:x-a", "header:x-b"]
    a = request(headers={"x-a": first[0], "x-b": first[1]})
    b = request(headers={"x-a": second[0], "x-b": second[1]})
    assert key_of(dimensions, a) != key_of(dimensions, b)


@pytest.mark.parametrize(("first", "second"), [
    (("a|b", "c"), ("a", "b|c")),
    (("a:b", "c"), ("a", "b:c")),
    (("a=b", "c"), ("a", "b=c")),
    (("a,b", "c"), ("a", "b,c")),
    (("a b", "c"), ("a", "b c")),
    (("a\x00b", "c"), ("a", "b\x00c")),
    (("", "x"), ("x", "")),
])
def test_shifting_a_separator_between_values_changes_the_key(first: tuple[str, str], second: tuple[str, str]) -> None:
    dimensions = ["header:x-a", "header:x-b"]
    a = request(headers={"x-a": first[0], "x-b": first[1]})
    b = request(headers={"x-a": second[0], "x-b": second[1]})
    assert key_of(dimensions, a) != key_of(dimensions, b)


@given(cookie_text, cookie_text)
def test_session_key_follows_the_cookie_value(first: str, second: str) -> None:
    a = key_of(["session:sid"], request(cookies={"sid": first}))
    b = key_of(["session:sid"], request(cookies={"sid": second}, client=OTHER_CLIENT))
    assert (a == b) == (first == second)


def test_session_without_the_cookie_falls_back_to_the_client_address() -> None:
    alone = key_of(["session:sid"], request())
    assert alone == key_of(["session:sid"], request("/other", cookies={"other": "1"}))
    assert alone != key_of(["session:sid"], request(client=OTHER_CLIENT))


@pytest.mark.parametrize("peer", ["192.0.2.10", "2001:db8:1:2::7", "junk"])
def test_session_fallback_never_equals_a_cookie_holding_the_address_text(peer: str) -> None:
    client = ClientIPResolver().resolve(peer, None)
    fallback = key_of(["session:sid"], request(client=client))
    for text in {client.key, client.text, peer, ""}:
        headers = {"cookie": f"sid={text}"}
        assert key_of(["session:sid"], request(headers=headers, client=client)) != fallback, text


@given(ipv4=st.integers(0, 2**32 - 1))
def test_session_fallback_is_marked_for_every_address(ipv4: int) -> None:
    client = ClientIPResolver().resolve(str(ip_address(ipv4)), None)
    fallback = key_of(["session:sid"], request(client=client))
    spoof = key_of(["session:sid"], request(cookies={"sid": client.key}, client=client))
    assert fallback != spoof


# --------------------------------------------------------------------------
# Conditions
# --------------------------------------------------------------------------


def condition(spec: dict):
    return compile_condition(config.Condition.model_validate(spec))


@pytest.mark.parametrize(("spec", "matching", "not_matching"), [
    ({"path": {"equals": "/api/login"}}, ["/api/login", "/api/login?x=1", "/api/%6Cogin", "//api/./login"],
     ["/api/login/", "/api/logins", "/API/login"]),
    ({"path": {"prefix": "/api/"}}, ["/api/", "/api/x", "/x/../api/y"], ["/api", "/apix", "/x/api/"]),
    ({"path": {"regex": r"^/u/\d+$"}}, ["/u/1", "/u/123?q"], ["/u/", "/u/x", "/v/u/1/"]),
    ({"path": {"in": ["/a", "/b"]}}, ["/a", "/b"], ["/c", "/ab"]),
])
def test_path_conditions(spec: dict, matching: list[str], not_matching: list[str]) -> None:
    predicate = condition(spec)
    for uri in matching:
        assert predicate(request(uri)), uri
    for uri in not_matching:
        assert not predicate(request(uri)), uri


def test_host_condition() -> None:
    predicate = condition({"host": {"equals": "api.example.com"}})
    assert predicate(request(host="api.example.com"))
    assert not predicate(request(host="www.example.com"))
    suffix = condition({"host": {"regex": r"\.example\.com$"}})
    assert suffix(request(host="a.example.com"))
    assert not suffix(request(host="example.org"))


def test_method_condition_takes_a_list() -> None:
    predicate = condition({"method": ["POST", "put"]})
    assert predicate(request(method="POST"))
    assert predicate(request(method="PUT"))
    assert not predicate(request(method="GET"))


@pytest.mark.parametrize(("kind", "make"), [
    ("header", lambda value: request(headers={"x-api-key": value})),
    ("cookie", lambda value: request(cookies={"x-api-key": value})),
    ("query", lambda value: request(f"/p?x-api-key={quote(value, safe='')}")),
])
@pytest.mark.parametrize(("operator", "argument", "matching", "not_matching"), [
    ("equals", "abc", ["abc"], ["ABC", "abcd", ""]),
    ("in", ["a", "b"], ["a", "b"], ["c", "ab", ""]),
    ("prefix", "ab", ["ab", "abc"], ["a", "xab", ""]),
    ("regex", "^k-[0-9]+$", ["k-1", "k-42"], ["k-", "xk-1", ""]),
    ("present", True, ["", "anything"], []),
])
def test_named_value_conditions(kind, make, operator, argument, matching, not_matching) -> None:
    predicate = condition({kind: {"name": "x-api-key", operator: argument}})
    for value in matching:
        assert predicate(make(value)), value
    for value in not_matching:
        assert not predicate(make(value)), value
    absent = request("/p?other=1", headers={"x-other": "abc"}, cookies={"other": "abc"})
    assert predicate(absent) is (operator == "present" and argument is False)


@pytest.mark.parametrize("kind", ["header", "cookie", "query"])
def test_present_false_matches_only_requests_without_the_value(kind: str) -> None:
    predicate = condition({kind: {"name": "token", "present": False}})
    assert predicate(request("/p?other=1", headers={"other": "1"}, cookies={"other": "1"}))
    with_value = {"header": request(headers={"token": "t"}),
                  "cookie": request(cookies={"token": "t"}),
                  "query": request("/p?token=t")}[kind]
    assert not predicate(with_value)


def test_header_condition_name_is_case_insensitive() -> None:
    predicate = condition({"header": {"name": "X-Api-Key", "equals": "k"}})
    assert predicate(request(headers={"x-api-key": "k"}))


def test_cookie_condition_name_is_case_sensitive() -> None:
    predicate = condition({"cookie": {"name": "SID", "present": True}})
    assert predicate(request(cookies={"SID": "1"}))
    assert not predicate(request(cookies={"sid": "1"}))


def test_several_header_tests_must_all_hold() -> None:
    predicate = condition({"header": [{"name": "a", "equals": "1"}, {"name": "b", "equals": "2"}]})
    assert predicate(request(headers={"a": "1", "b": "2"}))
    assert not predicate(request(headers={"a": "1", "b": "3"}))
    assert not predicate(request(headers={"a": "1"}))


def test_ip_condition_tests_membership_in_cidrs() -> None:
    predicate = condition({"ip": {"in": ["192.0.2.0/24", "2001:db8::/32"]}})
    resolve = ClientIPResolver().resolve
    assert predicate(request(client=resolve("192.0.2.200", None)))
    assert predicate(request(client=resolve("::ffff:192.0.2.1", None)))
    assert predicate(request(client=resolve("2001:db8:ffff::1", None)))
    assert not predicate(request(client=resolve("198.51.100.1", None)))
    assert not predicate(request(client=resolve("2001:db9::1", None)))
    assert not predicate(request(client=resolve("", None)))


def test_ip_condition_uses_the_full_address_not_the_prefix_key() -> None:
    predicate = condition({"ip": {"in": ["2001:db8:1:2::1/128"]}})
    resolver = ClientIPResolver(ipv6_prefix=64)
    assert predicate(request(client=resolver.resolve("2001:db8:1:2::1", None)))
    assert not predicate(request(client=resolver.resolve("2001:db8:1:2::2", None)))


def test_several_leaves_in_one_mapping_mean_all_of_them() -> None:
    predicate = condition({"path": {"equals": "/api/login"}, "method": ["POST"]})
    assert predicate(request("/api/login", method="POST"))
    assert not predicate(request("/api/login", method="GET"))
    assert not predicate(request("/other", method="POST"))


def test_all_any_not_nest() -> None:
    predicate = condition({
        "all": [
            {"path": {"prefix": "/api/"}},
            {"any": [{"method": ["POST"]}, {"header": {"name": "x-debug", "present": True}}]},
            {"not": {"ip": {"in": ["10.0.0.0/8"]}}},
        ],
    })
    resolve = ClientIPResolver().resolve
    outside, inside = resolve("192.0.2.1", None), resolve("10.1.2.3", None)
    assert predicate(request("/api/x", method="POST", client=outside))
    assert predicate(request("/api/x", headers={"x-debug": "1"}, client=outside))
    assert not predicate(request("/api/x", method="GET", client=outside))
    assert not predicate(request("/api/x", method="POST", client=inside))
    assert not predicate(request("/web/x", method="POST", client=outside))


def test_not_negates() -> None:
    predicate = condition({"not": {"path": {"prefix": "/static/"}}})
    assert predicate(request("/api"))
    assert not predicate(request("/static/app.js"))


def test_any_holds_when_one_alternative_holds() -> None:
    predicate = condition({"any": [{"path": {"equals": "/a"}}, {"host": {"equals": "h"}}]})
    assert predicate(request("/a"))
    assert predicate(request("/b", host="h"))
    assert not predicate(request("/b"))


# --------------------------------------------------------------------------
# Path normalisation
# --------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["/api/login", "/api/%6Cogin", "/api/%6cogin", "//api/./login",
                                 "/api/x/../login", "/api//login", "/./api/login", "/../api/login",
                                 "/api/x/%2e%2e/login", "/api/./x/./../login"])
def test_normalise_path_gives_one_spelling(raw: str) -> None:
    assert normalise_path(raw) == "/api/login"


def test_normalise_path_keeps_a_trailing_slash() -> None:
    assert normalise_path("/api/") == "/api/"
    assert normalise_path("//api//") == "/api/"
    assert normalise_path("/") == "/"


def test_request_path_is_normalised_and_query_stripped() -> None:
    req = request("//api/./%6Cogin?next=/x")
    assert req.path == "/api/login"
    assert req.uri == "//api/./%6Cogin?next=/x"
    assert key_of(["path"], req) == key_of(["path"], request("/api/login"))
    assert key_of(["uri"], req) != key_of(["uri"], request("/api/login?next=/x"))


# --------------------------------------------------------------------------
# The ruleset as one function
# --------------------------------------------------------------------------

CONDITIONS = [
    None,
    "{path: {prefix: /api/}}",
    "{path: {regex: '^/a/[0-9]+'}}",
    "{method: [POST]}",
    "{header: {name: x-api-key, present: true}}",
    "{header: {name: accept, prefix: text/}}",
    "{cookie: {name: sid, equals: s1}}",
    "{query: {name: q, in: [a, b]}}",
    "{ip: {in: [192.0.2.0/25]}}",
    "{not: {path: {equals: /}}}",
    "{any: [{header: {name: x-api-key, equals: k}}, {query: {name: q, present: true}}]}",
    "{all: [{path: {prefix: /a}}, {cookie: {name: sid, present: false}}]}",
]


@given(st.lists(st.tuples(st.sampled_from(CONDITIONS), st.lists(st.sampled_from(ALL_DIMENSIONS), unique=True,
                                                                  max_size=3)), min_size=1, max_size=6),
       st.lists(st.tuples(st.sampled_from(["/", "/api/x", "/a/12", "/a/b"]), st.sampled_from(["GET", "POST"]),
                          st.dictionaries(st.sampled_from(["x-api-key", "accept"]),
                                          st.sampled_from(["k", "text/html", ""]), max_size=2),
                          st.sampled_from(["", "q=a", "q=c"]), st.sampled_from([None, "s1", "s2"]),
                          st.sampled_from([CLIENT, OTHER_CLIENT, ClientIPResolver().resolve("192.0.2.200", None)])),
                min_size=1, max_size=5))
def test_the_ruleset_function_matches_and_keys_as_each_rule_does(rules: list, requests: list) -> None:
    """``Ruleset.match``, every rule's condition and key written inline in
    one function, agrees with each rule's own condition and key: the same
    rules, in order, and the same keys, whatever the mix (walrus names of
    several rules in one function included)."""
    text = "rules:\n" + "".join(
        f"  - id: r{index}\n" + (f"    match: {match}\n" if match else "")
        + f"    key: {dimensions!r}\n    limit: {{requests: 5, per: 60s}}\n    action: block\n"
        for index, (match, dimensions) in enumerate(rules))
    ruleset = compile_rules(parse_rules_text(text, "test", Path(".")))
    for path, method, headers, query, sid, client in requests:
        made = request(f"{path}?{query}" if query else path, method=method, headers=headers,
                       cookies={"sid": sid} if sid else None, client=client)
        matched: list = []
        checks: list = []
        assert not ruleset.match_request(made, matched, checks, "", lambda rule, req: False)
        expected = [rule for rule in ruleset.rules if rule.condition is None or rule.condition(made)]
        assert matched == expected
        assert [check.key for check in checks] == [rule.key(made) for rule in expected]
        assert [check.spec for check in checks] == [rule.spec for rule in expected]
