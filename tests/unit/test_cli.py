"""The ``sluice`` command line: version, help, and settings from the
environment (for containers), where a flag wins."""

from __future__ import annotations

import difflib
import logging
import re
import socket
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import DISTRIBUTION, addresses, cli, core
from sidecar.rendering import ENVOY_GUARD_ADDRESSES, ENVOY_MAX_TOKENS
from sidecar.rules import Ruleset, load_ruleset

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_distribution_s_and_names_the_core() -> None:
    from sidecar import core

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    result = CliRunner().invoke(cli.main, ["--version"])
    assert result.exit_code == 0 and result.output == f"sluice {project['version']}, {core.which()}\n"
    assert project["name"] == DISTRIBUTION


@pytest.mark.parametrize("args", [["-h"], ["--help"], ["serve", "-h"], ["check", "-h"], ["replay", "-h"]])
def test_h_is_help(args: list[str]) -> None:
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0 and result.output.startswith("Usage: ")


def test_serve_help_names_the_environment_variables() -> None:
    output = CliRunner().invoke(cli.main, ["serve", "-h"]).output
    for name in ("SLUICE_CONFIG", "SLUICE_HOST", "SLUICE_PORT", "SLUICE_LOG_LEVEL", "SLUICE_ADMIN_TOKEN_FILE"):
        assert name in output


RULES = "rules:\n  - id: r\n    key: [ip]\n    limit: {requests: 5, per: 1m}\n    action: block\n"


def test_serve_takes_its_settings_from_the_environment(tmp_path: Path, served: list) -> None:
    rules, token = tmp_path / "rules.yaml", tmp_path / "token"
    rules.write_text(RULES)
    token.write_text("t" * 32)
    env = {"SLUICE_CONFIG": str(rules), "SLUICE_HOST": "127.0.0.2", "SLUICE_PORT": "9191",
           "SLUICE_LOG_LEVEL": "WARNING", "SLUICE_ADMIN_TOKEN_FILE": str(token)}
    result = CliRunner().invoke(cli.main, ["serve"], env=env)
    assert result.exit_code == 0, result.output
    [run] = served
    assert (run["host"], run["port"], run["log_level"]) == ("127.0.0.2", 9191, "warning")
    assert run["app"]["config"] == str(rules) and run["app"]["admin_token_file"] == str(token)


def test_a_flag_wins_over_the_environment(tmp_path: Path, served: list) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    env = {"SLUICE_CONFIG": str(tmp_path / "missing.yaml"), "SLUICE_PORT": "9191", "SLUICE_LOG_LEVEL": "debug"}
    result = CliRunner().invoke(cli.main, ["serve", "--config", str(rules), "--port", "9292",
                                           "--log-level", "error"], env=env)
    assert result.exit_code == 0, result.output
    [run] = served
    assert (run["port"], run["log_level"], run["app"]["config"]) == (9292, "error", str(rules))


@pytest.mark.parametrize("name, value, message", [
    ("SLUICE_PORT", "99999", "SLUICE_PORT"),
    ("SLUICE_PORT", "http", "SLUICE_PORT"),
    ("SLUICE_LOG_LEVEL", "loud", "SLUICE_LOG_LEVEL"),
])
def test_a_bad_environment_value_is_a_clear_error(served: list, name: str, value: str, message: str) -> None:
    result = CliRunner().invoke(cli.main, ["serve"], env={name: value})
    assert result.exit_code == 2 and message in result.output and not served


def test_sluice_and_uvicorn_log_json_lines(capfd: pytest.CaptureFixture[str]) -> None:
    import json
    import logging
    import logging.config

    from sidecar.logs import configure_logging

    try:
        configure_logging("info")
        logging.getLogger("sluice").warning('a "quoted"\nmessage')
        logging.getLogger("uvicorn.error").info("Started server process")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("sluice").exception("failed")
        lines = [json.loads(line) for line in capfd.readouterr().err.splitlines()]
    finally:
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
    assert [(line["logger"], line["level"], line["message"]) for line in lines] == [
        ("sluice", "warning", 'a "quoted"\nmessage'), ("uvicorn.error", "info", "Started server process"),
        ("sluice", "error", "failed")]
    assert "ValueError: boom" in lines[-1]["error"]


def test_serve_takes_a_grpc_port_on_its_host(served: list) -> None:
    result = CliRunner().invoke(cli.main, ["serve", "--demo-rules", "--host", "127.0.0.3"],
                                env={"SLUICE_GRPC_PORT": "9393"})
    assert result.exit_code == 0, result.output
    assert served[0]["app"]["grpc"] == ("127.0.0.3", 9393)
    assert CliRunner().invoke(cli.main, ["serve", "--demo-rules"]).exit_code == 0
    assert served[1]["app"]["grpc"] is None  # off by default


def test_config_envoy_grpc_checks_over_grpc_at_the_given_port() -> None:
    result = CliRunner().invoke(cli.main, ["config", "envoy-grpc", "--sluice", "10.0.0.5:8181",
                                           "--sluice-grpc-port", "9393"])
    assert result.exit_code == 0, result.output
    bootstrap = yaml.safe_load(result.output)
    clusters = {cluster["name"]: cluster for cluster in bootstrap["static_resources"]["clusters"]}
    endpoint = clusters["sluice_grpc"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {"address": "10.0.0.5", "port_value": 9393}
    assert "grpc_service:" in result.output and "http_service:" not in result.output


def test_nginx_limits_what_it_lets_in_unchecked_at_the_guards_rate_of_the_rules_or_the_one_given(
        tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {id: fast, key: [ip], limit: {requests: 50, per: 1s}, action: block}\n")
    derived = CliRunner().invoke(cli.main, ["config", "nginx", "--rules", str(rules)])
    given = CliRunner().invoke(cli.main, ["config", "nginx-snippets", "--unchecked-rate", "2.5"])
    default = CliRunner().invoke(cli.main, ["config", "nginx-snippets"])
    assert derived.exit_code == given.exit_code == default.exit_code == 0
    zone = "limit_req_zone $binary_remote_addr zone=sluice_unchecked:10m rate={};"
    assert zone.format("500r/s") in derived.output and "zone=sluice_unchecked burst=1000 nodelay;" in derived.output
    assert zone.format("150r/m") in given.output and "zone=sluice_unchecked burst=5 nodelay;" in given.output
    assert zone.format("10r/s") in default.output and "zone=sluice_unchecked burst=20 nodelay;" in default.output


def test_the_nginx_guard_is_ten_times_the_fastest_rule_and_written_only_when_asked(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n"
                     "  - {id: slow, key: [ip], limit: {requests: 10, per: 60s}, action: block}\n"
                     "  - {id: fast, key: [ip], limit: {requests: 50, per: 1s}, action: block}\n")
    plain = CliRunner().invoke(cli.main, ["config", "nginx-snippets", "--rules", str(rules)])
    guarded = CliRunner().invoke(cli.main, ["config", "nginx-snippets", "--rules", str(rules), "--guard"])
    fixed = CliRunner().invoke(cli.main, ["config", "nginx-snippets", "--guard-rate", "7"])
    fractional = CliRunner().invoke(cli.main, ["config", "nginx-snippets", "--guard-rate", "7.5"])
    assert plain.exit_code == guarded.exit_code == fixed.exit_code == 0
    assert "sluice_guard" not in "\n".join(line for line in plain.output.splitlines() if not line.startswith("#"))
    assert "limit_req_zone $binary_remote_addr zone=sluice_guard:10m rate=500r/s;" in guarded.output
    assert "limit_req zone=sluice_guard burst=1000 nodelay;" in guarded.output
    assert "rate=7r/s;" in fixed.output and "burst=14 nodelay;" in fixed.output
    assert "rate=450r/m;" in fractional.output and "burst=15 nodelay;" in fractional.output
    # Without rules, or with slow ones only, the guard is never below 10 r/s.
    assert "rate=10r/s;" in CliRunner().invoke(cli.main, ["config", "nginx", "--guard"]).output


def envoy_http_filters(bootstrap: str) -> list[dict[str, Any]]:
    [listener] = yaml.safe_load(bootstrap)["static_resources"]["listeners"]
    filters: list[dict[str, Any]] = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    return filters


def local_ratelimit_at(filters: list[dict[str, Any]], stat_prefix: str) -> int | None:
    """Where the local_ratelimit filter of this stat_prefix is; None without it."""
    found = [at for at, entry in enumerate(filters) if entry["name"] == "envoy.filters.http.local_ratelimit"
             and entry["typed_config"]["stat_prefix"] == stat_prefix]
    assert len(found) <= 1, found
    return found[0] if found else None


def envoy_guard(bootstrap: str) -> dict[str, Any] | None:
    """The guard's filter in a rendered bootstrap, checked to come first,
    ahead of Sluice's check; None without it."""
    filters = envoy_http_filters(bootstrap)
    at = local_ratelimit_at(filters, "sluice_guard")
    if at is None:
        return None
    assert at == 0 and "envoy.filters.http.ext_authz" in [entry["name"] for entry in filters]
    config: dict[str, Any] = filters[0]["typed_config"]
    return config


def envoy_unchecked_limit(bootstrap: str) -> dict[str, Any]:
    """The limit on requests let in unchecked, checked to come right after
    Sluice's check, ahead of the router."""
    filters = envoy_http_filters(bootstrap)
    names = [entry["name"] for entry in filters]
    at = local_ratelimit_at(filters, "sluice_unchecked")
    assert at is not None and names[at - 1] == "envoy.filters.http.ext_authz", names
    assert names[at + 1:] == ["envoy.filters.http.router"]
    assert filters[at - 1]["typed_config"]["failure_mode_allow_header_add"] is True
    config: dict[str, Any] = filters[at]["typed_config"]
    return config


@pytest.mark.parametrize("target", ["envoy", "envoy-grpc"])
def test_envoy_limits_what_it_lets_in_after_a_failed_check_at_the_guards_rate_of_the_rules_or_the_one_given(
        tmp_path: Path, target: str) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {id: fast, key: [ip], limit: {requests: 50, per: 1s}, action: block}\n")
    derived = CliRunner().invoke(cli.main, ["config", target, "--rules", str(rules)])
    given = CliRunner().invoke(cli.main, ["config", target, "--unchecked-rate", "7.5"])
    default = CliRunner().invoke(cli.main, ["config", target])
    guarded = CliRunner().invoke(cli.main, ["config", target, "--guard"])
    assert derived.exit_code == given.exit_code == default.exit_code == guarded.exit_code == 0
    limit = envoy_unchecked_limit(default.output)
    # A bucket per address Envoy trusts, only for a request ext_authz let in
    # after a failed check: the mark's presence, whatever its value, is the
    # descriptor entry unchecked=true.
    assert limit["rate_limits"] == [{"actions": [
        {"header_value_match": {"descriptor_key": "unchecked", "descriptor_value": "true",
                                "headers": [{"name": "x-envoy-auth-failure-mode-allowed", "present_match": True}]}},
        {"remote_address": {}}]}]
    [descriptor] = limit["descriptors"]
    assert descriptor["entries"] == [{"key": "unchecked", "value": "true"}, {"key": "remote_address"}]
    assert descriptor["token_bucket"] == {"max_tokens": 20, "tokens_per_fill": 10, "fill_interval": "1s"}
    assert limit["always_consume_default_token_bucket"] is False
    assert limit["token_bucket"]["max_tokens"] == limit["token_bucket"]["tokens_per_fill"] == ENVOY_MAX_TOKENS
    assert limit["max_dynamic_descriptors"] == ENVOY_GUARD_ADDRESSES
    assert limit["status"] == {"code": "TooManyRequests"}
    assert envoy_unchecked_limit(derived.output)["descriptors"][0]["token_bucket"] == {
        "max_tokens": 1000, "tokens_per_fill": 500, "fill_interval": "1s"}
    assert envoy_unchecked_limit(given.output)["descriptors"][0]["token_bucket"] == {
        "max_tokens": 15, "tokens_per_fill": 15, "fill_interval": "2s"}
    # The guard, ahead of everything, leaves it in place.
    assert envoy_unchecked_limit(guarded.output) == limit


def test_an_unchecked_rate_beyond_envoys_token_buckets_is_an_error_naming_the_option() -> None:
    result = CliRunner().invoke(cli.main, ["config", "envoy", "--unchecked-rate", "3e9"])
    assert result.exit_code == 1 and "give a lower --unchecked-rate" in result.output


def test_the_envoy_guard_is_ten_times_the_fastest_rule_per_address_and_written_only_when_asked(
        tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n"
                     "  - {id: slow, key: [ip], limit: {requests: 10, per: 60s}, action: block}\n"
                     "  - {id: fast, key: [ip], limit: {requests: 50, per: 1s}, action: block}\n")
    for target in ("envoy", "envoy-grpc"):
        plain = CliRunner().invoke(cli.main, ["config", target, "--rules", str(rules)])
        guarded = CliRunner().invoke(cli.main, ["config", target, "--rules", str(rules), "--guard"])
        fixed = CliRunner().invoke(cli.main, ["config", target, "--guard-rate", "7.5"])
        assert plain.exit_code == guarded.exit_code == fixed.exit_code == 0
        assert envoy_guard(plain.output) is None
        guard = envoy_guard(guarded.output)
        assert guard is not None
        # One bucket per address Envoy trusts (the key has no value), and
        # only that bucket counts.
        assert guard["rate_limits"] == [{"actions": [{"remote_address": {}}]}]
        [descriptor] = guard["descriptors"]
        assert descriptor["entries"] == [{"key": "remote_address"}]
        assert descriptor["token_bucket"] == {"max_tokens": 1000, "tokens_per_fill": 500, "fill_interval": "1s"}
        assert guard["always_consume_default_token_bucket"] is False
        assert guard["max_dynamic_descriptors"] >= 10_000
        assert guard["status"] == {"code": "TooManyRequests"}
        fixed_guard = envoy_guard(fixed.output)
        assert fixed_guard is not None
        assert fixed_guard["descriptors"][0]["token_bucket"] == {"max_tokens": 15, "tokens_per_fill": 15,
                                                                 "fill_interval": "2s"}
    # Without rules, or with slow ones only, the guard is never below 10 r/s.
    floor = envoy_guard(CliRunner().invoke(cli.main, ["config", "envoy", "--guard"]).output)
    assert floor is not None
    assert floor["descriptors"][0]["token_bucket"] == {"max_tokens": 20, "tokens_per_fill": 10, "fill_interval": "1s"}


def test_the_envoy_guard_only_adds_lines_to_the_bootstrap() -> None:
    plain = CliRunner().invoke(cli.main, ["config", "envoy"]).output
    guarded = CliRunner().invoke(cli.main, ["config", "envoy", "--guard"]).output
    changes = [line[0] for line in difflib.ndiff(plain.splitlines(), guarded.splitlines()) if line[0] in "+-"]
    assert changes and set(changes) == {"+"}


@pytest.mark.parametrize("options", [["--guard-rate", "7.5"], ["--unchecked-rate", "7.5"], []],
                         ids=["guard", "unchecked-rate", "plain"])
def test_envoy_accepts_the_rendered_bootstraps(tmp_path: Path, options: list[str]) -> None:
    from devstack.launcher import find_envoy

    for target in ("envoy", "envoy-grpc"):
        out = tmp_path / target
        result = CliRunner().invoke(cli.main, ["config", target, *options, "--out", str(out)])
        assert result.exit_code == 0, result.output
        [bootstrap] = out.iterdir()
        validation = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(bootstrap), "--disable-hot-restart",
                                     "--log-level", "error"], capture_output=True, text=True, timeout=60)
        assert validation.returncode == 0, validation.stdout + validation.stderr


def test_a_tls_listener_is_written_into_each_envoy_bootstrap_and_envoy_accepts_it(tmp_path: Path) -> None:
    from devstack.launcher import find_envoy
    from tests.certificates import write_certificate

    cert, key = write_certificate(tmp_path)
    for target in ("envoy", "envoy-grpc", "envoy-rls"):
        out = tmp_path / target
        result = CliRunner().invoke(cli.main, ["config", target, "--tls-cert", str(cert), "--tls-key", str(key),
                                               "--out", str(out)])
        assert result.exit_code == 0, result.output
        [bootstrap] = out.iterdir()
        (listener,) = yaml.safe_load(bootstrap.read_text())["static_resources"]["listeners"]
        inspector = listener["listener_filters"][0]["typed_config"]
        assert inspector["enable_ja3_fingerprinting"] and inspector["enable_ja4_fingerprinting"]
        (chain,) = listener["filter_chains"]
        certificate = chain["transport_socket"]["typed_config"]["common_tls_context"]["tls_certificates"][0]
        assert certificate == {"certificate_chain": {"filename": str(cert)}, "private_key": {"filename": str(key)}}
        validation = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(bootstrap), "--disable-hot-restart",
                                     "--log-level", "error"], capture_output=True, text=True, timeout=60)
        assert validation.returncode == 0, validation.stdout + validation.stderr
    plain = CliRunner().invoke(cli.main, ["config", "envoy"]).output
    with_tls = CliRunner().invoke(cli.main, ["config", "envoy", "--tls-cert", str(cert), "--tls-key", str(key)]).output
    changes = [line[0] for line in difflib.ndiff(plain.splitlines(), with_tls.splitlines()) if line[0] in "+-"]
    assert changes.count("-") == 1  # "- filters:" becomes the TLS chain's; the rest is added


@pytest.mark.parametrize(("options", "says"), [
    (["config", "envoy", "--tls-cert", "c.pem"], "give both --tls-cert and --tls-key"),
    (["config", "nginx", "--tls-cert", "c.pem", "--tls-key", "k.pem"], "a TLS listener is written into an Envoy"),
    (["config", "envoy-fragments", "--tls-cert", "c.pem", "--tls-key", "k.pem"], "a TLS listener is written into"),
    (["config", "envoy", "--tls-cert", "my cert.pem", "--tls-key", "k.pem"], "a path without spaces"),
])
def test_a_tls_listener_that_cannot_be_written_is_refused(options: list[str], says: str) -> None:
    result = CliRunner().invoke(cli.main, options)
    assert result.exit_code != 0 and says in result.output, result.output


def test_the_envoy_guard_comes_with_both_check_fragments_and_not_the_rate_limit_service_s(tmp_path: Path) -> None:
    out = tmp_path / "fragments"
    assert CliRunner().invoke(cli.main, ["config", "envoy-fragments", "--guard", "--out", str(out)]).exit_code == 0
    guarded = {path.name for path in out.iterdir() if "stat_prefix: sluice_guard" in path.read_text()}
    assert guarded == {"sluice-http-filters.yaml", "sluice-grpc-http-filters.yaml"}
    for name in guarded:
        filters = yaml.safe_load((out / name).read_text())
        assert [(entry["name"], entry["typed_config"].get("stat_prefix")) for entry in filters] == [
            ("envoy.filters.http.local_ratelimit", "sluice_guard"), ("envoy.filters.http.header_mutation", None),
            ("envoy.filters.http.lua", None), ("envoy.filters.http.ext_authz", None),
            ("envoy.filters.http.local_ratelimit", "sluice_unchecked")]


@pytest.mark.parametrize("option", [["--guard"], ["--guard-rate", "5"]])
def test_the_guard_is_refused_for_the_rate_limit_service_s_envoy_which_has_no_check(option: list[str]) -> None:
    result = CliRunner().invoke(cli.main, ["config", "envoy-rls", *option])
    assert result.exit_code == 2 and "envoy-rls has none" in result.output


def test_nginx_keeps_the_refusals_it_answers_itself_where_config_says() -> None:
    default = CliRunner().invoke(cli.main, ["config", "nginx-snippets"])
    chosen = CliRunner().invoke(cli.main, ["config", "nginx", "--cache-dir", "/var/lib/nginx/sluice"])
    assert default.exit_code == chosen.exit_code == 0
    assert "proxy_cache_path sluice-cache levels=1:2 keys_zone=sluice_refusals:1m" in default.output
    assert "proxy_cache_path /var/lib/nginx/sluice levels=" in chosen.output
    for path in ("a b", "x;include /etc/passwd", "${HOME}", ""):
        result = CliRunner().invoke(cli.main, ["config", "nginx", "--cache-dir", path])
        assert result.exit_code == 2 and "--cache-dir" in result.output, path


def test_nginx_answers_refusals_from_its_cache_unless_the_rules_hold_requests(tmp_path: Path) -> None:
    held = tmp_path / "held.yaml"
    held.write_text("rules:\n  - {id: held, key: [ip], limit: {rate: 6r/m, burst: 1}, action: block}\n")
    plain = tmp_path / "plain.yaml"
    plain.write_text("rules:\n  - {id: plain, key: [ip], limit: {requests: 6, per: 1m}, action: block}\n")
    # With a cache, nginx would not tell Sluice that a held request's client has gone.
    assert "proxy_cache off;" in CliRunner().invoke(cli.main, ["config", "nginx-snippets", "--rules", str(held)]).output
    for argv in (["--rules", str(plain)], []):
        output = CliRunner().invoke(cli.main, ["config", "nginx-snippets", *argv]).output
        assert "proxy_cache sluice_refusals;" in output


# --------------------------------------------------------------------------
# serve: the rules are always given
# --------------------------------------------------------------------------


def test_serve_without_rules_refuses_to_start_and_says_how_to_give_them(served: list) -> None:
    result = CliRunner().invoke(cli.main, ["serve"], env={"SLUICE_CONFIG": None})
    assert result.exit_code == 2 and not served
    [line] = result.output.splitlines()
    assert line.startswith("error: ")
    for hint in ("--config FILE", "SLUICE_CONFIG", "--demo-rules", "make run"):
        assert hint in line


def test_serve_demo_rules_are_the_example_rules_make_run_uses(served: list) -> None:
    result = CliRunner().invoke(cli.main, ["serve", "--demo-rules"], env={"SLUICE_CONFIG": None})
    assert result.exit_code == 0, result.output
    [run] = served
    # A file, so that a reload reads them again as it reads any rules file.
    demo = load_ruleset(run["app"]["config"])
    assert described(demo) == described(load_ruleset(str(ROOT / "examples" / "default.yaml")))
    assert described(run["app"]["ruleset"]) == described(demo) and len(demo.rules) == 2
    assert "2 rules from " in result.output
    # ...and which core decides, as sluice --version says it.
    assert core.which() in result.output


def described(ruleset: Ruleset) -> list[tuple[str, str, str]]:
    return [(rule.id, rule.action, rule.limiter.describe()) for rule in ruleset.rules]


def test_serve_takes_a_rules_file_or_the_demo_rules_not_both(tmp_path: Path, served: list) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    both = CliRunner().invoke(cli.main, ["serve", "--config", str(rules), "--demo-rules"])
    assert both.exit_code == 2 and not served
    assert both.output == "error: give --config FILE or --demo-rules, not both\n"
    # The flag wins over the environment, as every flag does.
    flag = CliRunner().invoke(cli.main, ["serve", "--demo-rules"], env={"SLUICE_CONFIG": str(rules)})
    assert flag.exit_code == 0, flag.output
    assert [rule.id for rule in served[0]["app"]["ruleset"].rules] == ["api", "per-ip"]


def test_serve_with_a_rate_limit_service_alone_runs_no_check_rules(served: list) -> None:
    rls = ROOT / "examples" / "ratelimit" / "config"
    result = CliRunner().invoke(cli.main, ["serve", "--grpc-port", "9393", "--rls-config", str(rls)],
                                env={"SLUICE_CONFIG": None})
    assert result.exit_code == 0, result.output
    [run] = served
    assert run["app"]["config"] is None and run["app"]["ruleset"].rules == ()
    assert "0 rules from <no --config>" in result.output


def test_the_service_of_a_rate_limit_service_alone_reloads_no_rules(tmp_path: Path) -> None:
    from sidecar.admin import Admin

    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    settings = {"config": None, "admin_token_file": None, "hook_udp": None, "loopback": True,
                "log_level": "warning", "workers": 1, "secret": None}
    app = cli.service(settings)
    assert app.engine.ruleset.rules == ()
    assert Admin(app.engine, None).reload() == [] and app.engine.ruleset.rules == ()


# --------------------------------------------------------------------------
# serve: an address already taken
# --------------------------------------------------------------------------


@pytest.fixture
def taken() -> Iterator[Callable[[bool], int]]:
    """Take a free loopback port (TCP, listening; or UDP) for the test: its number."""
    held: list[socket.socket] = []

    def take(udp: bool = False) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM)
        held.append(sock)
        sock.bind(("127.0.0.1", 0))
        if not udp:
            sock.listen()
        port: int = sock.getsockname()[1]
        return port

    yield take
    for sock in held:
        sock.close()


def free_port(udp: bool = False) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.parametrize("option, udp", [("--port", False), ("--hook-udp", True), ("--grpc-port", False),
                                         ("--health", False)])
def test_serve_on_an_address_in_use_says_which_option_in_one_line(
        taken: Callable[[bool], int], started: list, option: str, udp: bool) -> None:
    busy = taken(udp)
    value = str(busy) if option.endswith("port") else f"127.0.0.1:{busy}"
    argv = {"--port": str(free_port()), "--hook-udp": f"127.0.0.1:{free_port(udp=True)}", option: value}
    result = CliRunner().invoke(cli.main, ["serve", "--demo-rules", *[part for item in argv.items() for part in item]])
    assert result.exit_code == 1 and not started
    assert result.exception is None or isinstance(result.exception, SystemExit)
    [line] = result.output.splitlines()
    assert line.startswith(f"error: {option}: cannot listen on 127.0.0.1:{busy}")
    assert "address already in use" in line and "Traceback" not in result.output


def test_serve_refuses_one_tcp_port_for_two_of_its_listeners(started: list) -> None:
    port = free_port()
    result = CliRunner().invoke(cli.main, ["serve", "--demo-rules", "--port", str(port), "--grpc-port", str(port),
                                           "--hook-udp", "off"])
    assert result.exit_code == 1 and not started
    assert result.output.startswith(f"error: --grpc-port: cannot listen on 127.0.0.1:{port}: address already in use")


def test_serve_listens_where_its_addresses_are_free(started: list) -> None:
    port, hook, health = free_port(), free_port(udp=True), free_port()
    result = CliRunner().invoke(cli.main, ["serve", "--demo-rules", "--port", str(port), "--hook-udp",
                                           f"127.0.0.1:{hook}", "--health", f"127.0.0.1:{health}"])
    assert result.exit_code == 0, result.output
    [run] = started
    assert run["port"] == port and run["app"]["hook_udp"] == ("127.0.0.1", hook)
    assert run["app"]["health"] == ("127.0.0.1", health)


# --------------------------------------------------------------------------
# HOST:PORT options say what they accept
# --------------------------------------------------------------------------


@pytest.mark.parametrize("argv, accepted", [
    (["config", "envoy", "--listen"], "expected HOST:PORT or PORT, got"),
    (["config", "envoy", "--sluice"], "expected HOST:PORT, got"),
    (["config", "envoy", "--hook-udp"], "expected HOST:PORT, got"),
    (["config", "envoy", "--upstream"], "expected HOST:PORT, got"),
    (["serve", "--demo-rules", "--hook-udp"], "expected HOST:PORT or 'off', got"),
    (["serve", "--demo-rules", "--health"], "expected HOST:PORT or 'off', got"),
])
@pytest.mark.parametrize("value", ["nonsense", "off", "host:", "127.0.0.1:http", "a b:80", "x;y:80"])
def test_every_host_port_option_says_exactly_what_it_accepts(served: list, argv: list[str], accepted: str,
                                                            value: str) -> None:
    result = CliRunner().invoke(cli.main, [*argv, value])
    if value == "off" and "or 'off'" in accepted:
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2 and not served
    assert f"Invalid value for '{argv[-1]}': {accepted} {value!r}" in result.output


@pytest.mark.parametrize("value", ["127.0.0.1:0", "127.0.0.1:65536", "99999"])
def test_a_port_out_of_range_is_named(value: str) -> None:
    result = CliRunner().invoke(cli.main, ["config", "envoy", "--listen", value])
    assert result.exit_code == 2 and f"the port of {value!r} is not from 1 to 65535" in result.output


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=30) | st.builds(lambda host, port: f"{host}:{port}", st.text(max_size=12),
                                              st.integers(-10, 70_000)),
       off=st.booleans(), bare_port=st.booleans())
def test_any_host_port_text_is_an_address_in_range_or_one_line_saying_what_is_accepted(
        text: str, off: bool, bare_port: bool) -> None:
    kind = addresses.Address(off=off, bare_port=bare_port)
    try:
        address = kind.convert(text, None, None)
    except click.BadParameter as exc:
        message = exc.message
        assert "\n" not in message and (message.startswith(f"expected {kind.accepts}, got ")
                                        or "is not from 1 to 65535" in message)
    else:
        if address is None:
            assert off and text.strip() == "off"
        else:
            host, port = address
            assert 1 <= port <= 65535 and str(port) in text
            assert re.fullmatch(r"[A-Za-z0-9._:-]+", host), host


def test_host_port_values_as_the_proxies_get_them() -> None:
    either = addresses.Address(off=True, bare_port=True)
    assert [either.convert(value, None, None) for value in ("off", "80", "[::1]:8182", ":8182", "example.org:9")] \
        == [None, ("0.0.0.0", 80), ("::1", 8182), ("127.0.0.1", 8182), ("example.org", 9)]
    assert either.accepts == "HOST:PORT, PORT or 'off'"


# --------------------------------------------------------------------------
# check: a file, or a folder
# --------------------------------------------------------------------------


RLS = "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"


def test_check_a_folder_checks_each_rules_file_in_it(tmp_path: Path) -> None:
    (tmp_path / "one.yaml").write_text("rules:\n  - {id: a, key: [ip], limit: {requests: 1, per: 1s}, action: block}\n")
    (tmp_path / "two.yml").write_text(RULES + "  - {id: b, key: [ip], limit: {requests: 1, per: 1s}, action: log}\n")
    (tmp_path / "notes.txt").write_text("not YAML, not read")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "broken.yaml").write_text("not: rules\n")  # subfolders are not read
    result = CliRunner().invoke(cli.main, ["check", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output == f"{tmp_path / 'one.yaml'}: OK, 1 rule\n{tmp_path / 'two.yml'}: OK, 2 rules\n"


def test_check_a_folder_gives_each_files_errors_as_file_line_and_checks_the_others(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(RULES)
    (tmp_path / "b.yaml").write_text("rules:\n  - id: r\n    key: [ip]\n    limit: {requests: many, per: 1m}\n"
                                     "    action: block\n")
    (tmp_path / "c.yaml").write_text(RLS.format(domain="c"))
    result = CliRunner().invoke(cli.main, ["check", str(tmp_path)])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0] == f"{tmp_path / 'a.yaml'}: OK, 1 rule"
    assert lines[1].startswith(f"{tmp_path / 'b.yaml'}:4: rules[0](r).limit.requests")
    assert f"{tmp_path / 'c.yaml'}: OK, Rate Limit Service: 1 domain (c), 1 limit" in lines
    assert lines[-1] == f"{tmp_path}: 1 of 3 files with errors"
    assert "domain: field required" not in result.output


def test_check_a_folder_of_rate_limit_service_files_checks_them_as_one_configuration(tmp_path: Path) -> None:
    (tmp_path / "nested").mkdir()
    (tmp_path / "a.yaml").write_text(RLS.format(domain="a"))
    (tmp_path / "nested" / "b.yaml").write_text(RLS.format(domain="b"))
    result = CliRunner().invoke(cli.main, ["check", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output == f"{tmp_path}: OK, Rate Limit Service: 2 domains (a, b), 2 limits\n"
    # As one configuration: a domain given by two files is an error.
    (tmp_path / "nested" / "b.yaml").write_text(RLS.format(domain="a"))
    again = CliRunner().invoke(cli.main, ["check", str(tmp_path)])
    assert again.exit_code == 1 and "domain 'a' is already configured in" in again.output


def test_check_the_examples_folder_checks_its_rules_files() -> None:
    result = CliRunner().invoke(cli.main, ["check", str(ROOT / "examples")])
    assert result.exit_code == 0, result.output
    checked = {Path(line.split(": OK, ")[0]).name for line in result.output.splitlines()}
    assert checked == {path.name for path in (ROOT / "examples").glob("*.yaml")}


def test_check_an_empty_folder_is_an_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli.main, ["check", str(tmp_path)])
    assert result.exit_code == 1 and result.output == f"error: {tmp_path}: no .yaml or .yml file in this folder\n"


# --------------------------------------------------------------------------
# config --out writes no file over another
# --------------------------------------------------------------------------


def test_config_out_leaves_files_already_there_unless_forced(tmp_path: Path) -> None:
    first = CliRunner().invoke(cli.main, ["config", "nginx-snippets", "--out", str(tmp_path)])
    assert first.exit_code == 0, first.output
    written = sorted(tmp_path.iterdir())
    assert written
    for path in written:
        path.write_text("# mine\n")
    again = CliRunner().invoke(cli.main, ["config", "nginx-snippets", "--out", str(tmp_path)])
    assert again.exit_code == 1
    [line] = again.output.splitlines()
    assert line.startswith(f"error: --out: {len(written)} files already there") and "--force" in line
    assert all(str(path) in line for path in written)
    assert all(path.read_text() == "# mine\n" for path in written)
    forced = CliRunner().invoke(cli.main, ["config", "nginx-snippets", "--out", str(tmp_path), "--force"])
    assert forced.exit_code == 0, forced.output
    assert all(path.read_text() != "# mine\n" for path in written)


def test_config_out_writes_nothing_when_one_file_is_there(tmp_path: Path) -> None:
    out = tmp_path / "site"
    first = CliRunner().invoke(cli.main, ["config", "nginx", "--out", str(out)])
    assert first.exit_code == 0, first.output
    files = sorted(path for path in out.rglob("*") if path.is_file())
    keep, *others = files
    for path in others:
        path.unlink()
    again = CliRunner().invoke(cli.main, ["config", "nginx", "--out", str(out)])
    assert again.exit_code == 1 and f"1 file already there, left as they are: {keep}" in again.output
    assert sorted(path for path in out.rglob("*") if path.is_file()) == [keep]


# --------------------------------------------------------------------------
# replay: nothing replayed is an error
# --------------------------------------------------------------------------


def invoke_replay(*args: str) -> Any:
    """``sluice replay`` in this process (the command quiets the "sluice"
    logger for its run; other tests need it back)."""
    logger = logging.getLogger("sluice")
    level = logger.level
    try:
        return CliRunner().invoke(cli.main, ["replay", *args])
    finally:
        logger.setLevel(level)


LOG_LINE = ('203.0.113.7 - - [01/Mar/2024:10:00:00 +0000] "GET /api/x HTTP/1.1" 200 12 "-" "curl/8"\n')


def test_replay_of_logs_without_a_request_exits_3_and_says_why(tmp_path: Path) -> None:
    rules, log = tmp_path / "rules.yaml", tmp_path / "access.log"
    rules.write_text(RULES)
    log.write_text("not a request\nnor this\n")
    result = invoke_replay("--config", str(rules), str(log))
    assert result.exit_code == 3
    assert result.output.startswith("replayed 0 requests from 2 lines of 1 log")
    assert "error: none of the 2 lines of the logs is a request" in result.output.splitlines()[-1]
    log.write_text("")
    empty = invoke_replay("--config", str(rules), str(log))
    assert empty.exit_code == 3 and "error: the logs have no lines" in empty.output


def test_replay_with_some_requests_exits_0_and_counts_in_words(tmp_path: Path) -> None:
    rules, log = tmp_path / "rules.yaml", tmp_path / "access.log"
    rules.write_text(RULES)
    log.write_text(LOG_LINE + "not a request\n")
    result = invoke_replay("--config", str(rules), str(log))
    assert result.exit_code == 0, result.output
    assert result.output.startswith("replayed 1 request from 2 lines of 1 log")
    assert "skipped 1 line that is not requests" in result.output


def test_replay_help_gives_its_exit_statuses() -> None:
    output = " ".join(CliRunner().invoke(cli.main, ["replay", "-h"]).output.split())
    assert "3 when no line of the logs was a request" in output


# --------------------------------------------------------------------------
# Help for every option; the environment variables' page
# --------------------------------------------------------------------------


def every_option() -> Iterator[tuple[str, click.Option]]:
    from sidecar.cli_reference import commands

    for name, command in commands(cli.main):
        for param in command.params:
            if isinstance(param, click.Option):
                yield name, param


@pytest.mark.parametrize("name, option", list(every_option()), ids=lambda item: getattr(item, "name", item))
def test_every_option_of_every_command_has_help_for_users(name: str, option: click.Option) -> None:
    text = option.help or ""
    assert text.strip(), f"{name} {option.opts[0]} has no help"
    assert not re.search(r"\b(sidecar|tests)/|\.py\b", text), f"{name} {option.opts[0]} cites a source file: {text}"


def test_the_environment_page_is_the_one_the_command_line_generates() -> None:
    from sidecar.cli_reference import ENVIRONMENT_PAGE, REGENERATE, environment_page

    committed = ROOT / ENVIRONMENT_PAGE
    assert committed.is_file() and committed.read_text(encoding="utf-8") == environment_page(), (
        f"{ENVIRONMENT_PAGE} is not what the options of `sluice` say: run `.venv/bin/{REGENERATE}` "
        "and commit the page")


def test_the_environment_page_lists_every_option_an_environment_variable_sets() -> None:
    from sidecar.cli_reference import environment_page

    @click.group()
    def tool() -> None:
        """A command line."""

    @tool.command()
    @click.option("--colour", default="blue", envvar="TOOL_COLOUR", help="The colour | of it.")
    @click.option("--loud", is_flag=True, envvar="TOOL_LOUD", help="Shout.")
    @click.option("--quiet", is_flag=True, help="No variable.")
    def paint(colour: str, loud: bool, quiet: bool) -> None:
        """Paint."""

    page = environment_page(tool)
    assert "| `TOOL_COLOUR` | `--colour` | `sluice paint` | `blue` | The colour \\| of it. |" in page
    assert "| `TOOL_LOUD` | `--loud` | `sluice paint` | off | Shout. |" in page
    assert "--quiet" not in page
    sluice_page = environment_page()
    for variable in ("SLUICE_CONFIG", "SLUICE_HOST", "SLUICE_PORT", "SLUICE_LOG_LEVEL", "SLUICE_ADMIN_TOKEN_FILE",
                     "SLUICE_GRPC_PORT", "SLUICE_RLS_CONFIG", "SLUICE_SHADOW", "SLUICE_LOOP", "SLUICE_ADMIN_URL"):
        assert f"| `{variable}` |" in sluice_page


# --------------------------------------------------------------------------
# Counts in words
# --------------------------------------------------------------------------


def test_counts_take_the_noun_in_their_number() -> None:
    from sidecar.plurals import plural

    assert [plural(count, "rule") for count in (0, 1, 2, 1528)] == ["0 rules", "1 rule", "2 rules", "1,528 rules"]
    assert plural(1, "entry", "entries") == "1 entry" and plural(3, "entry", "entries") == "3 entries"


def test_check_says_one_rule(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    result = CliRunner().invoke(cli.main, ["check", str(rules)])
    assert result.exit_code == 0 and result.output == f"{rules}: OK, 1 rule\n"
