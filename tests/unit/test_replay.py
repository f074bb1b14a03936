"""`sluice replay`: access logs through the rules in virtual time."""

from __future__ import annotations

import gzip
import json
import logging
import re
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar import cli
from sidecar.accesslog import AccessLogs, LogError, UnparsableLine, parse_line
from sidecar.config import parse_rules_text
from sidecar.replay import (
    SweepError,
    build_sweep,
    parse_sweep,
    peak_histogram,
    percentile,
    prepare_sweeps,
    render_text,
    replay_logs,
)
from sidecar.replay.page import escape, render_html, threshold_position

from .conftest import ruleset_from

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]
T0 = 1709287200.0  # 2024-03-01T10:00:00Z


def combined(ip: str, t: float, path: str = "/", status: int = 200, method: str = "GET",
             agent: str = "test-agent", forwarded: str | None = None) -> str:
    stamp = datetime.fromtimestamp(t, UTC).strftime("%d/%b/%Y:%H:%M:%S +0000")
    line = f'{ip} - - [{stamp}] "{method} {path} HTTP/1.1" {status} 512 "-" "{agent}"'
    return line + f' "{forwarded}"' if forwarded is not None else line


def json_line(ip: str, t: float, path: str = "/", status: int = 200, **fields: str) -> str:
    return json.dumps({"remote_addr": ip, "msec": f"{t:.3f}", "request": f"GET {path} HTTP/1.1",
                       "status": str(status), **fields})


def in_time_order(lines: list[str]) -> list[str]:
    return sorted(lines, key=lambda line: parse_line(line).time)


def write_log(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def replay(tmp_path: Path, rules: str, lines: list[str], **kwargs) -> dict:
    return replay_logs(ruleset_from(rules), [write_log(tmp_path / "access.log", lines)], **kwargs)


def rule_of(report: dict, rule_id: str) -> dict:
    return next(rule for rule in report["rules"] if rule["id"] == rule_id)


def outcomes(rule: dict) -> dict:
    names = ("matched", "allowed", "observed", "blocked", "challenged", "banned", "ban_closed", "held",
             "not_reached")
    return {name: rule[name] for name in names if rule[name]}


# --------------------------------------------------------------------------
# Reading log lines
# --------------------------------------------------------------------------


def test_combined_line_becomes_the_request_nginx_would_have_described():
    entry = parse_line('203.0.113.7 - alice [01/Mar/2024:11:00:00 +0100] "POST /api/login?next=%2F HTTP/1.1" '
                       '401 17 "https://example.com/" "Mozilla/5.0 (X11)"')
    assert entry.time == T0  # the offset is honoured
    assert (entry.peer, entry.method, entry.uri, entry.status) == ("203.0.113.7", "POST", "/api/login?next=%2F", 401)
    assert entry.headers == {"referer": "https://example.com/", "user-agent": "Mozilla/5.0 (X11)"}
    assert entry.host == ""  # the combined format does not log it


def test_main_format_adds_x_forwarded_for_and_dashes_mean_absent():
    entry = parse_line('10.0.0.2 - - [01/Mar/2024:10:00:00 +0000] "GET / HTTP/1.0" 200 5 "-" "-" "192.0.2.1, 10.0.0.9"')
    assert entry.headers == {"x-forwarded-for": "192.0.2.1, 10.0.0.9"}


def test_nginx_escapes_are_decoded():
    entry = parse_line(r'192.0.2.1 - - [01/Mar/2024:10:00:00 +0000] "GET /caf\xC3\xA9 HTTP/1.1" 200 5 "-" '
                       r'"say \x22hi\x22"')
    assert entry.uri == "/café"
    assert entry.headers["user-agent"] == 'say "hi"'


def test_json_line_takes_nginx_variables_as_fields():
    entry = parse_line(json.dumps({
        "msec": "1709287200.250", "remote_addr": "2001:db8::1", "request_method": "GET",
        "request_uri": "/api/items?page=2", "host": "shop.example", "status": "200",
        "http_user_agent": "curl/8.5.0", "http_cookie": "session=abc", "http_x_api_key": "k1",
        "http_x_forwarded_for": "", "upstream_http_x_score": "150", "request_id": "f00d", "bytes_sent": 512,
    }))
    assert entry.time == T0 + 0.25
    assert (entry.peer, entry.method, entry.host, entry.uri, entry.status) == \
        ("2001:db8::1", "GET", "shop.example", "/api/items?page=2", 200)
    assert entry.headers == {"user-agent": "curl/8.5.0", "cookie": "session=abc", "x-api-key": "k1"}
    assert entry.response_headers == {"x-score": "150"}
    assert entry.request_id == "f00d"


@pytest.mark.parametrize("fields", [
    {"msec": 1709287200.0},
    {"time_iso8601": "2024-03-01T11:00:00+01:00"},
    {"time_local": "01/Mar/2024:05:00:00 -0500"},
    {"time_iso8601": "2024-03-01T10:00:00"},  # no offset: UTC
])
def test_json_time_fields_all_give_the_same_instant(fields):
    line = json.dumps({"remote_addr": "192.0.2.1", "request": "GET / HTTP/1.1", **fields})
    assert parse_line(line).time == T0


def test_json_host_falls_back_to_the_host_header_without_its_port():
    entry = parse_line(json.dumps({"remote_addr": "192.0.2.1", "msec": "1", "request": "GET / HTTP/1.1",
                                   "http_host": "example.com:8080"}))
    assert entry.host == "example.com"
    assert entry.status is None  # not logged: no response to report


@pytest.mark.parametrize(("line", "reason"), [
    ('198.51.100.9 - - [01/Mar/2024:10:00:10 +0000] "-" 400 0 "-" "-"', "no request line"),
    (r'198.51.100.9 - - [01/Mar/2024:10:00:11 +0000] "\x16\x03\x01\x02\x00\x01" 400 157 "-" "-"',
     "not an HTTP request line"),
    ('203.0.113.7 - - [01/Mar/2024:10:0', "not the combined format"),
    ('203.0.113.7 - - [31/Feb/2024:10:00:00 +0000] "GET / HTTP/1.1" 200 5 "-" "-"', "unreadable time"),
    ('203.0.113.7 - - [01/Mär/2024:10:00:00 +0000] "GET / HTTP/1.1" 200 5 "-" "-"', "unreadable time"),
    ('{"remote_addr": "192.0.2.1", "msec": "1", "request": "GET / HTTP/1.1"', "invalid JSON"),
    ('{"remote_addr": "192.0.2.1", "msec": "nan", "request": "GET / HTTP/1.1"}', "unreadable time"),
    ('["192.0.2.1"]', "not the combined format"),
    ('{"remote_addr": "192.0.2.1", "request": "GET / HTTP/1.1"}', "no time"),
    ('{"msec": "1", "request": "GET / HTTP/1.1"}', "no remote_addr"),
    ('{"remote_addr": "192.0.2.1", "msec": "1", "request_uri": "/"}', "no request"),
    ('{"remote_addr": "192.0.2.1", "msec": "1", "request": "-"}', "no request"),
    ("garbage", "not the combined format"),
])
def test_lines_that_are_not_requests_say_why(line, reason):
    with pytest.raises(UnparsableLine, match=reason):
        parse_line(line)


def test_skipped_lines_are_counted_with_their_line_numbers():
    with AccessLogs([str(DATA / "access.log")]) as logs:
        entries = list(logs)
    assert (logs.lines, len(entries), logs.skipped) == (42, 39, 3)
    assert [(s.line, s.reason) for s in logs.examples] == [
        (19, "no request line (the client sent none)"),
        (20, "not an HTTP request line"),
        (21, "not the combined format"),
    ]
    assert logs.late == 0  # line 18 is 1 s behind line 17: put back in order
    assert [e.time for e in entries] == sorted(e.time for e in entries)


def test_lines_out_of_order_beyond_the_window_are_replayed_late_and_counted(tmp_path):
    lines = [combined("192.0.2.1", T0 + t) for t in (0, 100, 200)]
    lines.insert(3, combined("192.0.2.2", T0 + 50))  # 150 s behind: 0 and 100 are gone by then
    lines.insert(1, combined("192.0.2.3", T0 - 5))  # 5 s behind: still put in its place
    with AccessLogs([write_log(tmp_path / "a.log", lines)]) as logs:
        entries = [(e.peer, e.time - T0) for e in logs]
    assert entries == [("192.0.2.3", -5), ("192.0.2.1", 0), ("192.0.2.1", 100), ("192.0.2.2", 100),
                       ("192.0.2.1", 200)]
    assert logs.late == 1


def test_several_logs_are_merged_by_time_whatever_their_order(tmp_path):
    older = write_log(tmp_path / "access.log.1", [combined("192.0.2.1", T0 + t) for t in range(0, 100, 10)])
    newer = tmp_path / "access.log.2.gz"
    with gzip.open(newer, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(combined("192.0.2.1", T0 + t) for t in range(100, 200, 10)) + "\n")
    with AccessLogs([str(newer), older]) as logs:
        times = [e.time - T0 for e in logs]
    assert times == list(range(0, 200, 10)) and logs.late == 0


def test_a_log_that_cannot_be_opened_is_an_error_before_anything_is_replayed(tmp_path):
    with pytest.raises(LogError, match="missing.log"):
        with AccessLogs([str(DATA / "access.log"), str(tmp_path / "missing.log")]):
            pass


# --------------------------------------------------------------------------
# Replaying
# --------------------------------------------------------------------------

TWO_PER_TEN = """
rules:
  - id: api
    key: [ip]
    limit: {requests: 2, per: 10s}
    action: block
"""


def test_an_hour_of_log_replays_at_once_with_exact_counts(tmp_path):
    # A: bursts of 5 every 20 s — 2 allowed, 3 blocked each (the penalty
    # ends before the next burst, in virtual time). B: one request every
    # 10 s, never over the limit.
    lines = []
    for start in range(0, 3600, 20):
        lines += [combined("192.0.2.1", T0 + start)] * 5
        lines += [combined("192.0.2.2", T0 + start + 5), combined("192.0.2.2", T0 + start + 15)]
    began = time.monotonic()
    report = replay(tmp_path, TWO_PER_TEN, lines)
    assert time.monotonic() - began < 10  # nothing waits for the log's time
    assert report["seconds"] == 3595 and report["requests"] == 1260
    api = rule_of(report, "api")
    assert outcomes(api) == {"matched": 1260, "allowed": 720, "blocked": 540}
    assert report["answers"] == {"allowed": 720, "observed": 0, "held": 0, "exempt": 0, "denied": 540,
                                 "challenged": 0, "closed": 0, "closed_by_ban": 0}
    assert api["top_over_limit"] == [
        {"key": "ip=192.0.2.1", "requests": 900, "over_limit": 540, "peak": 5, "user_agents": 1}]
    assert [k["key"] for k in api["top_requests"]] == ["ip=192.0.2.1", "ip=192.0.2.2"]
    assert api["keys"] == 2 and api["peak"] == {"p50": 1, "p95": 5, "p99": 5, "max": 5}


BAN = """
rules:
  - id: scrapers
    match: {path: {prefix: /scrape}}
    key: [ip]
    limit: {requests: 3, per: 60s}
    action: ban
    ban: {duration: 5m}
"""


def test_bans_close_the_trigger_and_later_requests_and_expire_in_virtual_time(tmp_path):
    # 192.0.2.1 sends a request every 5 s for 20 minutes, every other one to
    # /scrape. /scrape at 0, 10, 20 reach the threshold; the one at 30 bans
    # the address for 300 s; every request until 330 is closed, whatever its
    # path; then counting starts afresh: bans at 30, 360, 690 and 1020.
    lines = [combined("192.0.2.1", T0 + t, "/scrape" if t % 10 == 0 else "/other") for t in range(0, 1200, 5)]
    lines += [combined("192.0.2.9", T0 + t, "/scrape") for t in range(0, 1200, 60)]  # never banned
    report = replay(tmp_path, BAN, in_time_order(lines))
    assert outcomes(rule_of(report, "scrapers")) == {
        "matched": 140, "allowed": 12 + 20, "banned": 4, "ban_closed": 3 * 59 + 35, "not_reached": 104}
    assert report["answers"] == {"allowed": 24 + 20, "observed": 0, "held": 0, "exempt": 0, "denied": 0,
                                 "challenged": 0, "closed": 4 + 212, "closed_by_ban": 212}


def test_observe_rules_let_over_limit_requests_through_and_count_them(tmp_path):
    rules = TWO_PER_TEN.replace("action: block", "action: log")
    report = replay(tmp_path, rules, [combined("192.0.2.1", T0)] * 5)
    assert outcomes(rule_of(report, "api")) == {"matched": 5, "allowed": 2, "observed": 3}
    assert report["answers"]["allowed"] == 5 and report["answers"]["observed"] == 3


def test_a_blocking_rule_ends_evaluation_so_later_rules_are_not_reached(tmp_path):
    rules = TWO_PER_TEN + """
  - id: watch
    key: [ip]
    limit: {requests: 100, per: 60s}
    action: log
"""
    report = replay(tmp_path, rules, [combined("192.0.2.1", T0)] * 5)
    assert outcomes(rule_of(report, "api")) == {"matched": 5, "allowed": 2, "blocked": 3}
    assert outcomes(rule_of(report, "watch")) == {"matched": 5, "allowed": 2, "not_reached": 3}


def test_challenges_and_their_auto_ban_are_told_apart_from_blocks(tmp_path):
    rules = "challenge: {auto_ban: {challenges: 2, per: 60s, ban: 5m}}\n" + \
        TWO_PER_TEN.replace("action: block", "action: challenge")
    report = replay(tmp_path, rules, [combined("192.0.2.1", T0)] * 6)
    # 2 allowed, 2 challenge pages, the 3rd challenge is a ban instead.
    assert outcomes(rule_of(report, "api")) == {
        "matched": 6, "allowed": 2, "challenged": 2, "banned": 1, "ban_closed": 1, "not_reached": 1}
    assert report["answers"]["denied"] == report["answers"]["challenged"] == 2


LOGIN = """
rules:
  - id: login
    match: {path: {equals: /api/login}}
    key: [ip]
    limit: {requests: 2, per: 60s}
    count_on: {status: [401]}
    action: block
  - id: cost
    match: {path: {prefix: /api/search}}
    key: [ip]
    limit: {score: 400, per: 60s, header: x-score}
    action: block
"""


def test_response_phase_rules_are_fed_the_logged_statuses(tmp_path):
    # The worked example: 401, 200, 401 pass; the 4th is refused.
    lines = [json_line("192.0.2.1", T0 + i, "/api/login", status) for i, status in enumerate((401, 200, 401, 200))]
    login = rule_of(replay(tmp_path, LOGIN, lines), "login")
    assert outcomes(login) == {"matched": 4, "allowed": 3, "blocked": 1}
    assert login["responses_counted"] == 2
    assert login["peak_unit"] == "counted responses per 1m" and login["peak"]["max"] == 2


def test_score_budgets_are_fed_the_logged_upstream_score(tmp_path):
    # Scores 100, 200, 150 (450 > 400): the 4th request is refused.
    lines = [json_line("192.0.2.1", T0 + i, "/api/search", upstream_http_x_score=score)
             for i, score in enumerate(("100", "200", "150", "10"))]
    cost = rule_of(replay(tmp_path, LOGIN, lines), "cost")
    assert outcomes(cost) == {"matched": 4, "allowed": 3, "blocked": 1}
    assert cost["peak"]["max"] == 460  # the demand, refused request included


def test_responses_without_a_logged_status_are_not_counted(tmp_path):
    lines = [json.dumps({"remote_addr": "192.0.2.1", "msec": str(T0 + i), "request": "GET /api/login HTTP/1.1"})
             for i in range(5)]
    report = replay(tmp_path, LOGIN, lines)
    assert outcomes(rule_of(report, "login")) == {"matched": 5, "allowed": 5}
    assert report["responses_without_status"] == 5


def test_leaky_bucket_holds_are_counted_not_waited(tmp_path):
    rules = """
rules:
  - id: like-nginx
    key: [ip]
    limit: {rate: 1r/s, burst: 5}
    action: block
"""
    began = time.monotonic()
    report = replay(tmp_path, rules, [json_line("192.0.2.1", T0)] * 8)
    assert time.monotonic() - began < 5
    bucket = rule_of(report, "like-nginx")
    # nginx: the first passes, the next 5 wait 1..5 s, the rest are refused.
    assert outcomes(bucket) == {"matched": 8, "allowed": 6, "held": 5, "blocked": 2}
    assert bucket["longest_hold_seconds"] == 5.0
    assert report["answers"]["held"] == 5


def test_clients_behind_trusted_proxies_are_found_in_x_forwarded_for(tmp_path):
    rules = "client_ip: {trusted_proxies: [10.0.0.0/8]}\n" + TWO_PER_TEN
    lines = [combined("10.0.0.1", T0, forwarded="192.0.2.1"), combined("10.0.0.1", T0, forwarded="192.0.2.2"),
             combined("203.0.113.5", T0, forwarded="192.0.2.3")]  # not a proxy: its header is ignored
    report = replay(tmp_path, rules, lines)
    assert sorted(k["key"] for k in rule_of(report, "api")["top_requests"]) == \
        ["ip=192.0.2.1", "ip=192.0.2.2", "ip=203.0.113.5"]


def test_exempt_addresses_are_allowed_and_match_no_rule(tmp_path):
    report = replay(tmp_path, "exempt: [192.0.2.0/24]\n" + TWO_PER_TEN, [combined("192.0.2.1", T0)] * 5)
    assert report["answers"]["exempt"] == 5 and report["answers"]["allowed"] == 5
    assert rule_of(report, "api")["matched"] == 0 and rule_of(report, "api")["peak"] is None


def test_host_rules_match_combined_logs_given_a_host(tmp_path):
    rules = TWO_PER_TEN.replace("key: [ip]", "match: {host: {equals: shop.example}}\n    key: [ip]")
    lines = [combined("192.0.2.1", T0)] * 3
    assert rule_of(replay(tmp_path, rules, lines), "api")["matched"] == 0
    assert rule_of(replay(tmp_path, rules, lines, default_host="shop.example"), "api")["blocked"] == 1


def test_distinct_user_agents_per_key_are_counted_up_to_ten(tmp_path):
    lines = [combined("192.0.2.1", T0 + i, agent=f"agent-{i % 12}") for i in range(24)]
    lines += [combined("192.0.2.2", T0 + i, agent="same") for i in range(3)]
    keys = rule_of(replay(tmp_path, TWO_PER_TEN, lines), "api")["top_requests"]
    assert [(k["key"], k["user_agents"]) for k in keys] == [("ip=192.0.2.1", 10), ("ip=192.0.2.2", 1)]


# --------------------------------------------------------------------------
# Peaks and percentiles
# --------------------------------------------------------------------------


def test_percentiles_are_nearest_rank():
    values = list(range(1, 101))
    assert [percentile(values, p) for p in (50, 95, 99, 100)] == [50, 95, 99, 100]
    assert [percentile([7], p) for p in (50, 99)] == [7, 7]
    assert [percentile([1, 2], p) for p in (50, 95)] == [1, 2]


WATCH = """
rules:
  - id: watch
    key: [ip]
    limit: {requests: 1000, per: 10s}
    action: log
"""


def test_a_keys_peak_is_its_most_requests_in_any_window_of_the_period(tmp_path):
    # Windows are (t - 10 s, t]: 0, 5 and 9.9 share one; so do 5, 9.9 and 10;
    # 10 and 20 do not.
    lines = [json_line("192.0.2.1", T0 + t) for t in (0, 5, 9.9, 10, 19.95)]
    lines += [json_line("192.0.2.2", T0 + t) for t in (0, 10, 20, 30)]
    keys = rule_of(replay(tmp_path, WATCH, in_time_order(lines)), "watch")["top_requests"]
    assert {k["key"]: k["peak"] for k in keys} == {"ip=192.0.2.1": 3, "ip=192.0.2.2": 1}


def test_peak_percentiles_across_keys_on_a_known_distribution(tmp_path):
    # Key k sends k requests in one second (k = 1..100), then nothing.
    lines = [json_line(f"198.51.100.{k}", T0 + k * 20 + i / 1000) for k in range(1, 101) for i in range(k)]
    watch = rule_of(replay(tmp_path, WATCH, lines), "watch")
    assert watch["keys"] == 100
    assert watch["peak"] == {"p50": 50, "p95": 95, "p99": 99, "max": 100}
    assert watch["peak_unit"] == "requests per 10s"


# --------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------


def sluice_replay(*args: str, cwd: Path = REPO, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", "replay", *args], cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_the_command_in_process_gives_the_sluice_logger_back_as_it_was():
    """It quiets the engine's warnings for its run only (in a test process,
    or any caller of the command, the logger is left as it was found)."""
    logger = logging.getLogger("sluice")
    before = logger.level
    logger.setLevel(logging.INFO)
    try:
        result = CliRunner().invoke(cli.main, ["replay", "--config", str(DATA / "replay-rules.yaml"),
                                               str(DATA / "access.log")])
        assert result.exit_code == 0, result.output
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(before)


def test_command_prints_a_readable_report():
    result = sluice_replay("--config", "tests/unit/data/replay-rules.yaml", "tests/unit/data/access.log")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("replayed 39 requests from 42 lines of 1 log, 2024-03-01T10:00:00Z to ")
    assert "tests/unit/data/access.log:19: no request line" in out
    assert "api: block, key ip, 5 per 10s (sliding window)" in out
    assert "peak requests per 10s per key, over 2 keys: P50 2, P95 12, P99 12, max 12" in out
    assert "ip=192.0.2.44" in out  # the client behind the trusted proxy 10.0.0.2


def test_command_prints_json_on_request(tmp_path):
    log = write_log(tmp_path / "a.log", [combined("192.0.2.1", T0)] * 3)
    (tmp_path / "rules.yaml").write_text(TWO_PER_TEN, encoding="utf-8")
    result = sluice_replay("--config", "rules.yaml", "--json", log, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert outcomes(rule_of(report, "api")) == {"matched": 3, "allowed": 2, "blocked": 1}


def test_command_reads_standard_input(tmp_path):
    (tmp_path / "rules.yaml").write_text(TWO_PER_TEN, encoding="utf-8")
    result = sluice_replay("--config", "rules.yaml", "--json", "-", cwd=tmp_path,
                           stdin="\n".join([combined("192.0.2.1", T0)] * 4) + "\n")
    assert result.returncode == 0, result.stderr
    assert rule_of(json.loads(result.stdout), "api")["blocked"] == 2


def test_command_exits_1_with_file_line_errors_for_a_bad_rules_file(tmp_path):
    (tmp_path / "rules.yaml").write_text(TWO_PER_TEN.replace("per: 10s", "per: 10 seconds"), encoding="utf-8")
    log = write_log(tmp_path / "a.log", [combined("192.0.2.1", T0)])
    result = sluice_replay("--config", "rules.yaml", log, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "rules.yaml:5: rules[0](api).limit.per: expected a duration like '10s', got '10 seconds'"]
    assert result.stdout == ""


@pytest.mark.parametrize("log", ["missing.log", "."])
def test_command_exits_2_for_a_log_it_cannot_read(tmp_path, log):
    (tmp_path / "rules.yaml").write_text(TWO_PER_TEN, encoding="utf-8")
    result = sluice_replay("--config", "rules.yaml", log, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: cannot read {log}: ")
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize("content", [
    b"not gzip at all\n",
    # truncated:
    gzip.compress("\n".join(combined(f"192.0.2.{i % 250}", T0 + i) for i in range(2000)).encode())[:2000],
])
def test_command_exits_2_for_a_corrupt_gzip_log(tmp_path, content):
    (tmp_path / "rules.yaml").write_text(TWO_PER_TEN, encoding="utf-8")
    (tmp_path / "a.log.gz").write_bytes(content)
    result = sluice_replay("--config", "rules.yaml", "a.log.gz", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("error: cannot read a.log.gz: ")


# --------------------------------------------------------------------------
# Whom a rule refused
# --------------------------------------------------------------------------


def one_window(tmp_path: Path, rules: str, **kwargs) -> dict:
    """All at one instant, so that a limit of N lets each key's first N
    through: 192.0.2.1 sends 5, 192.0.2.3 sends 6 with a browser each (a
    shared NAT), 192.0.2.2 and 192.0.2.4 one each."""
    lines = [combined("192.0.2.1", T0)] * 5 + [combined("192.0.2.2", T0)]
    lines += [combined("192.0.2.3", T0, agent=f"browser-{i}") for i in range(6)] + [combined("192.0.2.4", T0)]
    return replay(tmp_path, rules, lines, **kwargs)


def test_the_keys_a_rule_refused_are_counted_with_their_share_and_how_many_look_shared(tmp_path):
    report = one_window(tmp_path, TWO_PER_TEN)
    api = rule_of(report, "api")
    assert (api["refused_requests"], api["refused_keys"], api["refused_keys_share"], api["refused_shared_keys"]) \
        == (3 + 4, 2, 0.5, 1)
    assert api["refuses"] is True and api["keys"] == 4
    assert "  refused: 7 requests from 2 of 4 keys (50.0%), 1 of them with 5+ user agents (a shared NAT?)" \
        in render_text(report).splitlines()


def test_a_log_rule_reports_whom_it_let_through_over_its_limit(tmp_path):
    report = one_window(tmp_path, TWO_PER_TEN.replace("action: block", "action: log"))
    api = rule_of(report, "api")
    assert api["refuses"] is False and api["observed"] == 7
    assert (api["refused_requests"], api["refused_keys"], api["refused_shared_keys"]) == (7, 2, 1)
    assert "  over the limit, let through (action log): 7 requests from 2 of 4 keys (50.0%), 1 of them with " \
        "5+ user agents (a shared NAT?)" in render_text(report).splitlines()


def test_a_ban_rule_refused_the_trigger_and_every_request_its_bans_closed(tmp_path):
    lines = [combined("192.0.2.1", T0 + t, "/scrape" if t % 10 == 0 else "/other") for t in range(0, 1200, 5)]
    lines += [combined("192.0.2.9", T0 + t, "/scrape") for t in range(0, 1200, 60)]
    scrapers = rule_of(replay(tmp_path, BAN, in_time_order(lines)), "scrapers")
    assert (scrapers["refused_requests"], scrapers["refused_keys"], scrapers["refused_keys_share"]) == \
        (4 + 212, 1, 0.5)


def test_a_rule_that_refused_nobody_says_so(tmp_path):
    report = replay(tmp_path, TWO_PER_TEN, [combined("192.0.2.1", T0)])
    assert rule_of(report, "api")["refused_keys"] == 0
    assert "  refused: none" in render_text(report).splitlines()


# --------------------------------------------------------------------------
# Rules not reached, and why
# --------------------------------------------------------------------------


def test_a_rule_not_reached_names_the_earlier_rule_that_refused_first(tmp_path):
    rules = TWO_PER_TEN + """
  - id: watch
    key: [ip]
    limit: {requests: 100, per: 60s}
    action: log
"""
    report = replay(tmp_path, rules, [combined("192.0.2.1", T0)] * 5 + [combined("192.0.2.2", T0)] * 3)
    assert rule_of(report, "watch")["not_reached_because"] == [{"rule": "api", "by": "refused", "requests": 4}]
    assert rule_of(report, "api")["not_reached_because"] == []
    assert "`watch` was not reached for 4 requests because `api` refused them first" in render_text(report)


def test_requests_closed_by_a_ban_are_not_reached_because_of_the_ban(tmp_path):
    lines = [combined("192.0.2.1", T0 + t, "/scrape" if t % 10 == 0 else "/other") for t in range(0, 1200, 5)]
    report = replay(tmp_path, BAN, lines)
    assert rule_of(report, "scrapers")["not_reached_because"] == [
        {"rule": "scrapers", "by": "ban", "requests": 104}]
    assert "`scrapers` was not reached for 104 requests because a ban by `scrapers` closed them first" \
        in render_text(report)


def test_one_request_not_reached_is_said_in_the_singular(tmp_path):
    rules = TWO_PER_TEN + "\n  - id: watch\n    key: [ip]\n    limit: {requests: 100, per: 60s}\n    action: log\n"
    text = render_text(replay(tmp_path, rules, [combined("192.0.2.1", T0)] * 3))
    assert "`watch` was not reached for 1 request because `api` refused it first" in text


# --------------------------------------------------------------------------
# Percentiles without the heaviest keys, and the histogram
# --------------------------------------------------------------------------


def known_distribution() -> list[str]:
    """Key k sends k requests in one second (k = 1..100)."""
    return [json_line(f"198.51.100.{k}", T0 + k * 20 + i / 1000) for k in range(1, 101) for i in range(k)]


@pytest.mark.parametrize(("excluded", "expected", "line"), [
    (1, {"p50": 50, "p95": 95, "p99": 99, "max": 99}, "without the 1 heaviest key: P50 50, P95 95, P99 99, max 99"),
    (5, {"p50": 48, "p95": 91, "p99": 95, "max": 95}, "without the 5 heaviest keys: P50 48, P95 91, P99 95, max 95"),
    (100, None, "without the 100 heaviest keys: no key left"),
])
def test_percentiles_without_the_heaviest_keys(tmp_path, excluded, expected, line):
    report = replay(tmp_path, WATCH, known_distribution(), exclude_top=excluded)
    watch = rule_of(report, "watch")
    assert watch["peak"] == {"p50": 50, "p95": 95, "p99": 99, "max": 100}  # all of them, as before
    assert watch["peak_without_top"] == expected
    assert report["exclude_top"] == excluded
    assert "  " + line in render_text(report).splitlines()


def test_without_exclude_top_there_is_no_second_line_of_percentiles(tmp_path):
    report = replay(tmp_path, WATCH, known_distribution())
    assert rule_of(report, "watch")["peak_without_top"] is None
    assert "heaviest" not in render_text(report)


def test_peaks_are_counted_in_buckets_that_double():
    assert peak_histogram([1, 2, 3, 5, 12]) == [
        {"low": 1, "high": 1, "keys": 1}, {"low": 2, "high": 3, "keys": 2},
        {"low": 4, "high": 7, "keys": 1}, {"low": 8, "high": 15, "keys": 1}]
    assert peak_histogram([0, 0, 40]) == [
        {"low": 0, "high": 0, "keys": 2}, {"low": 1, "high": 1, "keys": 0}, {"low": 2, "high": 3, "keys": 0},
        {"low": 4, "high": 7, "keys": 0}, {"low": 8, "high": 15, "keys": 0}, {"low": 16, "high": 31, "keys": 0},
        {"low": 32, "high": 63, "keys": 1}]
    assert peak_histogram([]) == []


def test_a_threshold_line_falls_between_its_value_and_the_next():
    # Bucket b spans [b, b+1): 0 | 1 | 2-3 | 4-7 | 8-15.
    assert [threshold_position(t) for t in (0, 1, 2, 3, 5, 7, 8)] == [1, 2, 2.5, 3, 3.5, 4, 4.125]


def test_the_report_has_the_histogram_of_each_rule(tmp_path):
    histogram = rule_of(replay(tmp_path, WATCH, known_distribution()), "watch")["peak_histogram"]
    assert [bucket["keys"] for bucket in histogram] == [1, 2, 4, 8, 16, 32, 37]  # 1, 2-3, ..., 64-127 (64..100)


# --------------------------------------------------------------------------
# Threshold sweeps
# --------------------------------------------------------------------------


def sweeps_for(rules: str, *options: str) -> list:
    loaded = parse_rules_text(rules, "test.yaml", Path.cwd())
    return [build_sweep(loaded, *parse_sweep(option)) for option in options]


def test_a_sweep_replays_each_threshold_and_says_whom_each_would_refuse(tmp_path):
    report = one_window(tmp_path, TWO_PER_TEN, sweeps=sweeps_for(TWO_PER_TEN, "api=6,1,3,2"))
    sweep = rule_of(report, "api")["sweep"]
    assert sweep["field"] == "limit.requests" and sweep["current"] == 2
    assert [(c["threshold"], c["refused_requests"], c["refused_keys"], c["refused_keys_share"],
             c["refused_shared_keys"]) for c in sweep["candidates"]] == [
        (1, 4 + 5, 2, 0.5, 1),
        (2, 3 + 4, 2, 0.5, 1),
        (3, 2 + 3, 2, 0.5, 1),
        (6, 0, 0, 0.0, 0)]
    # The replay without the sweep is the same as before.
    assert rule_of(report, "api")["refused_requests"] == 7
    text = render_text(report).splitlines()
    at = text.index("  sweep of limit.requests (now 2), what each would refuse:")
    assert text[at + 1:at + 6] == [
        "    limit.requests  refused requests  refused keys  share of keys  of them 5+ user agents",
        "    1                              9             2          50.0%                       1",
        "    2 (now)                        7             2          50.0%                       1",
        "    3                              5             2          50.0%                       1",
        "    6                              0             0           0.0%                       0"]


def test_a_sweep_is_exactly_a_replay_with_the_rule_changed(tmp_path):
    # The sample log, where `api` refusing first hides requests from
    # `scrapers` and `per-ip`: each candidate must give what a rules file
    # with that number gives, for the swept rule.
    rules = (REPO / "examples" / "replay.yaml").read_text(encoding="utf-8")
    log = [str(REPO / "examples" / "access.log.sample")]
    report = replay_logs(ruleset_from(rules), log, sweeps=sweeps_for(rules, "api=10,50", "scrapers=30,60"))
    fields = ("refused_requests", "refused_keys", "refused_keys_share", "refused_shared_keys")
    for rule_id, old, _candidates in (("api", "requests: 20", (10, 50)), ("scrapers", "requests: 100", (30, 60))):
        for candidate in rule_of(report, rule_id)["sweep"]["candidates"]:
            at = rules.index(f"id: {rule_id}")
            changed = rules[:at] + rules[at:].replace(old, f"requests: {candidate['threshold']}", 1)
            alone = rule_of(replay_logs(ruleset_from(changed), log), rule_id)
            assert {f: candidate[f] for f in fields} == {f: alone[f] for f in fields}, (rule_id, candidate)
    assert rule_of(report, "scrapers")["sweep"]["candidates"][0]["refused_requests"] > 0


def test_a_sweep_of_a_token_bucket_sets_its_tokens(tmp_path):
    rules = "rules:\n  - id: bucket\n    key: [ip]\n    limit: {tokens: 3, refill: 1/m}\n    action: block\n"
    report = replay(tmp_path, rules, [combined("192.0.2.1", T0)] * 10, sweeps=sweeps_for(rules, "bucket=5,3"))
    sweep = rule_of(report, "bucket")["sweep"]
    assert sweep["field"] == "limit.tokens"
    assert [(c["threshold"], c["refused_requests"]) for c in sweep["candidates"]] == [(3, 7), (5, 5)]


KINDS = """
rules:
  - {id: window, key: [ip], limit: {requests: 5, per: 10s}, action: block}
  - {id: score, key: [ip], limit: {score: 100, per: 1m, header: x-score}, action: block}
  - {id: tokens, key: [ip], limit: {tokens: 10, refill: 1/s, cost: 3}, action: block}
  - {id: leaky, key: [ip], limit: {rate: 1r/s, burst: 5}, action: block}
  - {id: slots, key: [ip], limit: {concurrent: 2}, action: block}
"""


@pytest.mark.parametrize(("option", "field", "current"), [
    ("window=0", "requests", 5), ("score=1", "score", 100), ("tokens=3", "tokens", 10),
    ("leaky=0", "burst", 5), ("slots=1", "concurrent", 2)])
def test_each_kind_of_limit_is_swept_by_the_field_that_holds_its_threshold(option, field, current):
    (sweep,) = sweeps_for(KINDS, option)
    assert (sweep.field, sweep.current, len(sweep.rulesets)) == (field, current, 1)


@pytest.mark.parametrize(("option", "message"), [
    ("score=0", "score: limit.score is at least 1, got 0"),
    ("tokens=2,5", "tokens: limit.tokens is at least 3, got 2"),
    ("slots=0", "slots: limit.concurrent is at least 1, got 0"),
    ("windwo=5", "no rule 'windwo' in test.yaml (did you mean 'window'?)"),
    ("nothing=5", "no rule 'nothing' in test.yaml"),
])
def test_a_sweep_the_rule_cannot_take_is_refused_in_words(option, message):
    with pytest.raises(SweepError) as caught:
        sweeps_for(KINDS, option)
    assert str(caught.value) == message


def test_one_rule_is_swept_by_one_option():
    with pytest.raises(SweepError, match=r"^window is swept twice: give all its thresholds in one --sweep"):
        prepare_sweeps("unused.yaml", [("window", (1,)), ("window", (2,))])


@pytest.mark.parametrize(("text", "expected"), [
    ("api=5,10,20,50", ("api", (5, 10, 20, 50))),
    ("api-anon=50, 5 ,20,5", ("api-anon", (5, 20, 50))),
    (" login.v2=0 ", ("login.v2", (0,))),
])
def test_sweep_options_parse(text, expected):
    assert parse_sweep(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("api", "expected RULE=N,N,... (like api=5,10,20), got 'api'"),
    ("=5", "expected RULE=N,N,... (like api=5,10,20), got '=5'"),
    ("a pi=5", "expected RULE=N,N,... (like api=5,10,20), got 'a pi=5'"),
    ("api=", "api: no thresholds after '=': give some, like api=5,10,20"),
    ("api=5,,10", "api: thresholds are whole numbers from 0 to 999999999 separated by commas, got an empty one"),
    ("api=-1", "api: thresholds are whole numbers from 0 to 999999999 separated by commas, got '-1'"),
    ("api=1.5", "api: thresholds are whole numbers from 0 to 999999999 separated by commas, got '1.5'"),
    ("api=1e3", "api: thresholds are whole numbers from 0 to 999999999 separated by commas, got '1e3'"),
    ("api=\u0663", "api: thresholds are whole numbers from 0 to 999999999 separated by commas, got '\u0663'"),
    ("api=1000000000", "api: thresholds are whole numbers from 0 to 999999999 separated by commas, "
                       "got '1000000000'"),
    ("api=" + ",".join(str(n) for n in range(21)), "api: at most 20 thresholds (each replays the whole log), got 21"),
])
def test_bad_sweep_options_are_refused_in_words(text, message):
    with pytest.raises(SweepError) as caught:
        parse_sweep(text)
    assert str(caught.value) == message


RULE_IDS = st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True)


@given(RULE_IDS, st.lists(st.integers(0, 999_999_999), min_size=1, max_size=20),
       st.sampled_from([",", ", ", " , "]))
def test_any_valid_sweep_option_parses_to_its_rule_and_sorted_thresholds(rule_id, values, separator):
    text = f"{rule_id}={separator.join(str(v) for v in values)}"
    assert parse_sweep(text) == (rule_id, tuple(sorted(set(values))))


@settings(max_examples=300)
@given(st.text(max_size=60) | st.builds(lambda rule, rest: f"{rule}={rest}", RULE_IDS, st.text(max_size=30)))
def test_any_sweep_option_parses_or_is_refused_with_one_line_of_words(text):
    try:
        rule_id, values = parse_sweep(text)
    except SweepError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        assert re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", rule_id)
        assert 1 <= len(values) <= 20 and list(values) == sorted(set(values))
        assert all(0 <= value <= 999_999_999 for value in values)


def invoke_replay(*args: str):
    """``sluice replay`` in this process (the command quiets the "sluice"
    logger for its run; other tests need it back)."""
    logger = logging.getLogger("sluice")
    level = logger.level
    try:
        return CliRunner().invoke(cli.main, ["replay", *args])
    finally:
        logger.setLevel(level)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40) | st.builds(lambda rule, rest: f"{rule}={rest}",
                                        st.sampled_from(["api", "per-ip", "nope"]), st.text(max_size=20)))
def test_the_command_answers_any_sweep_option_with_a_report_or_a_usage_error(text):
    result = invoke_replay("--config", str(DATA / "replay-rules.yaml"), "--sweep", text, str(DATA / "access.log"))
    assert result.exit_code in (0, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    if result.exit_code == 2:
        assert "Invalid value for '--sweep'" in result.output


def test_command_prints_the_new_figures_in_json(tmp_path):
    result = invoke_replay("--config", str(DATA / "replay-rules.yaml"), "--json", "--exclude-top", "1",
                           "--sweep", "api=1,20", str(DATA / "access.log"))
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    api = rule_of(report, "api")
    assert report["exclude_top"] == 1 and report["shared_agents"] == 5
    assert api["peak_without_top"] == {"p50": 2, "p95": 2, "p99": 2, "max": 2}
    assert (api["refused_requests"], api["refused_keys"], api["refused_keys_share"]) == (15, 1, 0.5)
    assert api["peak_histogram"] == [{"low": 2, "high": 3, "keys": 1}, {"low": 4, "high": 7, "keys": 0},
                                     {"low": 8, "high": 15, "keys": 1}]
    assert [(c["threshold"], c["refused_keys"]) for c in api["sweep"]["candidates"]] == [(1, 2), (20, 0)]
    assert rule_of(report, "per-ip")["not_reached_because"] == [
        {"rule": "api", "by": "refused", "requests": 15}, {"rule": "login-failures", "by": "refused", "requests": 1}]


# --------------------------------------------------------------------------
# The HTML report
# --------------------------------------------------------------------------


def test_command_writes_the_html_report_besides_the_text(tmp_path):
    page = tmp_path / "report.html"
    result = invoke_replay("--config", str(DATA / "replay-rules.yaml"), "--sweep", "api=2,5", "--html", str(page),
                           str(DATA / "access.log"))
    assert result.exit_code == 0, result.output
    assert result.output.startswith("replayed 39 requests")
    html = page.read_text(encoding="utf-8")
    assert html.count('<section class="rule"') == 3 and html.count("<svg") == 3
    assert '<p class="refused">refused: 15 requests from 1 of 2 keys (50.0%), 0 of them with 5+ user agents ' \
        "(a shared NAT?)</p>" in html


def test_command_exits_2_when_the_html_report_cannot_be_written(tmp_path):
    result = invoke_replay("--config", str(DATA / "replay-rules.yaml"), "--html", str(tmp_path / "no" / "r.html"),
                           str(DATA / "access.log"))
    assert result.exit_code == 2
    assert f"error: cannot write {tmp_path / 'no' / 'r.html'}: No such file or directory" in result.output


def test_log_text_in_the_page_is_escaped(tmp_path):
    rules = "rules:\n  - id: paths\n    key: [path, header:user-agent]\n    limit: {requests: 1, per: 10s}\n" \
            "    action: block\n"
    line = json.dumps({"remote_addr": "192.0.2.1", "msec": str(T0), "request_method": "GET",
                       "request_uri": "/<script>alert(1)</script>", "http_user_agent": "\"><img src=x onerror=y>"})
    html = render_html(replay(tmp_path, rules, [line, line, "<script>not a log line</script>"]))
    assert "<script" not in html.lower() and "<img" not in html.lower()
    assert "header:user-agent=&quot;&gt;&lt;img src=x onerror=y&gt; path=/&lt;script&gt;alert(1)&lt;/script&gt;" \
        in html
    assert "&lt;script&gt;not a log line&lt;/script&gt;" in html


def test_unprintable_characters_and_lone_surrogates_are_replaced():
    assert escape("a\x00b\x1bc\ud800d\te\nf") == "a\ufffdb\ufffdc\ufffdd\te\nf"
    assert escape("<'\"&>") == "&lt;&#x27;&quot;&amp;&gt;"


def test_lone_surrogates_from_json_escapes_are_printed_as_replacement_characters(tmp_path):
    rules = "rules:\n  - id: paths\n    key: [path]\n    limit: {requests: 1, per: 10s}\n    action: block\n"
    log = write_log(tmp_path / "a.log", ['{"remote_addr": "192.0.2.1", "msec": "1", "request": "GET /a\\ud800b"}'])
    (tmp_path / "rules.yaml").write_text(rules, encoding="utf-8")
    result = sluice_replay("--config", "rules.yaml", "--html", "r.html", log, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "path=/a\ufffdb" in result.stdout and "path=/a\ufffdb" in (tmp_path / "r.html").read_text()


class Markup(HTMLParser):
    """The tags and attribute names of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.attributes: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.attributes.update(name for name, _ in attrs)


PAGE_TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "ul", "li", "code", "table",
             "thead", "tbody", "tr", "th", "td", "section", "figure", "figcaption", "svg", "line", "rect", "text"}
PAGE_ATTRIBUTES = {"lang", "charset", "http-equiv", "content", "name", "class", "id", "data-rule", "xmlns",
                   "viewbox", "width", "height", "role", "aria-label", "x", "y", "x1", "y1", "x2", "y2",
                   "text-anchor"}
FUZZ_RULES = ruleset_from("""
rules:
  - id: paths
    key: [path, header:user-agent]
    limit: {requests: 1, per: 10s}
    action: block
  - id: hosts
    key: [host, header:x-api-key]
    limit: {requests: 1, per: 10s}
    action: log
""")
MARKUP = st.sampled_from(["<script>", "</script>", "<SCRIPT SRC=//x>", "<scr<script>ipt>", "<img src=x onerror=a>",
                          '"><svg onload=a>', "&lt;script&gt;", "<!--", "]]>", "<style>", "\\x3cscript", "\u0000",
                          "\ud800", "\u2028", "`"])
FIELD = st.lists(MARKUP | st.text(max_size=8), max_size=4).map("".join)


def json_entry(uri: str, agent: str, host: str, key: str) -> str:
    return json.dumps({"remote_addr": "192.0.2.1", "msec": str(T0), "request_method": "GET", "request_uri": uri,
                       "http_user_agent": agent, "host": host, "http_x_api_key": key})


LOG_LINES = st.lists(st.builds(json_entry, FIELD, FIELD, FIELD, FIELD) | FIELD
                     | st.builds(lambda path, agent: combined("192.0.2.1", T0, path=path, agent=agent), FIELD, FIELD),
                     min_size=1, max_size=6)


# Each example replays a log: slow on a loaded machine, which is no failure.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(LOG_LINES)
def test_no_markup_from_any_log_line_reaches_the_page(lines):
    with tempfile.TemporaryDirectory() as folder:
        # A lone surrogate in a raw line is written as the invalid UTF-8 it
        # stands for (a JSON line carries it as an escape).
        log = Path(folder) / "access.log"
        log.write_bytes("".join(line.replace("\n", " ").replace("\r", " ") + "\n" for line in lines)
                        .encode("utf-8", "surrogatepass"))
        page = render_html(replay_logs(FUZZ_RULES, [str(log)], top=10))
    assert "<script" not in page.lower()
    markup = Markup()
    markup.feed(page)
    assert markup.tags <= PAGE_TAGS and markup.attributes <= PAGE_ATTRIBUTES
    assert not any(_ in page for _ in ("\ud800", "\x00"))
    page.encode("utf-8")  # writable as it is


def replay_examples() -> list[tuple[str, list[str], list[str]]]:
    """Each `sluice replay` session of the docs' replay page: (its first
    line, the command's arguments, the output lines it shows)."""
    page = (REPO / "docs" / "replay.md").read_text(encoding="utf-8")
    examples = []
    for block in re.findall(r"```console\n(.*?)```", page, re.DOTALL):
        lines = block.splitlines()
        if not re.match(r"\$ (\.venv/bin/)?sluice replay ", lines[0]):
            continue
        command = [lines.pop(0)]
        while command[-1].endswith("\\"):
            command.append(lines.pop(0))
        words = " ".join(line.rstrip("\\ ") for line in command).split()
        examples.append((command[0], words[3:], lines))  # after "$ sluice replay"
    return examples


REPLAY_EXAMPLES = replay_examples()


def test_the_docs_show_replay_examples():
    assert len(REPLAY_EXAMPLES) >= 3


@pytest.mark.parametrize("first, args, shown", REPLAY_EXAMPLES, ids=[first for first, _, _ in REPLAY_EXAMPLES])
def test_every_replay_example_of_the_docs_is_the_commands_real_output(first, args, shown, tmp_path):
    if "--html" in args:
        args[args.index("--html") + 1] = str(tmp_path / "report.html")
    result = sluice_replay(*args)
    assert result.returncode == 0, result.stderr
    real = result.stdout.splitlines()
    at = 0
    for line in shown:
        if line.strip() == "...":
            continue
        assert line in real[at:], f"{first}: not in the output where shown: {line!r}"
        at = real.index(line, at) + 1  # each shown line, in the order shown


def test_a_shadow_rule_reports_whom_it_would_refuse(tmp_path):
    rules = (REPO / "examples" / "replay.yaml").read_text().replace(
        "    action: block\n", "    action: block\n    shadow: true\n", 1)
    (tmp_path / "rules.yaml").write_text(rules)
    enforcing = sluice_replay("--config", "examples/replay.yaml", "examples/access.log.sample")
    shadow = sluice_replay("--config", str(tmp_path / "rules.yaml"), "examples/access.log.sample")
    assert shadow.returncode == 0, shadow.stderr
    assert "  would refuse (shadow, action block): " in shadow.stdout
    assert "  refused: 72 requests from 1 of 33 keys" in enforcing.stdout
