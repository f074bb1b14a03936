"""Reading what the repository ships for containers: the Dockerfile's
instructions, the Kubernetes manifests as ``kubectl apply -k`` builds them
and as the API server would judge them (``validate_manifest``), and nginx's
own verdict on a configuration."""

from __future__ import annotations

import copy
import functools
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from devstack.launcher import find_nginx
from sidecar.rendering import nginx_main_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
# Prometheus's own rule file, and the PrometheusRule generated from it.
ALERT_RULES = DEPLOY / "prometheus" / "alerts.yaml"
PROMETHEUS_RULE = DEPLOY / "prometheus" / "operator" / "prometheusrule.yaml"


# -- the Dockerfile -----------------------------------------------------------


def dockerfile_instructions(path: Path = REPO / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        pending += stripped[:-1] + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            keyword, _, arguments = pending.partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
            pending = ""
    return instructions


def dockerfile_user() -> tuple[int, int]:
    """The image's ``USER uid:gid``, which must be numeric."""
    [user] = [arguments for keyword, arguments in dockerfile_instructions() if keyword == "USER"]
    uid, _, gid = user.partition(":")
    return int(uid), int(gid)


def exec_form(arguments: str) -> list[str]:
    """A JSON-array ``CMD``/``HEALTHCHECK CMD``, as a list; else the shell words."""
    return yaml.safe_load(arguments) if arguments.startswith("[") else shlex.split(arguments)


# -- Kubernetes ---------------------------------------------------------------

# What the kustomizations may use: what `build` below understands. Anything
# else would make these tests read other manifests than kubectl applies.
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "configMapGenerator", "replicas"}
GENERATOR_FIELDS = {"name", "files", "behavior", "options"}
GENERATOR_OPTIONS = {"disableNameSuffixHash"}


@dataclass
class Build:
    """The objects a kustomization applies; generated ConfigMaps by name
    (kustomize suffixes their names with a hash of their content and rewrites
    the references, unless their options say ``disableNameSuffixHash``)."""

    objects: list[dict[str, Any]]
    config_maps: dict[str, dict[str, str]]
    config_map_options: dict[str, dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [item for item in self.objects if item["kind"] == kind]

    def named(self, kind: str, name: str) -> dict[str, Any]:
        [found] = [item for item in self.of_kind(kind) if item["metadata"]["name"] == name]
        return found

    def renamed_on_change(self, config_map: str) -> bool:
        """Whether a new content gives the ConfigMap a new name, and so new pods."""
        return not self.config_map_options[config_map].get("disableNameSuffixHash", False)

    def applied(self) -> list[dict[str, Any]]:
        """Every object the API server gets, the generated ConfigMaps included."""
        generated = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}
                     for name, data in self.config_maps.items()]
        return self.objects + generated


def build(directory: Path) -> Build:
    """What ``kubectl apply -k directory`` applies, for the fields in
    KUSTOMIZATION_FIELDS."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: kustomization fields these tests do not read: {unknown}"
    objects: list[dict[str, Any]] = []
    config_maps: dict[str, dict[str, str]] = {}
    options: dict[str, dict[str, Any]] = {}
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            base = build(path)
            objects += base.objects
            config_maps.update(base.config_maps)
            options.update(base.config_map_options)
        else:
            objects += [copy.deepcopy(item) for item in yaml.safe_load_all(_inside(directory, resource).read_text())
                        if item]
    for generator in kustomization.get("configMapGenerator", []):
        assert set(generator) <= GENERATOR_FIELDS, generator
        replaces = generator.get("behavior", "create") == "replace"
        assert (generator["name"] in config_maps) == replaces, f"{directory}: {generator}"
        assert set(generator.get("options", {})) <= GENERATOR_OPTIONS, generator
        config_maps[generator["name"]] = {Path(file).name: _inside(directory, file).read_text()
                                          for file in generator["files"]}
        # A replacement keeps the options of the ConfigMap it replaces, as kustomize does.
        options[generator["name"]] = {**options.get(generator["name"], {}), **generator.get("options", {})}
    for replicas in kustomization.get("replicas", []):
        build_so_far = Build(objects, config_maps, options)
        build_so_far.named("Deployment", replicas["name"])["spec"]["replicas"] = replicas["count"]
    return Build(objects, config_maps, options)


def _inside(directory: Path, name: str) -> Path:
    """A file of the kustomization, which kustomize loads only from its own folder or below."""
    path = (directory / name).resolve()
    assert path.is_relative_to(directory.resolve()), f"{directory}: {name} is outside the kustomization"
    return path


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """A pod's init containers (native sidecars among them), then its containers."""
    containers: list[dict[str, Any]] = spec.get("initContainers", []) + spec["containers"]
    return containers


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    """A container of the pod by name, whether a container or an init container."""
    [found] = [item for item in all_containers(pod_spec(deployment)) if item["name"] == name]
    return found


def is_sidecar(container_: dict[str, Any]) -> bool:
    """A native sidecar: an init container that the kubelet keeps running."""
    return container_.get("restartPolicy") == "Always"


def service_target_ports(deployment: dict[str, Any]) -> set[int | str]:
    """What a Service's targetPort may name in the pod: any container's port
    number, but only a regular container's port name (Kubernetes finds a
    sidecar's named port only from 1.32 on)."""
    spec = pod_spec(deployment)
    numbers = {port["containerPort"] for item in all_containers(spec) for port in item.get("ports", [])}
    names = {port["name"] for item in spec["containers"] for port in item.get("ports", []) if "name" in port}
    return numbers | names


def hardening_problems(deployment: dict[str, Any]) -> list[str]:
    """What a Deployment's pod lacks of deploy/'s rules: no root, no service
    account token, the runtime's seccomp profile; each container as a numeric
    user on a read-only root file system, without privileges or capabilities,
    with CPU and memory requests and a memory limit."""
    spec = pod_spec(deployment)
    pod = spec.get("securityContext", {})
    problems = [f"the pod needs {text}" for text, holds in (
        ("securityContext.runAsNonRoot: true", pod.get("runAsNonRoot") is True),
        ("securityContext.seccompProfile.type: RuntimeDefault",
         pod.get("seccompProfile") == {"type": "RuntimeDefault"}),
        ("automountServiceAccountToken: false", spec.get("automountServiceAccountToken") is False)) if not holds]
    for item in all_containers(spec):
        context, resources = item.get("securityContext", {}), item.get("resources", {})
        user = context.get("runAsUser")
        problems += [f"container {item['name']} needs {text}" for text, holds in (
            ("securityContext.runAsUser: a number above 0", isinstance(user, int) and user > 0),
            ("securityContext.readOnlyRootFilesystem: true", context.get("readOnlyRootFilesystem") is True),
            ("securityContext.allowPrivilegeEscalation: false", context.get("allowPrivilegeEscalation") is False),
            ("securityContext.capabilities.drop: [ALL]", context.get("capabilities", {}).get("drop") == ["ALL"]),
            ("resources.requests: cpu and memory", {"cpu", "memory"} <= set(resources.get("requests", {}))),
            ("resources.limits.memory", "memory" in resources.get("limits", {}))) if not holds]
    return [f"Deployment {deployment['metadata']['name']}: {problem}" for problem in problems]


def option(command: list[str], name: str) -> str:
    """The value after ``name`` in a command line."""
    return command[command.index(name) + 1]


def port_number(container_: dict[str, Any], port: int | str) -> int:
    """A container port given by number or by name."""
    if isinstance(port, int):
        return port
    [number] = [item["containerPort"] for item in container_.get("ports", []) if item["name"] == port]
    return int(number)


# -- validating manifests ----------------------------------------------------

# Native sidecars (init containers with restartPolicy: Always) are on by default
# from 1.29 and stable from 1.33; the manifests are checked against 1.30's API.
KUBERNETES_VERSION = "1.30"
CUSTOM_RESOURCE_SCHEMAS = Path(__file__).resolve().parent / "data" / "custom-resource-schemas.yaml"


def validate_manifest(document: Any) -> list[str]:
    """What the API server would refuse in one object, as messages naming the
    field; none if it is valid.

    Built-in kinds are checked against Kubernetes' own schemas for
    KUBERNETES_VERSION (kubernetes-validate's strict ones: an unknown field is
    an error, as ``kubectl apply --validate=strict`` makes it), plus the rules
    of a pod those schemas cannot say (native sidecars). Custom resources are
    checked against our schemas of the fields Sluice uses
    (tests/unit/data/custom-resource-schemas.yaml)."""
    if not isinstance(document, dict) or not all(isinstance(document.get(key), str) for key in ("apiVersion", "kind")):
        return ["not a Kubernetes object: a mapping with apiVersion and kind"]
    name = f"{document['kind']} {(document.get('metadata') or {}).get('name', '(no name)')}"
    schema = _custom_resource_schemas().get(f"{document['apiVersion']} {document['kind']}")
    if schema is not None:
        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(document), key=lambda e: e.json_path)
        return [f"{name}: {error.json_path}: {error.message}" for error in errors]
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{name}: {error.json_path}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [f"{name}: {error.message}; a custom resource needs a schema in {CUSTOM_RESOURCE_SCHEMAS.name}"]
    return [f"{name}: {problem}" for problem in _pod_problems(document)]


@functools.cache
def _custom_resource_schemas() -> dict[str, dict[str, Any]]:
    """"apiVersion Kind" -> a JSON Schema of the whole object."""
    data = yaml.safe_load(CUSTOM_RESOURCE_SCHEMAS.read_text())
    schemas = {}
    for key, kind_schema in data["kinds"].items():
        api_version, kind = key.split(" ")
        properties = {"apiVersion": {"const": api_version}, "kind": {"const": kind},
                      "metadata": {"$ref": "#/$defs/metadata"}, **kind_schema["properties"]}
        schemas[key] = {"$defs": data["$defs"], "type": "object", "additionalProperties": False,
                        "required": ["apiVersion", "kind", *kind_schema["required"]], "properties": properties}
        jsonschema.Draft202012Validator.check_schema(schemas[key])
    return schemas


def _pod_problems(document: dict[str, Any]) -> Iterator[str]:
    """What the API server's validation of a pod refuses beyond the schema:
    restartPolicy and probes on the wrong containers (KEP-753), and names or
    named ports used twice."""
    template = document.get("spec", {}).get("template", {}) if document["kind"] != "Pod" else document
    spec = template.get("spec")
    if spec is None:
        return
    names = [item["name"] for item in all_containers(spec)]
    for duplicate in sorted({name for name in names if names.count(name) > 1}):
        yield f"two containers are named {duplicate}"
    for group in ("initContainers", "containers"):
        for item in spec.get(group, []):
            where = f"{group}[{item['name']}]"
            if "restartPolicy" in item and (group == "containers" or item["restartPolicy"] != "Always"):
                yield f"{where}.restartPolicy: only an init container may have one, and only Always"
            if group == "initContainers" and not is_sidecar(item):
                for probe in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
                    if probe in item:
                        yield f"{where}.{probe}: only a sidecar (restartPolicy: Always) init container may have one"
            ports = [port["name"] for port in item.get("ports", []) if "name" in port]
            for duplicate in sorted({port for port in ports if ports.count(port) > 1}):
                yield f"{where}.ports: two ports are named {duplicate}"


def deploy_manifests() -> list[tuple[str, dict[str, Any]]]:
    """Every object deploy/ gives the API server, with where it comes from:
    what each kustomization builds (its generated ConfigMaps included), and
    every other YAML file but Prometheus's own rule file."""
    found = []
    read = {ALERT_RULES}
    for kustomization in sorted(DEPLOY.rglob("kustomization.yaml")):
        name = f"{kustomization.parent.relative_to(DEPLOY)}/ (kustomize build)"
        found += [(name, item) for item in build(kustomization.parent).applied()]
        read |= _kustomization_files(kustomization.parent)
    for path in sorted(set(DEPLOY.rglob("*.yaml")) - read):
        name = str(path.relative_to(DEPLOY))
        found += [(name, item) for item in yaml.safe_load_all(path.read_text()) if item is not None]
    return found


def deploy_objects_by_source() -> dict[str, list[dict[str, Any]]]:
    """deploy_manifests() grouped as they are applied together: one file's
    objects, or one kustomization's."""
    sources: dict[str, list[dict[str, Any]]] = {}
    for source, document in deploy_manifests():
        sources.setdefault(source, []).append(document)
    return sources


def _kustomization_files(directory: Path) -> set[Path]:
    """The kustomization file, its resource files and its generators' files."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    files = [*kustomization.get("resources", []),
             *(file for generator in kustomization.get("configMapGenerator", []) for file in generator["files"])]
    return {directory / "kustomization.yaml"} | {path for path in (directory / file for file in files)
                                                 if path.is_file()}


def prometheus_rule_text() -> str:
    """deploy/prometheus/operator/prometheusrule.yaml: the groups of
    alerts.yaml, verbatim, in a PrometheusRule."""
    lines = ALERT_RULES.read_text().splitlines(keepends=True)
    start = next(number for number, line in enumerate(lines) if line.startswith("groups:"))
    body = "".join(f"  {line}" if line.strip() else line for line in lines[start:])
    return (
        "# Generated from deploy/prometheus/alerts.yaml by `python -m tests.unit.test_monitoring`:\n"
        "# change alerts.yaml, not this file.\n"
        "#\n"
        "# Sluice's alerts for a Prometheus Operator, whose Prometheus loads the\n"
        "# PrometheusRules its ruleSelector matches: add your label (with the\n"
        "# kube-prometheus-stack chart, `release: <its release name>`).\n"
        "apiVersion: monitoring.coreos.com/v1\n"
        "kind: PrometheusRule\n"
        "metadata:\n"
        "  name: sluice\n"
        "  labels:\n"
        "    app.kubernetes.io/name: sluice\n"
        "spec:\n"
        f"{body}"
    )


# -- nginx --------------------------------------------------------------------


def nginx_test(run_dir: Path, site: str) -> subprocess.CompletedProcess[str]:
    """``nginx -t`` on a site configuration (an http-level snippet), included
    by the launcher's nginx.conf."""
    site_config = run_dir / "conf.d" / "sluice.conf"
    site_config.parent.mkdir(parents=True)
    site_config.write_text(site)
    for directory in ("logs", "tmp"):
        (run_dir / directory).mkdir()
    main_config = run_dir / "nginx.conf"
    main_config.write_text(nginx_main_config(run_dir, site_config))
    return subprocess.run([find_nginx(), "-t", "-q", "-e", "stderr", "-p", str(run_dir), "-c", str(main_config)],
                          capture_output=True, text=True, timeout=30)
