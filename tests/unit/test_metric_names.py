"""Sluice's metric names as Prometheus's linter wants them: ``promtool check
metrics`` finds nothing in a /metrics that has every family, but the one
deprecated name kept for a release; and that name still reads the same
count as the one that replaces it."""

from __future__ import annotations

import re
import shutil
import subprocess

from sidecar.app import SluiceApp
from sidecar.engine import Engine
from sidecar.frontdoors.rls import RateLimitService
from sidecar.metrics import DEPRECATED
from tests.unit.conftest import Harness, ruleset_from
from tests.unit.test_app import call, envoy, forward, nginx
from tests.unit.test_metrics import RULES as METRICS_RULES

# Every action, a shadow rule and a leaky bucket that holds.
RULES = METRICS_RULES + """\
  - id: puzzles
    match: {path: {prefix: /puzzle}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: challenge
  - id: watched
    match: {path: {prefix: /watched}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: block
    shadow: true
  - id: held
    match: {path: {prefix: /held}}
    key: [ip]
    limit: {rate: 100r/s, burst: 5}
    action: block
"""
# The deprecated names promtool objects to, and only those.
EXPECTED = {"sluice_counter_resets_total metric name should not include type 'counter'"}


def promtool_complaints(exposition: str) -> set[str]:
    """What ``promtool check metrics`` says of an exposition, a line each."""
    # `make test` installs it (Debian's prometheus package); its absence is a failure.
    found = shutil.which("promtool")
    assert found, "promtool is missing: apt-get install prometheus (make test does)"
    result = subprocess.run([found, "check", "metrics"], input=exposition, capture_output=True, text=True,
                            timeout=60)
    complaints = set((result.stdout + result.stderr).splitlines())
    # 3: only lint problems; 1 would be an exposition promtool cannot read.
    assert result.returncode == (3 if complaints else 0), result.stdout + result.stderr
    return complaints


def served_every_kind() -> list[str]:
    """The /metrics of a Sluice that answered checks of every front door,
    action and outcome, with the Rate Limit Service's statistics; and that
    of one on the Redis store, for its gauges (nothing connects before a
    request)."""
    app = SluiceApp(Harness(RULES).engine)
    RateLimitService(app.engine, None)
    # The ban last: it refuses the address's every request after it.
    for path in ("/api/x", "/quiet", "/page", "/puzzle", "/watched", "/held", "/held", "/held", "/scrape"):
        nginx(app, path)
        nginx(app, path)
    nginx(app, "/api/x")
    envoy(app, "/api/x", addr="198.51.100.8")
    envoy(app, "/api/x", addr="198.51.100.8")
    forward(app, "/api/x", peer="198.51.100.9")
    forward(app, "/api/x", peer="198.51.100.9")
    nginx(app, "/api/x", addr="not an address")
    shared = SluiceApp(Engine(ruleset_from('state: {backend: redis, url: "redis://127.0.0.1:1/0"}\nrules: []\n')))
    texts = [call(sluice, "/metrics", {})[2].decode() for sluice in (app, shared)]
    for kind in ("sluice_decisions_total{", "sluice_over_limit_total{", "sluice_shadow_actions_total{",
                 "sluice_challenges_issued_total 1", "sluice_delayed_total ", "sluice_penalty_cache_keys ",
                 "sluice_banned_requests_total 1",
                 "ratelimit_service_config_load_success "):
        assert kind in "".join(texts), kind
    return texts


def test_promtool_finds_nothing_but_the_deprecated_name() -> None:
    assert set().union(*map(promtool_complaints, served_every_kind())) == EXPECTED


def test_promtool_does_object_to_a_name_that_says_its_type() -> None:
    # The check above can fail: promtool does read what it is given.
    assert promtool_complaints("# HELP x_gauge_total A count.\n# TYPE x_gauge_total counter\nx_gauge_total 1\n") \
        == {"x_gauge_total metric name should not include type 'gauge'"}


def test_a_deprecated_name_reads_the_count_of_its_new_name_and_says_so() -> None:
    text = served_every_kind()[0]
    for old, _attribute in DEPRECATED.items():
        new = re.search(rf"^# HELP {old}_total Deprecated: use (\w+); removed in the next release\.$", text,
                        re.MULTILINE)
        assert new is not None, old
        values = [re.search(rf"^{name} (\S+)$", text, re.MULTILINE) for name in (f"{old}_total", new.group(1))]
        assert values[0] and values[1] and values[0].group(1) == values[1].group(1)
