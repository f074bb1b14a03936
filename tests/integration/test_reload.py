"""SIGHUP reloads a running `sluice serve`, on a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import free_port, wait_until

pytestmark = pytest.mark.integration

TWO_RULES = """
rules:
  - id: api
    match: {path: {prefix: /api/}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
  - id: watch
    key: [ip]
    limit: {requests: 1000, per: 1h}
    action: log
"""


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


class Sluice:
    def __init__(self, rules: Path, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", "--config", str(rules), "--port", str(self.port),
             "--hook-udp", "off"], stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_until(self.up, "sluice answers /healthz", 15)

    def up(self) -> bool:
        try:
            return get(f"{self.url}/healthz")[0] == 200
        except OSError:
            return False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def check(self, uri: str, client: str = "192.0.2.1") -> int:
        return get(f"{self.url}/v1/nginx/auth", {"X-Sluice-Client-Addr": client, "X-Original-URI": uri})[0]


@pytest.fixture
def sluice(tmp_path: Path) -> Iterator[tuple[Sluice, Path]]:
    rules = tmp_path / "rules.yaml"
    rules.write_text(TWO_RULES)
    server = Sluice(rules, tmp_path / "sluice.log")
    yield server, rules
    server.process.terminate()
    server.process.wait(10)


def test_sighup_runs_the_new_rules_and_keeps_counters(sluice: tuple[Sluice, Path]) -> None:
    server, rules = sluice
    assert [server.check("/api/a") for _ in range(2)] == [200, 403]
    rules.write_text(TWO_RULES.replace("requests: 1,", "requests: 5,"))
    os.kill(server.process.pid, signal.SIGHUP)
    wait_until(lambda: "reloaded 2 rules" in server.log.read_text(), "the reload is logged", 10)
    # The key is still in the penalty it entered before the reload.
    assert server.check("/api/a") == 403
    assert [server.check("/api/a", client="192.0.2.2") for _ in range(6)] == [200] * 5 + [403]


def test_an_invalid_file_on_sighup_keeps_the_old_rules(sluice: tuple[Sluice, Path]) -> None:
    server, rules = sluice
    rules.write_text(TWO_RULES.replace("per: 1h", "per: whenever", 1))
    os.kill(server.process.pid, signal.SIGHUP)
    wait_until(lambda: "reload refused" in server.log.read_text(), "the refusal is logged", 10)
    assert "rules[0](api).limit.per" in server.log.read_text()
    assert server.process.poll() is None
    assert [server.check("/api/b", client="192.0.2.3") for _ in range(2)] == [200, 403]
    assert get(f"{server.url}/readyz")[1].startswith("ok: 2 rules")


def test_admin_api_on_a_loopback_listener_without_a_token(sluice: tuple[Sluice, Path]) -> None:
    server, rules = sluice
    status, body = get(f"{server.url}/v1/admin/rules")
    assert status == 200 and '"id":"api"' in body
