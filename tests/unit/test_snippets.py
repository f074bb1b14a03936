"""The nginx snippets and Envoy fragments an existing proxy takes, and the
shipped site and bootstrap built from them, never beside them."""

from __future__ import annotations

import os
import re
import tempfile
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from devstack.demo_upstream import KEEP_ALIVE_SECONDS as DEMO_KEEP_ALIVE_SECONDS
from sidecar import cli
from sidecar import rendering as launcher
from sidecar.cli import KEEP_ALIVE_SECONDS
from sidecar.rendering import (
    DEFAULT_ENVOY_GRPC_TEMPLATE,
    DEFAULT_ENVOY_RLS_TEMPLATE,
    DEFAULT_ENVOY_TEMPLATE,
    DEFAULT_TEMPLATE,
    PACKAGE_TEMPLATES,
    StackPorts,
    expand_includes,
    render_template_file,
    template_variables,
)
from sidecar.rendering import (
    RenderError as StackError,
)

TEMPLATES = Path(str(PACKAGE_TEMPLATES))
SNIPPETS = TEMPLATES / "nginx" / "snippets"
FRAGMENTS = TEMPLATES / "envoy" / "fragments"
VARIABLES = template_variables(StackPorts(sluice=18181, sluice_hook=18182), "127.0.0.1")


def directives(text: str) -> list[str]:
    """The lines of an nginx or YAML template that are not comments."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def rendered_yaml(template: Path) -> Any:
    return yaml.safe_load(render_template_file(template, VARIABLES, "test"))


# -- nginx: the site is the three snippets, included ------------------------


def nginx_blocks(text: str) -> list[tuple[str, str]]:
    """(enclosing block, directive) for each directive of an nginx file:
    the block is "" at the top, else the opening line (`server`, `location /`)."""
    found, stack = [], [""]
    for line in directives(text):
        if line.endswith("{"):
            stack.append(line[:-1].strip())
        elif line == "}":
            stack.pop()
        else:
            found.append((stack[-1], line))
    return found


def test_the_site_includes_each_snippet_where_an_existing_nginx_does() -> None:
    includes = {directive.split()[1].rstrip(";").rsplit("/", 1)[1]: block
                for block, directive in nginx_blocks(DEFAULT_TEMPLATE.read_text())
                if directive.startswith("include ")}

    assert includes == {
        "sluice-http.conf": "",
        "sluice-server.conf": "server",
        "sluice-location.conf": "location /",
    }


def test_the_location_names_its_upstream_for_failing_open_and_proxies_to_it() -> None:
    location = [directive for block, directive in nginx_blocks(DEFAULT_TEMPLATE.read_text()) if block == "location /"]

    assert location == [
        "set $sluice_upstream http://sluice_protected_app;",
        "include conf.d/snippets/sluice-location.conf;",
        "proxy_pass $sluice_upstream;",
    ]
    fail_open = nginx_blocks((SNIPPETS / "sluice-server.conf.template").read_text())
    assert ("location @sluice_fail_open", "proxy_pass $sluice_upstream;") in fail_open


@pytest.mark.parametrize("marker", [
    "log_format sluice_report", "access_log syslog:", "upstream sluice {",
    "location = /_sluice/auth {", "location @sluice_deny {", "location @sluice_close {",
    "location @sluice_fail_open {", "location = /.sluice/challenge {",
    "auth_request /_sluice/auth;", "error_page 403 = @sluice_deny;", "add_header RateLimit ",
])
def test_each_piece_of_sluices_nginx_configuration_is_written_once(marker: str) -> None:
    holders = [template.name for template in sorted(TEMPLATES.glob("nginx/**/*.template"))
               if any(line.startswith(marker) for line in directives(template.read_text()))]

    assert len(holders) == 1, holders
    assert holders[0].startswith("sluice-") and holders[0] != DEFAULT_TEMPLATE.name


def test_a_refusal_is_sent_by_nginx_for_every_named_status_with_the_headers_of_the_check() -> None:
    """One call per refusal: @sluice_deny returns the page the check
    carried for each status with a name, and adds the over-limit fields
    itself (a named location inherits the server's add_header, not the
    protected location's)."""
    deny = [directive for block, directive in nginx_blocks((SNIPPETS / "sluice-server.conf.template").read_text())
            if block == "location @sluice_deny"]
    for status in (s.value for s in HTTPStatus if 400 <= s.value <= 599):
        assert f"if ($sluice_page_status = {status}) {{ return {status} $sluice_page; }}" in deny
    for header in ("X-RateLimit $sluice_ratelimit", "X-RateLimit-Limit $sluice_ratelimit_limit",
                   "X-RateLimit-Reset $sluice_ratelimit_reset", "Retry-After $sluice_retry_after"):
        assert f"add_header {header} always;" in deny


def test_the_snippets_name_only_sluices_settings() -> None:
    used = {name for snippet in SNIPPETS.glob("*.template")
            for name in re.findall(r"\$\{(\w+)\}", snippet.read_text())}

    assert used == {"SLUICE_ADDR", "SLUICE_HOOK_ADDR", "SLUICE_CONNECT_TIMEOUT", "SLUICE_READ_TIMEOUT",
                    "SLUICE_CACHE_DIR", "SLUICE_REFUSAL_CACHE", "SLUICE_UNCHECKED_RATE", "SLUICE_UNCHECKED_BURST"}


# -- Envoy: the bootstrap is the three fragments, put in place --------------


def http_connection_manager(bootstrap: Any) -> Any:
    (listener,) = bootstrap["static_resources"]["listeners"]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def test_the_bootstrap_holds_the_fragments_exactly() -> None:
    bootstrap = rendered_yaml(DEFAULT_ENVOY_TEMPLATE)
    manager = http_connection_manager(bootstrap)
    filters = rendered_yaml(FRAGMENTS / "sluice-http-filters.yaml.template")
    clusters = rendered_yaml(FRAGMENTS / "sluice-clusters.yaml.template")
    routes = rendered_yaml(FRAGMENTS / "sluice-routes.yaml.template")

    assert [f["name"] for f in filters] == [
        "envoy.filters.http.header_mutation", "envoy.filters.http.lua", "envoy.filters.http.ext_authz",
        "envoy.filters.http.local_ratelimit"]
    assert filters[-1] == rendered_yaml(FRAGMENTS / "sluice-unchecked-filter.yaml.template")[0]
    assert manager["http_filters"] == [*filters, manager["http_filters"][-1]]
    assert manager["http_filters"][-1]["name"] == "envoy.filters.http.router"
    assert bootstrap["static_resources"]["clusters"][:2] == clusters
    assert [c["name"] for c in clusters] == ["sluice", "sluice_hook"]
    (virtual_host,) = manager["route_config"]["virtual_hosts"]
    assert virtual_host["routes"][: len(routes)] == routes


def test_the_grpc_bootstrap_is_the_http_one_with_the_grpc_filters_and_cluster() -> None:
    http, grpc = rendered_yaml(DEFAULT_ENVOY_TEMPLATE), rendered_yaml(DEFAULT_ENVOY_GRPC_TEMPLATE)
    filters = rendered_yaml(FRAGMENTS / "sluice-grpc-http-filters.yaml.template")
    grpc_clusters = rendered_yaml(FRAGMENTS / "sluice-grpc-clusters.yaml.template")

    assert [f["name"] for f in filters] == [
        "envoy.filters.http.header_mutation", "envoy.filters.http.lua", "envoy.filters.http.ext_authz",
        "envoy.filters.http.local_ratelimit"]
    http_filters = rendered_yaml(FRAGMENTS / "sluice-http-filters.yaml.template")
    # The same fingerprints, Lua and unchecked filters around another ext_authz.
    assert (filters[0], filters[1], filters[3]) == (http_filters[0], http_filters[1], http_filters[3])
    assert "grpc_service" in filters[2]["typed_config"]
    assert http_connection_manager(grpc)["http_filters"] == [*filters,
                                                             http_connection_manager(http)["http_filters"][-1]]
    http_clusters = http["static_resources"]["clusters"]
    assert grpc["static_resources"]["clusters"] == [*http_clusters[:2], *grpc_clusters, *http_clusters[2:]]
    # Everything else, the listener's routes included, is the HTTP bootstrap's.
    for bootstrap in (http, grpc):
        http_connection_manager(bootstrap).pop("http_filters")
        bootstrap["static_resources"].pop("clusters")
    assert grpc == http


def seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration[:-1])


@pytest.mark.parametrize("template", [DEFAULT_ENVOY_TEMPLATE, DEFAULT_ENVOY_GRPC_TEMPLATE, DEFAULT_ENVOY_RLS_TEMPLATE])
def test_envoy_closes_an_idle_http1_connection_before_sluice_or_the_demo_application_would(template: Path) -> None:
    """A request sent on a kept connection as the server closes it fails:
    Envoy does not retry it (a 503, or a check let in unchecked)."""
    clusters = {cluster["name"]: cluster for cluster in rendered_yaml(template)["static_resources"]["clusters"]}
    http1 = [name for name, cluster in clusters.items() if "sluice_grpc" not in name and "rls" not in name]

    assert "protected_app" in http1
    for name in http1:
        options = clusters[name]["typed_extension_protocol_options"][
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        assert seconds(options["common_http_protocol_options"]["idle_timeout"]) < KEEP_ALIVE_SECONDS, name
        assert seconds(options["common_http_protocol_options"]["idle_timeout"]) < DEMO_KEEP_ALIVE_SECONDS, name


def test_nginx_closes_an_idle_connection_before_sluice_or_the_demo_application_would() -> None:
    upstreams = [(block, directive) for block, directive in
                 nginx_blocks(DEFAULT_TEMPLATE.read_text() + (SNIPPETS / "sluice-http.conf.template").read_text())
                 if block.startswith("upstream ")]
    timeouts = {block: seconds(directive.split()[1].rstrip(";")) for block, directive in upstreams
                if directive.startswith("keepalive_timeout ")}

    assert timeouts.keys() == {"upstream sluice", "upstream sluice_protected_app"}
    assert max(timeouts.values()) < min(KEEP_ALIVE_SECONDS, DEMO_KEEP_ALIVE_SECONDS)


@pytest.mark.parametrize("marker", [
    # The ext_authz filter is in each filters fragment, once over HTTP and
    # once over gRPC; the Lua filter is one fragment both include.
    "http_service:", "grpc_service:", "- name: sluice_grpc",
    '"@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua',
    "function envoy_on_response(response_handle)", "path_prefix: /v1/envoy/auth", "- name: sluice_hook",
    "- match: {path: \"/.sluice/challenge\"}", "stat_prefix: sluice_unchecked",
])
def test_each_piece_of_sluices_envoy_configuration_is_written_once(marker: str) -> None:
    holders = [template.name for template in sorted(TEMPLATES.glob("envoy/**/*.template"))
               if marker in directives(template.read_text())]

    assert len(holders) == 1, holders
    assert holders[0].startswith("sluice-")


# -- includes --------------------------------------------------------------


def test_an_include_of_a_template_that_does_not_exist_is_reported() -> None:
    with pytest.raises(StackError, match="@include envoy/fragments/nope.yaml: no such template"):
        expand_includes("clusters:\n  @include envoy/fragments/nope.yaml\n")


@pytest.mark.parametrize("name", ["../launcher.py", "envoy/../../launcher.py", "/", "envoy//x"])
def test_an_include_never_leaves_the_templates(name: str) -> None:
    with pytest.raises(StackError, match="not a path of a template"):
        expand_includes(f"x:\n  @include {name}\n")


def test_an_include_inside_a_line_or_a_comment_is_text() -> None:
    text = "# @include envoy/fragments/sluice-routes.yaml.template\nkey: a @include b\n"

    assert expand_includes(text) == text


def _literal_for_multiline(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


class _FragmentDumper(yaml.SafeDumper):
    """Writes multi-line strings as block scalars, as the Lua of the filters
    fragment is: blank lines in them must survive the indentation."""


_FragmentDumper.add_representer(str, _literal_for_multiline)

SCALARS = st.one_of(
    st.integers(),
    st.booleans(),
    st.text(st.characters(codec="ascii", exclude_categories=["Cc"]), max_size=12),
    # Lines, as block scalars (a last line ending in a line break would be
    # kept with `|+` and a document end marker: nothing a fragment holds).
    st.lists(st.text(st.characters(codec="ascii", exclude_categories=["Cc"]), max_size=10), max_size=4)
    .map("\n".join).filter(lambda text: not text.endswith("\n")),
)
FRAGMENTS_DATA = st.lists(
    st.dictionaries(st.from_regex(r"[a-z][a-z_]{0,7}", fullmatch=True), SCALARS, min_size=1, max_size=4),
    min_size=1,
    max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(data=FRAGMENTS_DATA, indent=st.integers(min_value=0, max_value=12), comment=st.booleans())
def test_an_included_fragment_loads_where_its_line_stands(data: list[dict[str, Any]], indent: int,
                                                          comment: bool) -> None:
    fragment = yaml.dump(data, Dumper=_FragmentDumper, sort_keys=False)
    if comment:
        fragment = "# What the fragment is for.\n\n" + fragment
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "proxy").mkdir()
        (Path(root) / "proxy" / "part.yaml.template").write_text(fragment)
        template = f"outer:\n  inner:\n{' ' * (indent + 2)}@include proxy/part.yaml.template\n  after: 1\n"

        expanded = expand_includes(template, Path(root))

    assert yaml.safe_load(expanded) == {"outer": {"inner": data, "after": 1}}


# -- maintainers' notes: in the templates, not in what users get -----------

ALL_TEMPLATES = sorted(path for proxy in ("nginx", "envoy") for path in (TEMPLATES / proxy).rglob("*.template"))
PLACEHOLDERS = sorted({name for template in ALL_TEMPLATES for name in re.findall(r"\$\{(\w+)\}", template.read_text())})
CONFIG_RUNS = [[target] for target in sorted(cli.CONFIG_TARGETS)] + [
    [target, "--guard"] for target in sorted(cli.CONFIG_TARGETS) if target != "envoy-rls"]


def configured(args: list[str]) -> str:
    result = CliRunner().invoke(cli.main, ["config", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_rendering_drops_the_lines_that_start_with_two_hashes() -> None:
    text = ('# for users\n## for maintainers\nlisten 80; # ## a comment\n    ## an indented note\n'
            '  key: "a ## b"\n\t## after a tab\n## the last line')

    assert launcher.without_maintainer_notes(text) == '# for users\nlisten 80; # ## a comment\n  key: "a ## b"\n'


@given(st.lists(st.text(alphabet=st.sampled_from(" \t#ab${}"), max_size=8), max_size=12))
def test_rendering_keeps_every_line_but_the_notes_in_order(lines: list[str]) -> None:
    kept = launcher.without_maintainer_notes("".join(f"{line}\n" for line in lines))

    assert kept.splitlines() == [line for line in lines if not line.lstrip(" \t").startswith("##")]


def test_a_note_names_a_setting_that_has_no_value_without_failing_the_rendering(tmp_path: Path) -> None:
    template = tmp_path / "site.conf.template"
    template.write_text("## NEW_SETTING: say what ${NEW_SETTING} is for\nlisten ${SLUICE_LISTEN};\n")

    assert render_template_file(template, {"SLUICE_LISTEN": "8080"}, "test") == "listen 8080;\n"


def test_every_setting_of_the_templates_is_explained_in_a_maintainers_note() -> None:
    notes = "\n".join(line for template in ALL_TEMPLATES for line in template.read_text().splitlines()
                      if line.lstrip().startswith("##"))

    assert len(PLACEHOLDERS) >= 20
    assert [name for name in PLACEHOLDERS if not re.search(rf"\b{name}\b", notes)] == []


@pytest.mark.parametrize("args", CONFIG_RUNS, ids=" ".join)
def test_sluice_config_prints_no_maintainers_note_and_no_placeholder(args: list[str]) -> None:
    output = configured(args)

    assert "${" not in output
    assert [line for line in output.splitlines() if line.lstrip().startswith("##")] == []
    # What a setting stands for is a maintainers' note: rendered, its value stands there instead.
    assert [name for name in PLACEHOLDERS if re.search(rf"\b{name}\b", output)] == []
    assert "Template notes" not in output and "upper-case names in braces" not in output


@pytest.mark.parametrize("args", CONFIG_RUNS, ids=" ".join)
def test_the_notes_leave_no_empty_comment_line_at_the_edge_of_a_comment(args: list[str]) -> None:
    lines = configured(args).splitlines()
    stray = [(lines[i - 1], lines[i + 1]) for i in range(1, len(lines) - 1) if lines[i].strip() == "#"
             and not (lines[i - 1].strip().startswith("#") and lines[i + 1].strip().startswith("#")
                      and "#" not in (lines[i - 1].strip(), lines[i + 1].strip()))]

    assert stray == []


# -- rendering for a proxy of one's own: --render --------------------------


def test_render_writes_the_snippets_with_the_stacks_values(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert launcher.main(["--render", "nginx/snippets", str(tmp_path)]) == 0

    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "sluice-http.conf", "sluice-location.conf", "sluice-server.conf"]
    assert "server 127.0.0.1:8181;" in (tmp_path / "sluice-http.conf").read_text()
    assert "proxy_read_timeout 1s;" in (tmp_path / "sluice-server.conf").read_text()
    assert capsys.readouterr().out.splitlines() == sorted(str(path) for path in tmp_path.iterdir())


def test_render_takes_a_value_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_HOST", "sluice.internal")
    monkeypatch.setenv("SLUICE_PORT", "8282")

    assert launcher.main(["--render", "envoy/fragments", str(tmp_path)]) == 0

    clusters = yaml.safe_load((tmp_path / "sluice-clusters.yaml").read_text())
    address = clusters[0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "sluice.internal", "port_value": 8282}


def test_render_waits_past_the_longest_hold_of_the_rules(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - id: slow\n    key: [ip]\n    limit: {rate: 2r/s, burst: 4, delay: 1}\n"
                     "    action: block\n")

    assert launcher.main(["--render", "nginx/snippets", str(tmp_path / "out"), "--rules", str(rules)]) == 0

    assert "proxy_read_timeout 3s;" in (tmp_path / "out" / "sluice-server.conf").read_text()


@pytest.mark.parametrize("folder", ["nginx/nope", "..", "lua", "envoy/envoy.yaml", "envoy-grpc"])
def test_render_of_an_unknown_folder_names_the_folders(folder: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert launcher.main(["--render", folder, str(tmp_path / "out")]) == 1

    error = capsys.readouterr().err
    assert error.startswith(f"sluice render: {folder}")
    # The folders that exist, unless the path leaves the templates.
    assert ("envoy/fragments" in error) == (folder != "..")
    assert not (tmp_path / "out").exists()


def test_render_of_the_envoy_folder_writes_the_three_bootstraps_and_not_their_includes(tmp_path: Path) -> None:
    assert launcher.main(["--render", "envoy", str(tmp_path)]) == 0

    assert sorted(path.name for path in tmp_path.iterdir()) == ["envoy-grpc.yaml", "envoy-rls.yaml", "envoy.yaml"]
    for path in tmp_path.iterdir():
        assert {"admin", "static_resources"} <= set(yaml.safe_load(path.read_text())), path.name


def test_render_of_one_template_writes_that_file_only(tmp_path: Path) -> None:
    assert launcher.main(["--render", "envoy/envoy-grpc.yaml.template", str(tmp_path)]) == 0

    [written] = tmp_path.iterdir()
    assert written.name == "envoy-grpc.yaml"
    variables = launcher.rendering_variables(StackPorts(), launcher.ruleset_of(None), os.environ)
    assert written.read_text() == render_template_file(DEFAULT_ENVOY_GRPC_TEMPLATE, variables, "test")


@pytest.mark.parametrize("target, template", [("envoy", DEFAULT_ENVOY_TEMPLATE),
                                              ("envoy-grpc", DEFAULT_ENVOY_GRPC_TEMPLATE),
                                              ("envoy-rls", DEFAULT_ENVOY_RLS_TEMPLATE)])
def test_sluice_config_of_an_envoy_bootstrap_prints_that_bootstrap_alone(target: str, template: Path,
                                                                         tmp_path: Path) -> None:
    result = CliRunner().invoke(cli.main, ["config", target, "--out", str(tmp_path)])

    assert result.exit_code == 0, result.output
    [written] = tmp_path.iterdir()
    assert written.name == template.name.removesuffix(launcher.TEMPLATE_SUFFIX)
    bootstrap = yaml.safe_load(written.read_text())
    clusters = [cluster["name"] for cluster in bootstrap["static_resources"]["clusters"]]
    # The include-only template is in the bootstrap, not a file of its own.
    assert "protected_app" in clusters


# The docs' nginx server with the three includes and their Envoy bootstrap with
# the fragments pasted are checked with every other block of the docs, by
# tests/unit/test_docs.py (nginx -t, envoy --mode validate).
