"""deploy/prometheus/alerts.yaml and deploy/grafana/sluice.json: valid for
Prometheus, firing on what they are meant for and not otherwise, and naming
only metrics and labels Sluice's /metrics has. deploy/prometheus/operator:
the same alerts in a PrometheusRule (generated: after a change to
alerts.yaml, ``python -m tests.unit.test_monitoring`` writes it again) and a
ServiceMonitor that scrapes every Sluice of deploy/ under the job the alerts
name.

`promtool` (Debian's prometheus package, which `make test` installs) checks
the rules and runs their unit tests; the dashboard's queries are checked by
the same parser, written as recording rules.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from sidecar.app import SluiceApp
from sidecar.chain import NextAuthAddress, ThenAuth
from sidecar.engine import Engine
from sidecar.shm.pure_zone import Zone as PureZone
from sidecar.store.node import NodeStore, NodeZones
from tests.unit.conftest import Harness, ruleset_from
from tests.unit.deploy_files import (
    ALERT_RULES,
    PROMETHEUS_RULE,
    REPO,
    container,
    deploy_objects_by_source,
    option,
    prometheus_rule_text,
    service_target_ports,
)
from tests.unit.test_app import call, envoy, forward, nginx
from tests.unit.test_metrics import RULES

ALERTS = ALERT_RULES
SERVICE_MONITOR = REPO / "deploy" / "prometheus" / "operator" / "servicemonitor.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "sluice.json"

# Prometheus's own series, which Sluice does not export.
PROMETHEUS_SERIES = {"up"}
METRIC = re.compile(r"\b((?:sluice|process|python)_[a-z0-9_]+|up)\b(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(?:=~|!~|!=|=)\s*"')


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    # `make test` installs it (Debian's prometheus package); its absence is a failure.
    found = shutil.which("promtool")
    assert found, "promtool is missing: apt-get install prometheus (make test does)"
    return subprocess.run([found, *args], capture_output=True, text=True, timeout=60)


# -- what Sluice exports ------------------------------------------------------


def scrape(app: SluiceApp) -> str:
    status, _, body = call(app, "/metrics", {})
    assert status == 200
    return body.decode()


def scrapes() -> list[Metric]:
    """The metric families of a memory-store Sluice that answered checks of
    every front door and kind of rule, and of a Redis-store one (its own
    gauges; nothing connects before a request)."""
    app = SluiceApp(Harness(RULES).engine)
    for path in ("/api/x", "/scrape", "/page"):
        nginx(app, path)
        nginx(app, path)
    envoy(app, "/api/x", addr="198.51.100.8")
    forward(app, "/api/x", peer="198.51.100.9")
    shared = SluiceApp(Engine(ruleset_from('state: {backend: redis, url: "redis://127.0.0.1:1/0"}\nrules: []\n')))
    # With --then-auth (nothing asked yet: its families are there, empty).
    chained_engine = Harness(RULES).engine
    chained = SluiceApp(chained_engine, then_auth=ThenAuth(NextAuthAddress.parse("http://127.0.0.1:1/auth"), 0.5,
                                                           chained_engine.metrics.registry))
    # With the node's table of --workers on the memory backend (its pure twin).
    table = NodeStore(NodeZones.private(1000, 0, zone_type=PureZone), "node")
    node = SluiceApp(Engine(ruleset_from("rules: []\n"), store=table))
    return [family for text in (scrape(app), scrape(shared), scrape(chained), scrape(node))
            for family in text_string_to_metric_families(text)]


def exported(families: list[Metric]) -> dict[str, set[str]]:
    """Sample name -> label names: every sample a family has or may have."""
    names: dict[str, set[str]] = {}
    for family in families:
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        for suffix in suffixes:
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


FAMILIES = scrapes()
EXPORTED = exported(FAMILIES)
# What the docs call each family: a counter with _total, a histogram by its name.
DOCUMENTED_NAMES = {family.name + "_total" if family.type == "counter" else family.name for family in FAMILIES}


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queries += [annotation["expr"] for annotation in dashboard["annotations"]["list"] if "expr" in annotation]
    return queries


def alert_rules() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"]
                                   for rule in group["rules"]]
    return rules


def as_prometheus_query(query: str) -> str:
    """A dashboard query with Grafana's variables given values."""
    return query.replace('=~"$instance"', '=~".*"').replace("$__rate_interval", "1m")


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_and_label_queried_is_one_sluice_exports(source: str) -> None:
    queries = dashboard_queries() if source == "dashboard" else [rule["expr"] for rule in alert_rules()]
    used = [(match.group(1), match.group(2) or "") for query in queries for match in METRIC.finditer(query)]

    assert len({name for name, _ in used}) >= 5
    for name, selector in used:
        if name in PROMETHEUS_SERIES:
            continue
        assert name in EXPORTED, f"{source} queries {name}, which /metrics does not have"
        for label in MATCHER.findall(selector):
            assert label in EXPORTED[name] | {"instance", "job"}, f"{source}: {name} has no label {label}"


def test_the_dashboard_shows_checks_rules_bans_store_errors_and_decision_latency() -> None:
    queried = " ".join(dashboard_queries())

    for name in ("sluice_decisions_total", "sluice_over_limit_total", "sluice_rule_hits_total",
                 "sluice_banned_requests_total", "sluice_active_bans", "sluice_store_errors_total",
                 "sluice_internal_errors_total", "sluice_decision_seconds_bucket"):
        assert name in queried, name


def test_the_dashboard_is_one_grafana_can_import() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}

    assert len({panel["id"] for panel in panels}) == len(panels)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"] and all('instance=~"$instance"' in target["expr"] for target in panel["targets"])


def test_prometheus_parses_every_dashboard_query(tmp_path: Path) -> None:
    rules = tmp_path / "dashboard-queries.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{number}", "expr": as_prometheus_query(query)}
        for number, query in enumerate(dashboard_queries())]}]}))

    result = promtool("check", "rules", str(rules))

    assert result.returncode == 0, result.stdout + result.stderr


# -- the alerts ---------------------------------------------------------------


def test_promtool_accepts_the_alerting_rules() -> None:
    result = promtool("check", "rules", str(ALERTS))

    assert result.returncode == 0, result.stdout + result.stderr


def alert(name: str, severity: str, summary: str, description: str, **labels: str) -> dict[str, Any]:
    """An alert promtool must find firing for the process `a`."""
    return {"exp_labels": {"alertname": name, "instance": "a", "severity": severity, **labels},
            "exp_annotations": {"summary": summary, "description": description}}


def counter(name: str, labels: str, values: str) -> dict[str, str]:
    return {"series": f"{name}{{{labels}}}", "values": values}


# Series of two Sluice processes, one sample a minute: `a` in trouble, `b`
# fine. Each case: the series, when to evaluate, and the one alert expected.
ALERT_CASES: dict[str, tuple[list[dict[str, str]], str, dict[str, Any]]] = {
    "SluiceDown": (
        [counter("up", 'job="sluice",instance="a"', "1 1 0x10"),
         counter("up", 'job="sluice",instance="b"', "1x12")],
        "6m",
        alert("SluiceDown", "critical", "Sluice on a cannot be scraped",
              "The proxies fail open while Sluice is unreachable: requests reach the application unchecked.",
              job="sluice")),
    "SluiceStoreUnavailable": (
        [counter("sluice_store_errors_total", 'instance="a"', "0+60x20"),
         counter("sluice_store_errors_total", 'instance="b"', "0x20")],
        "10m",
        alert("SluiceStoreUnavailable", "critical", "Sluice on a cannot reach its shared store",
              "1 decisions or response reports per second found Redis unavailable; the decisions were allowed "
              "(fail: open) or refused with 503 (fail: closed).")),
    "SluiceFailingOpen": (
        [counter("sluice_internal_errors_total", 'instance="a"', "0+30x20"),
         counter("sluice_internal_errors_total", 'instance="b"', "0x20")],
        "15m",
        alert("SluiceFailingOpen", "warning", "Sluice on a lets checks through after failing inside",
              "500m checks per second failed inside Sluice and were allowed; the log says why (at most every "
              "10 s).")),
    "SluiceBanStorm": (
        [counter("sluice_over_limit_total", 'instance="a",rule="scrapers",action="ban"', "0+20x20"),
         counter("sluice_over_limit_total", 'instance="b",rule="scrapers",action="ban"', "0+1x20"),
         counter("sluice_over_limit_total", 'instance="b",rule="api",action="block"', "0+100x20")],
        "15m",
        alert("SluiceBanStorm", "warning", "Sluice on a issued 200 bans in 10 minutes",
              "An attack from many addresses, or a ban rule whose limit is too low for honest traffic (check "
              "its rule in sluice_over_limit_total).")),
    "SluiceSlowDecisions": (
        # a: nearly every decision between 25 and 100 ms; b: all under 1 ms.
        [counter("sluice_decision_seconds_bucket", f'instance="a",le="{le}"', values)
         for le, values in (("0.001", "0+10x30"), ("0.025", "0+10x30"), ("0.1", "0+1000x30"),
                            ("+Inf", "0+1000x30"))]
        + [counter("sluice_decision_seconds_bucket", f'instance="b",le="{le}"', "0+1000x30")
           for le in ("0.001", "0.025", "0.1", "+Inf")],
        "20m",
        alert("SluiceSlowDecisions", "warning", "Sluice on a takes 99.24ms for 1% of its decisions",
              "Every checked request waits for its decision. With Redis, look at Redis's latency; otherwise "
              "at Sluice's CPU.")),
    "SluiceReloadFailed": (
        [counter("sluice_reloads_total", 'instance="a",result="failure"', "0 0 0 1 1 1"),
         counter("sluice_reloads_total", 'instance="b",result="failure"', "0x5"),
         counter("sluice_reloads_total", 'instance="b",result="success"', "0 1 2 3 4 5")],
        "5m",
        alert("SluiceReloadFailed", "warning", "Sluice on a refused a new rules file",
              "The old rules keep running; the log (or `sluice check FILE`) gives every error with its "
              "line.")),
}


def test_every_alert_has_a_case_below() -> None:
    assert {rule["alert"] for rule in alert_rules()} == set(ALERT_CASES)


def test_each_alert_fires_for_the_process_in_trouble_and_for_no_other(tmp_path: Path) -> None:
    tests = [{"name": name, "interval": "1m", "input_series": series,
              "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": [expected]}]}
             for name, (series, at, expected) in ALERT_CASES.items()]
    cases = tmp_path / "alerts-test.yaml"
    cases.write_text(yaml.safe_dump({"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": tests}))

    result = promtool("test", "rules", str(cases))

    assert result.returncode == 0, result.stdout + result.stderr


# -- the Prometheus Operator --------------------------------------------------


def test_the_prometheus_rule_is_alerts_yaml_as_generated() -> None:
    assert PROMETHEUS_RULE.read_text() == prometheus_rule_text(), \
        "deploy/prometheus/operator/prometheusrule.yaml is stale: python -m tests.unit.test_monitoring writes it"
    assert yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"] == yaml.safe_load(ALERTS.read_text())


def test_the_service_monitor_scrapes_the_metrics_of_every_sluice_of_deploy_as_the_job_the_alerts_watch() -> None:
    monitor = yaml.safe_load(SERVICE_MONITOR.read_text())["spec"]
    [endpoint] = monitor["endpoints"]
    [down] = [rule for rule in alert_rules() if rule["alert"] == "SluiceDown"]
    [job] = re.findall(r'job="([^"]+)"', down["expr"])
    scraped = set()
    for source, objects in deploy_objects_by_source().items():
        services = [item for item in objects if item["kind"] == "Service"
                    and monitor["selector"]["matchLabels"].items() <= item["metadata"].get("labels", {}).items()]
        if not services:
            continue
        [service] = services
        [port] = [port for port in service["spec"]["ports"] if port["name"] == endpoint["port"]]
        [deployment] = [item for item in objects if item["kind"] == "Deployment"
                        and service["spec"]["selector"].items()
                        <= item["spec"]["template"]["metadata"]["labels"].items()]
        sluice = container(deployment, "sluice")
        ports = {port_["name"]: port_["containerPort"] for port_ in sluice["ports"]}
        target = ports.get(port["targetPort"], port["targetPort"])

        assert port["targetPort"] in service_target_ports(deployment), source
        assert target == int(option(sluice["args"], "--port")), source
        # The series' job is the Service's label that jobLabel names.
        assert service["metadata"]["labels"][monitor["jobLabel"]] == job, source
        scraped.add(source)

    assert endpoint["path"] == "/metrics"
    assert {"sluice-service/sluice.yaml", "kubernetes/ (kustomize build)",
            "kubernetes/redis/ (kustomize build)"} <= scraped


# -- the documentation ---------------------------------------------------------

# The metrics table is on the operating page; any page may name a metric.
OPERATING = (REPO / "docs" / "operating.md").read_text()
DOCUMENTATION = "\n".join(page.read_text() for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
# Backticked names of the documentation that are not metrics.
NOT_METRICS = {"sluice_hook", "sluice_grpc", "sluice_refusals"}  # Envoy cluster names, an nginx cache zone


def test_the_docs_list_every_metric_sluice_exports_and_name_no_other() -> None:
    section = OPERATING[OPERATING.index("## Metrics\n"):]
    section = section[:re.search(r"\n#{2,3} ", section).start()]
    families = {name for name in DOCUMENTED_NAMES if name.startswith("sluice_")}
    everywhere = set(re.findall(r"`(sluice_[a-z_]+)(?:\{[^`]*\})?`", DOCUMENTATION)) - NOT_METRICS

    assert set(re.findall(r"`(sluice_[a-z_]+)", section)) == families
    assert everywhere <= families, everywhere - families


if __name__ == "__main__":
    PROMETHEUS_RULE.write_text(prometheus_rule_text())
