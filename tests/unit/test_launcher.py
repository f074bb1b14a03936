"""The launcher renders the nginx and Envoy templates as the official nginx image does."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from sidecar.launcher import (
    DEFAULT_ENVOY_TEMPLATE,
    DEFAULT_TEMPLATE,
    StackError,
    StackPorts,
    find_envoy,
    render_template,
    template_variables,
    write_envoy_config,
    write_nginx_config,
)


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
    assert "listen 127.0.0.1:18080;" in site
    assert "server 127.0.0.1:18181;" in site
    assert "server 127.0.0.1:19000;" in site
    assert "syslog:server=127.0.0.1:18182," in site
    assert "${" not in site
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
