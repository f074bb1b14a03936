"""The ``sluice`` command."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import shutil
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from sidecar import core, version
from sidecar.addresses import Address
from sidecar.cli_admin import admin as admin_commands
from sidecar.config import ConfigError
from sidecar.plurals import plural
from sidecar.rules import Ruleset, load_ruleset, no_ruleset
from sidecar.watch import DEFAULT_INTERVAL, SHORTEST_INTERVAL

if TYPE_CHECKING:
    from sidecar.rls import RlsConfig
    from sidecar.store.node import NodeZones


def _fail(message: str, status: int = 1) -> NoReturn:
    """One line on stderr, and the exit status."""
    click.echo(f"error: {message}", err=True)
    raise SystemExit(status)


def _echo_issues(exc: ConfigError) -> None:
    for issue in exc.issues:
        click.echo(str(issue), err=True)


def _load(config: str | None, shadow: bool = False) -> Ruleset:
    """The rules of ``config`` (None: no rules, a Rate Limit Service
    alone), or exit 1 with every error as FILE:LINE."""
    try:
        return load_ruleset(config, shadow) if config else no_ruleset(shadow)
    except ConfigError as exc:
        _echo_issues(exc)
        raise SystemExit(1) from None


def _is_rls(path: Path) -> bool:
    """A file with a top-level domain: a Rate Limit Service configuration."""
    from sidecar.rls import is_rls_text

    try:
        return is_rls_text(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return False  # the rules loader says what is wrong with it


def _load_rls(path: str) -> RlsConfig:
    from sidecar.rls import load_rls

    try:
        return load_rls(path)
    except ConfigError as exc:
        _echo_issues(exc)
        raise SystemExit(1) from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(version=version(), prog_name="sluice", message=f"%(prog)s %(version)s, {core.which()}")
def main() -> None:
    """Sluice: rate-limiting external authorization for nginx and Envoy.

    Every option of `sluice serve` that an environment variable can set says
    which (SLUICE_...); a flag on the command line wins over it.
    """


@main.command()
@click.argument("path", type=click.Path())
@click.option("--explain", is_flag=True,
              help="For a rules file: also print its rules as Sluice runs them, what each tests and in "
                   "what order (the compiled matcher's source, as tracebacks and debuggers show it).")
def check(path: str, explain: bool) -> None:
    """Validate a rules file, a Rate Limit Service configuration (a file
    with a top-level domain), or a folder of them: exit 0, or 1 with every
    error as FILE:LINE: field: message.

    A folder whose YAML files (subfolders included) are all Rate Limit
    Service configurations is checked as one, as `sluice serve --rls-config
    FOLDER` reads it. Any other folder: each .yaml and .yml file directly
    in it, a rules file or a Rate Limit Service configuration by its
    content."""
    from sidecar.rls import rls_files

    if explain:
        ok = _explain_rules(path)
    elif not os.path.isdir(path):
        ok = _check_file(path)
    elif (every := rls_files(path)) and all(map(_is_rls, every)):
        ok = _check_rls(path)
    else:
        files = sorted(file for file in Path(path).iterdir()
                       if file.suffix in (".yaml", ".yml") and file.is_file() and not file.name.startswith("."))
        if not files:
            _fail(f"{path}: no .yaml or .yml file in this folder")
        failed = [file for file in files if not _check_file(str(file))]
        if failed:
            click.echo(f"{path}: {len(failed):,} of {plural(len(files), 'file')} with errors", err=True)
        ok = not failed
    if not ok:
        raise SystemExit(1)


def _explain_rules(path: str) -> bool:
    """`sluice check --explain`: a rules file checked, then its matcher."""
    if os.path.isdir(path) or _is_rls(Path(path)):
        _fail(f"--explain: {path}: explains one rules file, not a folder or a Rate Limit Service configuration")
    if not _check_rules(path):
        return False
    click.echo()
    click.echo(load_ruleset(path).match_source.text, nl=False)
    return True


def _check_file(path: str) -> bool:
    """Check one file, a rules file or a Rate Limit Service configuration
    by its content; whether it is valid (its errors printed if not)."""
    return _check_rls(path) if _is_rls(Path(path)) else _check_rules(path)


def _check_rules(path: str) -> bool:
    try:
        ruleset = load_ruleset(path)
    except ConfigError as exc:
        _echo_issues(exc)
        return False
    click.echo(f"{path}: OK, {plural(len(ruleset.rules), 'rule')}")
    for warning in ruleset.warnings:
        click.echo(f"warning: {warning}", err=True)
    if ruleset.longest_hold:
        click.echo(f"leaky buckets hold requests up to {ruleset.longest_hold:g} s: the proxy's "
                   "timeout for Sluice must be longer, or held requests fail open, and nginx's refusal "
                   "cache off (`sluice config --rules` renders both)")
    return True


def _check_rls(path: str) -> bool:
    from sidecar.rls import load_rls

    try:
        config = load_rls(path)
    except ConfigError as exc:
        _echo_issues(exc)
        return False
    domains = ", ".join(sorted(config.domains))
    click.echo(f"{path}: OK, Rate Limit Service: {plural(len(config.domains), 'domain')} ({domains}), "
               f"{plural(config.limits, 'limit')}")
    return True


@main.command()
@click.option("--out", type=click.Path(dir_okay=False, writable=True), metavar="FILE",
              help="Write the schema to FILE instead of printing it.")
def schema(out: str | None) -> None:
    """Print the JSON Schema of the rules file, for editors: a rules file
    whose first line is `# yaml-language-server: $schema=PATH-OR-URL` gets
    completion, descriptions and errors as it is typed. `sluice check`
    still has the last word (ids, files, settings that exclude each other)."""
    from sidecar.schema import rules_schema_text

    text = rules_schema_text()
    if out is None:
        click.echo(text, nl=False)
        return
    try:
        Path(out).write_text(text, encoding="utf-8")
    except OSError as exc:
        _fail(f"cannot write {out}: {exc.strerror or exc}", 2)
    click.echo(f"wrote {out}", err=True)


# What `sluice config` renders: the package's template folders (each
# template directly in it) or single templates (an Envoy bootstrap, without
# its neighbours), and where each one's files go (the full nginx site
# includes conf.d/snippets/...).
CONFIG_TARGETS = {
    "nginx": (("nginx", ""), ("nginx/snippets", "snippets")),
    "nginx-snippets": (("nginx/snippets", ""),),
    "envoy": (("envoy/envoy.yaml.template", ""),),
    "envoy-fragments": (("envoy/fragments", ""),),
    "envoy-grpc": (("envoy/envoy-grpc.yaml.template", ""),),
    "envoy-rls": (("envoy/envoy-rls.yaml.template", ""),),
}


@main.command("config")
@click.argument("target", type=click.Choice(sorted(CONFIG_TARGETS)))
@click.option("--listen", "listen_at", default="127.0.0.1:8080", type=Address(bare_port=True),
              help="HOST:PORT (or PORT: every address) the proxy listens on (nginx's listen, Envoy's listener).")
@click.option("--sluice", "sluice_at", default="127.0.0.1:8181", type=Address(), help="HOST:PORT of sluice serve.")
@click.option("--hook-udp", "hook_at", default="127.0.0.1:8182", type=Address(),
              help="HOST:PORT of sluice serve --hook-udp (nginx's reports).")
@click.option("--upstream", "upstream_at", default="127.0.0.1:9000", type=Address(),
              help="HOST:PORT of the application.")
@click.option("--envoy-admin-port", default=9901, type=click.IntRange(1, 65535),
              help="Port of Envoy's admin interface, on loopback (envoy, envoy-grpc, envoy-rls).")
@click.option("--sluice-grpc-port", default=8183, show_default=True, type=click.IntRange(1, 65535),
              help="Port of sluice serve --grpc-port on the --sluice host (envoy-grpc, envoy-fragments).")
@click.option("--rules", type=click.Path(dir_okay=False, exists=True),
              help="Rules file: the proxy's timeout for Sluice's answer then outlasts its longest hold.")
@click.option("--guard", is_flag=True,
              help="A first tier per client address ahead of Sluice, the proxy's own (nginx's limit_req, "
                   "Envoy's local_ratelimit): ten times the fastest rule's rate (of --rules), at least "
                   "10 r/s. It holds a flood that outruns Sluice; it also limits every client behind one "
                   "address (a NAT). Not for envoy-rls.")
@click.option("--guard-rate", type=click.FloatRange(min=0.001), metavar="R",
              help="The guard's requests per second per address (implies --guard).")
@click.option("--unchecked-rate", type=click.FloatRange(min=0.001), metavar="R",
              help="The requests per second per address the proxy lets in unchecked (default: the guard's "
                   "rate, from --rules), in bursts of two seconds' worth. nginx: when Sluice did not answer "
                   "in time (a Sluice that is down lets every request in); Envoy: whenever the check failed, "
                   "Sluice down included (ext_authz cannot tell the two apart).")
@click.option("--tls-cert", type=click.Path(dir_okay=False), metavar="FILE",
              help="Envoy bootstraps: a TLS listener with this certificate chain (PEM; with --tls-key), "
                   "its tls_inspector computing JA3 and JA4 for the ja3 and ja4 keys.")
@click.option("--tls-key", type=click.Path(dir_okay=False), metavar="FILE",
              help="The private key of --tls-cert (PEM).")
@click.option("--cache-dir", default="sluice-cache", show_default=True,
              help="nginx: where it keeps the refusals it answers itself (proxy_cache_path); relative to "
                   "nginx's prefix. nginx creates the folder, not its parents.")
@click.option("--out", type=click.Path(file_okay=False),
              help="Write the files into this folder (as nginx's conf.d, say) instead of printing them; "
                   "files already there are left alone unless --force.")
@click.option("--force", is_flag=True, help="With --out: replace the files that are already there.")
def config_command(target: str, listen_at: tuple[str, int], sluice_at: tuple[str, int], hook_at: tuple[str, int],
                   upstream_at: tuple[str, int], envoy_admin_port: int, sluice_grpc_port: int, rules: str | None,
                   guard: bool, guard_rate: float | None, unchecked_rate: float | None, tls_cert: str | None,
                   tls_key: str | None, cache_dir: str, out: str | None, force: bool) -> None:
    """Print (or write) the nginx or Envoy configuration for Sluice, rendered
    for the given addresses: the full site or bootstrap, or the snippets and
    fragments to add to an existing one."""
    from sidecar.rendering import (
        RenderError,
        proxy_variables,
        render_package_templates,
        with_envoy_guard,
        with_envoy_tls,
        with_nginx_guard,
    )
    from sidecar.rendering import guard_rate as derived_guard_rate

    ruleset = _load(rules) if rules else None
    guarded = guard or guard_rate is not None
    if guarded and target == "envoy-rls":
        raise click.BadParameter("the guard goes ahead of Sluice's check, and envoy-rls has none (its Envoy asks "
                                 "Sluice's Rate Limit Service): give it with nginx, nginx-snippets, envoy, "
                                 "envoy-grpc or envoy-fragments", param_hint="--guard")
    if (tls_cert is None) != (tls_key is None):
        raise click.BadParameter("give both --tls-cert and --tls-key", param_hint="--tls-cert")
    if tls_cert is not None and target not in ("envoy", "envoy-grpc", "envoy-rls"):
        raise click.BadParameter("a TLS listener is written into an Envoy bootstrap: envoy, envoy-grpc or "
                                 "envoy-rls (nginx's TLS is nginx's own ssl_certificate)", param_hint="--tls-cert")
    if not re.fullmatch(r"[^\s;{}'\"$#\\]+", cache_dir):
        raise click.BadParameter("a path without spaces, quotes or any of ;{}$#\\ (nginx would read them)",
                                 param_hint="--cache-dir")
    files: dict[str, str] = {}
    try:
        variables = proxy_variables(listen_at, listen_at, sluice_at, hook_at, upstream_at, envoy_admin_port, ruleset,
                                    sluice_grpc_port, unchecked_rate)
        variables["SLUICE_CACHE_DIR"] = cache_dir
        for source, into in CONFIG_TARGETS[target]:
            for name, text in render_package_templates(source, variables).items():
                files[f"{into}/{name}" if into else name] = text
        if guarded:
            with_guard = with_nginx_guard if target.startswith("nginx") else with_envoy_guard
            files = with_guard(files, guard_rate if guard_rate is not None else derived_guard_rate(ruleset))
        if tls_cert is not None and tls_key is not None:
            files = with_envoy_tls(files, str(Path(tls_cert).resolve()), str(Path(tls_key).resolve()))
    except RenderError as exc:
        _fail(str(exc))
    if out is not None:
        _write_files(Path(out), files, force)
        return
    for name, text in files.items():
        if len(files) > 1:
            click.echo(f"# ==> {name} <==")
        click.echo(text, nl=not text.endswith("\n"))


def _write_files(folder: Path, files: dict[str, str], force: bool) -> None:
    """Write the rendered files into ``folder``; none of them, and exit 1,
    when some are there already and ``force`` is not given."""
    there = [str(folder / name) for name in files if (folder / name).exists()]
    if there and not force:
        _fail(f"--out: {plural(len(there), 'file')} already there, left as they are: {', '.join(there)} "
              "(--force replaces them)")
    for name, text in files.items():
        path = folder / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as exc:
            _fail(f"--out: cannot write {path}: {exc.strerror or exc}")
        click.echo(f"wrote {path}", err=True)


def _sweep_option(ctx: click.Context, param: click.Parameter,
                  values: tuple[str, ...]) -> list[tuple[str, tuple[int, ...]]]:
    from sidecar.replay import SweepError, parse_sweep

    try:
        return [parse_sweep(value) for value in values]
    except SweepError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


@main.command()
@click.option("--config", "config", required=True, type=click.Path(dir_okay=False),
              help="The rules file to replay the logs through.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--top", default=5, show_default=True, type=click.IntRange(min=0), help="Keys listed per rule.")
@click.option("--host", default="", help="Host for log lines that do not record one (the combined format).")
@click.option("--exclude-top", default=0, show_default=True, type=click.IntRange(min=0), metavar="N",
              help="Also give each rule's peak percentiles without its N keys of highest peak, so that "
                   "a few abusers do not set P99.")
@click.option("--sweep", "sweeps", multiple=True, metavar="RULE=N,N,...", callback=_sweep_option,
              help="Replay as well with each of these thresholds for RULE (its limit's requests, score, "
                   "tokens, burst or concurrent) and report what each would refuse. Once per rule; "
                   "each threshold is one more replay, in the same pass over the logs.")
@click.option("--html", "html", type=click.Path(dir_okay=False, writable=True), metavar="FILE",
              help="Also write the report as one self-contained HTML page (charts of the peaks, with "
                   "the sweep's thresholds) to FILE.")
@click.argument("logs", nargs=-1, required=True)
def replay(config: str, as_json: bool, top: int, host: str, exclude_top: int,
           sweeps: list[tuple[str, tuple[int, ...]]], html: str | None, logs: tuple[str, ...]) -> None:
    """Replay nginx access logs (combined or JSON lines; .gz; - for stdin) through the
    rules in virtual time, and report what each rule would have done.

    Exit status: 0 when some lines were replayed; 1 when the rules file has
    errors; 2 for a bad option, or a log or --html file that cannot be read
    or written; 3 when no line of the logs was a request (the report is
    printed all the same: its first skipped lines say why).
    """
    from sidecar.accesslog import LogError
    from sidecar.replay import (
        NOTHING_REPLAYED,
        SweepError,
        nothing_replayed,
        prepare_sweeps,
        render_json,
        render_text,
        replay_logs,
    )

    ruleset = _load(config)
    try:
        trials = prepare_sweeps(config, sweeps)
    except SweepError as exc:
        raise click.BadParameter(str(exc), param_hint="'--sweep'") from None
    # The report counts invalid client addresses; the engine's once-a-minute
    # warning about them would repeat for every minute of log time.
    # Quieted for the replay only: a caller in the same process (a test)
    # gets its logger back as it was.
    logger = logging.getLogger("sluice")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        report = replay_logs(ruleset, logs, top=top, default_host=host, exclude_top=exclude_top, sweeps=trials)
    except LogError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from None
    finally:
        logger.setLevel(level)
    if html is not None:
        from sidecar.replay.page import render_html

        try:
            with open(html, "w", encoding="utf-8") as page:
                page.write(render_html(report))
        except OSError as exc:
            click.echo(f"error: cannot write {html}: {exc.strerror or exc}", err=True)
            raise SystemExit(2) from None
    click.echo(render_json(report) if as_json else render_text(report), nl=False)
    if not report["requests"]:
        _fail(nothing_replayed(report), NOTHING_REPLAYED)


def _watch_interval(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if value == 0 or SHORTEST_INTERVAL <= value < float("inf"):
        return value
    raise click.BadParameter(f"expected 0 (off) or at least {SHORTEST_INTERVAL:g} seconds, got {value:g}", ctx, param)


def _otlp_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not re.match(r"^https?://[^/\s]+", value):
        raise click.BadParameter("an OTLP/HTTP collector's URL: http:// or https://, with a host", ctx, param)
    return value or None


def _then_auth_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from sidecar.chain import NextAuthAddress

    if value is None:
        return None
    try:
        NextAuthAddress.parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return value


@main.command()
@click.option("--config", "config", type=click.Path(dir_okay=False), envvar="SLUICE_CONFIG", show_envvar=True,
              help="The rules file. Required, unless --demo-rules, or --rls-config to serve the Rate Limit "
                   "Service alone (then no check rules: every check is allowed).")
@click.option("--demo-rules", is_flag=True,
              help="Run the demo rules of `make run` (examples/default.yaml: 5 requests per 10 s per client "
                   "address on /api/), to try Sluice out; never for real traffic.")
@click.option("--host", default="127.0.0.1", show_default=True, envvar="SLUICE_HOST", show_envvar=True,
              help="Address of the check port (0.0.0.0: every IPv4 address); --grpc-port listens there too.")
@click.option("--port", default=8181, show_default=True, type=click.IntRange(1, 65535), envvar="SLUICE_PORT",
              show_envvar=True,
              help="The check port: the proxies' checks over HTTP, /healthz, /readyz, /metrics and the admin API.")
@click.option("--uds", type=click.Path(), help="Listen on a Unix socket instead of host:port.")
@click.option("--hook-udp", "hook_at", default="127.0.0.1:8182", show_default=True, type=Address(off=True),
              help="HOST:PORT where nginx's response reports arrive (syslog over UDP), or 'off'.")
@click.option("--admin-token-file", type=click.Path(dir_okay=False, exists=True),
              envvar="SLUICE_ADMIN_TOKEN_FILE", show_envvar=True,
              help="File holding the bearer token of the admin API (at least 16 characters). "
                   "Without it the admin API answers only loopback peers of a loopback listener.")
@click.option("--health", default="off", show_default=True, type=Address(off=True),
              help="HOST:PORT of a listener of its own for /healthz and /readyz, answered "
                   "even while the main port is flooded (point liveness probes here), or 'off'.")
@click.option("--grpc-port", type=click.IntRange(1, 65535), envvar="SLUICE_GRPC_PORT", show_envvar=True,
              help="Also serve Envoy's gRPC ext_authz (envoy.service.auth.v3.Authorization) on this "
                   "port of --host. Default: off.")
@click.option("--rls-config", type=click.Path(exists=True), envvar="SLUICE_RLS_CONFIG", show_envvar=True,
              help="Also serve Envoy's Rate Limit Service (envoy.service.ratelimit.v3) on --grpc-port, "
                   "with envoyproxy/ratelimit's configuration: one YAML file, or a directory of them.")
@click.option("--rls-shadow", is_flag=True, envvar="SLUICE_RLS_SHADOW", show_envvar=True,
              help="Rate Limit Service in shadow mode: count and report every descriptor, but always "
                   "answer OK overall (envoyproxy/ratelimit's SHADOW_MODE).")
@click.option("--shadow", is_flag=True, envvar="SLUICE_SHADOW", show_envvar=True,
              help="Every rule in shadow mode: evaluated and counted as when enforcing, but no request is "
                   "refused, banned or challenged; what would have been is logged and counted.")
@click.option("--watch-interval", default=DEFAULT_INTERVAL, show_default=True, type=float, metavar="SECONDS",
              callback=_watch_interval, envvar="SLUICE_WATCH_INTERVAL", show_envvar=True,
              help="How often the rules file is looked at: once changed (written, renamed over, a Kubernetes "
                   "ConfigMap update) and steady for one more interval, it is reloaded as on SIGHUP, counters "
                   "kept; an invalid file keeps the old rules. 0: off.")
@click.option("--no-watch", is_flag=True, help="Reload the rules file only on SIGHUP or the admin API "
                                                "(as --watch-interval 0).")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(min=1),
              help="Processes sharing the ports and one count: with the memory backend, a table in shared "
                   "memory (/dev/shm) sized at start from state.max_keys, which needs the compiled core; with "
                   "Redis, the server's.")
@click.option("--log-level", default="info", show_default=True, envvar="SLUICE_LOG_LEVEL", show_envvar=True,
              type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
              help="The least severe log lines written (JSON lines on stderr).")
@click.option("--max-header-bytes", default=128 * 1024, show_default=True, type=click.IntRange(min=1024),
              help="Longest request head (request line and header fields) Sluice reads; a longer one "
                   "gets 431. Keep it above what the proxy forwards.")
@click.option("--max-headers", default=16_384, show_default=True, type=click.IntRange(min=1),
              help="Most header fields of one request; more get 431. Keep it above what the proxy forwards.")
@click.option("--loop", "event_loop", default="asyncio", show_default=True, envvar="SLUICE_LOOP", show_envvar=True,
              type=click.Choice(["asyncio", "uvloop"]),
              help="The event loop. uvloop under a flood of thousands of connections left new "
                   "connections unaccepted for seconds, past the proxies' timeouts.")
@click.option("--then-auth", metavar="URL", callback=_then_auth_url, envvar="SLUICE_THEN_AUTH", show_envvar=True,
              help="An auth service nginx's checks are asked of after Sluice admits them (oauth2-proxy's "
                   "http://127.0.0.1:4180/oauth2/auth): its 2xx, 401 and 403 and their header fields are "
                   "nginx's answer; no answer in time is a refusal (503). Default: off.")
@click.option("--then-auth-timeout", default=0.5, show_default=True, metavar="SECONDS",
              type=click.FloatRange(0.01, 30), envvar="SLUICE_THEN_AUTH_TIMEOUT", show_envvar=True,
              help="How long the --then-auth service may take to answer; keep it under nginx's "
                   "SLUICE_READ_TIMEOUT.")
@click.option("--otlp-endpoint", metavar="URL", callback=_otlp_url, envvar="SLUICE_OTLP_ENDPOINT", show_envvar=True,
              help="Export a span per check over OTLP/HTTP to this collector URL "
                   "(http://127.0.0.1:4318/v1/traces), continuing the request's traceparent; it carries the "
                   "front door, the outcome, the rule and a hash of the client's key. Default: off.")
@click.option("--otlp-sample-ratio", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0),
              envvar="SLUICE_OTLP_SAMPLE_RATIO", show_envvar=True,
              help="With --otlp-endpoint: the share of traces Sluice starts itself (checks without a "
                   "traceparent) that are recorded; a caller's trace follows the caller's sampling.")
def serve(config: str | None, demo_rules: bool, host: str, port: int, uds: str | None,
          hook_at: tuple[str, int] | None, admin_token_file: str | None, health: tuple[str, int] | None,
          grpc_port: int | None, rls_config: str | None, rls_shadow: bool, shadow: bool, workers: int,
          log_level: str, max_header_bytes: int, max_headers: int, event_loop: str, watch_interval: float,
          no_watch: bool, then_auth: str | None, then_auth_timeout: float, otlp_endpoint: str | None,
          otlp_sample_ratio: float) -> None:
    """Run the check service, with the rules of --config (or SLUICE_CONFIG)."""
    import uvicorn

    log_level = log_level.lower()
    from sidecar.admin import read_token

    config = _rules_to_serve(config, demo_rules, rls_config)
    ruleset = _load(config, shadow)
    _open_files_as_allowed()
    if rls_config is not None:
        if grpc_port is None:
            raise click.BadParameter("the Rate Limit Service is served on the gRPC port: give --grpc-port too",
                                     param_hint="--rls-config")
        _load_rls(rls_config)  # every error at start, as for the rules file
    if workers > 1 and ruleset.backend == "memory":
        _needs_compiled_core()
    try:
        read_token(admin_token_file)
    except (OSError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--admin-token-file") from None
    _listen_or_exit(host, None if uds else port, hook_at, health, grpc_port)
    settings = {"config": config, "admin_token_file": admin_token_file, "hook_udp": hook_at,
                "loopback": uds is not None or _is_loopback(host), "log_level": log_level,
                "workers": workers, "health": health,
                "grpc": None if grpc_port is None else (host, grpc_port),
                "rls_config": rls_config, "rls_shadow": rls_shadow, "shadow": shadow,
                "watch_interval": 0.0 if no_watch else watch_interval,
                "then_auth": then_auth, "then_auth_timeout": then_auth_timeout, "otlp_endpoint": otlp_endpoint,
                "otlp_sample_ratio": otlp_sample_ratio,
                # Workers must sign and verify pending-count tokens and
                # challenge credentials alike: without challenge.secret_file,
                # one random key for all of them.
                "secret": None if ruleset.secret is not None else os.urandom(32).hex()}
    from sidecar.logs import configure_logging, logging_config

    configure_logging(log_level)
    log = logging.getLogger("sluice")
    log.info("%s from %s, node %s%s, %s", plural(len(ruleset.rules), "rule"), ruleset.source, ruleset.node,
             f", {workers} workers" if workers > 1 else "", core.which())
    for warning in ruleset.warnings:
        log.warning("%s", warning)

    options: dict[str, Any] = dict(
        host=host, port=port, uds=uds, access_log=False, log_level=log_level, lifespan="on",
        log_config=logging_config(log_level),
        server_header=False, date_header=False,
        loop=event_loop,
        # A flood opens a connection for each check in flight: room for the
        # thousands that arrive at once, so that none waits out the proxy's
        # connect timeout (the kernel caps it at net.core.somaxconn).
        backlog=LISTEN_BACKLOG,
        # The proxies close idle connections to Sluice first (Envoy's
        # idle_timeout and nginx's keepalive_timeout are 60 s): a check sent
        # on a connection that Sluice is closing at that moment would fail,
        # and the proxy would let it in unchecked.
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        # The client address is Sluice's business: uvicorn must
        # not rewrite the peer from X-Forwarded-For by itself.
        proxy_headers=False,
        # Sluice's own HTTP protocol (sidecar.server): checks answered in it,
        # request heads bounded (431), the rest through ASGI.
        http=_http_protocol(max_header_bytes, max_headers))
    if workers == 1:
        uvicorn.run(service(settings, ruleset), **options)
        return
    # Worker processes build their own application from an import string;
    # the settings travel in the environment (with the memory backend, the
    # name of the table in shared memory they count in), and so does the
    # directory of this run's own where the workers' metrics add up
    # (sidecar.nodemetrics).
    from sidecar.nodemetrics import MULTIPROC_DIR

    zones = _node_zones(ruleset) if ruleset.backend == "memory" else None
    settings["zones"] = zones.prefix if zones is not None else None
    os.environ[SERVE_SETTINGS] = json.dumps(settings)
    try:
        os.environ[MULTIPROC_DIR] = _metrics_directory()
        try:
            from sidecar.workers import run_workers

            run_workers(uvicorn.Config("sidecar.cli:worker_service", factory=True, workers=workers, **options))
        finally:
            shutil.rmtree(os.environ[MULTIPROC_DIR], ignore_errors=True)
    finally:
        if zones is not None:
            zones.unlink()
            zones.close()


def _needs_compiled_core() -> None:
    """Exit 2 unless the compiled core runs: the workers' shared table
    needs its process-shared locks."""
    if core.PURE:
        _fail(f"--workers > 1 with the memory backend needs the compiled core (this is the {core.which()}): "
              "install Sluice with a C compiler, or run one worker, or use state.backend: redis", 2)


def _node_zones(ruleset: Ruleset) -> NodeZones:
    """The table in shared memory that every worker of the memory backend
    counts in, made before they start (they attach to it by name, from the
    settings) and removed by ``serve`` when they have stopped."""
    from sidecar.store.node import NodeZones, remove_orphans, zones_directory, zones_prefix

    largest = max((getattr(rule.limiter, "limit", 0) for rule in ruleset.rules if rule.limiter.leases), default=0)
    directory = zones_directory()
    for orphan in remove_orphans(directory):
        logging.getLogger("sluice").info("removed %s, left by a serve that was killed", orphan)
    try:
        zones = NodeZones.create(zones_prefix(directory), ruleset.max_keys, largest)
    except (OSError, ValueError) as exc:
        _fail(f"--workers: no shared memory for the node's table of {ruleset.max_keys:,} keys ({exc}); "
              "free some in /dev/shm (a container: --shm-size), or lower state.max_keys")
    logging.getLogger("sluice").info("the workers share a table of %s keys in %s-* (%d MiB)",
                                     f"{ruleset.max_keys:,}", zones.prefix, zones.memory() >> 20)
    return zones


def _metrics_directory() -> str:
    """A new private directory (mode 0700) under TMPDIR, for this run only."""
    import tempfile

    try:
        return tempfile.mkdtemp(prefix="sluice-metrics-")
    except OSError as exc:
        click.echo(f"error: --workers: no directory for the workers' metrics ({exc}); "
                   "set TMPDIR to a writable directory", err=True)
        raise SystemExit(2) from None


def _rules_to_serve(config: str | None, demo_rules: bool, rls_config: str | None) -> str | None:
    """The rules file ``serve`` runs: --config, or the demo rules' file;
    None for a Rate Limit Service alone. Never a default: a Sluice started
    without its rules must not enforce someone else's."""
    from click.core import ParameterSource

    if demo_rules:
        given = click.get_current_context().get_parameter_source("config")
        if config is not None and given is not ParameterSource.ENVIRONMENT:
            _fail("give --config FILE or --demo-rules, not both", 2)
        return str(resources.files("sidecar") / DEMO_RULES)
    if config is None and rls_config is None:
        _fail("no rules: give the rules file with --config FILE (or SLUICE_CONFIG=FILE); the demo rules "
              "that `make run` uses are --demo-rules (examples/default.yaml)", 2)
    return config


def _listen_or_exit(host: str, port: int | None, hook_at: tuple[str, int] | None,
                    health: tuple[str, int] | None, grpc_port: int | None) -> None:
    """Exit 1 with one line naming the option when one of serve's addresses
    cannot be listened on (another Sluice on it, say)."""
    from sidecar.addresses import AddressBusy, Listener, check_listeners

    free_or_off = "give a free HOST:PORT, or off"
    listeners = [Listener("--port", (host, port), remedy="give a free --port")] if port is not None else []
    listeners += [Listener("--hook-udp", hook_at, udp=True, remedy=free_or_off)] if hook_at is not None else []
    listeners += [Listener("--health", health, remedy=free_or_off)] if health is not None else []
    listeners += [Listener("--grpc-port", (host, grpc_port), remedy="give a free --grpc-port")] \
        if grpc_port is not None else []
    try:
        check_listeners(listeners)
    except AddressBusy as exc:
        _fail(str(exc))


def _open_files_as_allowed() -> None:
    """Raise the soft limit of open files to the hard one: under a flood
    each check in flight holds a connection (Go's runtime does the same)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass  # keep the soft limit


SERVE_SETTINGS = "SLUICE_SERVE_SETTINGS"
# The package's copy of examples/default.yaml: `sluice serve --demo-rules`.
DEMO_RULES = "default_rules.yaml"
LISTEN_BACKLOG = 16_384
KEEP_ALIVE_SECONDS = 75


def _http_protocol(max_header_bytes: int, max_headers: int) -> Any:
    from sidecar.server import protocol_factory

    return protocol_factory(max_header_bytes, max_headers)


def service(settings: dict[str, Any], ruleset: Ruleset | None = None) -> Any:
    """The application ``serve`` runs, in this process or in each worker."""
    from sidecar.admin import Admin, read_token
    from sidecar.app import create_app
    from sidecar.decisionlog import configure_decision_log
    from sidecar.engine import Engine
    from sidecar.logs import configure_logging
    from sidecar.server import freeze_loaded_objects, tune_garbage_collector

    tune_garbage_collector()
    configure_logging(settings["log_level"])
    configure_decision_log()
    ruleset = ruleset or _load(settings["config"], settings.get("shadow", False))
    store = None
    if settings.get("zones"):
        # The memory backend of several workers: the node's table, made by serve.
        from sidecar.state import epoch_clock
        from sidecar.store import open_store

        store = open_store(ruleset.backend, ruleset.url, ruleset.max_keys, ruleset.node, epoch_clock,
                           zones=settings["zones"])
        store.configure(ruleset.max_keys, ruleset.node)
    engine = Engine(ruleset, store=store,
                    secret=bytes.fromhex(settings["secret"]) if settings.get("secret") else None,
                    workers=settings["workers"])
    rls = None
    if settings.get("rls_config"):
        from sidecar.frontdoors.rls import RateLimitService

        rls = RateLimitService(engine, settings["rls_config"], shadow=settings.get("rls_shadow", False))
    admin = Admin(engine, settings["config"], read_token(settings["admin_token_file"]),
                  loopback_listener=settings["loopback"], rls=rls, shadow=settings.get("shadow", False),
                  watch_interval=settings.get("watch_interval", 0.0))
    hook_udp = settings["hook_udp"]
    # Several workers share the report port: the kernel spreads datagrams
    # over them (SO_REUSEPORT).
    health = settings.get("health")
    grpc = settings.get("grpc")
    then_auth = None
    if settings.get("then_auth"):
        from sidecar.chain import NextAuthAddress, ThenAuth

        then_auth = ThenAuth(NextAuthAddress.parse(settings["then_auth"]), settings["then_auth_timeout"],
                             engine.metrics.registry)
    if settings.get("otlp_endpoint"):
        from sidecar.tracing import Tracing

        engine.tracing = Tracing(settings["otlp_endpoint"], engine.derived_key(b"sluice trace keys"), ruleset.node,
                                 ratio=settings.get("otlp_sample_ratio", 1.0))
    app = create_app(engine, tuple(hook_udp) if hook_udp else None, admin,
                     share_report_port=settings["workers"] > 1, health=tuple(health) if health else None,
                     grpc=tuple(grpc) if grpc else None, rls=rls, then_auth=then_auth)
    freeze_loaded_objects()
    return app


def worker_service() -> Any:
    """The factory uvicorn's worker processes call; a scrape of any worker
    answers for all of them."""
    from sidecar.nodemetrics import MULTIPROC_DIR

    app = service(json.loads(os.environ[SERVE_SETTINGS]))
    app.engine.metrics.share(os.environ[MULTIPROC_DIR])
    return app


main.add_command(admin_commands)

if __name__ == "__main__":  # pragma: no cover
    main()
