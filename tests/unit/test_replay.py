"""`sluice replay`: access logs through the rules in virtual time."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from sidecar.accesslog import AccessLogs, LogError, UnparsableLine, parse_line
from sidecar.replay import percentile, replay_logs

from .conftest import ruleset_from

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]
T0 = 1709287200.0  # 2024-03-01T10:00:00Z


def combined(ip: str, t: float, path: str = "/", status: int = 200, method: str = "GET",
             agent: str = "test-agent", forwarded: str | None = None) -> str:
    stamp = datetime.fromtimestamp(t, timezone.utc).strftime("%d/%b/%Y:%H:%M:%S +0000")
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
