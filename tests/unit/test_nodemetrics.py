"""The metrics of a node of several workers (sidecar.nodemetrics): a scrape,
whichever worker answers it, reads every worker's counts summed, gauges as
each one's meaning says, and keeps the counts of a worker gone.

The workers here are two ``Metrics`` of one process sharing a directory:
the files, the locks and the scrape's wait are the ones of two processes
(``flock`` locks conflict between two opens of a file in one process too);
tests/integration/test_metrics_workers.py runs a real ``sluice serve
--workers 2``."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from sidecar import nodemetrics
from sidecar.engine import Engine
from sidecar.frontdoors.rls import RateLimitService
from sidecar.metrics import Metrics, add_one
from sidecar.nodemetrics import GAUGE_MODES, NodeMetrics, file_kind
from tests.unit.conftest import FakeClock, ruleset_from
from tests.unit.test_metrics import RULES


def parse(text: bytes) -> dict[str, float]:
    """Every sample of an exposition, by its line's name and labels."""
    return {name: float(value) for name, value in re.findall(r"^([^#\s][^ ]*) (\S+)$", text.decode(), re.MULTILINE)}


def worker(directory: Path, loaded_at: float = 1_700_000_000.0, waiting: int = 0) -> Metrics:
    """A worker's metrics, shared in ``directory``."""
    metrics = Metrics(wall_clock=FakeClock(loaded_at))
    metrics.watch("sluice_waiting_requests", "Requests held by a leaky bucket right now.", lambda: waiting)
    metrics.share(str(directory))
    return metrics


def count(metrics: Metrics, checks: int, latency: float = 0.0002) -> None:
    """What answering ``checks`` checks through nginx adds."""
    for _ in range(checks):
        metrics.checks.value += 1
        add_one(metrics.decisions, ("nginx", "allow"))
        metrics.latency.observe(latency)
    metrics.rule_hits["api"] += checks


def scrape(metrics: Metrics, *running: Metrics) -> dict[str, float]:
    """A scrape answered by ``metrics``, while the workers ``running``
    look for scrapes on the same loop."""
    async def answer() -> bytes:
        for other in running:
            node(other).start(asyncio.get_running_loop())
        return await metrics.exposition()

    return parse(asyncio.run(answer()))


def node(metrics: Metrics) -> NodeMetrics:
    assert metrics.node is not None
    return metrics.node


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return tmp_path / "metrics"


@pytest.fixture
def two(directory: Path) -> Iterator[tuple[Metrics, Metrics]]:
    directory.mkdir()
    first, second = worker(directory, 1_700_000_000.0, waiting=2), worker(directory, 1_700_000_060.0, waiting=3)
    yield first, second
    for metrics in (first, second):
        if os.path.exists(directory / f"{node(metrics).worker}.worker"):
            node(metrics).stop()


def test_either_worker_answers_with_the_counters_and_histograms_of_both_summed(
        two: tuple[Metrics, Metrics]) -> None:
    first, second = two
    count(first, 11, latency=0.0002)
    count(second, 9, latency=0.02)
    node(second).publish()

    for answering, other in ((first, second), (second, first), (first, second)):
        found = scrape(answering, other)
        assert found["sluice_checks_total"] == 20
        assert found['sluice_decisions_total{front_door="nginx",outcome="allow"}'] == 20
        assert found['sluice_rule_hits_total{rule="api"}'] == 20
        assert found["sluice_decision_seconds_count"] == 20
        assert found['sluice_decision_seconds_bucket{le="0.00025"}'] == 11
        assert found['sluice_decision_seconds_bucket{le="0.025"}'] == 20
        assert found['sluice_decision_seconds_bucket{le="+Inf"}'] == 20
        assert found["sluice_decision_seconds_sum"] == pytest.approx(11 * 0.0002 + 9 * 0.02)


def test_gauges_add_up_as_their_meaning_says(two: tuple[Metrics, Metrics]) -> None:
    first, second = two
    found = scrape(first, second)

    # Held on the node: both workers' requests.
    assert found["sluice_waiting_requests"] == 5
    # Rules loaded at this time or later run on every worker.
    assert found["sluice_last_reload_timestamp_seconds"] == 1_700_000_000.0
    assert [line for line in found if line.startswith("sluice_build_info")] == \
        [f'sluice_build_info{{version="{first.version}"}}']
    assert found[f'sluice_build_info{{version="{first.version}"}}'] == 1
    # No worker's pid as a label.
    assert not [line for line in found if "pid=" in line]


def test_a_scrape_waits_for_the_other_worker_to_write_what_it_counted_since(
        two: tuple[Metrics, Metrics]) -> None:
    first, second = two
    count(second, 2)
    assert scrape(first, second)["sluice_checks_total"] == 2
    count(second, 7)  # counted after its last writing, as a worker answers checks between scrapes

    assert scrape(first, second)["sluice_checks_total"] == 9


def test_a_scrape_wakes_the_other_workers_to_write(two: tuple[Metrics, Metrics],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = two
    # No write falls due by the clock during the test: only the scrape's
    # wake can make the other worker write what it counted.
    monkeypatch.setattr(nodemetrics, "PUBLISH_SECONDS", 3600.0)
    count(second, 2)
    assert scrape(first, second)["sluice_checks_total"] == 2
    count(second, 5)

    assert scrape(first, second)["sluice_checks_total"] == 7


def test_an_idle_worker_is_not_woken_before_its_next_write_falls_due(two: tuple[Metrics, Metrics]) -> None:
    _, second = two

    async def started() -> float:
        loop = asyncio.get_running_loop()
        node(second).start(loop)
        await asyncio.sleep(0)  # its first write
        assert node(second)._timer is not None
        return node(second)._timer.when() - loop.time()

    # No look every few milliseconds: the loop sleeps until a scrape wakes
    # it or the next write falls due.
    assert nodemetrics.PUBLISH_SECONDS * 0.9 <= asyncio.run(started()) <= nodemetrics.PUBLISH_SECONDS


def test_without_a_fifo_a_worker_looks_for_a_scrape_and_is_still_counted(
        directory: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    directory.mkdir()
    first = worker(directory)

    def refused(path: str, mode: int = 0o666) -> None:
        raise PermissionError(1, "Operation not permitted", path)

    monkeypatch.setattr(os, "mkfifo", refused)  # a file system that makes none (vfat)
    monkeypatch.setattr(nodemetrics, "PUBLISH_SECONDS", 3600.0)  # only a look finds the scrape
    second = worker(directory)
    count(second, 2)
    assert scrape(first, second)["sluice_checks_total"] == 2
    count(second, 5)

    assert scrape(first, second)["sluice_checks_total"] == 7
    assert "makes no FIFO" in caplog.text
    node(second).stop()
    node(first).stop()
    assert not list(directory.glob("*.worker"))


def test_a_worker_that_does_not_write_is_waited_for_a_bounded_time_and_its_last_counts_given(
        directory: Path) -> None:
    directory.mkdir()
    clock = FakeClock(0)

    def nanoseconds() -> int:
        clock.advance(0.5)  # half a second each time the scrape looks
        return int(clock() * 1e9)

    wedged = worker(directory)
    count(wedged, 4)
    node(wedged).publish()
    count(wedged, 3)  # never written: its loop does not run
    answering = Metrics()
    answering.node = NodeMetrics(answering.registry, str(directory), clock=nanoseconds)

    found = scrape(answering)

    assert found["sluice_checks_total"] == 4
    assert clock() <= nodemetrics.WAIT_SECONDS + 1.5


def test_a_worker_gone_keeps_its_counts_in_the_totals_and_its_gauges_leave(two: tuple[Metrics, Metrics],
                                                                          directory: Path) -> None:
    first, second = two
    count(second, 9)
    node(second).publish()
    # Killed outright: no goodbye, the kernel lets go of its lock.
    os.close(node(second)._alive)

    found = scrape(first)

    assert found["sluice_checks_total"] == 9
    assert found["sluice_waiting_requests"] == 2
    assert not (directory / f"{node(second).worker}.worker").exists()
    assert not (directory / f"{node(second).worker}{nodemetrics.WAKE}").exists()


def test_a_worker_that_restarts_does_not_reset_the_totals(two: tuple[Metrics, Metrics], directory: Path) -> None:
    first, second = two
    count(first, 5)
    count(second, 9)
    before = scrape(first, second)["sluice_checks_total"]
    node(second).stop()
    replacement = worker(directory)
    count(replacement, 1)

    after = scrape(first, replacement)["sluice_checks_total"]
    node(replacement).stop()

    assert (before, after) == (14, 15)


def test_a_worker_ending_writes_its_last_counts(two: tuple[Metrics, Metrics], directory: Path) -> None:
    first, second = two
    count(second, 6)
    node(second).stop()

    assert scrape(first)["sluice_checks_total"] == 6
    assert not (directory / f"{node(second).worker}{nodemetrics.WAKE}").exists()


def test_one_worker_answers_from_its_own_registry_with_nothing_shared() -> None:
    metrics = Metrics()
    count(metrics, 3)

    def sluice_lines(text: bytes) -> list[str]:
        return [line for line in text.decode().splitlines() if "sluice_" in line]

    assert metrics.node is None
    assert sluice_lines(asyncio.run(metrics.exposition())) == sluice_lines(generate_latest(metrics.registry))


def every_family() -> list:
    """The families a Sluice can have: memory store, Redis store, the Rate
    Limit Service's statistics."""
    memory = Engine(ruleset_from(RULES))
    memory.metrics.watch("sluice_waiting_requests", "Held.", lambda: 0)
    shared = Engine(ruleset_from('state: {backend: redis, url: "redis://127.0.0.1:1/0"}\nrules: []\n'))
    for name, (documentation, read) in [*memory.store.gauges().items(), *shared.store.gauges().items()]:
        memory.metrics.watch(name, documentation, read)
    RateLimitService(memory, None)
    return list(memory.metrics.registry.collect())


@pytest.mark.parametrize("family", every_family(), ids=lambda family: family.name)
def test_every_family_sluice_exports_has_a_meaning_over_workers(family) -> None:
    kind = file_kind(family)

    assert kind in ("counter", "histogram", "unknown") or family.name in GAUGE_MODES
