"""The launcher renders nginx templates as the official nginx image does."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.launcher import (
    DEFAULT_TEMPLATE,
    StackError,
    StackPorts,
    render_template,
    template_variables,
    write_nginx_config,
)


def test_defined_variables_are_replaced_in_both_envsubst_spellings() -> None:
    assert render_template("listen ${PORT}; # $PORT", {"PORT": "8080"}) == "listen 8080; # 8080"


def test_undefined_names_and_nginx_variables_are_kept() -> None:
    text = "proxy_set_header X-Original-URI $request_uri; server ${SLUICE_ADDR}; set $x ${y};"

    assert render_template(text, {"PORT": "1"}) == text


def test_shipped_template_has_a_value_for_every_variable(tmp_path: Path) -> None:
    variables = template_variables(StackPorts(nginx=18080, sluice=18181, upstream=19000), "127.0.0.1")

    config = write_nginx_config(tmp_path, DEFAULT_TEMPLATE, variables)

    site = (tmp_path / "conf.d" / "sluice.conf").read_text()
    assert "listen 127.0.0.1:18080;" in site
    assert "server 127.0.0.1:18181;" in site
    assert "server 127.0.0.1:19000;" in site
    assert "${" not in site
    assert f'include "{tmp_path / "conf.d" / "sluice.conf"}";' in config.read_text()


def test_a_variable_without_value_is_reported(tmp_path: Path) -> None:
    variables = template_variables(StackPorts(), "127.0.0.1")
    del variables["SLUICE_READ_TIMEOUT"]

    with pytest.raises(StackError, match="no value for SLUICE_READ_TIMEOUT"):
        write_nginx_config(tmp_path, DEFAULT_TEMPLATE, variables)
