"""deploy/: Sluice for Kubernetes, Envoy Gateway and Istio, checked without a cluster.

Every object deploy/ gives the API server (kustomizations built as kubectl
builds them) is validated against Kubernetes 1.30's schemas, or ours for a
custom resource (deploy_files.validate_manifest), and every pod is hardened
and names the rules file Sluice reads from a ConfigMap that can change under it.

Each manifest is read as the API server would get it: its kind under the
API version that serves it, the fields Sluice depends on present, and every
value that must match Sluice (ports, paths, header names, the headers the
Envoy fragment passes on) taken from Sluice itself rather than repeated here.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar import cli
from sidecar.actions import over_limit_headers
from sidecar.challenge import SOLUTION_PATH
from sidecar.frontdoors.challenge_solution import CHALLENGE_PATH
from sidecar.frontdoors.envoy import ENVOY_AUTH_PREFIX
from sidecar.rendering import PACKAGE_TEMPLATES, expand_includes
from sidecar.rules import load_ruleset
from tests.unit.deploy_files import (
    KUBERNETES,
    all_containers,
    build,
    deploy_manifests,
    deploy_objects_by_source,
    hardening_problems,
    pod_spec,
    validate_manifest,
)

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

# The API version that serves each kind the manifests use.
API_VERSIONS = {
    "ConfigMap": "v1",
    "Service": "v1",
    "Deployment": "apps/v1",
    "PodDisruptionBudget": "policy/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1",
    "SecurityPolicy": "gateway.envoyproxy.io/v1alpha1",
    "ClientTrafficPolicy": "gateway.envoyproxy.io/v1alpha1",
    "AuthorizationPolicy": "security.istio.io/v1",
    "VirtualService": "networking.istio.io/v1",
    "IstioOperator": "install.istio.io/v1alpha1",
}


# Sluice as a Service for a gateway or mesh, and the gateway's and mesh's own.
FOLDERS = ("sluice-service", "envoy-gateway", "istio")


def manifests() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(path for folder in FOLDERS for path in (DEPLOY / folder).rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                found.append((str(path.relative_to(DEPLOY)), document))
    return found


MANIFESTS = manifests()


def the(kind: str, name: str | None = None) -> dict[str, Any]:
    matching = [doc for _, doc in MANIFESTS
                if doc["kind"] == kind and name in (None, doc.get("metadata", {}).get("name"))]
    assert len(matching) == 1, (kind, name, len(matching))
    return matching[0]


def serve_default(option: str) -> Any:
    (parameter,) = [p for p in cli.serve.params if p.name == option]
    return parameter.default


SLUICE_PORT = serve_default("port")
ADDRESS_HEADER = "x-sluice-client-addr"


def envoy_filters_fragment() -> dict[str, Any]:
    text = (Path(str(PACKAGE_TEMPLATES)) / "envoy" / "fragments" / "sluice-http-filters.yaml.template").read_text()
    filters = yaml.safe_load(expand_includes(text).replace("${SLUICE_CHECK_TIMEOUT}", "1s"))
    (ext_authz,) = [f["typed_config"] for f in filters if f["name"] == "envoy.filters.http.ext_authz"]
    return dict(ext_authz)


EXT_AUTHZ = envoy_filters_fragment()
RESPONSE = EXT_AUTHZ["http_service"]["authorization_response"]
(ADDRESS,) = [h["value"] for h in EXT_AUTHZ["http_service"]["authorization_request"]["headers_to_add"]
              if h["key"] == ADDRESS_HEADER]


def as_istio_patterns(matchers: dict[str, Any]) -> list[str]:
    """An Envoy ListStringMatcher as Istio writes it: "name", or "prefix*"."""
    return [m["exact"] if "exact" in m else m["prefix"] + "*" for m in matchers["patterns"]]


# -- every object of deploy/ ---------------------------------------------------

DEPLOYED = deploy_manifests()


@pytest.mark.parametrize(("source", "document"), DEPLOYED,
                         ids=[f"{source}:{doc.get('kind')}/{doc.get('metadata', {}).get('name', '')}"
                              for source, doc in DEPLOYED])
def test_every_object_of_deploy_is_valid_for_the_kubernetes_api(source: str, document: dict[str, Any]) -> None:
    assert validate_manifest(document) == []


def test_deploy_has_kubernetes_objects_custom_resources_and_every_kustomization_built() -> None:
    kinds = {document["kind"] for _, document in DEPLOYED}
    built = {source for source, _ in DEPLOYED if source.endswith("(kustomize build)")}

    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    assert {"ServiceMonitor", "PrometheusRule", "HTTPRoute", "SecurityPolicy", "AuthorizationPolicy"} <= kinds
    assert built == {f"{path.parent.relative_to(DEPLOY)}/ (kustomize build)"
                     for path in DEPLOY.rglob("kustomization.yaml")}


def sidecar_deployment() -> dict[str, Any]:
    return copy.deepcopy(build(KUBERNETES).named("Deployment", "sluice"))


def service_monitor() -> dict[str, Any]:
    [monitor] = [copy.deepcopy(doc) for _, doc in DEPLOYED if doc["kind"] == "ServiceMonitor"]
    return monitor


def misspell_a_probe(deployment: dict[str, Any]) -> None:
    pod_spec(deployment)["containers"][0]["readinesProbe"] = {"tcpSocket": {"port": 8080}}


def give_a_container_restart_policy(deployment: dict[str, Any]) -> None:
    pod_spec(deployment)["containers"][0]["restartPolicy"] = "Always"


def make_sluice_a_plain_init_container(deployment: dict[str, Any]) -> None:
    del pod_spec(deployment)["initContainers"][0]["restartPolicy"]


def quote_the_replicas(deployment: dict[str, Any]) -> None:
    deployment["spec"]["replicas"] = "3"


def misspell_an_endpoint_field(monitor: dict[str, Any]) -> None:
    monitor["spec"]["endpoints"][0]["paht"] = "/metrics"


def give_an_interval_no_unit(monitor: dict[str, Any]) -> None:
    monitor["spec"]["endpoints"][0]["interval"] = "15"


# Each mistake, and the field the refusal must name.
BREAKAGES: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None], str]] = {
    "unknown field": (sidecar_deployment, misspell_a_probe, "readinesProbe"),
    "restartPolicy on a container": (sidecar_deployment, give_a_container_restart_policy, "restartPolicy"),
    "probes on a plain init container": (sidecar_deployment, make_sluice_a_plain_init_container, "startupProbe"),
    "wrong type": (sidecar_deployment, quote_the_replicas, "$.spec.replicas"),
    "custom resource, unknown field": (service_monitor, misspell_an_endpoint_field, "paht"),
    "custom resource, bad value": (service_monitor, give_an_interval_no_unit, "$.spec.endpoints[0].interval"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_validation_refuses_a_broken_manifest_naming_the_field(breakage: str) -> None:
    original, breaks, field = BREAKAGES[breakage]
    document = original()
    assert validate_manifest(document) == []

    breaks(document)
    problems = validate_manifest(document)

    assert problems and any(field in problem for problem in problems), problems


@pytest.mark.parametrize("document", [
    {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyExtensionPolicy", "metadata": {"name": "x"}},
    {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": 1}},
    {"kind": "ConfigMap"},
    ["not", "a", "mapping"],
])
def test_validation_refuses_unknown_kinds_and_what_is_not_an_object(document: Any) -> None:
    assert validate_manifest(document)


def test_every_pod_of_deploy_is_hardened_and_bounded() -> None:
    deployments = [doc for _, doc in DEPLOYED if doc["kind"] == "Deployment"]

    assert len(deployments) >= 4
    for deployment in deployments:
        assert hardening_problems(deployment) == []


def test_hardening_names_what_a_pod_lacks() -> None:
    deployment = sidecar_deployment()
    del pod_spec(deployment)["initContainers"][0]["securityContext"]["readOnlyRootFilesystem"]
    del pod_spec(deployment)["containers"][1]["resources"]["limits"]

    assert hardening_problems(deployment) == [
        "Deployment sluice: container sluice needs securityContext.readOnlyRootFilesystem: true",
        "Deployment sluice: container app needs resources.limits.memory"]


def sluice_containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    """The containers of a Sluice image, which must each say what they run."""
    found = [item for item in all_containers(pod_spec(deployment)) if "sluice" in item["image"].split("/")[-1]]
    for item in found:
        assert item.get("command") or item.get("args"), f"{item['name']}: the image's CMD, which names no rules"
    return found


def test_every_sluice_names_its_rules_file_in_a_config_map_folder_that_follows_changes() -> None:
    serving = 0
    for _, deployment in ((s, d) for s, d in DEPLOYED if d["kind"] == "Deployment"):
        volumes = {volume["name"]: volume for volume in pod_spec(deployment).get("volumes", [])}
        for item in sluice_containers(deployment):
            argv = item.get("command", []) + item.get("args", [])
            if argv[:2] != ["sluice", "serve"]:
                continue
            serving += 1
            # Without --config (or SLUICE_CONFIG), sluice serve refuses to start.
            assert "--config" in argv, f"{deployment['metadata']['name']}: {item['name']} names no rules file"
            rules = Path(argv[argv.index("--config") + 1])
            [mount] = [mount for mount in item["volumeMounts"] if Path(mount["mountPath"]) == rules.parent]
            # A subPath mount is a copy the kubelet never updates.
            assert "subPath" not in mount and "configMap" in volumes[mount["name"]], (item["name"], mount)
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        assert not [key for key in annotations if key.startswith("checksum/")], "pods restarted on a change"

    assert serving >= 4


def test_every_sluice_pod_has_a_disruption_budget_that_lets_a_drain_go_on() -> None:
    budgeted = []
    for source, objects in deploy_objects_by_source().items():
        deployments = [item for item in objects if item["kind"] == "Deployment"]
        budgets = [item for item in objects if item["kind"] == "PodDisruptionBudget"]
        for budget in budgets:
            selector = budget["spec"]["selector"]["matchLabels"].items()
            [deployment] = [item for item in deployments
                            if selector <= item["spec"]["template"]["metadata"]["labels"].items()]
            assert deployment["metadata"]["name"] == "sluice", source
            # One pod at a time: a drain goes on with one replica (a minimum
            # of one available would stop it) and leaves two of three.
            assert budget["spec"]["maxUnavailable"] == 1, source
            # A pod that is not ready answers nothing: evicting it never waits.
            assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow", source
        if any(item["metadata"]["name"] == "sluice" for item in deployments):
            assert budgets, f"{source}: Sluice has no PodDisruptionBudget"
            budgeted.append(source)

    assert len(budgeted) >= 4


# -- every manifest ---------------------------------------------------------


@pytest.mark.parametrize(("path", "document"), MANIFESTS, ids=[f"{path}:{doc.get('kind')}" for path, doc in MANIFESTS])
def test_each_manifest_is_a_known_kind_under_its_api_version(path: str, document: dict[str, Any]) -> None:
    assert set(document) >= {"apiVersion", "kind", "spec" if document["kind"] != "ConfigMap" else "data"}
    assert API_VERSIONS[document["kind"]] == document["apiVersion"]
    if document["kind"] != "IstioOperator":
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", document["metadata"]["name"])


def test_every_folder_has_its_manifests() -> None:
    assert {path.split("/")[0] for path, _ in MANIFESTS} == set(FOLDERS)


# -- Sluice's own pod ---------------------------------------------------------


def test_the_pod_serves_the_rules_of_its_config_map_on_sluices_port(tmp_path: Path) -> None:
    deployment, service, rules = the("Deployment", "sluice"), the("Service", "sluice"), the("ConfigMap")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    (mount,) = container["volumeMounts"]
    (volume,) = deployment["spec"]["template"]["spec"]["volumes"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}

    assert args[:2] == ["sluice", "serve"]
    assert int(args[args.index("--port") + 1]) == ports["http"] == SLUICE_PORT
    assert args[args.index("--health") + 1].endswith(f":{ports['health']}")
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert volume == {"name": mount["name"], "configMap": {"name": rules["metadata"]["name"]}}
    config = Path(args[args.index("--config") + 1])
    assert config.parent == Path(mount["mountPath"])
    (tmp_path / config.name).write_text(rules["data"][config.name])
    assert load_ruleset(str(tmp_path / config.name)).rules
    (service_port,) = service["spec"]["ports"]
    assert (service_port["port"], service_port["targetPort"]) == (SLUICE_PORT, "http")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["template"]["metadata"]["labels"] == deployment["spec"]["selector"]["matchLabels"]


# -- Envoy Gateway ------------------------------------------------------------


def test_envoy_gateway_sends_each_check_to_sluices_envoy_endpoint_and_fails_open() -> None:
    ext_auth = the("SecurityPolicy")["spec"]["extAuth"]
    (backend,) = ext_auth["http"]["backendRefs"]
    service = the("Service", "sluice")

    assert (backend["name"], backend["port"]) == (service["metadata"]["name"], SLUICE_PORT)
    assert ext_auth["http"]["path"] == ENVOY_AUTH_PREFIX
    assert ext_auth["failOpen"] is True
    assert ext_auth["timeout"] == EXT_AUTHZ["http_service"]["server_uri"]["timeout"]
    # Only the headers named go; the client's address must be one of them.
    assert ADDRESS_HEADER in ext_auth["headersToExtAuth"]
    assert all(name == name.lower() for name in ext_auth["headersToExtAuth"])


def test_envoy_gateway_sets_the_client_address_as_the_fragment_does() -> None:
    policy = the("ClientTrafficPolicy")
    (target,) = policy["spec"]["targetRefs"]
    (header,) = policy["spec"]["headers"]["earlyRequestHeaders"]["set"]

    assert (target["group"], target["kind"]) == ("gateway.networking.k8s.io", "Gateway")
    assert header == {"name": ADDRESS_HEADER, "value": ADDRESS}


def test_envoy_gateway_passes_observe_headers_to_the_application() -> None:
    to_backend = the("SecurityPolicy")["spec"]["extAuth"]["http"]["headersToBackend"]

    # Exact names: Envoy Gateway matches these exactly.
    assert to_backend == [name.lower() for name, _ in over_limit_headers(limit=1, reset=1)]


def test_the_challenge_route_reaches_sluice_unchecked() -> None:
    route, policy = the("HTTPRoute", "sluice-challenge"), the("SecurityPolicy")
    (rule,) = route["spec"]["rules"]
    (rewrite,) = rule["filters"]
    (backend,) = rule["backendRefs"]
    (gateway,) = the("ClientTrafficPolicy")["spec"]["targetRefs"]

    assert rule["matches"] == [{"path": {"type": "Exact", "value": SOLUTION_PATH}}]
    assert rewrite == {"type": "URLRewrite",
                       "urlRewrite": {"path": {"type": "ReplaceFullPath", "replaceFullPath": CHALLENGE_PATH}}}
    assert (backend["name"], backend["port"]) == ("sluice", SLUICE_PORT)
    assert [parent["name"] for parent in route["spec"]["parentRefs"]] == [gateway["name"]]
    assert route["metadata"]["name"] not in [target["name"] for target in policy["spec"]["targetRefs"]]


# -- Istio --------------------------------------------------------------------


def istio_provider() -> tuple[str, dict[str, Any]]:
    (provider,) = the("IstioOperator")["spec"]["meshConfig"]["extensionProviders"]
    return provider["name"], provider["envoyExtAuthzHttp"]


def test_istio_sends_each_check_to_sluices_envoy_endpoint_and_fails_open() -> None:
    _, provider = istio_provider()
    service = the("Service", "sluice")

    assert provider["service"] == f"{service['metadata']['name']}.default.svc.cluster.local"
    assert provider["port"] == SLUICE_PORT
    assert provider["pathPrefix"] == ENVOY_AUTH_PREFIX
    assert provider["failOpen"] is True
    assert provider["timeout"] == EXT_AUTHZ["http_service"]["server_uri"]["timeout"]
    assert provider["includeAdditionalHeadersInCheck"] == {ADDRESS_HEADER: ADDRESS}


def test_istio_passes_on_the_headers_the_fragment_does() -> None:
    _, provider = istio_provider()

    assert provider["headersToDownstreamOnDeny"] == as_istio_patterns(RESPONSE["allowed_client_headers"])
    assert provider["headersToDownstreamOnAllow"] == as_istio_patterns(RESPONSE["allowed_client_headers_on_success"])


def test_the_custom_policy_names_the_provider_and_leaves_the_challenge_unchecked() -> None:
    name, _ = istio_provider()
    policy = the("AuthorizationPolicy")["spec"]

    assert (policy["action"], policy["provider"]) == ("CUSTOM", {"name": name})
    (rule,) = policy["rules"]
    (to,) = rule["to"]
    assert to["operation"] == {"notPaths": [SOLUTION_PATH]}


def test_the_istio_challenge_route_comes_first_and_carries_the_client_address() -> None:
    first = the("VirtualService")["spec"]["http"][0]
    (destination,) = first["route"]

    assert first["match"] == [{"uri": {"exact": SOLUTION_PATH}}]
    assert first["rewrite"] == {"uri": CHALLENGE_PATH}
    assert first["headers"]["request"]["set"] == {ADDRESS_HEADER: ADDRESS}
    assert destination["destination"] == {"host": "sluice.default.svc.cluster.local",
                                           "port": {"number": SLUICE_PORT}}
