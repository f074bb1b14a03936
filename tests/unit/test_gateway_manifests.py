"""deploy/: Sluice for Kubernetes, Envoy Gateway and Istio, checked without a cluster.

Each manifest is read as the API server would get it: its kind under the
API version that serves it, the fields Sluice depends on present, and every
value that must match Sluice (ports, paths, header names, the headers the
Envoy fragment passes on) taken from Sluice itself rather than repeated here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar import cli
from sidecar.actions import over_limit_headers
from sidecar.challenge import SOLUTION_PATH
from sidecar.frontdoors.challenge_solution import CHALLENGE_PATH
from sidecar.frontdoors.envoy import ENVOY_AUTH_PREFIX
from sidecar.launcher import PACKAGE_TEMPLATES, expand_includes
from sidecar.rules import load_ruleset

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

# The API version that serves each kind the manifests use.
API_VERSIONS = {
    "ConfigMap": "v1",
    "Service": "v1",
    "Deployment": "apps/v1",
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
    matching = [doc for _, doc in MANIFESTS if doc["kind"] == kind and name in (None, doc.get("metadata", {}).get("name"))]
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
