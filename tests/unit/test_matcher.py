"""The compiled matcher (``Ruleset.match``): what it decides, agreed with an
interpreter of the rules file; its source, as tracebacks, pdb and
``sluice check --explain`` show it."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import linecache
import pdb
import re
import sys
import traceback
from collections.abc import Callable
from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import cli
from sidecar.clientip import ClientIPResolver
from sidecar.config import parse_rules_text
from sidecar.matching import MEMO_LONGEST, MEMO_SIZE
from sidecar.request import CheckRequest
from sidecar.rules import CompiledRule, Ruleset, compile_rules, load_ruleset
from sidecar.state import Check

RESOLVER = ClientIPResolver()

SAMPLE = """\
verified_bots:
  - cidrs: [192.0.2.0/25]
    user_agent: "goodbot"
overrides:
  - {cidrs: [198.51.100.0/24], rules: [search], multiply: 2}
rules:
  - id: login
    match:
      method: [POST]
      path: {equals: /api/login}
    key: [ip]
    limit: {requests: 5, per: 60s}
    action: block
  - id: everyone
    limit: {requests: 100, per: 60s}
    action: log
  - id: search
    match:
      header: {name: X-Api-Key, present: true}
      any:
        - query: {name: q, prefix: sh}
        - cookie: {name: sid, in: [s1, s2]}
      not: {host: {regex: '^internal\\.'}}
      ip: {in: [192.0.2.0/24, 198.51.100.0/24]}
    key: [ip, "header:x-api-key"]
    limit: {requests: 10, per: 10s}
    action: challenge
"""


def request(uri: str = "/", *, method: str = "GET", host: str = "example.com",
            headers: dict[str, str] | None = None, client: str = "192.0.2.10") -> CheckRequest:
    return CheckRequest(method, host, uri, dict(headers or {}), RESOLVER.resolve(client, None), "req-1")


def run(ruleset: Ruleset, made: CheckRequest,
        has_credential: Callable[[CompiledRule, CheckRequest], bool] = lambda rule, req: False,
        ) -> tuple[list[CompiledRule], list[Check], bool]:
    matched: list[CompiledRule] = []
    checks: list[Check] = []
    ended = ruleset.match_request(made, matched, checks, "", has_credential)
    return matched, checks, ended


def run_program(ruleset: Ruleset, made: CheckRequest,
                has_credential: Callable[[CompiledRule, CheckRequest], bool] = lambda rule, req: False,
                ) -> tuple[list[CompiledRule], list[Check], bool]:
    """``run``, by the ruleset's program (sidecar.matching) instead."""
    assert ruleset.program is not None
    matched: list[CompiledRule] = []
    checks: list[Check] = []
    ended = ruleset.program.run(made, made.client.key, matched, checks, "", has_credential)
    return matched, checks, ended


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(SAMPLE)
    return path


# --------------------------------------------------------------------------
# The matcher agrees with an interpreter of the rules file
# --------------------------------------------------------------------------
# The reference reads the rules file's own mappings, not the compiled
# rules: a test at a time, a rule at a time, as a reader of the file would.


def string_holds(test: dict[str, Any], value: str) -> bool:
    if "equals" in test:
        return value == test["equals"]
    if "in" in test:
        return value in test["in"]
    if "prefix" in test:
        return value.startswith(test["prefix"])
    return re.search(test["regex"], value) is not None


def named_holds(tests: dict[str, Any] | list[dict[str, Any]], values: dict[str, str], fold: bool) -> bool:
    for test in tests if isinstance(tests, list) else [tests]:
        name = test["name"].lower() if fold else test["name"]
        if "present" in test:
            if (name in values) != test["present"]:
                return False
        elif name not in values or not string_holds(test, values[name]):
            return False
    return True


def holds(condition: dict[str, Any], made: CheckRequest, client: str) -> bool:
    """Whether a ``match:`` mapping holds for a request: every field of it."""
    for field, test in condition.items():
        if field == "all":
            result = all(holds(part, made, client) for part in test)
        elif field == "any":
            result = any(holds(part, made, client) for part in test)
        elif field == "not":
            result = not holds(test, made, client)
        elif field in ("path", "host"):
            result = string_holds(test, getattr(made, field))
        elif field == "method":
            result = made.method in {method.upper() for method in ([test] if isinstance(test, str) else test)}
        elif field == "ip":
            result = any(ip_address(client) in ip_network(network) for network in test["in"])
        else:
            values = {"header": made.headers, "cookie": made.cookies, "query": made.query}[field]
            result = named_holds(test, values, fold=field == "header")
        if not result:
            return False
    return True


def key_of(rule: dict[str, Any], made: CheckRequest) -> tuple[Any, ...]:
    """The rule's counting key: its id, its sorted dimensions, their values."""
    dimensions = sorted(name if not name.startswith("header:") else name.lower()
                        for name in rule.get("key") or ["host", "ip"])
    values: list[Any] = []
    for dimension in dimensions:
        kind, _, name = dimension.partition(":")
        if kind == "ip":
            values.append(made.client.key)
        elif kind in ("host", "method", "path", "uri"):
            values.append(getattr(made, kind))
        elif kind == "session":
            cookie = made.cookies.get(name)
            values.append(("ip", made.client.key) if cookie is None else ("cookie", cookie))
        else:
            values.append({"header": made.headers, "cookie": made.cookies, "query": made.query}[kind].get(name, ""))
    return ((rule["id"], tuple(dimensions)), *values)


def interpret(document: dict[str, Any], ruleset: Ruleset, made: CheckRequest, client: str,
              credentials: set[str]) -> tuple[list[str], list[tuple[Any, ...]], list[float], bool]:
    """What the rules file says for a request: the matching rules' ids,
    their keys and thresholds, in order, and whether a challenge's
    credential ended the evaluation."""
    bot = any(any(ip_address(client) in ip_network(network) for network in bots["cidrs"])
              and re.search(bots.get("user_agent", ""), made.headers.get("user-agent", "")) is not None
              for bots in document.get("verified_bots", []))
    ids: list[str] = []
    keys: list[tuple[Any, ...]] = []
    specs: list[Any] = []
    for rule in document["rules"]:
        if "match" in rule and not holds(rule["match"], made, client):
            continue
        if rule["action"] == "challenge" and rule["id"] in credentials:
            return ids, keys, specs, True
        compiled = ruleset.by_id[rule["id"]]
        spec = compiled.bot_spec if bot else compiled.spec
        for override in document.get("overrides", []):
            if rule["id"] in override["rules"] and any(ip_address(client) in ip_network(network)
                                                       for network in override["cidrs"]):
                spec = dataclasses.replace(spec, threshold=compiled.threshold * override["multiply"])
                break
        ids.append(rule["id"])
        keys.append(key_of(rule, made))
        specs.append(spec)
    return ids, keys, specs, False


PATHS = ["/", "/a", "/a/b", "/api/x", "/A"]
HOSTS = ["example.com", "a.example.com"]


def string_test(values: list[str], patterns: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(st.builds(lambda v: {"equals": v}, st.sampled_from(values)),
                     st.builds(lambda v: {"in": v}, st.lists(st.sampled_from(values), min_size=1, max_size=3)),
                     st.builds(lambda v: {"prefix": v[:2]}, st.sampled_from(values)),
                     st.builds(lambda v: {"regex": v}, st.sampled_from(patterns)))


def named_tests(names: list[str], values: list[str]) -> st.SearchStrategy[Any]:
    one = st.tuples(st.sampled_from(names), st.one_of(
        st.builds(lambda present: {"present": present}, st.booleans()),
        string_test(values, ["^k", "html", "^$"]))).map(lambda pair: {"name": pair[0], **pair[1]})
    return one | st.lists(one, min_size=1, max_size=2)


LEAVES: dict[str, st.SearchStrategy[Any]] = {
    "path": string_test(PATHS, ["^/a", "b$", "^/api/[a-z]+$", "A"]),
    "host": string_test(HOSTS, ["^a\\.", "com$"]),
    "method": st.sampled_from(["GET", "post"]) | st.lists(st.sampled_from(["GET", "post", "PUT"]), min_size=1,
                                                          max_size=2, unique=True),
    "header": named_tests(["X-Api-Key", "accept", "user-agent"], ["k", "text/html", "goodbot"]),
    "cookie": named_tests(["sid", "other"], ["s1", "s2"]),
    "query": named_tests(["q", "x"], ["a", "b", "1"]),
    "ip": st.builds(lambda networks: {"in": networks}, st.lists(
        st.sampled_from(["192.0.2.0/25", "198.51.100.0/24", "2001:db8::/32"]), min_size=1, max_size=2)),
}


def conditions(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: fields[name] for name in names}))


CONDITIONS = st.recursive(
    conditions(LEAVES),
    lambda inner: conditions({**LEAVES, "all": st.lists(inner, min_size=1, max_size=3),
                              "any": st.lists(inner, min_size=1, max_size=3), "not": inner}),
    max_leaves=8)
DIMENSIONS = ["ip", "host", "method", "path", "uri", "header:X-Api-Key", "cookie:sid", "query:q", "session:sid"]
# Ids whose constants' names would collide (a-b, a_b, a.b) among them.
IDS = ["a-b", "a_b", "a.b", "5xx", "login", "Login"]

RULE = st.fixed_dictionaries(
    {"key": st.lists(st.sampled_from(DIMENSIONS), unique=True, max_size=3),
     "limit": st.just({"requests": 5, "per": "60s"}),
     "action": st.sampled_from(["block", "log", "ban", "challenge"])},
    optional={"match": CONDITIONS, "shadow": st.booleans()})


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    ids = draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=5, unique=True))
    document: dict[str, Any] = {"rules": [{"id": rule_id, **draw(RULE)} for rule_id in ids]}
    if draw(st.booleans()):
        document["verified_bots"] = [{"cidrs": ["192.0.2.0/25"], "user_agent": "goodbot"}]
    overrides = draw(st.lists(st.fixed_dictionaries({
        "cidrs": st.lists(st.sampled_from(["192.0.2.0/24", "198.51.100.0/24"]), min_size=1, max_size=2),
        "rules": st.lists(st.sampled_from(ids), min_size=1, unique=True),
        "multiply": st.sampled_from([0.5, 2, 3])}), max_size=2))
    if overrides:
        document["overrides"] = overrides
    return document


REQUESTS = st.fixed_dictionaries({
    "path": st.sampled_from(PATHS), "host": st.sampled_from(HOSTS), "method": st.sampled_from(["GET", "POST", "PUT"]),
    "query": st.sampled_from(["", "q=a", "q=b&x=1", "x=k"]),
    "headers": st.dictionaries(st.sampled_from(["x-api-key", "accept", "user-agent", "cookie"]),
                               st.sampled_from(["k", "text/html", "goodbot", "", "sid=s1", "sid=s2; other=s1"]),
                               max_size=4),
    "client": st.sampled_from(["192.0.2.10", "192.0.2.200", "198.51.100.7", "203.0.113.1", "2001:db8::1"]),
})


@settings(max_examples=300, deadline=None)
@given(documents(), st.lists(REQUESTS, min_size=1, max_size=4), st.sets(st.sampled_from(IDS)))
def test_the_matcher_decides_as_an_interpreter_of_the_rules_file(document: dict[str, Any],
                                                                 requests: list[dict[str, Any]],
                                                                 credentials: set[str]) -> None:
    """Whatever the conditions (nested all, any, not; every leaf), keys,
    actions, verified bots, overrides and challenge credentials: the same
    rules match, in order, with the same keys and specs, and a credential
    ends the evaluation where the file says."""
    ruleset = compile_rules(parse_rules_text(yaml.safe_dump(document), "property.yaml", Path(".")))
    for fields in requests:
        uri = f"{fields['path']}?{fields['query']}" if fields["query"] else fields["path"]
        made = request(uri, method=fields["method"], host=fields["host"], headers=fields["headers"],
                       client=fields["client"])
        matched, checks, ended = run(ruleset, made, lambda rule, req: rule.id in credentials)
        ids, keys, specs, should_end = interpret(document, ruleset, made, fields["client"], credentials)
        assert [rule.id for rule in matched] == ids
        assert [check.key for check in checks] == keys
        assert [check.spec for check in checks] == specs
        assert ended is should_end
        if ruleset.program is not None:  # the same rules as the compiled core runs them: the same checks
            program_matched, program_checks, program_ended = run_program(
                ruleset, request(uri, method=fields["method"], host=fields["host"], headers=fields["headers"],
                                 client=fields["client"]), lambda rule, req: rule.id in credentials)
            assert program_matched == matched
            assert [(check.spec, check.key, check.lease) for check in program_checks] == \
                [(check.spec, check.key, check.lease) for check in checks]
            assert program_ended is ended


# Every leaf and dimension the program reads natively, and those it calls
# the matcher's code for (an address range, a fingerprint's condition, the
# session fallback's tagged key).
EVERY_KIND = """
rules:
  - id: natives
    match:
      all:
        - path: {prefix: /api}
        - host: {in: [example.com, api.example.com]}
        - method: [GET, POST]
        - header: [{name: Accept, regex: json}, {name: x-debug, present: false}]
        - any: [{cookie: {name: sid, equals: s1}}, {query: {name: page, present: true}}]
    key: [ip, host, method, path, uri, "header:x-api-key", "cookie:sid", "query:q"]
    limit: {requests: 5, per: 60s}
    action: block
  - id: calls
    match: {any: [{ip: {in: [192.0.2.0/24]}}, {ja4: {prefix: t13}}, {not: {ja3: {equals: ""}}}]}
    key: [ja3, ja4, "session:sid"]
    limit: {requests: 5, per: 60s}
    action: challenge
"""


@pytest.mark.parametrize("uri", ["/api/items?page=2&q=shoes", "/api?q=a%20b", "/other", "/api/x"])
@pytest.mark.parametrize("headers", [
    {"accept": "application/json", "cookie": "sid=s1", "x-api-key": "k", "x-sluice-ja4": "t13d_x"},
    {"accept": "text/html", "x-debug": "1", "x-sluice-ja3": "771,4865"},
    {"accept": "application/json", "cookie": "other=1; sid=s2"},
    {},
])
@pytest.mark.parametrize("client", ["192.0.2.10", "198.51.100.7", "2001:db8::1"])
@pytest.mark.parametrize("credential", [False, True])
def test_the_program_adds_what_the_matcher_adds_for_every_kind_of_leaf_and_key(
        uri: str, headers: dict[str, str], client: str, credential: bool) -> None:
    ruleset = compile_rules(parse_rules_text(EVERY_KIND, "kinds.yaml", Path(".")))
    def has_credential(rule: CompiledRule, req: CheckRequest) -> bool:
        return credential
    for method, host in (("GET", "example.com"), ("POST", "api.example.com"), ("PUT", "example.com"),
                         ("GET", "other.example")):
        expected = run(ruleset, request(uri, method=method, host=host, headers=headers, client=client),
                       has_credential)
        got = run_program(ruleset, request(uri, method=method, host=host, headers=headers, client=client),
                          has_credential)
        assert got[0] == expected[0]
        assert [(check.spec, check.key) for check in got[1]] == [(check.spec, check.key) for check in expected[1]]
        assert got[2] is expected[2]


def test_a_regex_leaf_remembers_its_answers_for_a_bounded_number_of_short_values() -> None:
    """Answered from its memo or by its pattern, a regex leaf decides as
    the matcher does; the memo holds at most MEMO_SIZE values, none longer
    than MEMO_LONGEST characters, whatever paths clients send."""
    ruleset = compile_rules(parse_rules_text(
        "rules:\n  - id: r\n    match: {path: {regex: '^/api/(items|search)'}}\n"
        "    limit: {requests: 5, per: 60s}\n    action: block\n", "regex.yaml", Path(".")))
    assert ruleset.program is not None
    condition = ruleset.program.steps[0].condition
    paths = ["/api/items", "/other", "/api/search/x", "/api/item", "/api/" + "x" * (MEMO_LONGEST + 1),
             *[f"/api/{'items' if n % 3 else 'search'}/{n}" for n in range(MEMO_SIZE + 10)],
             *[f"/n/{n}" for n in range(MEMO_SIZE // 2)]]
    for path in paths + paths[:8]:  # the first ones again: from the memo, or after it was cleared
        assert run_program(ruleset, request(path))[0] == run(ruleset, request(path))[0]
        assert 0 < len(condition.memo) <= MEMO_SIZE
    assert all(len(value) <= MEMO_LONGEST for value in condition.memo)
    assert condition.memo["/other"] is False and condition.memo["/api/items"] is True


@pytest.mark.parametrize(("extra", "action", "has_program"), [
    ("", "ban", True),
    ("verified_bots: [{cidrs: [192.0.2.0/25]}]\n", "ban", False),  # a verified bot is never banned
    ("verified_bots: [{cidrs: [192.0.2.0/25]}]\n", "block", True),  # a bot's spec is the rule's
    ("overrides: [{cidrs: [192.0.2.0/24], rules: [r], multiply: 2}]\n", "block", False),
    ("overrides: [{cidrs: [192.0.2.0/24], rules: [other], multiply: 2}]\n", "block", False),
])
def test_a_ruleset_whose_rules_choose_their_spec_per_request_runs_its_matcher(extra: str, action: str,
                                                                              has_program: bool) -> None:
    """Verified bots (of a rule that bans) and overrides choose a rule's
    spec per request: the program has no step for that, and the engine
    runs the matcher."""
    text = extra + "rules:\n" + "".join(
        f"  - id: {rule_id}\n    limit: {{requests: 5, per: 60s}}\n    action: {action}\n"
        for rule_id in ("r", "other"))
    ruleset = compile_rules(parse_rules_text(text, "spec.yaml", Path(".")))
    assert (ruleset.program is not None) is has_program


def test_values_that_look_like_code_stay_values(tmp_path: Path) -> None:
    """A value with line breaks and Python in it is compared, not run: its
    comment shows it escaped on one line, and it matches only itself."""
    sneaky = "/x\n    return True\n# "
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"rules": [
        {"id": "sneaky", "match": {"path": {"equals": sneaky}, "header": {"name": "a\rb", "present": False}},
         "limit": {"requests": 1, "per": "1s"}, "action": "block"}]}))
    ruleset = load_ruleset(str(path))
    assert run(ruleset, request("/elsewhere"))[0] == []
    assert [rule.id for rule in run(ruleset, request("/x%0A    return True%0A%23 "))[0]] == ["sneaky"]
    text = ruleset.match_source.text
    assert "path equals '/x\\n    return True\\n# '" in text
    assert "header 'a\\rb' absent" in text
    assert all(line.isascii() and line.isprintable() for line in text.splitlines())


# --------------------------------------------------------------------------
# Tracebacks and debuggers
# --------------------------------------------------------------------------


class FailingHeaders(dict[str, str]):
    """A request's headers that fail when one of them is read."""

    def get(self, name: str, default: Any = None) -> Any:
        if name == "x-api-key":
            raise LookupError("the header cannot be read")
        return super().get(name, default)


def failing_request() -> CheckRequest:
    """A request that passes the search rule's tests, and whose header read
    for the rule's key fails."""
    made = request("/?q=shoes", host="example.com", headers={"x-api-key": "k"})
    made.headers = FailingHeaders(made.headers)
    return made


def matcher_frame(exc: BaseException, filename: str) -> traceback.FrameSummary:
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == filename]
    assert len(frames) == 1, traceback.format_exception(exc)
    return frames[0]


def test_a_matcher_error_s_traceback_names_the_rules_file_and_shows_the_rule_and_its_line(sample: Path) -> None:
    ruleset = load_ruleset(str(sample))
    # The key's header read fails: the search rule's key line, after its condition held.
    with pytest.raises(LookupError) as caught:
        run(ruleset, failing_request())
    frame = matcher_frame(caught.value, f"{sample}.matcher.py")
    assert frame.name == "match"
    shown = re.search(r"# (\S+) \(line (\d+)\): (.*)$", frame.line or "")
    assert shown is not None, frame.line
    rule_id, line, says = shown.groups()
    assert (rule_id, says) == ("search", "key header:x-api-key, ip")
    # The line it names is the rule's key in the rules file.
    assert sample.read_text().splitlines()[int(line) - 1].strip() == 'key: [ip, "header:x-api-key"]'


class QueryFails(CheckRequest):
    """A request whose query string cannot be read."""

    __slots__ = ()

    @property
    def query(self) -> dict[str, str]:
        raise LookupError("the query cannot be read")


def test_a_failing_test_s_traceback_shows_that_test_s_own_line(sample: Path) -> None:
    # The search rule's first test, its `any`'s query test, fails.
    made = QueryFails("GET", "example.com", "/", {}, RESOLVER.resolve("192.0.2.10", None), "req-1")
    with pytest.raises(LookupError) as caught:
        run(load_ruleset(str(sample)), made)
    frame = matcher_frame(caught.value, f"{sample}.matcher.py")
    shown = re.search(r"# search \(line (\d+)\): query 'q' prefix 'sh'$", frame.line or "")
    assert shown is not None, frame.line
    assert sample.read_text().splitlines()[int(shown.group(1)) - 1].strip() == "- query: {name: q, prefix: sh}"


def test_the_source_is_shown_even_after_linecache_is_cleared(sample: Path) -> None:
    """linecache forgets what it was given on clearcache(); the matcher's
    globals give it back (the loader protocol), as for an imported module."""
    ruleset = load_ruleset(str(sample))
    with pytest.raises(LookupError) as caught:
        run(ruleset, failing_request())
    linecache.clearcache()
    formatted = "".join(traceback.format_exception(caught.value))
    assert f'File "{sample}.matcher.py"' in formatted
    assert "# search (line" in formatted


def test_the_registered_source_is_the_function_s_and_what_explain_prints(sample: Path) -> None:
    ruleset = load_ruleset(str(sample))
    source = ruleset.match_source
    assert ruleset.match.__code__.co_filename == source.filename == f"{sample}.matcher.py"
    assert "".join(linecache.getlines(source.filename)) == source.text
    assert inspect.getsource(ruleset.match) in source.text
    assert inspect.getsource(ruleset.match).startswith(
        "def match(request, method, host, path, headers, client_key, matched, checks, lease, has_credential):")


def test_pdb_steps_through_the_matcher_test_by_test_and_lists_its_source(sample: Path) -> None:
    ruleset = load_ruleset(str(sample))
    output = io.StringIO()
    debugger = pdb.Pdb(stdin=io.StringIO("next\nnext\nnext\nlist\ncontinue\n"), stdout=output, nosigint=True)
    debugger.use_rawinput = False
    made = request("/api/login", method="POST")
    debugger.runcall(ruleset.match, made, made.method, made.host, made.path, made.headers, made.client.key,
                     [], [], "", lambda rule, req: False)
    steps = [line for line in output.getvalue().splitlines() if "-> " in line]
    # Each step is one test of the first rule, then its check, as its source says.
    assert [step.split("-> ", 1)[1].split("  # ")[-1] for step in steps[1:]] == [
        "login (line 10): path equals '/api/login'", "login (line 9): method in ['POST']", "login (line 11): key ip"]
    assert f"> {sample}.matcher.py(" in output.getvalue()
    # list shows the lines around the stop.
    assert "# rules[1]: everyone (line 14), log" in output.getvalue()


# --------------------------------------------------------------------------
# sluice check --explain
# --------------------------------------------------------------------------

RULE_HEADER = re.compile(r"^    # rules\[(\d+)\]: (\S+) \(line (\d+)\), (\w+)")
TEST_COMMENT = re.compile(r"  # (\S+) \(line (\d+)\): (\w+) (.*)$")


def explain(path: Path) -> str:
    result = CliRunner().invoke(cli.main, ["check", "--explain", str(path)])
    assert result.exit_code == 0, result.output
    first, blank, explained = result.output.split("\n", 2)
    assert (first, blank) == (f"{path}: OK, 3 rules", "")
    return explained


def test_explain_lists_every_rule_in_the_file_s_order_at_its_line(sample: Path) -> None:
    explained = explain(sample)
    lines = sample.read_text().splitlines()
    headers = [RULE_HEADER.match(line) for line in explained.splitlines()]
    found = [(int(m[1]), m[2], int(m[3]), m[4]) for m in headers if m is not None]
    assert [(index, rule_id, action) for index, rule_id, _, action in found] == [
        (0, "login", "block"), (1, "everyone", "log"), (2, "search", "challenge")]
    for _, rule_id, line, _ in found:
        assert lines[line - 1].strip() == f"- id: {rule_id}"
    # It is the Python that runs: one function, which parses.
    module = ast.parse(explained)
    assert [type(node).__name__ for node in module.body] == ["FunctionDef"]


def test_explain_shows_each_test_at_its_line_in_the_order_the_matcher_tests_them(sample: Path) -> None:
    """The order --explain gives is the order the matcher reads the request
    in: a request that passes every test is read field by field."""
    explained = explain(sample)
    lines = sample.read_text().splitlines()
    tests = [(m[1], int(m[2]), m[3], m[4]) for m in map(TEST_COMMENT.search, explained.splitlines())
             if m is not None and m[3] != "key"]
    for rule_id, line, field, _ in tests:
        assert field in lines[line - 1], (rule_id, line, field)
    # The matcher's order: all, any, not, path, host, method, header, cookie, query, ip.
    assert [(rule_id, field) for rule_id, _, field, _ in tests] == [
        ("login", "path"), ("login", "method"),
        ("search", "query"), ("search", "cookie"), ("search", "host"), ("search", "header"), ("search", "ip")]


ORDERED = """\
rules:
  - id: first
    match:
      path: {prefix: /api/}
      method: [POST]
      all:
        - header: {name: x-api-key, present: true}
        - cookie: {name: sid, equals: s1}
    key: [ip]
    limit: {requests: 5, per: 60s}
    action: block
  - id: second
    match:
      query: {name: q, equals: shoes}
      any:
        - host: {equals: other.example}
        - host: {prefix: example}
      not: {method: [GET]}
    key: [ip]
    limit: {requests: 5, per: 60s}
    action: block
"""


def test_explain_gives_the_order_in_which_the_matcher_tests_the_request(tmp_path: Path) -> None:
    """A request that passes every test but one alternative of an `any` is
    tested leaf by leaf in the order --explain lists the tests: the lines
    the matcher runs, traced, are those of the listing, in order (each
    line's first run: the line table sends a short-circuit's end back to
    a line it left)."""
    path = tmp_path / "rules.yaml"
    path.write_text(ORDERED)
    result = CliRunner().invoke(cli.main, ["check", "--explain", str(path)])
    assert result.exit_code == 0, result.output
    listed = [m[3] for m in map(TEST_COMMENT.search, result.output.splitlines()) if m is not None and m[3] != "key"]
    made = CheckRequest("POST", "example.com", "/api/x?q=shoes", {"x-api-key": "k", "cookie": "sid=s1"},
                        RESOLVER.resolve("192.0.2.10", None), "req-1")
    ruleset = load_ruleset(str(path))
    tested: list[str] = []
    lines: set[int] = set()

    def trace(frame: Any, event: str, arg: object) -> Any:
        if frame.f_code.co_filename != ruleset.match_source.filename:
            return None
        if event == "line" and frame.f_lineno not in lines:
            lines.add(frame.f_lineno)
            found = TEST_COMMENT.search(linecache.getline(frame.f_code.co_filename, frame.f_lineno))
            if found is not None and found[3] != "key":
                tested.append(found[3])
        return trace

    sys.settrace(trace)
    try:
        matched, _, _ = run(ruleset, made)
    finally:
        sys.settrace(None)
    assert [rule.id for rule in matched] == ["first", "second"]
    assert tested == listed
    assert tested == ["header", "cookie", "path", "method", "host", "host", "method", "query"]


def test_explain_of_a_folder_or_a_rate_limit_service_file_is_one_line_naming_the_option(tmp_path: Path) -> None:
    rls = tmp_path / "rls.yaml"
    rls.write_text("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n")
    for path in (tmp_path, rls):
        result = CliRunner().invoke(cli.main, ["check", "--explain", str(path)])
        assert result.exit_code == 1
        assert result.output.count("\n") == 1
        assert result.output.startswith(f"error: --explain: {path}: ")


def test_explain_of_an_invalid_rules_file_gives_its_errors_and_no_explanation(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n  - id: x\n    limit: {requests: 1, per: ten}\n    action: block\n")
    result = CliRunner().invoke(cli.main, ["check", "--explain", str(path)])
    assert result.exit_code == 1
    assert result.output.startswith(f"{path}:3: ")
    assert "def match" not in result.output
