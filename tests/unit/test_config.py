"""The rules file: validation, error reports and `sluice check`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar import config
from sidecar.config import ConfigError, ConfigIssue, LoadedRules, load_rules_file, parse_duration, parse_rules_text
from sidecar.limiters.window import WindowLimit
from sidecar.rules import compile_rules, load_ruleset

REPO = Path(__file__).resolve().parents[2]

VALID_RULE = """\
rules:
  - id: ok
    key: [ip]
    limit: {requests: 5, per: 10s}
    action: block
"""


def parse(text: str, source: str = "rules.yaml", base_dir: Path = Path(".")) -> LoadedRules:
    """A fragment without rules is checked inside a file that has them."""
    text = textwrap.dedent(text)
    if re.search(r"^\w+:", text, re.MULTILINE) and not re.search(r"^rules:", text, re.MULTILINE):
        text += "\nrules: []\n"
    return parse_rules_text(text, source, base_dir)


def issues_of(text: str, source: str = "rules.yaml", base_dir: Path = Path(".")) -> list[ConfigIssue]:
    with pytest.raises(ConfigError) as info:
        parse(text, source, base_dir)
    return info.value.issues


def compile_issues(text: str, base_dir: Path = Path(".")) -> list[ConfigIssue]:
    with pytest.raises(ConfigError) as info:
        compile_rules(parse(text, base_dir=base_dir))
    return info.value.issues


def line_of(text: str, fragment: str, occurrence: int = 1) -> int:
    """1-based line of the ``occurrence``-th line containing ``fragment``."""
    found = [number for number, line in enumerate(textwrap.dedent(text).splitlines(), 1) if fragment in line]
    return found[occurrence - 1]


def located(issues: list[ConfigIssue]) -> set[tuple[int, str]]:
    return {(issue.line, issue.field) for issue in issues}


def only_issue(text: str, base_dir: Path = Path(".")) -> ConfigIssue:
    issues = issues_of(text, base_dir=base_dir)
    assert len(issues) == 1, issues
    return issues[0]


def more_rules(text: str) -> str:
    """Rules to append to VALID_RULE, written at any indentation."""
    return textwrap.indent(textwrap.dedent(text), "  ")


def rule_file(rule_body: str) -> str:
    """A file with one valid rule ``ok`` and the given rule after it."""
    body = textwrap.indent(textwrap.dedent(rule_body), "    ")
    return VALID_RULE + "  - id: r\n" + body


@pytest.fixture
def pages(tmp_path: Path) -> Path:
    """A directory holding page.html, for rules that name a body_file."""
    (tmp_path / "page.html").write_text("<p>slow down</p>", encoding="utf-8")
    return tmp_path


# --------------------------------------------------------------------------
# Error values
# --------------------------------------------------------------------------


def test_config_issue_prints_as_file_line_field_message() -> None:
    issue = ConfigIssue("rules.yaml", 14, "rules[2].limit.per", "expected a duration like '10s', got '10 seconds'")
    assert str(issue) == "rules.yaml:14: rules[2].limit.per: expected a duration like '10s', got '10 seconds'"
    named = ConfigIssue("rules.yaml", 14, "rules[2].limit.per", "expected a duration", rule="api-key")
    assert str(named) == "rules.yaml:14: rules[2](api-key).limit.per: expected a duration"
    # A file that cannot be read has no line to point at.
    assert str(ConfigIssue("gone.yaml", 0, "", "cannot read the rules file")) == \
        "gone.yaml: cannot read the rules file"


@pytest.mark.parametrize("text, expected", [
    (rule_file("match: {path: {equal: /x}}\nlimit: {requests: 1, per: 1s}\naction: block\n"),
     "rules[1](r).match.path.equal: unknown field (did you mean 'equals'?)"),
    (rule_file("limit: {requests: 1, per: 1s}\npenalti: 3s\naction: block\n"),
     "rules[1](r).penalti: unknown field (did you mean 'penalty'?)"),
    (rule_file("limit: {requests: 1, per: 1s}\naction: block\nbolck: {status: 429}\n"),
     "rules[1](r).bolck: unknown field (did you mean 'block'?)"),
    ("stat: {backend: redis}\n" + VALID_RULE, "stat: unknown field (did you mean 'state'?)"),
    (rule_file("limit: {requests: 1, per: 1s}\naction: block\nzzzzqqq: 1\n"),
     "rules[1](r).zzzzqqq: unknown field"),
])
def test_a_misspelt_field_gets_a_hint_and_the_rule_s_id(text: str, expected: str) -> None:
    issue = only_issue(text)
    assert str(issue).split(": ", 1)[1] == expected


def test_a_rules_file_that_cannot_be_read_has_no_invented_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_rules_file(tmp_path / "missing.yaml")
    assert str(info.value) == f"{tmp_path / 'missing.yaml'}: cannot read the rules file: " \
        f"[Errno 2] No such file or directory: '{tmp_path / 'missing.yaml'}'"


def test_config_error_lists_every_issue_one_per_line() -> None:
    issues = [ConfigIssue("a.yaml", 1, "node", "bad"), ConfigIssue("a.yaml", 2, "rules", "worse")]
    error = ConfigError(issues)
    assert error.issues == issues
    assert str(error).splitlines() == ["a.yaml:1: node: bad", "a.yaml:2: rules: worse"]


def test_issue_names_the_source_given_by_the_caller() -> None:
    issue = issues_of("bogus: 1\n", source="conf/x.yaml")[0]
    assert issue.file == "conf/x.yaml"
    assert str(issue).startswith("conf/x.yaml:1: bogus: ")


# --------------------------------------------------------------------------
# Every error at once
# --------------------------------------------------------------------------

MANY_ERRORS = """\
node: edge-1
colour: blue
client_ip:
  trusted_proxies: [10.0.0.1/8]
exempt: [not-a-cidr]
rules:
  - id: first
    key: [ip, ip]
    limit: {requests: 5, per: 10 seconds}
    action: block
    block: {status: 399}
  - id: first
    limit: {requests: many, per: 1s}
    action: block
  - id: "bad id!"
    key: [colour]
    action: log
  - id: missing-action
    match: {path: {regex: "("}}
    limit: {rate: 10r/h}
  - id: short-ban
    limit: {requests: 1, per: 1s, extra: 1}
    action: ban
    ban: {duration: 500ms}
  - id: pages
    limit: {requests: 1, per: 1s}
    action: block
    block: {status: 503, body: hi, body_file: page.html}
overrides:
  - cidrs: [203.0.113.0/24]
    rules: [pages, nope]
    multiply: 2
"""


def test_every_error_is_reported_at_once_with_its_line_and_field(pages: Path) -> None:
    issues = issues_of(MANY_ERRORS, base_dir=pages)
    at = lambda fragment, n=1: line_of(MANY_ERRORS, fragment, n)  # noqa: E731
    assert located(issues) == {
        (at("colour: blue"), "colour"),
        (at("trusted_proxies"), "client_ip.trusted_proxies[0]"),
        (at("exempt:"), "exempt[0]"),
        (at("key: [ip, ip]"), "rules[0].key"),
        (at("10 seconds"), "rules[0].limit.per"),
        (at("status: 399"), "rules[0].block.status"),
        (at("id: first", 2), "rules[1].id"),
        (at("requests: many"), "rules[1].limit.requests"),
        (at("bad id!"), "rules[2].id"),
        (at("bad id!"), "rules[2].limit"),
        (at("[colour]"), "rules[2].key[0]"),
        (at("missing-action"), "rules[3].action"),
        (at('regex: "("'), "rules[3].match.path.regex"),
        (at("10r/h"), "rules[3].limit.rate"),
        (at("extra: 1"), "rules[4].limit.extra"),
        (at("500ms"), "rules[4].ban.duration"),
        (at("body_file: page.html"), "rules[5].block"),
        (at("rules: [pages, nope]"), "overrides[0].rules[1]"),
    }
    assert all(issue.file == "rules.yaml" for issue in issues)


def test_errors_are_listed_in_file_order(pages: Path) -> None:
    lines = [issue.line for issue in issues_of(MANY_ERRORS, base_dir=pages)]
    assert lines == sorted(lines)


# --------------------------------------------------------------------------
# One kind of error at a time: line, field and a message a user can act on
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "fragment", "field"), [
    ("bogus: 1\n" + VALID_RULE, "bogus", "bogus"),
    (VALID_RULE + "    colour: red\n", "colour", "rules[0].colour"),
    (rule_file("limit: {requests: 1, per: 1s, burst: 3}\naction: log\n"), "burst", "rules[1].limit.burst"),
    ("state: {backend: memory, size: 3}\n", "size", "state.size"),
    (rule_file("match: {path: {equals: /a, suffix: x}}\nlimit: {requests: 1, per: 1s}\naction: log\n"),
     "suffix", "rules[1].match.path.suffix"),
])
def test_unknown_field_is_an_error_at_its_line(text: str, fragment: str, field: str) -> None:
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, fragment), field)
    assert "unknown field" in issue.message


@pytest.mark.parametrize(("text", "fragment", "field"), [
    (rule_file("limit: {requests: many, per: 1s}\naction: log\n"), "many", "rules[1].limit.requests"),
    (rule_file("limit: {requests: 1, per: 1s}\naction: [log]\n"), "[log]", "rules[1].action"),
    (rule_file("key: ip\nlimit: {requests: 1, per: 1s}\naction: log\n"), "key: ip", "rules[1].key"),
    ("node: [a, b]\n", "node", "node"),
    ("rules: {id: x}\n", "rules", "rules"),
    ("client_ip: {ipv6_prefix: sixty-four}\n", "ipv6_prefix", "client_ip.ipv6_prefix"),
    ("client_ip: {ipv6_prefix: 129}\n", "ipv6_prefix", "client_ip.ipv6_prefix"),
    ("state: {backend: mysql}\n", "mysql", "state.backend"),
    (rule_file("limit: {requests: 1, per: 1s}\naction: drop\n"), "drop", "rules[1].action"),
    (rule_file("limit: {requests: 1, per: 1s}\naction: block\nblock: {close: maybe}\n"),
     "maybe", "rules[1].block.close"),
])
def test_wrong_type_or_value_is_an_error_at_its_line(text: str, fragment: str, field: str) -> None:
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, fragment), field)


def test_compound_durations_and_weeks_are_accepted_wherever_a_duration_is() -> None:
    text = rule_file("limit: {requests: 1, per: 1h30m}\naction: ban\npenalty: 2m30s\n"
                     "ban: {duration: 1w, increment: {max: 2w, remember: 1d12h}}\n")
    rule = parse(text).model.rules[1]
    assert (rule.limit.per, rule.penalty, rule.ban.duration) == (5400, 150, 7 * 86400)
    assert (rule.ban.increment.max_, rule.ban.increment.remember) == (14 * 86400, 129600)


def test_bad_duration_message_shows_what_was_written() -> None:
    text = rule_file("limit: {requests: 1, per: 10 seconds}\naction: log\n")
    issue = only_issue(text)
    # The rule's id beside its position.
    assert str(issue) == (f"rules.yaml:{line_of(text, '10 seconds')}: rules[1](r).limit.per: "
                          "expected a duration like '10s', got '10 seconds'")


@pytest.mark.parametrize("rate", ["10r/h", "10/s", "r/s", "0r/s", "-1r/s", "ten r/s", "10", "1.5r/s"])
def test_bad_rate_is_an_error(rate: str) -> None:
    text = rule_file(f"limit: {{rate: '{rate}', burst: 1}}\naction: log\n")
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "rate:"), "rules[1].limit.rate")


@pytest.mark.parametrize(("rate", "count", "period"), [("10r/s", 10, 1), ("30r/m", 30, 60), ("1r/s", 1, 1)])
def test_rates_parse(rate: str, count: int, period: int) -> None:
    assert config.parse_rate(rate) == config.Rate(count, period)
    assert str(config.parse_rate(rate)) == rate


@pytest.mark.parametrize("rate", ["10r/h", "10/s", "r/s", "0r/s", "-1r/s", "10", "", 10, None, True])
def test_bad_rates_are_rejected(rate: object) -> None:
    with pytest.raises(ValueError):
        config.parse_rate(rate)


@pytest.mark.parametrize("status", [399, 600, 200, 0])
def test_block_status_outside_400_to_599_is_an_error(status: int) -> None:
    text = rule_file(f"limit: {{requests: 1, per: 1s}}\naction: block\nblock: {{status: {status}}}\n")
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "status:"), "rules[1].block.status")
    assert str(status) in issue.message


@pytest.mark.parametrize("status", [400, 429, 503, 599])
def test_block_status_from_400_to_599_is_accepted(status: int) -> None:
    loaded = parse(rule_file(f"limit: {{requests: 1, per: 1s}}\naction: block\nblock: {{status: {status}}}\n"))
    assert loaded.model.rules[1].block.status == status
    assert compile_rules(loaded).rules[1].page.status == status


def test_block_status_defaults_to_429() -> None:
    assert compile_rules(parse(VALID_RULE)).rules[0].page.status == 429


def test_duplicate_rule_id_is_reported_at_the_second_occurrence() -> None:
    text = VALID_RULE + "  - id: other\n    limit: {requests: 1, per: 1s}\n    action: log\n" + \
        "  - id: ok\n    limit: {requests: 1, per: 1s}\n    action: log\n"
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "id: ok", 2), "rules[2].id")
    assert "duplicate" in issue.message and "'ok'" in issue.message


def test_every_repeat_of_a_rule_id_is_reported() -> None:
    repeat = "  - id: ok\n    limit: {requests: 1, per: 1s}\n    action: log\n"
    text = VALID_RULE + repeat + repeat
    assert located(issues_of(text)) == {(line_of(text, "id: ok", 2), "rules[1].id"),
                                       (line_of(text, "id: ok", 3), "rules[2].id")}


@pytest.mark.parametrize(("where", "fragment", "field"), [
    ("match: {path: {regex: '[a-'}}", "[a-", "rules[1].match.path.regex"),
    ("match: {host: {regex: '(?P<x'}}", "(?P<x", "rules[1].match.host.regex"),
    ("match: {header: {name: ua, regex: '*bot'}}", "*bot", "rules[1].match.header.regex"),
    ("match: {header: [{name: a, present: true}, {name: ua, regex: '*bot'}]}", "*bot",
     "rules[1].match.header[1].regex"),
    ("match: {all: [{path: {prefix: /}}, {cookie: [{name: c, regex: '('}]}]}", "cookie",
     "rules[1].match.all[1].cookie[0].regex"),
    ("match: {not: {query: {name: q, regex: '+'}}}", "query", "rules[1].match.not.query.regex"),
])
def test_invalid_regex_is_an_error(where: str, fragment: str, field: str) -> None:
    text = rule_file(f"{where}\nlimit: {{requests: 1, per: 1s}}\naction: log\n")
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, fragment), field)
    assert "regular expression" in issue.message


def test_invalid_user_agent_regex_of_verified_bots_is_an_error() -> None:
    text = "verified_bots:\n  - cidrs: [66.249.64.0/19]\n    user_agent: '(Googlebot'\n"
    issue = only_issue(text)
    assert (issue.line, issue.field) == (3, "verified_bots[0].user_agent")


@pytest.mark.parametrize(("text", "fragment", "field"), [
    ("exempt: [10.0.0.0/33]\n", "exempt", "exempt[0]"),
    ("exempt: [10.0.0.0/8, 'nonsense']\n", "exempt", "exempt[1]"),
    ("client_ip:\n  trusted_proxies: ['2001:db8::/129']\n", "trusted", "client_ip.trusted_proxies[0]"),
    ("verified_bots:\n  - cidrs: [300.1.1.0/24]\n", "cidrs", "verified_bots[0].cidrs[0]"),
    (rule_file("match: {ip: {in: [1.2.3.4/x]}}\nlimit: {requests: 1, per: 1s}\naction: log\n"),
     "match:", "rules[1].match.ip.in[0]"),
])
def test_invalid_cidr_is_an_error(text: str, fragment: str, field: str) -> None:
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, fragment), field)


@pytest.mark.parametrize(("text", "field"), [
    ("exempt: [10.0.0.1/8]\n", "exempt[0]"),
    ("client_ip: {trusted_proxies: ['2001:db8::1/64']}\n", "client_ip.trusted_proxies[0]"),
    (VALID_RULE + "overrides:\n  - cidrs: [203.0.113.7/24]\n    rules: [ok]\n    multiply: 2\n",
     "overrides[0].cidrs[0]"),
    (rule_file("match: {ip: {in: [192.0.2.1/24]}}\nlimit: {requests: 1, per: 1s}\naction: log\n"),
     "rules[1].match.ip.in[0]"),
])
def test_cidr_with_host_bits_is_an_error(text: str, field: str) -> None:
    issue = only_issue(text)
    assert issue.field == field
    assert "host bits" in issue.message


def test_plain_addresses_and_cidrs_are_accepted_as_networks() -> None:
    loaded = parse("exempt: [10.0.0.0/8, 192.0.2.7, '2001:db8::/32']\n")
    assert [str(network) for network in loaded.model.exempt] == ["10.0.0.0/8", "192.0.2.7/32", "2001:db8::/32"]


@pytest.mark.parametrize(("key", "field"), [
    ("[colour]", "rules[1].key[0]"),
    ("[ip, 'header:']", "rules[1].key[1]"),
    ("['cookies:sid']", "rules[1].key[0]"),
    ("[IP]", "rules[1].key[0]"),
])
def test_unknown_dimension_is_an_error(key: str, field: str) -> None:
    text = rule_file(f"key: {key}\nlimit: {{requests: 1, per: 1s}}\naction: log\n")
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "key:", 2), field)
    assert "dimension" in issue.message


@pytest.mark.parametrize("key", ["[ip, path, ip]", "['header:X-Key', 'header:x-key']", "['cookie:a', 'cookie:a']"])
def test_duplicate_dimension_is_an_error(key: str) -> None:
    text = rule_file(f"key: {key}\nlimit: {{requests: 1, per: 1s}}\naction: log\n")
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "key:", 2), "rules[1].key")


def test_cookie_dimensions_differing_in_case_are_two_dimensions() -> None:
    loaded = parse(rule_file("key: ['cookie:Sid', 'cookie:sid']\nlimit: {requests: 1, per: 1s}\naction: log\n"))
    assert loaded.model.rules[1].key == ["cookie:Sid", "cookie:sid"]


def test_body_and_body_file_together_is_an_error(pages: Path) -> None:
    text = rule_file("limit: {requests: 1, per: 1s}\naction: block\nblock: {body: hi, body_file: page.html}\n")
    issue = only_issue(text, pages)
    assert (issue.line, issue.field) == (line_of(text, "body_file"), "rules[1].block")
    assert "body_file" in issue.message


@pytest.mark.parametrize("page", ["body: hi", "body_file: page.html"])
def test_close_with_a_page_is_an_error(page: str, pages: Path) -> None:
    text = rule_file(f"limit: {{requests: 1, per: 1s}}\naction: block\nblock: {{close: true, {page}}}\n")
    issue = only_issue(text, pages)
    assert (issue.line, issue.field) == (line_of(text, "close: true"), "rules[1].block")


@pytest.mark.parametrize(("block", "json"), [
    ("{}", "if_preferred"), ("{content_type: auto}", "if_preferred"), ("{content_type: text/html}", "never"),
    ("{content_type: application/json}", "always"), ("{content_type: Application/JSON}", "always"),
    ("{status: 503, content_type: application/json}", "always"),
])
def test_the_built_in_page_is_sent_as_html_json_or_as_the_client_prefers(block: str, json: str) -> None:
    ruleset = compile_rules(parse(rule_file(f"limit: {{requests: 1, per: 1s}}\naction: block\nblock: {block}\n")))
    assert ruleset.rules[1].page.json == json


@pytest.mark.parametrize(("block", "content_type"), [
    ("{body: hi}", "text/html; charset=utf-8"),
    ("{body: '{}', content_type: application/json}", "application/json"),
    ("{body: hi, content_type: text/plain}", "text/plain; charset=utf-8"),
    ("{body: hi, content_type: 'text/plain; charset=UTF-8'}", "text/plain; charset=UTF-8"),
    ("{body: '{}', content_type: application/problem+json}", "application/problem+json"),
    ("{body_file: page.html, content_type: text/html}", "text/html; charset=utf-8"),
])
def test_a_page_of_ones_own_keeps_its_declared_type(block: str, content_type: str, pages: Path) -> None:
    text = rule_file(f"limit: {{requests: 1, per: 1s}}\naction: block\nblock: {block}\n")
    page = compile_rules(parse(text, base_dir=pages)).rules[1].page
    assert (page.content_type, page.json) == (content_type, "never")


@pytest.mark.parametrize(("block", "message"), [
    ("{content_type: json}", "the built-in page is sent as auto (HTML or JSON, as the client's Accept header "
     "prefers), text/html or application/json, got 'json' (did you mean 'application/json'?); another type "
     "needs a body or body_file of its own"),
    ("{content_type: application/jsn}", "(did you mean 'application/json'?)"),
    ("{content_type: htm}", "(did you mean 'text/html'?)"),
    ("{content_type: text/plain}", "got 'text/plain'; another type needs a body or body_file of its own"),
    ("{body: hi, content_type: aplication/json}",
     "expected a media type like 'application/json' or 'text/plain', got 'aplication/json' "
     "(did you mean 'application/json'?)"),
    ("{body: hi, content_type: plain}", "got 'plain' (did you mean 'text/plain'?)"),
    ("{body: hi, content_type: auto}", "auto chooses between the built-in HTML and JSON pages; a body of "
     "your own is sent as the one type you give it, e.g. application/json"),
    ("{body: hi, content_type: 'text/plain; charset=latin-1'}", "pages are sent as UTF-8, got charset 'latin-1'"),
    ("{close: true, content_type: application/json}", "close: true sends no page; remove content_type"),
    ("{content_type: 1}", 'YAML read 1 as a number; quote it: content_type: "1"'),
])
def test_a_bad_content_type_is_an_error_at_its_line_with_a_hint(block: str, message: str) -> None:
    text = rule_file(f"limit: {{requests: 1, per: 1s}}\naction: block\nblock: {block}\n")
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "content_type"), "rules[1].block.content_type")
    assert message in issue.message, issue.message


def test_sluice_check_names_file_line_and_field_of_a_bad_content_type(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(rule_file("limit: {requests: 1, per: 1s}\naction: block\nblock:\n"
                               "  status: 429\n  content_type: jsno\n"), encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "sidecar", "check", str(rules)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines()[0].startswith(f"{rules}:11: rules[1](r).block.content_type: ")
    assert "(did you mean 'application/json'?)" in result.stderr


@pytest.mark.parametrize("duration", ["500ms", "0.5", "2y", "366d", "31536001", "0s", 0])
def test_ban_duration_outside_1s_to_1y_is_an_error(duration: object) -> None:
    text = rule_file(f"limit: {{requests: 1, per: 1s}}\naction: ban\nban: {{duration: {duration}}}\n")
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "duration:"), "rules[1].ban.duration")


@pytest.mark.parametrize(("duration", "seconds"), [("1s", 1), (1, 1), ("1y", 365 * 86400), ("365d", 365 * 86400),
                                                   ("1h", 3600)])
def test_ban_duration_from_1s_to_1y_is_accepted(duration: object, seconds: float) -> None:
    loaded = parse(rule_file(f"limit: {{requests: 1, per: 1s}}\naction: ban\nban: {{duration: {duration}}}\n"))
    assert compile_rules(loaded).rules[1].ban_duration == seconds


@pytest.mark.parametrize(("rule", "fragment", "field"), [
    ("key: [ip]\naction: log\n", "id: r", "rules[1].limit"),
    ("limit: {requests: 1, per: 1s}\n", "id: r", "rules[1].action"),
    ("limit: {per: 1s}\naction: log\n", "limit:", "rules[1].limit"),
    ("limit: {requests: 1}\naction: log\n", "limit:", "rules[1].limit.per"),
])
def test_missing_required_field_is_an_error_at_the_mapping_that_lacks_it(rule: str, fragment: str, field: str) -> None:
    text = rule_file(rule)
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, fragment, 2 if fragment == "limit:" else 1), field)


def test_missing_limit_and_action_are_both_reported_at_the_rule() -> None:
    text = VALID_RULE + "  - id: bare\n    key: [ip]\n"
    assert located(issues_of(text)) == {(line_of(text, "id: bare"), "rules[1].limit"),
                                       (line_of(text, "id: bare"), "rules[1].action")}


def test_missing_rule_id_is_an_error() -> None:
    text = VALID_RULE + "  - key: [ip]\n    limit: {requests: 1, per: 1s}\n    action: log\n"
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "key: [ip]", 2), "rules[1].id")


@pytest.mark.parametrize(("text", "fragment"), [
    ("node: a\nrules:\n  - id: x: y\n", "id: x: y"),
    ("node: a\nstate: {backend: memory\nexempt: []\nrules: []\n", "exempt"),
    ("node: a\n\trules: []\n", "rules"),
    ("node: 'unterminated\nrules: []\n", None),
])
def test_yaml_syntax_error_is_reported_with_its_line(text: str, fragment: str | None) -> None:
    issue = only_issue(text)
    assert "YAML" in issue.message
    assert issue.file == "rules.yaml"
    if fragment is not None:
        assert issue.line == line_of(text, fragment)
    else:
        assert 1 <= issue.line <= len(text.splitlines()) + 1


@pytest.mark.parametrize(("text", "fragment", "field"), [
    ("node: !foo bar\n", "node", "node"),
    ("node: a\nstate: !!python/object:os.system 1\n", "state", "state"),
    ("node: 2001-02-30\n", "node", "node"),
])
def test_yaml_value_that_cannot_be_constructed_is_an_error_at_its_line(text: str, fragment: str, field: str) -> None:
    # An unknown tag or an impossible date is a mistake in the file: it must be
    # reported as FILE:LINE like any other, not escape as a YAML/Python error.
    issues = issues_of(text)
    assert {issue.line for issue in issues} == {line_of(text, fragment)}
    assert {issue.field for issue in issues} <= {"", field}


def test_yaml_merge_key_is_either_applied_or_reported() -> None:
    text = ("rules:\n"
            "  - id: a\n"
            "    limit: &base {requests: 1, per: 1s}\n"
            "    action: log\n"
            "  - id: b\n"
            "    limit:\n"
            "      <<: *base\n"
            "      requests: 2\n"
            "    action: log\n")
    try:
        loaded = parse(text)
    except ConfigError as error:
        assert all(issue.line >= 5 for issue in error.issues), error.issues
    else:
        assert loaded.model.rules[1].limit == WindowLimit(requests=2, per=1)


def test_yaml_aliases_are_followed() -> None:
    text = ("rules:\n"
            "  - id: a\n"
            "    limit: &shared {requests: 3, per: 1m}\n"
            "    action: log\n"
            "  - id: b\n"
            "    limit: *shared\n"
            "    action: log\n")
    assert parse(text).model.rules[1].limit.per == 60


@pytest.mark.parametrize(("text", "fragment", "field"), [
    (rule_file("limit: {requests: true, per: 1s}\naction: log\n"), "true", "rules[1].limit.requests"),
    (rule_file("limit: {requests: yes, per: 1s}\naction: log\n"), "yes", "rules[1].limit.requests"),
    (rule_file("limit: {tokens: true, refill: 1/s}\naction: log\n"), "true", "rules[1].limit.tokens"),
    ("state: {max_keys: true}\n", "max_keys", "state.max_keys"),
    ("client_ip: {ipv4_prefix: true}\n", "ipv4_prefix", "client_ip.ipv4_prefix"),
])
def test_boolean_is_not_a_number(text: str, fragment: str, field: str) -> None:
    # Validated strictly. YAML turns `yes`/`true` into a boolean; a
    # typo must not become "1 request".
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, fragment), field)


def test_token_cost_above_the_bucket_is_an_error() -> None:
    text = rule_file("limit: {tokens: 3, refill: 1/s, cost: 4}\naction: log\n")
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "cost"), "rules[1].limit")


@pytest.mark.parametrize(("tokens", "words"), [(1, "a bucket of 1 token"), (2, "a bucket of 2 tokens")])
def test_counts_in_messages_agree_with_their_nouns(tokens: int, words: str) -> None:
    issue = only_issue(rule_file(f"limit: {{tokens: {tokens}, refill: 1/s, cost: 3}}\naction: log\n"))
    assert issue.message == f"cost 3 can never be admitted by {words}"


# YAML 1.1 reads yes/no/on/off/true/false as booleans and 1_000, 0x1f, 1:30,
# 1.5e+3 as numbers: where text is due, the message says so and how to quote.
@pytest.mark.parametrize(("rule", "fragment", "field", "message"), [
    ("id: yes", "id: yes", "rules[1].id", 'YAML read yes as true; quote it: id: "yes"'),
    ("id: Off", "id: Off", "rules[1].id", 'YAML read Off as false; quote it: id: "Off"'),
    ("id: 404", "id: 404", "rules[1].id", 'YAML read 404 as a number; quote it: id: "404"'),
    ("id: 1_000", "id: 1_000", "rules[1].id", 'YAML read 1_000 as the number 1000; quote it: id: "1_000"'),
    ("id: 1:30", "id: 1:30", "rules[1].id", 'YAML read 1:30 as the number 90; quote it: id: "1:30"'),
    ("id: 1.5e+3", "id: 1.5e+3", "rules[1].id", 'YAML read 1.5e+3 as the number 1500.0; quote it: id: "1.5e+3"'),
    ("id: r\nmatch: {header: {name: x-country, in: [SE, NO]}}", "NO]", "rules[1].match.header.in[1]",
     'YAML read NO as false; quote it: "NO"'),
    ("id: r\nmatch: {header: {name: on, present: true}}", "name: on", "rules[1].match.header.name",
     'YAML read on as true; quote it: name: "on"'),
    ("id: r\naction: block\nblock: {body: 404}", "body: 404", "rules[1].block.body",
     'YAML read 404 as a number; quote it: body: "404"'),
])
def test_a_word_yaml_reads_as_a_boolean_or_number_where_text_is_due_says_so(
        rule: str, fragment: str, field: str, message: str) -> None:
    body = rule + "\n" + ("" if "action:" in rule else "action: log\n") + "key: [ip]\nlimit: {requests: 1, per: 1s}\n"
    text = VALID_RULE + "  - " + textwrap.indent(body, "    ")[4:]
    issue = only_issue(text)
    assert (issue.line, issue.field, issue.message) == (line_of(text, fragment), field, message)


def test_a_quoted_yes_is_text() -> None:
    assert parse(VALID_RULE.replace("id: ok", 'id: "yes"')).model.rules[0].id == "yes"


def test_a_boolean_for_a_word_from_a_list_says_what_yaml_read() -> None:
    text = rule_file("limit: {requests: 1, per: 1s, window: on}\naction: log\n")
    issue = only_issue(text)
    assert (issue.field, issue.message) == (
        "rules[1].limit.window", "should be 'sliding' or 'fixed', got True (YAML read on as true)")


def test_a_field_name_yaml_reads_as_a_boolean_says_so() -> None:
    text = rule_file("limit: {requests: 1, per: 1s}\naction: log\non: 1\n")
    issue = only_issue(text)
    assert (issue.line, issue.message) == (
        line_of(text, "on: 1"), 'field names must be text; YAML read on as true; quote it: "on":')


def test_limit_of_no_known_kind_is_an_error() -> None:
    text = rule_file("limit: {per: 1s, amount: 3}\naction: log\n")
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "amount"), "rules[1].limit")


@pytest.mark.parametrize(("action", "section"), [("log", "block: {status: 503}"), ("block", "ban: {duration: 1h}"),
                                                 ("ban", "block: {close: true}")])
def test_action_settings_for_another_action_are_an_error(action: str, section: str) -> None:
    text = rule_file(f"limit: {{requests: 1, per: 1s}}\naction: {action}\n{section}\n")
    assert only_issue(text).field == "rules[1]"


@pytest.mark.parametrize(("text", "fragment", "field"), [
    ("node: a\nnode: b\n", "node: b", "node"),
    (VALID_RULE + "    action: log\n", "action: log", "rules[0].action"),
    ("state:\n  backend: memory\n  fail: open\n  backend: redis\n", "backend: redis", "state.backend"),
])
def test_duplicate_yaml_key_is_reported_at_the_second_occurrence(text: str, fragment: str, field: str) -> None:
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, fragment), field)


def test_override_referencing_an_unknown_rule_is_an_error() -> None:
    text = VALID_RULE + "overrides:\n  - cidrs: [203.0.113.0/24]\n    rules: [ok, missing]\n    multiply: 10\n"
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "rules: [ok, missing]"), "overrides[0].rules[1]")
    assert "missing" in issue.message


def test_override_may_reference_a_rule_defined_after_it_in_the_file() -> None:
    text = "overrides:\n  - cidrs: [203.0.113.0/24]\n    rules: [ok]\n    multiply: 10\n" + VALID_RULE
    ruleset = compile_rules(parse(text))
    assert ruleset.by_id["ok"].overrides[0].multiply == 10


@pytest.mark.parametrize("rule_id", ["'bad id!'", "a/b", "'-leading-dash'", "''", "x" * 65, "'ключ'", "'a b'",
                                     "'a:b'", "'a|b'"])
def test_invalid_rule_id_characters_are_an_error(rule_id: str) -> None:
    text = VALID_RULE + f"  - id: {rule_id}\n    limit: {{requests: 1, per: 1s}}\n    action: log\n"
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "id:", 2), "rules[1].id")


@pytest.mark.parametrize("rule_id", ["a", "login-failures", "api_v2.read", "A1", "x" * 64])
def test_valid_rule_ids_are_accepted(rule_id: str) -> None:
    text = VALID_RULE + f"  - id: {rule_id}\n    limit: {{requests: 1, per: 1s}}\n    action: log\n"
    assert parse(text).model.rules[1].id == rule_id


def test_non_mapping_document_is_an_error() -> None:
    issue = only_issue("- just\n- a list\n")
    assert issue.line == 1


@pytest.mark.parametrize("text", ["", "# all rules removed\n", "\n\n"])
def test_an_empty_file_is_an_error_not_a_file_without_rules(text: str) -> None:
    # A truncated or emptied file must not turn rate limiting off.
    assert [str(issue) for issue in parse_issues(text)] == ["rules.yaml:1: rules: the rules file is empty"]


def test_a_file_without_a_rules_list_is_an_error() -> None:
    issues = parse_issues("node: a\n")
    assert [str(issue) for issue in issues] == [
        "rules.yaml:1: rules: field required (write `rules: []` to run without rules on purpose)"]


def test_an_explicit_empty_rules_list_is_accepted() -> None:
    assert parse("rules: []\n").model.rules == []


def parse_issues(text: str) -> list[ConfigIssue]:
    with pytest.raises(ConfigError) as info:
        parse_rules_text(text, "rules.yaml", Path("."))
    return info.value.issues


# --------------------------------------------------------------------------
# Durations
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("written", "seconds"), [
    ("500ms", 0.5), ("10s", 10), ("15m", 900), ("1h", 3600), ("1d", 86400), ("1y", 365 * 86400),
    (10, 10), (1, 1), ("90s", 90),
    # Weeks, and several units from the largest to the smallest.
    ("1w", 7 * 86400), ("2w", 14 * 86400), ("1h30m", 5400), ("2m30s", 150), ("1d12h", 129600),
    ("1w2d", 9 * 86400), ("1s500ms", 1.5), ("1h 30m", 5400), ("1.5h", 5400), ("1y1d", 366 * 86400),
])
def test_durations_parse(written: object, seconds: float) -> None:
    assert parse_duration(written) == seconds
    loaded = parse(rule_file(f"limit: {{requests: 1, per: {written}}}\naction: log\n"))
    assert loaded.model.rules[1].limit.per == seconds


@pytest.mark.parametrize("written", [0, -1, -10, "0s", "0ms", "-5s", True, False, "10 seconds", "10",
                                     "ten", "", None, "1x", "10S", "1.h", [10], "1h1h", "30m1h", "1ms1s",
                                     "10min", "h", "1h30", "1h,30m", "0h0m", "1e3s", float("nan"),
                                     float("inf"), 10**400, "9" * 5000 + "s"])
def test_invalid_durations_are_rejected(written: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(written)


@pytest.mark.parametrize(("written", "message"), [
    ("10 seconds", "expected a duration like '10s', got '10 seconds'"),
    ("10", "expected a duration like '10s', got '10' (did you mean '10s'?)"),
    ("10S", "expected a duration like '10s', got '10S' (did you mean '10s'?)"),
    ("1H30", "expected a duration like '10s', got '1H30'"),
    ("-5s", "expected a duration like '10s', got '-5s' (a duration is positive)"),
    ("1h1h", "units go from the largest to the smallest, each once (1h30m, 2m30s), got '1h1h'"),
    ("30m1h", "units go from the largest to the smallest, each once (1h30m, 2m30s), got '30m1h'"),
    ("0s", "a duration must be positive, got '0s'"),
    (10**400, "a duration must be positive and finite, got 1000000000"),
])
def test_a_bad_duration_says_what_to_write(written: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(written)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(("seconds", "written"), [
    (0.5, "500ms"), (10, "10s"), (90, "1m30s"), (900, "15m"), (3600, "1h"), (5400, "1h30m"),
    (86400, "1d"), (7 * 86400, "7d"), (1.5, "1s500ms"), (1234567, "14d6h56m7s"), (0.0004, "0.0004s"),
])
def test_durations_are_formatted_as_a_rules_file_writes_them(seconds: float, written: str) -> None:
    assert config.format_duration(seconds) == written


positive_durations = st.one_of(
    st.integers(1, 10**12),
    st.integers(1, 10**12).map(lambda milliseconds: milliseconds / 1000),
    st.floats(min_value=0, exclude_min=True, allow_infinity=False, allow_nan=False),
)


@given(positive_durations)
def test_a_formatted_duration_reads_back_as_the_same_number(seconds: float) -> None:
    assert parse_duration(config.format_duration(seconds)) == seconds


@given(st.one_of(st.text(), st.text(alphabet="0123456789.msdhwy -+eE:_", max_size=20),
                 st.integers(), st.floats(), st.booleans(), st.none(), st.lists(st.integers(), max_size=2)))
def test_any_value_is_a_positive_duration_or_a_value_error(value: object) -> None:
    try:
        seconds = parse_duration(value)
    except ValueError:
        return
    assert 0 < seconds < float("inf")


@given(st.one_of(st.text(max_size=30), st.text(alphabet="0123456789.msdhwy -:_", max_size=20),
                 st.integers(), st.floats(), st.booleans()))
def test_any_per_in_a_file_loads_or_is_a_config_error_at_its_field(value: object) -> None:
    # JSON is YAML: the value as it is, strings quoted.
    text = rule_file(f"limit: {{requests: 1, per: {json.dumps(value)}}}\naction: log\n")
    try:
        parse(text)
    except ConfigError as error:
        assert [issue.field for issue in error.issues] == ["rules[1].limit.per"], error


@pytest.mark.parametrize("written", ["0", "-1", "true", "false", "'10 seconds'", "'10'", "1x", "null", "1h1h"])
def test_invalid_duration_in_a_file_is_an_error_at_its_field(written: str) -> None:
    text = rule_file(f"limit: {{requests: 1, per: {written}}}\naction: log\n")
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, "per:", 2), "rules[1].limit.per")


def test_penalty_is_a_duration() -> None:
    text = rule_file("limit: {requests: 1, per: 10s}\naction: block\npenalty: 15m\n")
    assert compile_rules(parse(text)).rules[1].reset == 900
    bad = rule_file("limit: {requests: 1, per: 10s}\naction: block\npenalty: 15 minutes\n")
    assert (only_issue(bad).line, only_issue(bad).field) == (line_of(bad, "penalty"), "rules[1].penalty")


# --------------------------------------------------------------------------
# The reference example and the shipped examples
# --------------------------------------------------------------------------


# A complete rules file using every top-level section (kept here as a
# fixture of its own: the project reads nothing outside the repository).
REFERENCE_EXAMPLE = """\
node: edge-1                      # name in ban records; default: hostname
client_ip:
  trusted_proxies: []             # CIDRs whose X-Forwarded-For is believed
  ipv6_prefix: 64
  ipv4_prefix: 32
state:
  backend: memory                 # memory | redis
  url: redis://127.0.0.1:6379/0   # with backend: redis
  max_keys: 100000
  fail: open                      # open | closed
exempt: [10.0.0.0/8]              # never limited
verified_bots:
  - cidrs: [66.249.64.0/19]
    user_agent: Googlebot         # optional regex
challenge:
  secret_file: /run/secrets/sluice   # HMAC key; default: random at start
  auto_ban: {challenges: 100, per: 60s, ban: 5m}
overrides:
  - cidrs: [203.0.113.0/24]       # a campus NAT
    rules: [pages]
    multiply: 10                  # threshold x10 for these addresses
rules:
  - id: login-failures            # unique; the priority is the order here
    match:
      all:
        - path: {equals: /api/login}
        - method: [POST]
    key: [ip]
    limit: {requests: 5, per: 15m}          # sliding window (default)
    count_on: {status: [401]}               # response-phase counting
    action: block
    penalty: 15m
    block: {status: 429}                    # built-in page
  - id: api-key
    key: [ip, "header:x-api-key"]
    limit: {requests: 2, per: 10s, window: fixed}
    action: block
    block: {status: 503, body: "busy, ${{remote_addr}}"}
  - id: heavy-queries
    key: ["header:x-api-key"]
    limit: {score: 400, per: 60s, header: x-score}
    action: block
    penalty: 10m
  - id: scrapers
    key: [ip]
    limit: {requests: 100, per: 60s}
    action: ban
    ban: {duration: 1h}
  - id: pages
    match: {header: {name: accept, prefix: text/html}}
    key: [ip]
    limit: {requests: 30, per: 10s}
    action: challenge
    challenge: {ttl: 24h}
  - id: like-nginx
    key: [ip]
    limit: {rate: 10r/s, burst: 20, nodelay: true}
    action: block
  - id: tokens
    key: [ip, path]
    limit: {tokens: 3, refill: 2/s}
    action: log
"""


def test_spec_example_validates_except_for_its_absent_secret_file() -> None:
    """The reference example is valid; only its secret file, absent on this
    machine, is refused."""
    with pytest.raises(ConfigError) as info:
        parse_rules_text(REFERENCE_EXAMPLE, "reference.yaml", Path("."))
    assert {issue.field for issue in info.value.issues} == {"challenge.secret_file"}


def test_spec_example_runs_with_its_secret_file(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("s3cret\n", encoding="utf-8")
    text = REFERENCE_EXAMPLE.replace("/run/secrets/sluice", "secret")
    ruleset = compile_rules(parse_rules_text(text, "reference.yaml", tmp_path))
    pages = ruleset.by_id["pages"]
    assert pages.action == "challenge" and pages.challenge is not None
    assert (pages.challenge.cookie, pages.challenge.ttl) == ("sluice_pass_pages", 86400)
    assert ruleset.secret == b"s3cret"
    assert (ruleset.auto_ban.threshold, ruleset.auto_ban.duration) == (100, 300)


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")) + [REPO / "sidecar/default_rules.yaml"],
                         ids=lambda path: path.name)
def test_shipped_rules_files_load(path: Path) -> None:
    assert load_ruleset(str(path)).rules


# --------------------------------------------------------------------------
# What cannot run: compile_rules / load_ruleset
# --------------------------------------------------------------------------


def test_missing_body_file_is_an_error_at_its_field(tmp_path: Path) -> None:
    text = rule_file("limit: {requests: 1, per: 1s}\naction: block\nblock: {body_file: missing.html}\n")
    issues = compile_issues(text, base_dir=tmp_path)
    assert located(issues) == {(line_of(text, "body_file"), "rules[1].block.body_file")}
    assert issues[0].file == "rules.yaml"


def test_body_file_is_read_relative_to_the_rules_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "busy.html").write_text("busy ${{remote_addr}} <", encoding="utf-8")
    rules = tmp_path / "rules.yaml"
    rules.write_text(rule_file("limit: {requests: 1, per: 1s}\naction: block\n"
                               "block: {status: 503, body_file: pages/busy.html}\n"), encoding="utf-8")
    monkeypatch.chdir(REPO)
    page = load_ruleset(str(rules)).rules[1].page
    assert page.status == 503
    assert page.template.render("192.0.2.1", "h", "id") == b"busy 192.0.2.1 <"


def test_body_file_that_is_not_utf8_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "page.html").write_bytes(b"\xff\xfe\x00 not text")
    text = rule_file("limit: {requests: 1, per: 1s}\naction: block\nblock: {body_file: page.html}\n")
    issues = compile_issues(text, base_dir=tmp_path)
    assert located(issues) == {(line_of(text, "body_file"), "rules[1].block.body_file")}


def test_load_ruleset_reports_a_missing_body_file(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    text = rule_file("limit: {requests: 1, per: 1s}\naction: block\nblock: {body_file: nope.html}\n")
    rules.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_ruleset(str(rules))
    assert [str(issue).split(": ", 2)[:2] for issue in info.value.issues] == \
        [[f"{rules}:{line_of(text, 'body_file')}", "rules[1](r).block.body_file"]]


@pytest.mark.parametrize(("rule", "fragment", "field"), [
    ("limit: {requests: 1, per: 1s}\naction: challenge\nchallenge: {ttl: 10m}\n", "ttl", "rules[1].challenge.ttl"),
    ("limit: {requests: 1, per: 1s}\naction: challenge\nchallenge: {ttl: 8d}\n", "ttl", "rules[1].challenge.ttl"),
])
def test_challenge_settings_out_of_range_are_refused(rule: str, fragment: str, field: str) -> None:
    text = rule_file(rule)
    assert located(compile_issues(text)) == {(line_of(text, fragment), field)}


@pytest.mark.parametrize("difficulty", [0, 25])
def test_challenge_difficulty_out_of_range_is_refused(difficulty: int) -> None:
    text = f"challenge:\n  difficulty: {difficulty}\n" + VALID_RULE
    assert located(compile_issues(text)) == {(2, "challenge.difficulty")}


def test_redis_backend_loads_with_its_url_and_fail_mode() -> None:
    text = "state:\n  backend: redis\n  url: redis://127.0.0.1:6390/2\n  fail: closed\n" + VALID_RULE
    ruleset = compile_rules(parse(text))
    assert (ruleset.backend, ruleset.url, ruleset.fail) == ("redis", "redis://127.0.0.1:6390/2", "closed")


@pytest.mark.parametrize("limit", ["{rate: 10r/s, burst: 5}", "{tokens: 10, refill: 1/s}"])
def test_bucket_rules_load_with_the_redis_backend(limit: str) -> None:
    text = "state: {backend: redis}\n" + rule_file(f"limit: {limit}\naction: block\n")
    ruleset = compile_rules(parse(text))
    assert ruleset.backend == "redis" and [rule.id for rule in ruleset.rules] == ["ok", "r"]


def test_draft_headers_load_with_the_redis_backend() -> None:
    text = "headers: draft\nstate: {backend: redis}\n" + VALID_RULE
    ruleset = compile_rules(parse(text))
    assert ruleset.backend == "redis" and ruleset.draft_headers


def test_every_compile_error_is_reported_at_once(tmp_path: Path) -> None:
    text = "state: {backend: valkey}\n" + VALID_RULE + more_rules("""\
          - id: a
            limit: {requests: 1, per: 1s}
            action: challenge
            challenge: {ttl: 1m}
          - id: b
            limit: {tokens: 3, refill: 2/s}
            count_on: {status: [404]}
            action: log
          - id: c
            limit: {requests: 1, per: 1s}
            action: block
            block: {body_file: nope.html}
          - id: d
            limit: {requests: 1, per: 1s}
            action: log
            count_on: {status: [404]}
        """)
    assert located(compile_issues(text, base_dir=tmp_path)) == {
        (1, "state.backend"),
        (line_of(text, "ttl: 1m"), "rules[1].challenge.ttl"),
        (line_of(text, "id: b"), "rules[2]"),
        (line_of(text, "body_file"), "rules[3].block.body_file"),
    }


def test_load_ruleset_reports_a_missing_file_as_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_ruleset(str(tmp_path / "absent.yaml"))
    assert info.value.issues[0].file == str(tmp_path / "absent.yaml")


# --------------------------------------------------------------------------
# `sluice check`
# --------------------------------------------------------------------------

ISSUE_LINE = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): (?P<field>\S+): (?P<message>.+)$")


def sluice_check(file: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", "check", file], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_check_accepts_a_valid_file() -> None:
    result = sluice_check("examples/default.yaml", REPO)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_check_reports_every_error_as_file_line_field_message(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "rules.yaml").write_text(MANY_ERRORS, encoding="utf-8")
    (tmp_path / "conf" / "page.html").write_text("<p>slow down</p>", encoding="utf-8")
    result = sluice_check("conf/../conf/rules.yaml", tmp_path)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    parsed = [ISSUE_LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert {match["file"] for match in parsed} == {"conf/../conf/rules.yaml"}
    # A field of a rule with a valid id names it: rules[0](first).limit.per.
    assert {(int(match["line"]), re.sub(r"^(rules\[\d+\])\([^)]*\)", r"\1", match["field"])) for match in parsed} == \
        located(issues_of(MANY_ERRORS, base_dir=tmp_path / "conf"))
    assert (f"conf/../conf/rules.yaml:{line_of(MANY_ERRORS, '10 seconds')}: rules[0](first).limit.per: "
            "expected a duration like '10s', got '10 seconds'") in lines


@pytest.mark.parametrize(("text", "line"), [
    ("node: a\nrules:\n  - id: x: y\n", 3),
    ("node: a\nexempt: [!cidr 10.0.0.0/8]\n", 2),
    ("rules: []\nnode: 2001-02-30\n", 2),
])
def test_check_reports_yaml_problems_as_file_line_without_a_traceback(tmp_path: Path, text: str, line: int) -> None:
    (tmp_path / "r.yaml").write_text(text, encoding="utf-8")
    result = sluice_check("r.yaml", tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines and all(text.startswith(f"r.yaml:{line}: ") for text in lines), lines


def test_check_reports_load_time_errors(tmp_path: Path) -> None:
    text = rule_file("limit: {requests: 1, per: 1s}\naction: block\nblock: {body_file: gone.html}\n")
    (tmp_path / "r.yaml").write_text(text, encoding="utf-8")
    result = sluice_check("r.yaml", tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines()[0].startswith(
        f"r.yaml:{line_of(text, 'gone.html')}: rules[1](r).block.body_file: ")


def test_check_reports_schema_and_load_time_errors_together(tmp_path: Path) -> None:
    # sluice check exits 1 with every error. A missing page template must not
    # wait until the schema errors elsewhere in the file are fixed.
    text = VALID_RULE + more_rules("""\
          - id: page
            limit: {requests: 1, per: 1s}
            action: block
            block: {body_file: missing.html}
          - id: typo
            limit: {requests: 1, per: 10 seconds}
            action: log
        """)
    (tmp_path / "r.yaml").write_text(text, encoding="utf-8")
    result = sluice_check("r.yaml", tmp_path)
    assert result.returncode == 1
    fields = {ISSUE_LINE.match(line)["field"] for line in result.stderr.splitlines()}
    assert fields == {"rules[1](page).block.body_file", "rules[2](typo).limit.per"}


def test_check_reports_a_secret_file_that_does_not_exist(tmp_path: Path) -> None:
    # A secret_file that does not exist is an error.
    text = "challenge:\n  secret_file: ./no-such-secret\n" + VALID_RULE
    (tmp_path / "r.yaml").write_text(text, encoding="utf-8")
    result = sluice_check("r.yaml", tmp_path)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("r.yaml:2: challenge.secret_file: "), lines


def test_check_accepts_an_existing_secret_file(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("s3cret", encoding="utf-8")
    text = "challenge:\n  secret_file: secret\n" + VALID_RULE
    (tmp_path / "r.yaml").write_text(text, encoding="utf-8")
    result = sluice_check("r.yaml", tmp_path)
    assert result.returncode == 0, result.stderr


def test_check_console_script_reports_errors_with_the_file_as_given(tmp_path: Path) -> None:
    # `make test` installs the project into the interpreter's venv.
    script = Path(sys.executable).with_name("sluice")
    assert script.exists(), f"the sluice console script is not installed beside {sys.executable}"
    (tmp_path / "bad.yaml").write_text("bogus: 1\nrules: []\n", encoding="utf-8")
    result = subprocess.run([str(script), "check", "./bad.yaml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["./bad.yaml:1: bogus: unknown field"]


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://h:99999/0", "redis://h/db"])
def test_a_state_url_that_is_no_redis_url_is_an_error(url: str) -> None:
    issues = issues_of(f"state: {{backend: redis, url: '{url}'}}\n")
    assert [issue.field for issue in issues] == ["state.url"]


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://user:pw@h:6380/1",
                                 "unix:///run/redis/redis.sock?db=2"])
def test_redis_and_unix_socket_urls_are_accepted(url: str) -> None:
    assert parse(f"state: {{backend: redis, url: '{url}'}}\n").model.state.url == url


def test_a_redis_cluster_loads_with_its_nodes() -> None:
    text = ("state:\n  backend: redis\n  url: rediss://app:pw@ignored\n"
            "  cluster: {nodes: ['10.0.0.1:7000', '[2001:db8::7]:7001']}\n" + VALID_RULE)
    ruleset = compile_rules(parse(text))
    assert ruleset.cluster == (("10.0.0.1", 7000), ("2001:db8::7", 7001))
    assert compile_rules(parse("state: {backend: redis}\n" + VALID_RULE)).cluster == ()


@pytest.mark.parametrize("state, field, message", [
    ("{backend: redis, cluster: {nodes: []}}", "state.cluster.nodes", "at least 1"),
    ("{backend: redis, cluster: {nodes: ['10.0.0.1']}}", "state.cluster.nodes", "HOST:PORT"),
    ("{backend: redis, cluster: {nodes: ['h:0']}}", "state.cluster.nodes", "HOST:PORT"),
    ("{backend: redis, cluster: {nodes: ['h:1'], node: x}}", "state.cluster.node", "unknown field"),
    ("{backend: memory, cluster: {nodes: ['h:1']}}", "state", "needs backend: redis"),
    ("{backend: redis, url: 'redis://h/2', cluster: {nodes: ['h:1']}}", "state", "database 0"),
    ("{backend: redis, url: 'unix:///r.sock', cluster: {nodes: ['h:1']}}", "state", "Unix socket"),
])
def test_a_bad_cluster_setting_is_an_error_at_its_field(state: str, field: str, message: str) -> None:
    issues = issues_of(f"state: {state}\n")
    assert [issue.field for issue in issues] == [field]
    assert message in issues[0].message and issues[0].line == 1


SENTINEL = """\
state:
  backend: redis
  sentinel:
    master: main
    nodes: ["10.0.0.5:26379", "[2001:db8::5]", "sentinel-c.internal:26380"]
"""


def test_sentinel_settings_load_with_the_redis_backend() -> None:
    sentinel = compile_rules(parse(SENTINEL + VALID_RULE)).sentinel
    assert sentinel is not None
    assert (sentinel.master, sentinel.nodes, sentinel.db, sentinel.password) == (
        "main", [("10.0.0.5", 26379), ("2001:db8::5", 26379), ("sentinel-c.internal", 26380)], 0, None)


@pytest.mark.parametrize(("text", "fragment", "field"), [
    (SENTINEL + "  url: redis://10.0.0.9:6379/0\n", "url:", "state.url"),
    (SENTINEL.replace("backend: redis", "backend: memory"), "sentinel:", "state.sentinel"),
    (SENTINEL.replace('"10.0.0.5:26379"', '"::1:26379"'), "nodes", "state.sentinel.nodes[0]"),
    (SENTINEL.replace("26380", "70000"), "nodes", "state.sentinel.nodes[2]"),
    (SENTINEL.replace("[2001:db8::5]", "[2001:zz::5]"), "nodes", "state.sentinel.nodes[1]"),
    (SENTINEL.replace('"[2001:db8::5]"', '"10.0.0.5:26379"'), "nodes", "state.sentinel.nodes"),
    (SENTINEL.replace('nodes: ["10.0.0.5:26379", "[2001:db8::5]", "sentinel-c.internal:26380"]', "nodes: []"),
     "nodes", "state.sentinel.nodes"),
    (SENTINEL.replace("master: main", "master: my master"), "master:", "state.sentinel.master"),
    (SENTINEL.replace("    master: main\n", ""), "sentinel:", "state.sentinel.master"),
    (SENTINEL + "    username: app\n", "username", "state.sentinel.username"),
    (SENTINEL + "    db: -1\n", "db:", "state.sentinel.db"),
    (SENTINEL + "    tls: true\n", "tls", "state.sentinel.tls"),
])
def test_a_bad_sentinel_setting_is_an_error_at_its_line(text: str, fragment: str, field: str) -> None:
    issue = only_issue(text)
    assert (issue.line, issue.field) == (line_of(text, fragment), field)


def test_a_sentinel_with_a_url_says_where_the_database_and_password_go() -> None:
    issue = only_issue(SENTINEL + "  url: redis://:pw@10.0.0.9:6379/2\n")
    assert "either url or sentinel" in issue.message and "sentinel.db" in issue.message


@given(st.text(max_size=40) | st.integers() | st.none())
def test_any_sentinel_node_is_an_address_or_a_clear_error(value: object) -> None:
    try:
        host, port = config.parse_host_port(value)
    except ValueError as exc:
        assert "HOST:PORT" in str(exc) or "out of range" in str(exc)
        return
    assert host and 1 <= port <= 65535


@given(st.ip_addresses() | st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z0-9-]{1,10}){0,3}", fullmatch=True),
       st.integers(1, 65535))
def test_a_sentinel_node_written_as_host_and_port_reads_back(host: object, port: int) -> None:
    text = f"[{host}]" if ":" in str(host) else str(host)
    assert config.parse_host_port(f"{text}:{port}") == (str(host), port)
