"""Reading what the repository ships for containers: the Dockerfile's
instructions, the Kubernetes manifests as ``kubectl apply -k`` builds them,
and nginx's own verdict on a configuration."""

from __future__ import annotations

import copy
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sidecar.launcher import find_nginx, nginx_main_config

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"


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
GENERATOR_FIELDS = {"name", "files", "behavior"}


@dataclass
class Build:
    """The objects a kustomization applies; generated ConfigMaps by name
    (kustomize suffixes their names with a hash and rewrites the references)."""

    objects: list[dict[str, Any]]
    config_maps: dict[str, dict[str, str]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [item for item in self.objects if item["kind"] == kind]

    def named(self, kind: str, name: str) -> dict[str, Any]:
        [found] = [item for item in self.of_kind(kind) if item["metadata"]["name"] == name]
        return found


def build(directory: Path) -> Build:
    """What ``kubectl apply -k directory`` applies, for the fields in
    KUSTOMIZATION_FIELDS."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: kustomization fields these tests do not read: {unknown}"
    objects: list[dict[str, Any]] = []
    config_maps: dict[str, dict[str, str]] = {}
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            base = build(path)
            objects += base.objects
            config_maps.update(base.config_maps)
        else:
            objects += [copy.deepcopy(item) for item in yaml.safe_load_all(_inside(directory, resource).read_text())
                        if item]
    for generator in kustomization.get("configMapGenerator", []):
        assert set(generator) <= GENERATOR_FIELDS, generator
        replaces = generator.get("behavior", "create") == "replace"
        assert (generator["name"] in config_maps) == replaces, f"{directory}: {generator}"
        config_maps[generator["name"]] = {Path(file).name: _inside(directory, file).read_text()
                                          for file in generator["files"]}
    for replicas in kustomization.get("replicas", []):
        build_so_far = Build(objects, config_maps)
        build_so_far.named("Deployment", replicas["name"])["spec"]["replicas"] = replicas["count"]
    return Build(objects, config_maps)


def _inside(directory: Path, name: str) -> Path:
    """A file of the kustomization, which kustomize loads only from its own folder or below."""
    path = (directory / name).resolve()
    assert path.is_relative_to(directory.resolve()), f"{directory}: {name} is outside the kustomization"
    return path


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [item for item in pod_spec(deployment)["containers"] if item["name"] == name]
    return found


def option(command: list[str], name: str) -> str:
    """The value after ``name`` in a command line."""
    return command[command.index(name) + 1]


def port_number(container_: dict[str, Any], port: int | str) -> int:
    """A container port given by number or by name."""
    if isinstance(port, int):
        return port
    [number] = [item["containerPort"] for item in container_.get("ports", []) if item["name"] == port]
    return int(number)


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
