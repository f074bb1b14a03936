"""A running `sluice serve` reloads its rules file when it changes, on a
real process: a Kubernetes ConfigMap update (the kubelet's symlink swap,
done for real in a temporary folder) runs the new rules with the counters
kept; a broken file keeps the old rules and logs its errors with FILE:LINE;
every worker process reloads."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import free_port, wait_until
from tests.integration.redis_server import RedisServer
from tests.unit.configmap_volume import ConfigMapVolume
from tests.unit.test_watch import FIVE, RULES

pytestmark = pytest.mark.integration

BROKEN = FIVE.replace("per: 1d", "per: whenever")  # line 4
RELOADED = re.compile(r'"message":"reloaded \d+ rules? from ')


class WatchingSluice:
    """``sluice serve`` of a ConfigMap volume's rules.yaml, polling it every
    0.2 s; its log (info) in ``log``."""

    def __init__(self, rules: Path, log: Path, workers: int = 1) -> None:
        self.rules = rules
        self.log = log
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", "--config", str(rules), "--port", str(self.port),
             "--hook-udp", "off", "--watch-interval", "0.2", "--workers", str(workers)],
            stdout=subprocess.DEVNULL, stderr=log.open("wb"))
        wait_until(self.up, "sluice answers /healthz", 20)
        # Every worker has loaded the rules (a worker still starting would
        # load a change as its first rules, with nothing to reload).
        wait_until(lambda: self.log.read_text().count('"Application startup complete."') == workers,
                   "every worker has started", 20)

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def up(self) -> bool:
        assert self.process.poll() is None, self.log.read_text()
        try:
            return self.get("/healthz")[0] == 200
        except OSError:
            return False

    def checks(self, count: int, client: str = "192.0.2.1") -> list[int]:
        return [self.get("/v1/nginx/auth", {"X-Sluice-Client-Addr": client, "X-Original-URI": "/"})[0]
                for _ in range(count)]

    def reloads(self, result: str) -> float:
        metrics = self.get("/metrics")[1]
        found = re.search(rf'^sluice_reloads_total{{result="{result}"}} (\S+)$', metrics, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(20)


@pytest.fixture
def volume(tmp_path: Path) -> ConfigMapVolume:
    return ConfigMapVolume(tmp_path / "config", {"rules.yaml": RULES})


@pytest.fixture
def sluice(volume: ConfigMapVolume, tmp_path: Path) -> Iterator[WatchingSluice]:
    server = WatchingSluice(volume.path("rules.yaml"), tmp_path / "sluice.log")
    yield server
    server.stop()


def test_a_configmap_update_runs_the_new_rules_with_the_counters_kept(
        volume: ConfigMapVolume, sluice: WatchingSluice) -> None:
    assert sluice.checks(2) == [200, 200]
    volume.update({"rules.yaml": FIVE})
    wait_until(lambda: sluice.reloads("success") == 1, "the new rules are loaded", 15)
    assert sluice.checks(4) == [200, 200, 200, 403]
    assert len(RELOADED.findall(sluice.log.read_text())) == 1


def test_a_broken_configmap_update_keeps_the_old_rules_and_logs_file_and_line(
        volume: ConfigMapVolume, sluice: WatchingSluice) -> None:
    volume.update({"rules.yaml": FIVE})
    wait_until(lambda: sluice.reloads("success") == 1, "the new rules are loaded", 15)
    volume.update({"rules.yaml": BROKEN})
    wait_until(lambda: sluice.reloads("failure") == 1, "the broken file is refused", 15)
    log = sluice.log.read_text()
    assert "reload refused, the old rules keep running" in log
    assert f"{volume.path('rules.yaml')}:4: rules[0](api).limit.per: " in log
    assert sluice.process.poll() is None
    assert sluice.checks(6, client="192.0.2.9") == [200] * 5 + [403]  # the rules before it
    assert sluice.reloads("success") == 1


def test_every_worker_reloads_and_the_shared_count_is_kept(
        volume: ConfigMapVolume, redis_server: RedisServer, tmp_path: Path) -> None:
    shared = f"state: {{backend: redis, url: '{redis_server.url}'}}\n"
    volume.update({"rules.yaml": shared + RULES})
    server = WatchingSluice(volume.path("rules.yaml"), tmp_path / "workers.log", workers=2)
    try:
        # Fresh connections: the two workers take turns.
        assert server.checks(2, client="192.0.2.7") == [200, 200]
        volume.update({"rules.yaml": shared + FIVE})
        wait_until(lambda: len(RELOADED.findall(server.log.read_text())) == 2, "both workers reload", 15)
        assert server.checks(4, client="192.0.2.7") == [200, 200, 200, 403]
    finally:
        server.stop()
    assert len(RELOADED.findall(server.log.read_text())) == 2
