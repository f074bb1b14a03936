"""What /metrics tells an operator: answers by front door and outcome,
reloads, the build, and the process; HEAD on the probes and /metrics."""

from __future__ import annotations

import bisect
import collections
import re
import socket
import threading
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from sidecar.admin import Admin
from sidecar.app import SluiceApp
from sidecar.engine import Engine
from sidecar.health import HealthListener, Heartbeat
from sidecar.latency import LATENCY_BUCKETS, LatencyHistogram
from sidecar.metrics import RULE_SETS, Counts, Metrics, add_one
from sidecar.rules import load_ruleset
from tests.unit.conftest import FakeClock, Harness
from tests.unit.test_app import call, envoy, forward, nginx

ROOT = Path(__file__).resolve().parents[2]

# Every kind of rule (test_monitoring.py asks for the labels of each).
RULES = """
rules:
  - id: api
    match: {path: {prefix: /api/}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: block
  - id: quiet
    match: {path: {prefix: /quiet}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: block
    block: {close: true}
  - id: scrapers
    match: {path: {prefix: /scrape}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: ban
  - id: pages
    match: {path: {prefix: /page}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: log
"""


def samples(metrics: Metrics) -> dict[str, float]:
    """Every sample of the registry, by its line's name and labels."""
    text = generate_latest(metrics.registry).decode()
    return {name: float(value) for name, value in re.findall(r"^([^#\s][^ ]*) (\S+)$", text, re.MULTILINE)}


def decisions(metrics: Metrics) -> dict[tuple[str, str], float]:
    found = {}
    for line, value in samples(metrics).items():
        labels = re.fullmatch(r'sluice_decisions_total\{front_door="(\w+)",outcome="(\w+)"\}', line)
        if labels:
            found[labels.group(1), labels.group(2)] = value
    return found


@pytest.fixture
def app() -> SluiceApp:
    return SluiceApp(Harness(RULES).engine)


# -- answers by front door ----------------------------------------------------


def test_every_answer_is_counted_by_its_front_door_and_what_the_proxy_was_told(app: SluiceApp) -> None:
    assert nginx(app, "/api/x")[0] == 200
    assert nginx(app, "/api/x")[0] == 403  # deny, with a page to fetch
    assert nginx(app, "/quiet")[0] == 200
    assert nginx(app, "/quiet")[0] == 401  # close
    assert envoy(app, "/api/x", addr="198.51.100.8")[0] == 200
    assert forward(app, "/api/x", peer="198.51.100.9")[0] == 200
    assert forward(app, "/api/x", peer="198.51.100.9")[0] == 429

    assert decisions(app.engine.metrics) == {
        ("nginx", "allow"): 2, ("nginx", "deny"): 1, ("nginx", "close"): 1,
        ("envoy", "allow"): 1, ("forward_auth", "allow"): 1, ("forward_auth", "deny"): 1,
    }


def test_the_deny_page_nginx_fetches_afterwards_is_not_a_second_answer(app: SluiceApp) -> None:
    nginx(app, "/api/x")
    token = nginx(app, "/api/x")[1]["x-sluice-deny"]
    call(app, "/v1/nginx/deny", {"X-Sluice-Deny": token})

    assert decisions(app.engine.metrics) == {("nginx", "allow"): 1, ("nginx", "deny"): 1}


def test_checks_the_http_protocol_answers_itself_are_counted(app: SluiceApp) -> None:
    check = app.check_for("/v1/nginx/auth")
    assert check is not None
    headers = {"x-sluice-client-addr": "198.51.100.7", "x-original-uri": "/api/x"}
    scope = {"type": "http", "path": "/v1/nginx/auth", "method": "GET", "headers": [], "client": ("127.0.0.1", 1)}

    replies = [check.reply(dict(scope), headers) for _ in range(3)]

    assert [reply[0] for reply in replies if reply is not None] == [200, 403, 403]
    assert decisions(app.engine.metrics) == {("nginx", "allow"): 1, ("nginx", "deny"): 2}


def test_a_check_that_fails_inside_sluice_is_counted_as_the_allow_it_answers(
        app: SluiceApp, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(request: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(app.engine, "decide_now", broken)  # the memory store's decision

    assert envoy(app, "/api/x")[0] == 200
    assert decisions(app.engine.metrics) == {("envoy", "allow"): 1}
    assert samples(app.engine.metrics)["sluice_internal_errors_total"] == 1


# -- reloads ------------------------------------------------------------------


def test_reloads_are_counted_and_the_time_is_that_of_the_rules_running(tmp_path: Path) -> None:
    wall = FakeClock(1_700_000_000.0)
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    metrics = Metrics(wall_clock=wall)
    engine = Engine(load_ruleset(str(rules)), clock=FakeClock(), metrics=metrics)
    admin = Admin(engine, str(rules))
    before = samples(metrics)

    wall.advance(60)
    assert admin.reload() == []
    after_success = samples(metrics)
    wall.advance(60)
    rules.write_text("rules:\n  - id: api\n    limit: {requests: 1, per: 10 seconds}\n")
    assert admin.reload() != []
    after_failure = samples(metrics)

    def reloads(found: dict[str, float]) -> tuple[float, float, float]:
        return (found['sluice_reloads_total{result="success"}'], found['sluice_reloads_total{result="failure"}'],
                found["sluice_last_reload_timestamp_seconds"])

    assert reloads(before) == (0, 0, 1_700_000_000.0)
    assert reloads(after_success) == (1, 0, 1_700_000_060.0)
    assert reloads(after_failure) == (1, 1, 1_700_000_060.0)


# -- the build and the process ----------------------------------------------


def test_the_scrape_names_the_version_and_carries_the_process_gc_and_platform_collectors() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    found = samples(Metrics())

    assert found[f'sluice_build_info{{version="{version}"}}'] == 1
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"):
        assert found[name] > 0, name
    assert any(line.startswith('python_gc_collections_total{generation="0"}') for line in found)
    assert any(line.startswith("python_info{") for line in found)


def test_a_store_value_named_total_is_a_counter_and_the_others_gauges() -> None:
    metrics = Metrics()
    metrics.watch("sluice_answers_total", "Answered.", lambda: 3)
    metrics.watch("sluice_held", "Held.", lambda: 2)
    text = generate_latest(metrics.registry).decode()

    assert "# TYPE sluice_answers_total counter\nsluice_answers_total 3.0\n" in text
    assert "# TYPE sluice_held gauge\nsluice_held 2.0\n" in text


# -- HEAD ---------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/readyz"])
def test_head_is_answered_like_get(app: SluiceApp, path: str) -> None:
    status, headers, _ = call(app, path, {}, method="HEAD")

    assert status == 200 and int(headers["content-length"]) > 0


def test_the_probe_listener_answers_head_without_a_body_so_the_next_answer_on_the_connection_is_whole() -> None:
    listener = HealthListener("127.0.0.1", 0, Heartbeat(), lambda: "ok: ready\n")
    thread = threading.Thread(target=listener.serve_forever, daemon=True)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", listener.server_address[1]), timeout=5) as connection:
            # Two requests on one connection, as a keep-alive client sends them.
            connection.sendall(b"HEAD /readyz HTTP/1.1\r\nHost: probe\r\n\r\n"
                               b"GET /healthz HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
            received = b""
            while chunk := connection.recv(65536):
                received += chunk
    finally:
        listener.shutdown()
        listener.server_close()
        thread.join(timeout=5)
    head, _, rest = received.partition(b"\r\n\r\n")
    get_head, _, get_body = rest.partition(b"\r\n\r\n")

    assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: 10" in head
    assert get_head.startswith(b"HTTP/1.1 200") and get_body == b"ok\n"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.sampled_from([f"rule-{n}" for n in range(14)]), max_size=6), max_size=3000))
def test_rules_counted_together_add_up_per_rule_in_bounded_memory(requests: list[list[str]]) -> None:
    """Each request's rules are counted as one set (Metrics.count_rules):
    read, ``rule_hits`` is what one count per rule would be, whatever sets
    came and however many; never more than RULE_SETS sets are held."""
    metrics = Metrics()
    expected: collections.Counter[str] = collections.Counter()
    for ids in requests:
        metrics.count_rules(ids)
        expected.update(ids)
        assert len(metrics.rule_sets) <= RULE_SETS
    assert metrics.rule_hits == expected
    assert not metrics.rule_sets  # added up by the read
    assert b"sluice_rule_hits_total" in generate_latest(metrics.registry) or not expected


def test_counts_start_from_zero_as_a_counter_does() -> None:
    """The hot path's counts: Counts (a Counter's ``+=`` at a dict's cost)
    and add_one over a plain dict; a key only read is not kept."""
    counts: Counts[str] = Counts()
    counts["a"] += 1
    counts["a"] += 1
    assert counts["b"] == 0 and counts == {"a": 2}
    plain: dict[tuple[str, str], int] = {}
    add_one(plain, ("nginx", "allow"))
    add_one(plain, ("nginx", "allow"))
    add_one(plain, ("nginx", "deny"))
    assert plain == {("nginx", "allow"): 2, ("nginx", "deny"): 1}


def test_the_same_rules_counted_as_a_tuple_or_a_list_add_up_together() -> None:
    """The engine passes one tuple for a set of rules (Engine._rule_set),
    tests and tools a list: both are the same set."""
    metrics = Metrics()
    metrics.count_rules(["a", "b"])
    metrics.count_rules(("a", "b"))
    assert {ids: count.value for ids, count in metrics.rule_sets.items()} == {("a", "b"): 2}
    assert metrics.rule_hits == {"a": 2, "b": 2}


def test_the_engine_counts_its_requests_rules_across_reads_of_the_metrics() -> None:
    """The engine keeps the count of the rules that counted its last
    request (Engine._count_rules): a read of the metrics (a scrape) adds it
    up, and the next request counts again, none lost or counted twice,
    whichever rules count it."""
    harness = Harness("""
rules:
  - id: everyone
    key: [ip]
    limit: {requests: 1000000, per: 1h}
    action: block
  - id: api
    match: {path: {prefix: /api/}}
    key: [ip]
    limit: {requests: 1000000, per: 1h}
    action: block
""")
    metrics = harness.engine.metrics
    expected: collections.Counter[str] = collections.Counter()
    for paths, read in ((["/", "/", "/api/x"], True), (["/api/y", "/api/y"], False), (["/api/z", "/"], True),
                        (["/"], True), (["/"], False)):
        for path in paths:
            harness.decide_now(path=path)
            expected.update(["everyone", "api"] if path.startswith("/api/") else ["everyone"])
        if read:
            assert metrics.rule_hits == expected
    assert metrics.rule_hits == expected and metrics.hits_of("api") == 4


def test_a_flood_of_distinct_rule_sets_is_added_up_past_the_bound() -> None:
    metrics = Metrics()
    for number in range(3 * RULE_SETS):
        metrics.count_rules([f"rule-{number}"])
        assert len(metrics.rule_sets) <= RULE_SETS
    assert metrics.hits_of("rule-0") == 1 and sum(metrics.rule_hits.values()) == 3 * RULE_SETS


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.floats(allow_nan=True), st.sampled_from(LATENCY_BUCKETS)), max_size=30))
def test_the_latency_histogram_counts_each_check_in_the_bucket_bisect_names(seconds: list[float]) -> None:
    """Each observation in the first bucket whose bound is not below it
    (bisect_left, the reference; on a bound, that bound's bucket), and the
    sum and number of them, on either core."""
    histogram = LatencyHistogram()
    expected = [0] * (len(LATENCY_BUCKETS) + 1)
    for value in seconds:
        histogram.observe(value)
        expected[bisect.bisect_left(LATENCY_BUCKETS, value)] += 1
    assert histogram.counts == expected
    assert histogram.count == len(seconds)
    total = 0.0
    for value in seconds:
        total += value
    assert histogram.total == total or (histogram.total != histogram.total and total != total)
