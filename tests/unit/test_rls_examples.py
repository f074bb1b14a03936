"""The Rate Limit Service files users copy: examples/ratelimit/ is the
package's default configuration and the envoy-rls bootstrap, rendered; the
descriptors the bootstrap's rate_limits make land on the configuration's
limits. ``python -m tests.unit.test_rls_examples`` regenerates the
rendered bootstrap after a template change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from devstack.launcher import DEFAULT_RLS_CONFIG
from sidecar.rendering import (
    DEFAULT_ENVOY_RLS_TEMPLATE,
    DEFAULT_RLS_DOMAIN,
    StackPorts,
    render_template_file,
    template_variables,
)
from sidecar.rls import load_rls

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ratelimit"
EXAMPLE_CONFIG = EXAMPLES / "config" / "sluice.yaml"
EXAMPLE_ENVOY = EXAMPLES / "envoy.yaml"


def rendered_bootstrap() -> str:
    """The envoy-rls bootstrap with make run's values (Sluice on 127.0.0.1)."""
    header = ("# The envoy-rls bootstrap of `make run`, rendered: `sluice config envoy-rls` writes it for\n"
              "# other addresses. Regenerate with `python -m tests.unit.test_rls_examples`.\n")
    return header + render_template_file(DEFAULT_ENVOY_RLS_TEMPLATE, template_variables(StackPorts(), "127.0.0.1"),
                                          "envoy-rls")


def test_the_example_configuration_is_the_one_make_run_serves() -> None:
    assert EXAMPLE_CONFIG.read_text() == DEFAULT_RLS_CONFIG.read_text()


def test_the_example_bootstrap_is_the_rendered_template() -> None:
    assert EXAMPLE_ENVOY.read_text() == rendered_bootstrap(), \
        "examples/ratelimit/envoy.yaml is stale: python -m tests.unit.test_rls_examples"


def descriptors_of(route_limits: list[dict[str, Any]], address: str,
                   api_key: str | None) -> list[list[tuple[str, str]]]:
    """The descriptors Envoy makes from rate_limits actions for one request
    (a request without the header makes no descriptor of that entry)."""
    made = []
    for entry in route_limits:
        entries = []
        for action in entry["actions"]:
            if "remote_address" in action:
                entries.append(("remote_address", address))
            elif "request_headers" in action:
                if api_key is None:
                    break
                entries.append((action["request_headers"]["descriptor_key"], api_key))
            else:
                generic = action["generic_key"]
                entries.append((generic["descriptor_key"], generic["descriptor_value"]))
        else:
            made.append(entries)
    return made


def test_every_descriptor_the_bootstrap_makes_has_a_limit_in_the_configuration() -> None:
    bootstrap = yaml.safe_load(rendered_bootstrap())
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    host = manager["route_config"]["virtual_hosts"][0]
    login = next(route for route in host["routes"] if route["match"].get("path") == "/login")
    rate_limit_filter = next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ratelimit")
    assert rate_limit_filter["typed_config"]["domain"] == DEFAULT_RLS_DOMAIN
    config = load_rls(Path(str(DEFAULT_RLS_CONFIG)))
    limits = []
    for route_limits in (host["rate_limits"], host["rate_limits"] + login["route"]["rate_limits"]):
        for entries in descriptors_of(route_limits, "203.0.113.9", "key-1"):
            match = config.match(DEFAULT_RLS_DOMAIN, entries)
            assert match is not None, entries
            limits.append(match.limit.rule_id)
    assert limits == ["sluice.remote_address", "sluice.remote_address.api_key"] * 2 + \
        ["sluice.path_login.remote_address"]
    assert descriptors_of(host["rate_limits"], "203.0.113.9", None) == [[("remote_address", "203.0.113.9")]]


if __name__ == "__main__":
    EXAMPLE_ENVOY.write_text(rendered_bootstrap())
