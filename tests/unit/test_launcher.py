"""The launcher renders the nginx and Envoy templates, package data, as the official nginx image does."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tomllib
import zipfile
from importlib.resources import files
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

import sidecar
from devstack import launcher
from devstack.launcher import find_envoy
from sidecar.rendering import (
    DEFAULT_ENVOY_GRPC_TEMPLATE,
    DEFAULT_ENVOY_TEMPLATE,
    DEFAULT_TEMPLATE,
    StackPorts,
    check_timeout_seconds,
    envoy_token_bucket,
    nginx_rate,
    render_template,
    ruleset_of,
    template_variables,
    write_envoy_config,
    write_nginx_config,
)
from sidecar.rendering import (
    RenderError as StackError,
)

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(sidecar.__file__).resolve().parent


def package_files() -> list[Path]:
    """Every file of the package folder, through the links to the templates
    (Path.rglob does not follow links to folders before Python 3.13)."""
    return sorted(Path(folder) / name for folder, _, names in os.walk(PACKAGE, followlinks=True)
                  if "__pycache__" not in Path(folder).parts for name in names)


def test_the_package_s_templates_are_the_repository_s_nginx_and_envoy_folders() -> None:
    for proxy in ("nginx", "envoy"):
        linked = PACKAGE / "templates" / proxy
        # A relative link inside the checkout, which git keeps and the build follows.
        assert linked.is_symlink() and not os.readlink(linked).startswith("/")
        assert linked.resolve() == REPO / proxy


def test_default_templates_are_package_data_the_wheel_ships() -> None:
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    # What setuptools puts in the wheel: the globs, relative to the package
    # folder (glob, as setuptools', follows the links).
    shipped = {path for pattern in package_data["sidecar"] for path in PACKAGE.glob(pattern)}

    for template in (DEFAULT_TEMPLATE, DEFAULT_ENVOY_TEMPLATE, DEFAULT_ENVOY_GRPC_TEMPLATE):
        # In a source checkout the package is a folder, its data files on disk.
        assert isinstance(template, Path) and template.is_file()
        assert template in shipped
    assert files("sidecar") / "templates" / "nginx" / "sluice.conf.template" == DEFAULT_TEMPLATE
    # The snippets, fragments and includes too: every template of both folders.
    templates = {path for path in package_files() if path.name.endswith(".template")}
    assert {path.resolve() for path in templates} == {*(REPO / "nginx").rglob("*.template"),
                                                      *(REPO / "envoy").rglob("*.template")}
    assert len(templates) >= 18
    assert templates <= shipped


# Run with nothing but the package, zipped: no checkout around it, and its
# files are not files on disk (importlib.resources reads them from the archive).
RENDER_FROM_ZIP = """
import json, sys
from pathlib import Path
import sidecar
from sidecar.rendering import DEFAULT_ENVOY_TEMPLATE, DEFAULT_TEMPLATE, StackPorts, template_variables
from sidecar.rendering import write_envoy_config, write_nginx_config
variables = template_variables(StackPorts(nginx=18080), "127.0.0.1")
write_nginx_config(Path(sys.argv[1]), DEFAULT_TEMPLATE, variables)
write_envoy_config(Path(sys.argv[1]), DEFAULT_ENVOY_TEMPLATE, variables)
print(json.dumps([sidecar.__file__, isinstance(DEFAULT_TEMPLATE, Path)]))
"""


def test_the_launcher_renders_its_templates_from_a_zipped_package(tmp_path: Path) -> None:
    archive = tmp_path / "sluice.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        for path in package_files():
            zipped.write(path, path.relative_to(PACKAGE.parent).as_posix())
    run_dir = tmp_path / "run"

    result = subprocess.run(
        [sys.executable, "-c", RENDER_FROM_ZIP, str(run_dir)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(archive)},
        timeout=60,
    )

    assert result.returncode == 0, result.stderr
    imported_from, template_is_a_path = json.loads(result.stdout)
    assert imported_from.startswith(str(archive))
    assert not template_is_a_path
    assert "listen 127.0.0.1:18080;" in (run_dir / "conf.d" / "sluice.conf").read_text()
    assert "server 127.0.0.1:8181;" in (run_dir / "conf.d" / "snippets" / "sluice-http.conf").read_text()
    # The fragments, included from the archive.
    envoy = (run_dir / "envoy.yaml").read_text()
    assert "${" not in envoy
    assert not re.search(r"^\s*@include", envoy, re.MULTILINE)
    assert "name: sluice_hook" in envoy


def test_defined_variables_are_replaced_in_both_envsubst_spellings() -> None:
    assert render_template("listen ${PORT}; # $PORT", {"PORT": "8080"}) == "listen 8080; # 8080"


def test_undefined_names_and_nginx_variables_are_kept() -> None:
    text = "proxy_set_header X-Original-URI $request_uri; server ${SLUICE_ADDR}; set $x ${y};"

    assert render_template(text, {"PORT": "1"}) == text


def test_shipped_template_has_a_value_for_every_variable(tmp_path: Path) -> None:
    variables = template_variables(
        StackPorts(nginx=18080, sluice=18181, upstream=19000, sluice_hook=18182), "127.0.0.1"
    )

    config = write_nginx_config(tmp_path, DEFAULT_TEMPLATE, variables)

    site = (tmp_path / "conf.d" / "sluice.conf").read_text()
    http = (tmp_path / "conf.d" / "snippets" / "sluice-http.conf").read_text()
    assert "listen 127.0.0.1:18080;" in site
    assert "server 127.0.0.1:19000;" in site
    assert "server 127.0.0.1:18181;" in http
    assert "syslog:server=127.0.0.1:18182," in http
    for rendered in (tmp_path / "conf.d").rglob("*.conf"):
        assert "${" not in rendered.read_text(), rendered
    assert f'include "{tmp_path / "conf.d" / "sluice.conf"}";' in config.read_text()


def test_a_variable_without_value_is_reported(tmp_path: Path) -> None:
    variables = template_variables(StackPorts(), "127.0.0.1")
    del variables["SLUICE_READ_TIMEOUT"]

    with pytest.raises(StackError, match="no value for SLUICE_READ_TIMEOUT"):
        write_nginx_config(tmp_path, DEFAULT_TEMPLATE, variables)


def test_shipped_envoy_template_renders_to_a_bootstrap_envoy_accepts(tmp_path: Path) -> None:
    variables = template_variables(
        StackPorts(nginx=18080, sluice=18181, upstream=19000, envoy=20000, envoy_admin=29901), "127.0.0.1"
    )

    config = write_envoy_config(tmp_path, DEFAULT_ENVOY_TEMPLATE, variables)

    text = config.read_text()
    assert "${" not in text
    assert "%DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT%" in text
    bootstrap = yaml.safe_load(text)
    assert bootstrap["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 29901}
    (listener,) = bootstrap["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 20000}
    clusters = {cluster["name"]: cluster for cluster in bootstrap["static_resources"]["clusters"]}
    (hook,) = clusters["sluice_hook"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert hook["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 18181}
    validation = subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(config), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert validation.returncode == 0, validation.stdout + validation.stderr


def test_an_envoy_variable_without_value_is_reported(tmp_path: Path) -> None:
    variables = template_variables(StackPorts(), "127.0.0.1")
    del variables["SLUICE_CHECK_TIMEOUT"]

    with pytest.raises(StackError, match="no value for SLUICE_CHECK_TIMEOUT"):
        write_envoy_config(tmp_path, DEFAULT_ENVOY_TEMPLATE, variables)


# Timeouts for Sluice's answer against the holds of leaky bucket rules.

LEAKY_RULES = """
rules:
  - id: slow
    key: [ip]
    limit: {rate: 2r/s, burst: 4, delay: 1}     # holds up to (4 - 1) / 2 = 1.5 s
    action: block
  - id: fast
    key: [ip]
    limit: {rate: 10r/s, burst: 5, nodelay: true}
    action: block
"""


@pytest.mark.parametrize(
    ("longest_hold", "seconds"),
    [(0.0, 1), (0.3, 2), (1.0, 2), (1.5, 3), (59.999, 61)],
)
def test_check_timeout_outlasts_the_longest_hold_by_a_second_or_more(longest_hold: float, seconds: int) -> None:
    assert check_timeout_seconds(longest_hold) == seconds


def test_longest_hold_is_read_from_the_rules_file(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(LEAKY_RULES)

    assert ruleset_of(rules).longest_hold == 1.5


def test_built_in_rules_hold_nothing_and_keep_the_one_second_timeouts() -> None:
    assert ruleset_of(None).longest_hold == 0.0
    variables = template_variables(StackPorts(), "127.0.0.1", ruleset_of(None))

    assert (variables["SLUICE_READ_TIMEOUT"], variables["SLUICE_CHECK_TIMEOUT"]) == ("1s", "1s")


def test_unusable_rules_are_reported_before_anything_starts(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - id: bad\n    key: [ip]\n    limit: {rate: fast, burst: 1}\n")

    with pytest.raises(StackError, match="rules.yaml:4"):
        ruleset_of(rules)


def test_rendered_front_doors_wait_past_the_longest_hold_and_a_second_to_connect(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(LEAKY_RULES)  # holds up to 1.5 s
    variables = template_variables(
        StackPorts(nginx=18080, sluice=18181, upstream=19000, envoy=20000, envoy_admin=29901), "127.0.0.1",
        ruleset_of(rules)
    )

    write_nginx_config(tmp_path, DEFAULT_TEMPLATE, variables)
    envoy_config = write_envoy_config(tmp_path, DEFAULT_ENVOY_TEMPLATE, variables)

    server = (tmp_path / "conf.d" / "snippets" / "sluice-server.conf").read_text()
    check = server[server.index("location = /_sluice/auth {"):]
    check = check[: check.index("}")]
    assert "proxy_connect_timeout 1s;" in check
    assert "proxy_read_timeout 3s;" in check
    assert "proxy_send_timeout 3s;" in check
    bootstrap = yaml.safe_load(envoy_config.read_text())
    (listener,) = bootstrap["static_resources"]["listeners"]
    filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    (ext_authz,) = [f["typed_config"] for f in filters if f["name"] == "envoy.filters.http.ext_authz"]
    assert ext_authz["http_service"]["server_uri"]["timeout"] == "3s"
    clusters = {cluster["name"]: cluster for cluster in bootstrap["static_resources"]["clusters"]}
    assert clusters["sluice"]["connect_timeout"] == "1s"
    grpc = yaml.safe_load(write_envoy_config(tmp_path, DEFAULT_ENVOY_GRPC_TEMPLATE, variables, "grpc.yaml").read_text())
    grpc_clusters = {cluster["name"]: cluster for cluster in grpc["static_resources"]["clusters"]}
    assert grpc_clusters["sluice_grpc"]["connect_timeout"] == "1s"


class SignalledStack:
    """A stack that gets signals the way `make run` passes them on: one to
    stop it, then another while it is stopping."""

    def __init__(self) -> None:
        self.components: dict = {}
        self.stopped = 0

    def start(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    def stop(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # make's own SIGTERM, arriving now
        os.kill(os.getpid(), signal.SIGINT)
        self.stopped += 1


def test_a_second_signal_while_stopping_does_not_interrupt_the_stop() -> None:
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stack = SignalledStack()
    try:
        status = launcher.run_foreground(stack)  # type: ignore[arg-type]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert status == 0 and stack.stopped == 1


@given(st.floats(min_value=0.001, max_value=1e9, allow_nan=False))
def test_a_rate_is_written_as_nginx_reads_it_whole_and_never_below_the_rate_asked(rate: float) -> None:
    written = nginx_rate(rate)
    number, unit = re.fullmatch(r"(\d+)r/(s|m)", written).groups()  # type: ignore[union-attr]
    per_second = int(number) / (1 if unit == "s" else 60)
    assert rate - 1e-6 <= per_second < rate + 1 / 60


@given(st.floats(min_value=0.001, max_value=1e6, allow_nan=False))
def test_an_envoy_token_bucket_is_the_rate_in_whole_tokens_every_whole_seconds_with_two_seconds_at_once(
        rate: float) -> None:
    bucket = envoy_token_bucket(rate, "--unchecked-rate")
    assert bucket.tokens_per_fill >= 1 and 1 <= bucket.fill_seconds <= 1000
    assert abs(bucket.tokens_per_fill / bucket.fill_seconds - rate) <= rate / 100
    assert bucket.max_tokens == math.ceil(rate * 2)
