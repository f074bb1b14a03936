"""deploy/kubernetes: nginx, Sluice and the application in one pod (Sluice
a native sidecar), and the Redis variant with three replicas.

No cluster is needed: the kustomizations are built here as ``kubectl apply
-k`` builds them (tests/unit/deploy_files.py), and the objects are checked
for what a cluster would refuse or silently get wrong: references between
objects, ports and probes against the commands, the order the pod starts in,
the rules Sluice reads and how a change reaches it, and the nginx
configuration, which must be the shipped template rendered for the pod and
accepted by ``nginx -t``. What every manifest of deploy/ must be (valid for
the API server, hardened) is checked in test_gateway_manifests.py.

After a change to the nginx template, write the pod's configuration again:
``python -m tests.unit.test_kubernetes``.
"""

from __future__ import annotations

import os
import re
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar import rendering as launcher
from sidecar.rendering import StackPorts, template_variables
from sidecar.rules import Ruleset, load_ruleset
from tests.unit.deploy_files import (
    KUBERNETES,
    Build,
    all_containers,
    build,
    container,
    dockerfile_user,
    is_sidecar,
    nginx_test,
    option,
    pod_spec,
    port_number,
    service_target_ports,
)

BASE = KUBERNETES / "base"
REDIS_VARIANT = KUBERNETES / "redis"
VARIANTS = {"one-pod": KUBERNETES, "redis": REDIS_VARIANT}
NGINX_CONFIG = BASE / "nginx" / "sluice.conf"


@pytest.fixture(params=sorted(VARIANTS), scope="module")
def variant(request: pytest.FixtureRequest) -> Build:
    return build(VARIANTS[request.param])


def sluice_deployment(manifests: Build) -> dict[str, Any]:
    return manifests.named("Deployment", "sluice")


def sluice_command(manifests: Build) -> list[str]:
    command: list[str] = container(sluice_deployment(manifests), "sluice")["args"]
    return command


def mounted_file(manifests: Build, deployment: dict[str, Any], container_name: str, path: str) -> str:
    """The content a container sees at ``path``, from a ConfigMap volume."""
    volumes = {volume["name"]: volume for volume in pod_spec(deployment)["volumes"]}
    for mount in container(deployment, container_name)["volumeMounts"]:
        relative = os.path.relpath(path, mount["mountPath"])
        if not relative.startswith(".."):
            config_map = volumes[mount["name"]]["configMap"]["name"]
            return manifests.config_maps[config_map][relative]
    raise AssertionError(f"nothing is mounted at {path} in {container_name}")


def pod_nginx_variables(manifests: Build) -> dict[str, str]:
    """The template's values in the pod: Sluice and the application on the
    pod's loopback, nginx listening on every address (the Service's port),
    and the launcher's timeouts for these rules."""
    deployment = sluice_deployment(manifests)
    sluice = sluice_command(manifests)
    rules = load_ruleset_text(mounted_file(manifests, deployment, "sluice", option(sluice, "--config")))
    hook_host, _, hook_port = option(sluice, "--hook-udp").rpartition(":")
    assert hook_host == "127.0.0.1"  # nginx is in the pod: its reports stay on loopback
    ports = StackPorts(nginx=port_number(container(deployment, "nginx"), "http"),
                       sluice=int(option(sluice, "--port")),
                       upstream=int(option(container(deployment, "app")["args"], "--port")),
                       envoy=0, envoy_admin=0, sluice_hook=int(hook_port))
    variables = template_variables(ports, "127.0.0.1", rules)
    # The root file system is read-only: nginx's cache goes to its /tmp.
    return {**variables, "SLUICE_LISTEN": str(ports.nginx), "SLUICE_CACHE_DIR": "/tmp/sluice-cache"}


def load_ruleset_text(text: str) -> Ruleset:
    """A rules file's text loaded as Sluice loads it at start."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "rules.yaml"
        path.write_text(text)
        return load_ruleset(str(path))


def rendered_for_the_pod() -> str:
    """The shipped site rendered for the pod, its three snippets written in
    place of their include lines: one file, one ConfigMap key."""
    variables = pod_nginx_variables(build(KUBERNETES))
    snippets = Path(str(launcher.DEFAULT_TEMPLATE)).parent / launcher.SNIPPETS_DIR
    lines = []
    for line in launcher.render_template_file(launcher.DEFAULT_TEMPLATE, variables, "nginx").splitlines(keepends=True):
        match = re.fullmatch(r"(\s*)include conf\.d/snippets/([\w-]+\.conf);\n", line)
        if match is None:
            lines.append(line)
            continue
        indent, name = match.groups()
        snippet = launcher.render_template_file(snippets / f"{name}{launcher.TEMPLATE_SUFFIX}", variables, "nginx")
        lines.append(f"{indent}# ---- {name}, the shipped snippet ----\n")
        lines += [f"{indent}{text}" if text.strip() else text for text in snippet.splitlines(keepends=True)]
    return "".join(lines)


# -- references between the objects ---------------------------------------


def test_every_volume_names_a_config_map_the_kustomization_makes_and_every_mount_a_volume(variant: Build) -> None:
    for deployment in variant.of_kind("Deployment"):
        spec = pod_spec(deployment)
        volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in variant.config_maps, volume
        for item in all_containers(spec):
            for mount in item.get("volumeMounts", []):
                assert mount["name"] in volumes, (item["name"], mount)


def test_each_deployment_selects_its_own_pods_and_each_service_selects_a_deployment(variant: Build) -> None:
    deployments = variant.of_kind("Deployment")
    for deployment in deployments:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for service in variant.of_kind("Service"):
        selector = service["spec"]["selector"].items()
        [selected] = [item for item in deployments
                      if selector <= item["spec"]["template"]["metadata"]["labels"].items()]
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in service_target_ports(selected), (service["metadata"]["name"], port)


def test_the_service_sends_clients_to_nginx() -> None:
    manifests = build(KUBERNETES)
    [port] = manifests.named("Service", "sluice")["spec"]["ports"]
    nginx = container(sluice_deployment(manifests), "nginx")

    assert port_number(nginx, port["targetPort"]) == int(pod_nginx_variables(manifests)["SLUICE_LISTEN"])


# -- Sluice's container -----------------------------------------------------


def test_sluice_is_a_native_sidecar_that_nginx_and_the_app_wait_for(variant: Build) -> None:
    spec = pod_spec(sluice_deployment(variant))
    sluice = container(sluice_deployment(variant), "sluice")
    startup = sluice["startupProbe"]["httpGet"]

    # The kubelet starts the containers once every init container before them
    # has started and passed its startupProbe; a sidecar keeps running.
    assert [item["name"] for item in spec["initContainers"]] == ["sluice"]
    assert is_sidecar(sluice)
    assert {item["name"] for item in spec["containers"]} == {"nginx", "app"}
    # Ready means answering where nginx asks: the check port, not the health listener.
    assert startup["path"] == "/readyz"
    assert port_number(sluice, startup["port"]) == int(option(sluice["args"], "--port"))


def test_sluice_listens_where_its_ports_probes_and_scrape_annotations_say(variant: Build) -> None:
    deployment = sluice_deployment(variant)
    sluice = container(deployment, "sluice")
    command = sluice["args"]
    health_host, _, health_port = option(command, "--health").rpartition(":")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]

    assert command[:2] == ["sluice", "serve"]
    # The kubelet and Prometheus connect to the pod's address, not its loopback.
    assert (option(command, "--host"), health_host) == ("0.0.0.0", "0.0.0.0")
    assert port_number(sluice, "sluice") == int(option(command, "--port")) == int(annotations["prometheus.io/port"])
    assert port_number(sluice, "health") == int(health_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert sluice[probe]["httpGet"]["path"] == path
        assert port_number(sluice, sluice[probe]["httpGet"]["port"]) == int(health_port)


def test_sluice_reads_a_valid_rules_file_from_its_config_map(variant: Build) -> None:
    text = mounted_file(variant, sluice_deployment(variant), "sluice", option(sluice_command(variant), "--config"))

    assert load_ruleset_text(text).rules


def test_sluice_runs_as_the_images_numeric_user() -> None:
    uid, gid = dockerfile_user()
    images = [item for item in all_containers(pod_spec(sluice_deployment(build(KUBERNETES))))
              if item["image"].startswith("sluice-ratelimit:")]

    assert {item["name"] for item in images} == {"sluice", "app"}
    for item in images:
        context = item["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"]) == (uid, gid), item["name"]


def test_a_changed_rules_file_reaches_the_running_pods_and_a_changed_nginx_configuration_new_ones(
        variant: Build) -> None:
    # The rules ConfigMap keeps its name: kubectl apply changes it in place,
    # the kubelet swaps the mounted folder's files and Sluice reloads them.
    # nginx reads its configuration only at start: a new name, new pods.
    assert variant.renamed_on_change("sluice-rules") is False
    assert variant.renamed_on_change("sluice-nginx") is True


# -- nginx in the pod ---------------------------------------------------------


def test_the_nginx_config_map_is_the_shipped_template_rendered_for_the_pod() -> None:
    assert NGINX_CONFIG.read_text() == rendered_for_the_pod(), \
        "deploy/kubernetes/base/nginx/sluice.conf is stale: python -m tests.unit.test_kubernetes writes it"


def test_nginx_asks_the_sluice_of_its_pod_and_reports_to_it(variant: Build) -> None:
    deployment = sluice_deployment(variant)
    config = mounted_file(variant, deployment, "nginx", "/etc/nginx/conf.d/sluice.conf")
    command = sluice_command(variant)

    assert f"server 127.0.0.1:{option(command, '--port')};" in config
    assert f"syslog:server={option(command, '--hook-udp')}," in config
    assert f"listen {port_number(container(deployment, 'nginx'), 'http')};" in config


def test_nginx_accepts_the_pods_configuration(tmp_path: Path) -> None:
    result = nginx_test(tmp_path, NGINX_CONFIG.read_text())

    assert result.returncode == 0, result.stderr


# -- the Redis variant --------------------------------------------------------


def test_the_redis_variant_runs_three_replicas_on_one_shared_store() -> None:
    manifests = build(REDIS_VARIANT)
    deployment = sluice_deployment(manifests)
    rules = load_ruleset_text(mounted_file(manifests, deployment, "sluice",
                                           option(sluice_command(manifests), "--config")))
    url = urllib.parse.urlsplit(rules.url)
    service = manifests.named("Service", url.hostname or "")
    [port] = [item for item in service["spec"]["ports"] if item["port"] == (url.port or 6379)]
    redis = manifests.named("Deployment", "sluice-redis")

    assert deployment["spec"]["replicas"] == 3
    assert rules.backend == "redis"
    assert port_number(container(redis, "redis"), port["targetPort"]) == 6379
    assert service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()


def test_the_redis_variant_has_the_same_rules_but_for_the_state() -> None:
    one_pod = yaml.safe_load((BASE / "rules.yaml").read_text())
    shared = yaml.safe_load((REDIS_VARIANT / "rules.yaml").read_text())

    assert shared.pop("state")["backend"] == "redis"
    assert shared == one_pod


def test_the_one_pod_variant_keeps_the_memory_store() -> None:
    manifests = build(KUBERNETES)
    rules = load_ruleset_text(mounted_file(manifests, sluice_deployment(manifests), "sluice",
                                           option(sluice_command(manifests), "--config")))

    assert (rules.backend, sluice_deployment(manifests)["spec"]["replicas"]) == ("memory", 1)


if __name__ == "__main__":
    NGINX_CONFIG.write_text(rendered_for_the_pod())
