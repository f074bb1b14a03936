"""``sluice admin`` against a real ``sluice serve`` on loopback, with its
bearer token: what each command prints, ``--json`` for scripts, and one
clear line and exit status 1 for every failure."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from sidecar.cli import main
from tests.integration.clients import LOOPBACK
from tests.integration.conftest import free_port
from tests.integration.sluice_serve import SluiceServe

RULES = """
node: edge-1
tiers: {names: [free, pro], default: free, identity: "header:x-api-key"}
rules:
  - id: login
    match: {path: {prefix: /login}}
    key: [ip]
    limit: {requests: 2, per: 1m}
    penalty: 10m
    action: block
  - id: api-key
    match: {path: {prefix: /api/}}
    key: ["header:x-api-key"]
    limit: {tokens: 20, refill: 2/s}
    action: block
  - id: metered
    match: {path: {prefix: /metered/}}
    key: ["header:x-api-key"]
    limit: {requests: 1, per: 1h}
    tiers: {pro: 3}
    action: block
"""

TOKEN = "a-cli-admin-token-0123456789"
_numbers = iter(range(1, 250))


@pytest.fixture(scope="module")
def sluice(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServe]:
    """One ``sluice serve`` with an admin token, given the way an operator
    gives it: SLUICE_ADMIN_TOKEN_FILE, which ``sluice admin`` reads too."""
    directory = tmp_path_factory.mktemp("cli-admin")
    (directory / "rules.yaml").write_text(RULES)
    (directory / "token").write_text(TOKEN + "\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLUICE_ADMIN_TOKEN_FILE", str(directory / "token"))
        with SluiceServe(directory / "rules.yaml") as serve:
            yield serve


def fresh_address() -> str:
    return f"203.0.113.{next(_numbers)}"


def admin(sluice: SluiceServe, *arguments: str, token: str | None = None) -> Result:
    """``sluice admin ARGUMENTS`` in process, at that Sluice; ``token`` a
    token file other than the server's."""
    env = {"SLUICE_ADMIN_URL": f"http://{LOOPBACK}:{sluice.port}"}
    if token is not None:
        env["SLUICE_ADMIN_TOKEN_FILE"] = token
    return CliRunner().invoke(main, ["admin", *arguments], env=env, catch_exceptions=False)


def check(sluice: SluiceServe, address: str, path: str = "/login", headers: dict[str, str] | None = None) -> int:
    """One nginx auth_request check, straight to Sluice: its status."""
    connection = http.client.HTTPConnection(LOOPBACK, sluice.port, timeout=5)
    try:
        connection.request("GET", "/v1/nginx/auth", headers={
            "X-Sluice-Client-Addr": address, "X-Original-URI": path, "X-Original-Method": "GET",
            "X-Original-Host": "shop.example", **(headers or {})})
        return connection.getresponse().status
    finally:
        connection.close()


def columns(text: str) -> list[list[str]]:
    """A table's rows, split where its header's columns start."""
    lines = text.rstrip("\n").split("\n")
    starts = [match.start() for match in re.finditer(r"\S+( \S+)*", lines[0])]
    return [[line[start:end].strip() for start, end in zip(starts, starts[1:] + [None])] for line in lines]


def test_a_ban_by_hand_is_printed_listed_and_lifted(sluice: SluiceServe) -> None:
    address = fresh_address()
    banned = admin(sluice, "ban", address, "--for", "1h", "--reason", "credential stuffing (ticket 4312)")
    assert (banned.exit_code, banned.output) == (0, f"banned {address} for 1h: credential stuffing (ticket 4312)\n")
    assert check(sluice, address, "/") == 401  # nginx is told to close the connection
    listed = admin(sluice, "bans")
    rows = columns(listed.output)
    assert rows[0] == ["ADDRESS", "RULE", "REASON", "NODE", "STARTED", "LEFT"]
    [row] = [row for row in rows if row[0] == address]
    assert row[1:4] == ["manual", "credential stuffing (ticket 4312)", "edge-1"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", row[4]) and row[5] in ("1h", "59m 59s")
    lifted = admin(sluice, "unban", address)
    assert (lifted.exit_code, lifted.output) == (0, f"lifted the ban of {address}\n")
    assert check(sluice, address, "/") == 200
    again = admin(sluice, "unban", address)
    assert (again.exit_code, again.output) == (1, f"error: no ban of {address} (404)\n")


def test_an_identity_is_assigned_to_a_tier_listed_and_removed(sluice: SluiceServe) -> None:
    key = {"X-Api-Key": "cli-key-1"}
    assert [check(sluice, fresh_address(), "/metered/a", {"X-Api-Key": "cli-key-0"}) for _ in range(2)] == \
        [200, 403]  # free: one an hour
    assigned = admin(sluice, "tier", "set", "cli-key-1", "pro")
    assert (assigned.exit_code, assigned.output) == (0, "assigned to tier pro\n")
    assert [check(sluice, fresh_address(), "/metered/a", key) for _ in range(4)] == [200, 200, 200, 403]
    rows = columns(admin(sluice, "tier", "list").output.split("\n", 1)[1])
    assert rows[0] == ["IDENTITY", "TIER", "FROM"] and ["cli-key-1", "pro", "run time"] in rows
    assert admin(sluice, "tier", "list").output.startswith("tiers: free, pro (default free); identity: "
                                                            "header:x-api-key\n")
    removed = admin(sluice, "tier", "unset", "cli-key-1")
    assert (removed.exit_code, removed.output) == (0, "removed the run-time assignment\n")
    again = admin(sluice, "tier", "unset", "cli-key-1")
    assert (again.exit_code, again.output) == \
        (1, "error: no run-time assignment of that identity; it is in tier 'free' (default) (404)\n")
    wrong = admin(sluice, "tier", "set", "cli-key-2", "gold")
    assert (wrong.exit_code, wrong.output) == \
        (1, "error: no tier 'gold'; the tiers are free, pro (tiers.names) (422)\n")
    listing = json.loads(admin(sluice, "tier", "list", "--json").output)
    assert listing["names"] == ["free", "pro"] and listing["assignments"] == []


def test_a_network_ban_and_json_for_scripts(sluice: SluiceServe) -> None:
    banned = admin(sluice, "ban", "198.51.100.0/24", "--for", "7200", "--json")
    answer = json.loads(banned.output)
    assert (answer["address"], answer["scope"], answer["rule"], answer["duration_seconds"]) == \
        ("198.51.100.0/24", "network", "manual", 7200.0)
    assert check(sluice, "198.51.100.42", "/") == 401
    listing = json.loads(admin(sluice, "bans", "--json").output)
    assert "198.51.100.0/24" in [ban["address"] for ban in listing if ban["scope"] == "network"]
    assert admin(sluice, "unban", "198.51.100.0/24").exit_code == 0
    assert check(sluice, "198.51.100.42", "/") == 200


def test_a_clients_counters_are_listed_and_reset_lets_it_in(sluice: SluiceServe) -> None:
    address = fresh_address()
    assert [check(sluice, address) for _ in range(3)] == [200, 200, 403]  # refused: nginx asks for the page
    listed = admin(sluice, "counters", "--ip", address)
    assert listed.exit_code == 0
    rows = columns(listed.output)
    assert rows[0] == ["RULE", "KEY", "LIMIT", "REMAINING", "RESETS IN", "PENALTY LEFT"]
    assert rows[1][:4] == ["login", f"ip={address}", "2 per 1m (sliding window), penalty 10m", "0"]
    assert rows[1][5] in ("10m", "9m 59s") and len(rows) == 2
    reset = admin(sluice, "reset", "--ip", address)
    assert (reset.exit_code, reset.output) == (0, f"reset 1 counter of {address}\n")
    assert check(sluice, address) == 200
    assert json.loads(admin(sluice, "counters", "--ip", address, "--json").output)["counters"][0]["remaining"] == 1


def test_one_key_of_a_rule_is_listed_and_reset(sluice: SluiceServe) -> None:
    for key in ("k-1", "k-1", "k-2"):
        check(sluice, fresh_address(), "/api/orders", {"X-Api-Key": key})
    one = admin(sluice, "counters", "--rule", "api-key", "--key", "header:x-api-key=k-1")
    rows = columns(one.output)
    assert [row[:2] for row in rows[1:]] == [["api-key", "header:x-api-key=k-1"]] and rows[1][3] == "18"
    reset = admin(sluice, "reset", "--rule", "api-key", "--key", "header:x-api-key=k-1")
    assert reset.output == "reset 1 counter of rule api-key (header:x-api-key=k-1)\n"
    left = json.loads(admin(sluice, "counters", "--rule", "api-key", "--json").output)["counters"]
    assert "header:x-api-key=k-1" not in [counter["key"] for counter in left]
    assert "header:x-api-key=k-2" in [counter["key"] for counter in left]


def test_a_reset_of_a_banned_client_says_the_ban_stays(sluice: SluiceServe) -> None:
    address = fresh_address()
    admin(sluice, "ban", address, "--for", "10m")
    reset = admin(sluice, "reset", "--ip", address)
    assert reset.output.startswith(f"reset 0 counters of {address}\n{address} is banned by hand, ")
    assert reset.output.endswith(f" left: sluice admin unban {address}\n")
    admin(sluice, "unban", address)


def test_rules_and_reload(sluice: SluiceServe) -> None:
    rows = columns(admin(sluice, "rules").output)
    assert rows[0] == ["RULE", "ACTION", "LIMIT", "PENALTY", "HITS", "OVER LIMIT"]
    assert [row[:4] for row in rows[1:]] == [["login", "block", "2", "10m"], ["api-key", "block", "20", "-"],
                                             ["metered", "block", "1", "1h"]]
    assert admin(sluice, "reload").output == "reloaded: 3 rules\n"
    sluice.rules.write_text(RULES.replace("per: 1m", "per: soon"))
    try:
        refused = admin(sluice, "reload")
        assert refused.exit_code == 1
        assert refused.output.startswith("error: ") and "rules[0](login).limit.per" in refused.output
        assert refused.output.endswith(" (422)\n") and refused.output.count("\n") == 1
    finally:
        sluice.rules.write_text(RULES)


@pytest.mark.parametrize(("arguments", "line"), [
    (["counters", "--rule", "nope"], "error: no rule 'nope' runs now (rules: login, api-key, metered) (404)"),
    (["counters", "--ip", "banana"],
     "error: expected an IP address or a network (CIDR), got 'banana' (422)"),
    (["counters", "--rule", "api-key", "--key", "ip=1.2.3.4"],
     "error: rule api-key counts by header:x-api-key, not by ip (422)"),
    (["ban", "198.51.100.7/24", "--for", "1h"],
     "error: address: '198.51.100.7/24' has bits set after its /24: did you mean 198.51.100.0/24? (422)"),
    (["ban", "192.0.2.1", "--for", "soon"], "error: duration: expected a duration like '10s', got 'soon' (422)"),
    (["ban", "192.0.2.1", "--for", "2y"], "error: duration: a ban lasts from 1s to 1y (422)"),
    (["counters", "--ip", "192.0.2.1", "--limit", "0"], None),  # refused by the command itself
])
def test_what_sluice_refuses_is_one_line_and_exit_status_1(sluice: SluiceServe, arguments, line) -> None:
    result = admin(sluice, *arguments)
    if line is None:
        assert result.exit_code == 2 and "--limit" in result.output
    else:
        assert (result.exit_code, result.output) == (1, line + "\n")


def test_a_missing_or_wrong_token_is_one_line(sluice: SluiceServe, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("a-wrong-token-of-some-length\n")
    refused = admin(sluice, "bans", token=str(wrong))
    assert (refused.exit_code, refused.output) == (1, f"error: the admin API refused the token in {wrong} (401)\n")
    env = {"SLUICE_ADMIN_URL": f"http://{LOOPBACK}:{sluice.port}", "SLUICE_ADMIN_TOKEN_FILE": None}
    missing = CliRunner().invoke(main, ["admin", "bans"], env=env)
    assert (missing.exit_code, missing.output) == (
        1, "error: the admin API needs its bearer token: give --token-file (or SLUICE_ADMIN_TOKEN_FILE)\n")
    absent = admin(sluice, "bans", token=str(tmp_path / "absent"))
    assert absent.exit_code == 1 and absent.output.startswith(f"error: cannot read the token file {tmp_path}")


def test_no_sluice_there_is_one_line() -> None:
    port = free_port()
    result = CliRunner().invoke(main, ["admin", "bans", "--url", f"http://{LOOPBACK}:{port}"])
    assert (result.exit_code, result.output) == (
        1, f"error: cannot reach Sluice at http://{LOOPBACK}:{port} (connection refused): is `sluice serve` "
           "running there? (--url, SLUICE_ADMIN_URL)\n")
    for url in ("ftp://example", "http://[::1", "http://127.0.0.1:99999"):
        bad = CliRunner().invoke(main, ["admin", "bans", "--url", url])
        assert bad.exit_code == 1 and bad.output.startswith("error: --url: "), bad.output


def test_a_server_that_is_not_sluice_is_one_line() -> None:
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html>a shop</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer((LOOPBACK, 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://{LOOPBACK}:{server.server_port}"
        result = CliRunner().invoke(main, ["admin", "bans", "--url", url], env={"SLUICE_ADMIN_TOKEN_FILE": None})
        assert (result.exit_code, result.output) == (
            1, f"error: {url} answered 200 but not with JSON: is it sluice serve? (--url, SLUICE_ADMIN_URL)\n")
    finally:
        server.shutdown()
        server.server_close()


def test_the_installed_command_runs_and_the_log_never_holds_the_token(sluice: SluiceServe) -> None:
    """``python -m sidecar admin``, as an operator runs it (the environment
    carries the URL and the token file)."""
    address = fresh_address()
    env = {**os.environ, "SLUICE_ADMIN_URL": f"http://{LOOPBACK}:{sluice.port}"}
    done = subprocess.run([sys.executable, "-m", "sidecar", "admin", "ban", address, "--for", "90s"],
                          env=env, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"banned {address} for 1m 30s\n", "")
    admin(sluice, "unban", address)
    log = sluice.log.read_text()
    assert f'"audit":"ban","who":"token","result":"banned","address":"{address}"' in log
    assert TOKEN not in log


def test_a_sluice_on_a_unix_socket_answers_without_a_token(tmp_path: Path) -> None:
    """``sluice serve --uds``: its peers are local, as loopback ones are."""
    from sidecar.cli_admin import UnixConnection
    from tests.integration.conftest import wait_until

    (tmp_path / "rules.yaml").write_text(RULES)
    socket_path = tmp_path / "sluice.sock"
    env = {key: value for key, value in os.environ.items() if key != "SLUICE_ADMIN_TOKEN_FILE"}
    process = subprocess.Popen([sys.executable, "-m", "sidecar", "serve", "--config", str(tmp_path / "rules.yaml"),
                                "--uds", str(socket_path), "--hook-udp", "off", "--log-level", "warning"],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def up() -> bool:
        connection = UnixConnection(str(socket_path), 1.0)
        try:
            connection.request("GET", "/healthz")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    try:
        wait_until(up, "sluice serve --uds answers", 20)
        url = f"unix:{socket_path}"
        runner = CliRunner()
        banned = runner.invoke(main, ["admin", "ban", "192.0.2.5", "--for", "1m", "--url", url],
                               env={"SLUICE_ADMIN_TOKEN_FILE": None})
        assert (banned.exit_code, banned.output) == (0, "banned 192.0.2.5 for 1m\n")
        listed = runner.invoke(main, ["admin", "bans", "--json", "--url", url], env={"SLUICE_ADMIN_TOKEN_FILE": None})
        assert [ban["address"] for ban in json.loads(listed.output)] == ["192.0.2.5"]
    finally:
        process.terminate()
        process.wait(timeout=20)
