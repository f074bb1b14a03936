"""The rules file's JSON Schema (``sluice schema``): committed as generated,
named by every example, and in agreement with the loader: whatever the
loader accepts, the schema accepts (jsonschema, the reference validator,
judges); what it refuses for its shape, the schema refuses too."""

from __future__ import annotations

import ast
import json
import re
import string
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sidecar import cli
from sidecar.config import ConfigError, RulesFile, parse_rules_text
from sidecar.schema import REGENERATE, SCHEMA_FILE, rules_schema, rules_schema_text
from tests.unit.test_config import MANY_ERRORS, VALID_RULE, rule_file

REPO = Path(__file__).resolve().parents[2]
SCHEMA = rules_schema()
VALIDATOR = jsonschema.Draft7Validator(SCHEMA)
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SCHEMA_LINE = "# yaml-language-server: $schema="


def schema_errors(text: str) -> list[str]:
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
            for error in VALIDATOR.iter_errors(yaml.safe_load(text))]


def loads(text: str, base_dir: Path = REPO) -> bool:
    try:
        parse_rules_text(text, "rules.yaml", base_dir)
    except ConfigError:
        return False
    return True


# --------------------------------------------------------------------------
# The committed file, the command, the examples
# --------------------------------------------------------------------------


def test_the_committed_schema_is_the_generated_one() -> None:
    committed = (REPO / SCHEMA_FILE).read_text(encoding="utf-8")
    assert committed == rules_schema_text(), f"{SCHEMA_FILE} is stale: run `{REGENERATE}`"


def test_the_schema_is_a_draft_07_schema_as_the_yaml_language_server_reads() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert "$defs" not in json.dumps(SCHEMA)  # draft-07 keeps them in definitions


def test_sluice_schema_prints_it_and_writes_it(tmp_path: Path) -> None:
    printed = CliRunner().invoke(cli.main, ["schema"])
    assert printed.exit_code == 0 and json.loads(printed.output) == SCHEMA
    out = tmp_path / "rules.schema.json"
    written = CliRunner().invoke(cli.main, ["schema", "--out", str(out)])
    assert written.exit_code == 0 and out.read_text(encoding="utf-8") == rules_schema_text()


def test_sluice_schema_says_in_one_line_when_it_cannot_write(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli.main, ["schema", "--out", str(tmp_path / "missing" / "x.json")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"error: cannot write {tmp_path / 'missing' / 'x.json'}: "
                                                  "No such file or directory"]


def test_the_schema_keeps_the_models_descriptions() -> None:
    definitions = SCHEMA["definitions"]
    assert "fail2ban" in definitions["BanIncrementConfig"]["description"]
    assert "10s" in definitions["WindowLimit"]["properties"]["per"]["description"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_every_example_names_the_schema_on_its_first_line(path: Path) -> None:
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith(SCHEMA_LINE)
    # The YAML language server resolves a relative path from the file's folder.
    assert (path.parent / first[len(SCHEMA_LINE):]).resolve() == (REPO / SCHEMA_FILE).resolve()


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 5


# --------------------------------------------------------------------------
# Every rules file the loader accepts is valid against the schema
# --------------------------------------------------------------------------


def _test_blocks() -> list[tuple[str, str]]:
    """Every rules file written as a string in the tests (an f-string is
    not: its values are only known when it runs), with where it is."""
    blocks = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.search(r"^rules:", node.value, re.MULTILINE):
                blocks.append((f"{path.relative_to(REPO)}:{node.lineno}", node.value))
    return blocks


def _page_blocks() -> list[tuple[str, str]]:
    """Every ```yaml block with a top-level ``rules:`` of the README and the docs."""
    blocks = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        if path.exists():
            for number, block in enumerate(re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S)):
                if re.search(r"^rules:", block, re.MULTILINE):
                    blocks.append((f"{path.relative_to(REPO)} block {number}", block))
    return blocks


def _shipped_files() -> list[tuple[str, str]]:
    paths = [*EXAMPLES, REPO / "sidecar" / "default_rules.yaml", *sorted((REPO / "tests").rglob("rules/*.yaml"))]
    return [(str(path.relative_to(REPO)), path.read_text(encoding="utf-8")) for path in paths if path.exists()]


LOADED = [(where, text) for where, text in _shipped_files() + _test_blocks() + _page_blocks() if loads(text)]


def test_the_files_checked_are_many() -> None:
    # Rules files that name a page or secret file the test writes, or with
    # placeholders filled in later, do not load here: they are left out.
    assert len(LOADED) >= 100


@pytest.mark.parametrize("where, text", LOADED, ids=[where for where, _ in LOADED])
def test_the_schema_accepts_every_rules_file_the_loader_accepts(where: str, text: str) -> None:
    assert schema_errors(text) == []


# --------------------------------------------------------------------------
# What the loader refuses for its shape, the schema refuses
# --------------------------------------------------------------------------

WINDOW = "limit: {requests: 1, per: 1s}\naction: log\n"
REFUSED = {
    "many errors": MANY_ERRORS,
    "empty file": "",
    "no rules list": "node: edge-1\n",
    "unknown top-level field": "rule: []\n" + VALID_RULE,
    "unknown rule field": VALID_RULE + "    colour: red\n",
    "rule without id": "rules:\n  - " + WINDOW.replace("\n", "\n    "),
    "id: yes (a boolean)": rule_file(WINDOW).replace("id: r", "id: yes"),
    "unknown action": rule_file("limit: {requests: 1, per: 1s}\naction: drop\n"),
    "duration in words": rule_file("limit: {requests: 1, per: 10 seconds}\naction: log\n"),
    "duration without unit in quotes": rule_file("limit: {requests: 1, per: '10'}\naction: log\n"),
    "zero duration": rule_file("limit: {requests: 1, per: 0s}\naction: log\n"),
    "negative duration": rule_file("limit: {requests: 1, per: -5}\naction: log\n"),
    "rate per hour": rule_file("limit: {rate: 10r/h}\naction: log\n"),
    "zero rate": rule_file("limit: {rate: 0r/s}\naction: log\n"),
    "zero refill": rule_file("limit: {tokens: 5, refill: 0/s}\naction: log\n"),
    "limit of no kind": rule_file("limit: {burst: 5}\naction: log\n"),
    "two limit kinds": rule_file("limit: {requests: 1, per: 1s, tokens: 3}\naction: log\n"),
    "unknown dimension": rule_file("key: [ipaddress]\n" + WINDOW),
    "header dimension without a name": rule_file("key: ['header: ']\n" + WINDOW),
    "key as a string": rule_file("key: ip\n" + WINDOW),
    "a boolean as a count": rule_file("limit: {requests: true, per: 1s}\naction: log\n"),
    "block status 600": rule_file("limit: {requests: 1, per: 1s}\naction: block\nblock: {status: 600}\n"),
    "method as a number": rule_file("match: {method: 5}\n" + WINDOW),
    "unknown backend": "state: {backend: mysql}\nrules: []\n",
    "prefix length 129": "client_ip: {ipv6_prefix: 129}\nrules: []\n",
    "a network as a number": "exempt: [10]\nrules: []\n",
    "rules as a mapping": "rules: {id: x}\n",
}


@pytest.mark.parametrize("text", REFUSED.values(), ids=REFUSED.keys())
def test_the_schema_refuses_what_the_loader_refuses_for_its_shape(text: str) -> None:
    assert not loads(text)
    assert not VALIDATOR.is_valid(yaml.safe_load(text))


# --------------------------------------------------------------------------
# Properties: the schema and the models agree on the scalars with units,
# and accept the same generated files
# --------------------------------------------------------------------------

UNITS = ["ms", "s", "m", "h", "d", "w", "y", "r/s", "r/m", "r/h", "/s", "/m", "", "sec", "H"]
numbers = st.one_of(st.integers(0, 10**6).map(str), st.from_regex(r"\A[0-9]{1,4}\.[0-9]{0,3}\Z"),
                    st.sampled_from(["-1", "1e3", ".5", "0.0", "007", "0"]))
terms = st.builds(lambda space, number, gap, unit: f"{space}{number}{gap}{unit}",
                  st.sampled_from(["", " ", "\n"]), numbers, st.sampled_from(["", " ", "\t"]), st.sampled_from(UNITS))
with_units = st.builds(lambda written, end: "".join(written) + end,
                       st.lists(terms, min_size=1, max_size=3), st.sampled_from(["", " ", "\n"]))
ascii_text = st.text(string.printable, max_size=12)
scalars = st.one_of(with_units, ascii_text, st.integers(-3, 10**6), st.floats(allow_nan=False, allow_infinity=False),
                    st.booleans(), st.none())
dimension_text = st.one_of(
    st.sampled_from(["ip", "host", "method", "path", "uri", "IP", "user", "header", "header:", "header: ",
                     "cookie:sid", "query:page", "session:sid", "header:X-Key", "header:\tx", "body:x"]),
    st.builds("{}:{}".format, st.sampled_from(["header", "cookie", "query", "session", "other"]), ascii_text),
    ascii_text)


def model_errors(document: dict[str, Any]) -> list[str]:
    try:
        RulesFile.model_validate(document, context={"base_dir": REPO})
    except ValidationError as exc:
        return [error["msg"] for error in exc.errors()]
    return []


def both_accept(document: dict[str, Any]) -> tuple[bool, bool]:
    """Whether the models, and the schema, accept ``document``."""
    return not model_errors(document), VALIDATOR.is_valid(document)


def one_rule(**fields: Any) -> dict[str, Any]:
    return {"rules": [{"id": "r", "action": "log", **fields}]}


@settings(max_examples=400, deadline=None)
@given(scalars)
def test_a_duration_is_valid_for_the_schema_exactly_when_for_the_loader(value: Any) -> None:
    document = one_rule(limit={"requests": 1, "per": value})
    errors, schema = model_errors(document), VALIDATOR.is_valid(document)
    # The longest duration is the loader's to check.
    too_long = errors and all("a duration is at most" in error for error in errors)
    assert (not errors or too_long) == schema, (value, errors)


@settings(max_examples=300, deadline=None)
@given(scalars)
def test_a_rate_is_valid_for_the_schema_exactly_when_for_the_loader(value: Any) -> None:
    models, schema = both_accept(one_rule(limit={"rate": value}))
    assert models == schema, value


@settings(max_examples=300, deadline=None)
@given(scalars)
def test_a_refill_is_valid_for_the_schema_exactly_when_for_the_loader(value: Any) -> None:
    models, schema = both_accept(one_rule(limit={"tokens": 5, "refill": value}))
    assert models == schema, value


@settings(max_examples=300, deadline=None)
@given(dimension_text)
def test_a_dimension_is_valid_for_the_schema_exactly_when_for_the_loader(value: str) -> None:
    models, schema = both_accept(one_rule(key=[value], limit={"requests": 1, "per": 1}))
    assert models == schema, value


durations = st.one_of(st.integers(1, 86400), st.builds("{}{}".format, st.integers(1, 500),
                                                      st.sampled_from(["ms", "s", "m", "h", "d"])))
limits = st.one_of(
    st.fixed_dictionaries({"requests": st.integers(0, 10**6), "per": durations},
                          optional={"window": st.sampled_from(["sliding", "fixed"])}),
    st.fixed_dictionaries({"score": st.integers(1, 1000), "per": durations, "header": st.just("X-Cost")}),
    st.fixed_dictionaries({"tokens": st.integers(5, 100), "refill": st.sampled_from(["1/s", "0.5/s", "30/m"])},
                          optional={"cost": st.integers(1, 5)}),
    st.fixed_dictionaries({"rate": st.sampled_from(["10r/s", "30r/m", "1r/s"])},
                          optional={"burst": st.integers(0, 50), "nodelay": st.booleans()}),
    st.fixed_dictionaries({"concurrent": st.integers(1, 50)}, optional={"lease": st.sampled_from([1, "30s", "10m"])}),
)
string_tests = st.one_of(st.fixed_dictionaries({"prefix": st.just("/api/")}),
                         st.fixed_dictionaries({"equals": st.just("/login")}),
                         st.fixed_dictionaries({"in": st.just(["/a", "/b"])}),
                         st.fixed_dictionaries({"regex": st.just("^/v[0-9]+/")}))
named_test = st.fixed_dictionaries({"name": st.just("X-Key"), "present": st.booleans()})
leaves = st.fixed_dictionaries({}, optional={
    "path": string_tests,
    "host": string_tests,
    # The shorthand forms: one method, one header test, without a list.
    "method": st.one_of(st.just("POST"), st.just(["GET", "HEAD"])),
    "header": st.one_of(named_test, st.lists(named_test, min_size=1, max_size=2)),
    "ip": st.just({"in": ["10.0.0.0/8", "2001:db8::/32"]}),
}).filter(bool)
conditions = st.recursive(leaves, lambda inner: st.one_of(
    st.fixed_dictionaries({"any": st.lists(inner, min_size=1, max_size=2)}),
    st.fixed_dictionaries({"not": inner})), max_leaves=4)
keys = st.lists(st.sampled_from(["ip", "host", "path", "header:X-Key", "cookie:sid", "query:page"]),
                max_size=3, unique=True)


@st.composite
def rules_files(draw: st.DrawFn) -> dict[str, Any]:
    rules = []
    for number in range(draw(st.integers(0, 3))):
        rule: dict[str, Any] = {"id": f"rule-{number}", "limit": draw(limits), "action": draw(
            st.sampled_from(["log", "block"]))}
        rule.update(draw(st.fixed_dictionaries({}, optional={
            "key": keys, "match": conditions, "penalty": durations, "shadow": st.booleans()})))
        if "concurrent" in rule["limit"]:
            rule.pop("penalty", None)  # it refuses only while its limit is in flight
        if rule["action"] == "block" and draw(st.booleans()):
            rule["block"] = {"status": draw(st.integers(400, 599))}
        rules.append(rule)
    document: dict[str, Any] = draw(st.fixed_dictionaries({}, optional={
        "mode": st.sampled_from(["enforce", "shadow"]),
        "headers": st.sampled_from(["standard", "draft"]),
        "exempt": st.lists(st.sampled_from(["10.0.0.0/8", "192.0.2.7", "::1"]), max_size=2),
        "client_ip": st.fixed_dictionaries({}, optional={"trusted_proxies": st.just(["10.0.0.0/8"]),
                                                         "ipv6_prefix": st.integers(1, 128)}),
        "overload": st.fixed_dictionaries({"after": st.sampled_from(["250ms", "1s", 0.5])}),
    }))
    document["rules"] = rules
    if rules and draw(st.booleans()):
        document["overrides"] = [{"cidrs": ["203.0.113.0/24"], "rules": [rules[0]["id"]], "multiply": 2}]
    return document


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rules_files())
def test_the_schema_accepts_a_generated_rules_file_the_loader_accepts(document: dict[str, Any]) -> None:
    text = yaml.safe_dump(document, sort_keys=False)
    assert loads(text), text  # the strategy makes valid files only
    assert schema_errors(text) == []
