"""The ``sluice`` command line: version, help, and settings from the
environment (for containers), where a flag wins."""

from __future__ import annotations

import difflib
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import uvicorn
import yaml
from click.testing import CliRunner

from sidecar import DISTRIBUTION, cli
from sidecar.launcher import ENVOY_GUARD_ADDRESSES, ENVOY_MAX_TOKENS

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_distribution_s() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    result = CliRunner().invoke(cli.main, ["--version"])
    assert result.exit_code == 0 and result.output == f"sluice {project['version']}\n"
    assert project["name"] == DISTRIBUTION


@pytest.mark.parametrize("args", [["-h"], ["--help"], ["serve", "-h"], ["check", "-h"], ["replay", "-h"]])
def test_h_is_help(args: list[str]) -> None:
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0 and result.output.startswith("Usage: ")


def test_serve_help_names_the_environment_variables() -> None:
    output = CliRunner().invoke(cli.main, ["serve", "-h"]).output
    for name in ("SLUICE_CONFIG", "SLUICE_HOST", "SLUICE_PORT", "SLUICE_LOG_LEVEL", "SLUICE_ADMIN_TOKEN_FILE"):
        assert name in output


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What serve would run uvicorn with (nothing is started)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: calls.append({"app": app, **options}))
    monkeypatch.setattr(cli, "service", lambda settings, ruleset=None: settings)
    return calls


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
    result = CliRunner().invoke(cli.main, ["serve", "--host", "127.0.0.3"], env={"SLUICE_GRPC_PORT": "9393"})
    assert result.exit_code == 0, result.output
    assert served[0]["app"]["grpc"] == ("127.0.0.3", 9393)
    assert CliRunner().invoke(cli.main, ["serve"]).exit_code == 0
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
    from sidecar.launcher import find_envoy

    for target in ("envoy", "envoy-grpc"):
        out = tmp_path / target
        result = CliRunner().invoke(cli.main, ["config", target, *options, "--out", str(out)])
        assert result.exit_code == 0, result.output
        [bootstrap] = out.iterdir()
        validation = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(bootstrap), "--disable-hot-restart",
                                     "--log-level", "error"], capture_output=True, text=True, timeout=60)
        assert validation.returncode == 0, validation.stdout + validation.stderr


def test_the_envoy_guard_comes_with_both_check_fragments_and_not_the_rate_limit_service_s(tmp_path: Path) -> None:
    out = tmp_path / "fragments"
    assert CliRunner().invoke(cli.main, ["config", "envoy-fragments", "--guard", "--out", str(out)]).exit_code == 0
    guarded = {path.name for path in out.iterdir() if "stat_prefix: sluice_guard" in path.read_text()}
    assert guarded == {"sluice-http-filters.yaml", "sluice-grpc-http-filters.yaml"}
    for name in guarded:
        filters = yaml.safe_load((out / name).read_text())
        assert [(entry["name"], entry["typed_config"].get("stat_prefix")) for entry in filters] == [
            ("envoy.filters.http.local_ratelimit", "sluice_guard"), ("envoy.filters.http.lua", None),
            ("envoy.filters.http.ext_authz", None), ("envoy.filters.http.local_ratelimit", "sluice_unchecked")]


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
