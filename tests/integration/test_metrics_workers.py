"""``sluice serve --workers 2`` on Redis: whichever worker answers a scrape,
/metrics reads the node's totals: every check counted once, by both
workers together, and still after a worker is killed and replaced."""

from __future__ import annotations

import os
import re
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.mmap_dict import MmapedDict

from tests.integration.burst import burst
from tests.integration.clients import LOOPBACK
from tests.integration.conftest import wait_until
from tests.integration.redis_server import RedisServer
from tests.integration.sluice_serve import SluiceServe
from tests.unit.test_metric_names import EXPECTED, promtool_complaints

pytestmark = pytest.mark.integration

BUDGET = 50
# Checks of each front door, sent at once: each on a connection of its own,
# which either worker may accept.
EACH = 120
DOORS = {"nginx": ("/v1/nginx/auth", {"X-Sluice-Client-Addr": "10.80.0.1"}),
         "envoy": ("/v1/envoy/auth/burst", {"X-Sluice-Client-Addr": "10.80.0.2"}),
         "forward_auth": ("/v1/check", {})}
SCRAPES = 10


class Node:
    """A ``sluice serve --workers 2``, and the directory its workers write
    their metrics into (found under the TMPDIR it was given)."""

    def __init__(self, sluice: SluiceServe, tmp: Path) -> None:
        self.sluice = sluice
        self.tmp = tmp

    @property
    def directory(self) -> Path:
        found = list(self.tmp.glob("sluice-metrics-*"))
        assert len(found) == 1, found
        return found[0]

    def workers(self) -> list[str]:
        """The workers running, as they name themselves (pid-token)."""
        return sorted(path.name[:-len(".worker")] for path in self.directory.glob("*.worker"))

    def checks_by_worker(self) -> dict[str, float]:
        """sluice_checks_total as each worker, running or gone, last wrote it."""
        found = {}
        for path in self.directory.glob("counter_*.db"):
            values = {key: value for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path))}
            found[path.name[len("counter_"):-len(".db")]] = sum(
                value for key, value in values.items() if key.startswith('["sluice_checks", "sluice_checks_total"'))
        return found

    def scrape(self) -> str:
        import http.client

        connection = http.client.HTTPConnection(LOOPBACK, self.sluice.port, timeout=10)
        try:
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            assert response.status == 200
            return response.read().decode()
        finally:
            connection.close()


def sample(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def decisions(text: str) -> dict[tuple[str, str], float]:
    return {(door, outcome): float(value) for door, outcome, value in re.findall(
        r'^sluice_decisions_total\{front_door="(\w+)",outcome="(\w+)"\} (\S+)$', text, re.MULTILINE)}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Node]:
    directory = tmp_path_factory.mktemp("metrics-workers")
    rules = directory / "rules.yaml"
    rules.write_text(f"""\
state: {{backend: redis, url: "{redis_server.url}", fail: closed}}
rules:
  - id: per-key
    match: {{header: {{name: x-k, present: true}}}}
    key: ["header:x-k"]
    limit: {{requests: {BUDGET}, per: 60s}}
    action: block
""")
    tmp = directory / "tmp"
    tmp.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(tmp))
        with SluiceServe(rules, workers=2) as sluice:
            running = Node(sluice, tmp)
            wait_until(lambda: len(running.workers()) == 2, "both workers running", 20)
            yield running
    assert not list(tmp.glob("sluice-metrics-*")), "serve removes its metrics directory at exit"


def send_checks(node: Node) -> dict[tuple[str, str], float]:
    """Bursts through every front door on one new key each; the decisions
    by front door and outcome the node then has."""
    answered = decisions(node.scrape())
    for door, (path, headers) in DOORS.items():
        statuses = burst(node.sluice.port, EACH, path, {**headers, "x-k": uuid.uuid4().hex})
        assert sum(statuses.values()) == EACH and 0 not in statuses, (door, statuses)
        answered[door, "allow"] = answered.get((door, "allow"), 0) + BUDGET
        answered[door, "deny"] = answered.get((door, "deny"), 0) + EACH - BUDGET
    return answered


def assert_every_scrape_reads(node: Node, answered: dict[tuple[str, str], float]) -> None:
    """Scrape after scrape, whichever worker answers: the node's checks."""
    checks = sum(answered.values())
    seen = []
    for _ in range(SCRAPES):
        text = node.scrape()
        seen.append(sample(text, "sluice_checks_total"))
        assert decisions(text) == answered
        assert sample(text, "sluice_decision_seconds_count") == checks
    assert seen == [checks] * SCRAPES


def test_every_scrape_reads_the_checks_of_both_workers(node: Node) -> None:
    answered = send_checks(node)

    assert_every_scrape_reads(node, answered)
    # What each worker wrote for the scrapes.
    by_worker = node.checks_by_worker()
    assert len(by_worker) == 2 and all(by_worker.values()), f"both workers took checks: {by_worker}"
    assert sum(by_worker.values()) == sum(answered.values())


def test_the_node_metrics_pass_promtool(node: Node) -> None:
    send_checks(node)

    assert promtool_complaints(node.scrape()) == EXPECTED


def test_a_worker_killed_and_replaced_leaves_the_totals_whole(node: Node) -> None:
    answered = send_checks(node)
    assert_every_scrape_reads(node, answered)
    first = node.workers()
    os.kill(int(first[0].split("-")[0]), signal.SIGKILL)
    # uvicorn starts another in its place (the scrapes find the one killed gone).
    wait_until(lambda: set(node.workers()) - set(first), "a worker in its place", 30)

    assert_every_scrape_reads(node, answered)
    assert first[0] not in node.workers()
    assert_every_scrape_reads(node, send_checks(node))
