"""The figures of docs/identity.md ("Beyond the address: choosing a key"),
replayed from the logs docs/examples/beyond_the_address.py writes: the
page says what replay reports, and this test holds it to it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from sidecar.replay.simulate import replay_logs
from sidecar.replay.sweep import prepare_sweeps
from sidecar.rules import load_ruleset

REPO = Path(__file__).resolve().parents[2]
PAGE = (REPO / "docs" / "identity.md").read_text()


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = importlib.util.spec_from_file_location("beyond", REPO / "docs" / "examples" / "beyond_the_address.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    directory = tmp_path_factory.mktemp("beyond")
    module.write_examples(directory)
    return directory


def replayed(directory: Path, rules: str, log: str, sweeps: list[tuple[str, tuple[int, ...]]] | None = None
             ) -> dict[str, Any]:
    path = str(directory / rules)
    return replay_logs(load_ruleset(path), [str(directory / log)], sweeps=prepare_sweeps(path, sweeps or []))


def rule(report: dict[str, Any], rule_id: str) -> dict[str, Any]:
    return next(found for found in report["rules"] if found["id"] == rule_id)


def said(figure: int) -> None:
    """The page states the figure (written as replay writes it: 7,061)."""
    assert re.search(rf"\b{figure:,}\b", PAGE), f"docs/identity.md does not say {figure:,}"


def test_a_campus_behind_one_nat(examples: Path) -> None:
    by_address = replayed(examples, "campus-by-address.yaml", "campus.log")
    by_student = replayed(examples, "campus-by-student.yaml", "campus.log")

    # Per address: the whole campus is one key, and most of its requests are refused.
    assert rule(by_address, "per-address")["keys"] == 1
    denied = by_address["answers"]["denied"]
    assert denied > by_address["requests"] // 2
    # Per student: only the one scripting is refused.
    per_student = rule(by_student, "per-student")
    assert per_student["refused_keys"] == 1
    assert per_student["top_over_limit"][0]["key"] == "jwt:sub=('jwt', 'student-scripted')"
    assert rule(by_student, "anonymous")["matched"] == 0
    for figure in (by_address["requests"], denied, per_student["blocked"]):
        said(figure)


def test_a_scraper_rotating_through_its_providers_addresses(examples: Path) -> None:
    by_address = replayed(examples, "pool-by-address.yaml", "pool.log")
    by_network = replayed(examples, "pool-by-network.yaml", "pool.log", [("per-network", (300, 600, 1200, 2400))])

    assert by_address["answers"]["denied"] == 0  # no address is ever over its limit
    per_network = rule(by_network, "per-network")
    assert per_network["refused_keys"] == 1
    assert per_network["top_over_limit"][0]["key"] == "asn=64500"
    sweep = {candidate["threshold"]: candidate for candidate in per_network["sweep"]["candidates"]}
    assert sweep[300]["refused_keys"] == 2  # too low: the broadband network's customers too
    assert sweep[2400]["refused_requests"] == 0
    for figure in (by_address["requests"], per_network["blocked"], sweep[300]["refused_requests"],
                   sweep[1200]["refused_requests"]):
        said(figure)
