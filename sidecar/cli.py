"""The ``sluice`` command."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import sys
from typing import TYPE_CHECKING, Any

import click

from sidecar import version
from sidecar.cli_admin import admin as admin_commands
from sidecar.config import ConfigError
from sidecar.rules import Ruleset, default_ruleset, load_ruleset

if TYPE_CHECKING:
    from sidecar.rls import RlsConfig


def _load(config: str | None, shadow: bool = False) -> Ruleset:
    try:
        return load_ruleset(config, shadow) if config else default_ruleset(shadow)
    except ConfigError as exc:
        for issue in exc.issues:
            click.echo(str(issue), err=True)
        raise SystemExit(1) from None


def _is_rls(path: str) -> bool:
    """A directory, or a file with a top-level domain: Rate Limit Service configurations."""
    from sidecar.rls import is_rls_text

    if os.path.isdir(path):
        return True
    try:
        with open(path, encoding="utf-8") as file:
            return is_rls_text(file.read())
    except (OSError, UnicodeDecodeError):
        return False  # the rules loader says what is wrong with it


def _load_rls(path: str) -> RlsConfig:
    from sidecar.rls import load_rls

    try:
        return load_rls(path)
    except ConfigError as exc:
        for issue in exc.issues:
            click.echo(str(issue), err=True)
        raise SystemExit(1) from None


def _host_port(value: str, option: str = "--hook-udp") -> tuple[str, int] | None:
    if value == "off":
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise click.BadParameter(f"expected HOST:PORT or 'off', got {value!r}", param_hint=option)
    return host.strip("[]") or "127.0.0.1", int(port)


def _address(value: str, option: str) -> tuple[str, int]:
    address = _host_port(value, option)
    if address is None:
        raise click.BadParameter(f"expected HOST:PORT, got {value!r}", param_hint=option)
    return address


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(version=version(), prog_name="sluice", message="%(prog)s %(version)s")
def main() -> None:
    """Sluice: rate-limiting external authorization for nginx and Envoy.

    Every option of `sluice serve` that an environment variable can set says
    which (SLUICE_...); a flag on the command line wins over it.
    """


@main.command()
@click.argument("file", type=click.Path())
def check(file: str) -> None:
    """Validate a rules file, or Rate Limit Service configurations (a file
    with a top-level domain, or a directory of them): exit 0, or 1 with
    every error as FILE:LINE: field: message."""
    if _is_rls(file):
        config = _load_rls(file)
        domains = ", ".join(sorted(config.domains))
        click.echo(f"{file}: OK, Rate Limit Service: {len(config.domains)} domains ({domains}), "
                   f"{config.limits} limits")
        return
    ruleset = _load(file)
    click.echo(f"{file}: OK, {len(ruleset.rules)} rules")
    for warning in ruleset.warnings:
        click.echo(f"warning: {warning}", err=True)
    if ruleset.longest_hold:
        click.echo(f"leaky buckets hold requests up to {ruleset.longest_hold:g} s: the proxy's "
                   "timeout for Sluice must be longer, or held requests fail open, and nginx's refusal "
                   "cache off (`sluice config --rules` renders both)")


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
@click.option("--listen", default="127.0.0.1:8080",
              help="HOST:PORT (or PORT: every address) the proxy listens on (nginx's listen, Envoy's listener).")
@click.option("--sluice", default="127.0.0.1:8181", help="HOST:PORT of sluice serve.")
@click.option("--hook-udp", default="127.0.0.1:8182", help="HOST:PORT of sluice serve --hook-udp (nginx's reports).")
@click.option("--upstream", default="127.0.0.1:9000", help="HOST:PORT of the application.")
@click.option("--envoy-admin-port", default=9901, type=click.IntRange(1, 65535))
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
@click.option("--cache-dir", default="sluice-cache", show_default=True,
              help="nginx: where it keeps the refusals it answers itself (proxy_cache_path); relative to "
                   "nginx's prefix. nginx creates the folder, not its parents.")
@click.option("--out", type=click.Path(file_okay=False),
              help="Write the files into this folder (as nginx's conf.d, say) instead of printing them.")
def config_command(target: str, listen: str, sluice: str, hook_udp: str, upstream: str, envoy_admin_port: int,
                   sluice_grpc_port: int, rules: str | None, guard: bool, guard_rate: float | None,
                   unchecked_rate: float | None, cache_dir: str, out: str | None) -> None:
    """Print (or write) the nginx or Envoy configuration for Sluice, rendered
    for the given addresses: the full site or bootstrap, or the snippets and
    fragments to add to an existing one."""
    from pathlib import Path

    from sidecar.launcher import StackError, guard_rate as derived_guard_rate
    from sidecar.launcher import proxy_variables, render_package_templates, with_envoy_guard, with_nginx_guard

    ruleset = _load(rules) if rules else None
    guarded = guard or guard_rate is not None
    if guarded and target == "envoy-rls":
        raise click.BadParameter("the guard goes ahead of Sluice's check, and envoy-rls has none (its Envoy asks "
                                 "Sluice's Rate Limit Service): give it with nginx, nginx-snippets, envoy, "
                                 "envoy-grpc or envoy-fragments", param_hint="--guard")
    # A bare port listens on every address, as nginx's `listen 80` does.
    listen_at = ("0.0.0.0", int(listen)) if listen.isdigit() else _address(listen, "--listen")
    sluice_at, hook_at, upstream_at = (_address(sluice, "--sluice"), _address(hook_udp, "--hook-udp"),
                                       _address(upstream, "--upstream"))
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
    except StackError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(1) from None
    if out is not None:
        for name, text in files.items():
            path = Path(out) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            click.echo(f"wrote {path}", err=True)
        return
    for name, text in files.items():
        if len(files) > 1:
            click.echo(f"# ==> {name} <==")
        click.echo(text, nl=not text.endswith("\n"))


def _sweep_option(ctx: click.Context, param: click.Parameter,
                  values: tuple[str, ...]) -> list[tuple[str, tuple[int, ...]]]:
    from sidecar.replay import SweepError, parse_sweep

    try:
        return [parse_sweep(value) for value in values]
    except SweepError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


@main.command()
@click.option("--config", "config", required=True, type=click.Path(dir_okay=False), help="Rules file.")
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
    rules in virtual time, and report what each rule would have done."""
    from sidecar.accesslog import LogError
    from sidecar.replay import SweepError, prepare_sweeps, render_json, render_text, replay_logs

    ruleset = _load(config)
    try:
        trials = prepare_sweeps(config, sweeps)
    except SweepError as exc:
        raise click.BadParameter(str(exc), param_hint="'--sweep'") from None
    # The report counts invalid client addresses; the engine's once-a-minute
    # warning about them would repeat for every minute of log time.
    logging.getLogger("sluice").setLevel(logging.ERROR)
    try:
        report = replay_logs(ruleset, logs, top=top, default_host=host, exclude_top=exclude_top, sweeps=trials)
    except LogError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from None
    if html is not None:
        from sidecar.replay_report import render_html

        try:
            with open(html, "w", encoding="utf-8") as page:
                page.write(render_html(report))
        except OSError as exc:
            click.echo(f"error: cannot write {html}: {exc.strerror or exc}", err=True)
            raise SystemExit(2) from None
    click.echo(render_json(report) if as_json else render_text(report), nl=False)


@main.command()
@click.option("--config", "config", type=click.Path(dir_okay=False), envvar="SLUICE_CONFIG", show_envvar=True,
              help="Rules file (default: the embedded default rules).")
@click.option("--host", default="127.0.0.1", show_default=True, envvar="SLUICE_HOST", show_envvar=True)
@click.option("--port", default=8181, show_default=True, type=click.IntRange(1, 65535), envvar="SLUICE_PORT",
              show_envvar=True)
@click.option("--uds", type=click.Path(), help="Listen on a Unix socket instead of host:port.")
@click.option("--hook-udp", default="127.0.0.1:8182", show_default=True,
              help="HOST:PORT where nginx's response reports arrive (syslog over UDP), or 'off'.")
@click.option("--admin-token-file", type=click.Path(dir_okay=False, exists=True),
              envvar="SLUICE_ADMIN_TOKEN_FILE", show_envvar=True,
              help="File holding the bearer token of the admin API (at least 16 characters). "
                   "Without it the admin API answers only loopback peers of a loopback listener.")
@click.option("--health", default="off", show_default=True,
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
@click.option("--workers", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--log-level", default="info", show_default=True, envvar="SLUICE_LOG_LEVEL", show_envvar=True,
              type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False))
@click.option("--max-header-bytes", default=128 * 1024, show_default=True, type=click.IntRange(min=1024),
              help="Longest request head (request line and header fields) Sluice reads; a longer one "
                   "gets 431. Keep it above what the proxy forwards (sidecar/server.py).")
@click.option("--max-headers", default=16_384, show_default=True, type=click.IntRange(min=1),
              help="Most header fields of one request; more get 431. Keep it above what the proxy forwards.")
@click.option("--loop", "event_loop", default="asyncio", show_default=True, envvar="SLUICE_LOOP", show_envvar=True,
              type=click.Choice(["asyncio", "uvloop"]),
              help="The event loop. uvloop under a flood of thousands of connections left new "
                   "connections unaccepted for seconds, past the proxies' timeouts (README, Floods).")
def serve(config: str | None, host: str, port: int, uds: str | None, hook_udp: str,
          admin_token_file: str | None, health: str, grpc_port: int | None, rls_config: str | None,
          rls_shadow: bool, shadow: bool, workers: int, log_level: str, max_header_bytes: int,
          max_headers: int, event_loop: str) -> None:
    """Run the check service."""
    import uvicorn

    log_level = log_level.lower()
    from sidecar.admin import read_token

    ruleset = _load(config, shadow)
    _open_files_as_allowed()
    if rls_config is not None:
        if grpc_port is None:
            raise click.BadParameter("the Rate Limit Service is served on the gRPC port: give --grpc-port too",
                                     param_hint="--rls-config")
        _load_rls(rls_config)  # every error at start, as for the rules file
    if workers > 1 and ruleset.backend == "memory":
        click.echo("error: --workers > 1 needs a shared state backend (state.backend: redis): "
                   "with the memory backend each worker would keep its own counters and "
                   "silently multiply every limit", err=True)
        raise SystemExit(2)
    try:
        read_token(admin_token_file)
    except (OSError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--admin-token-file") from None
    settings = {"config": config, "admin_token_file": admin_token_file, "hook_udp": _host_port(hook_udp),
                "loopback": uds is not None or _is_loopback(host), "log_level": log_level,
                "workers": workers, "health": _host_port(health, "--health"),
                "grpc": None if grpc_port is None else (host, grpc_port),
                "rls_config": rls_config, "rls_shadow": rls_shadow, "shadow": shadow,
                # Workers must sign and verify pending-count tokens and
                # challenge credentials alike: without challenge.secret_file,
                # one random key for all of them.
                "secret": None if ruleset.secret is not None else os.urandom(32).hex()}
    from sidecar.logs import configure_logging, logging_config

    configure_logging(log_level)
    log = logging.getLogger("sluice")
    log.info("%d rules from %s, node %s%s", len(ruleset.rules), ruleset.source, ruleset.node,
             f", {workers} workers" if workers > 1 else "")
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
        # uvicorn's httptools protocol with a bounded request head (431).
        http=_http_protocol(max_header_bytes, max_headers))
    if workers == 1:
        uvicorn.run(service(settings, ruleset), **options)
        return
    # Worker processes build their own application from an import string;
    # the settings travel in the environment.
    os.environ[SERVE_SETTINGS] = json.dumps(settings)
    uvicorn.run("sidecar.cli:worker_service", factory=True, workers=workers, **options)


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
    engine = Engine(ruleset, secret=bytes.fromhex(settings["secret"]) if settings.get("secret") else None)
    rls = None
    if settings.get("rls_config"):
        from sidecar.frontdoors.rls import RateLimitService

        rls = RateLimitService(engine, settings["rls_config"], shadow=settings.get("rls_shadow", False))
    admin = Admin(engine, settings["config"], read_token(settings["admin_token_file"]),
                  loopback_listener=settings["loopback"], rls=rls, shadow=settings.get("shadow", False))
    hook_udp = settings["hook_udp"]
    # Several workers share the report port: the kernel spreads datagrams
    # over them (SO_REUSEPORT).
    health = settings.get("health")
    grpc = settings.get("grpc")
    app = create_app(engine, tuple(hook_udp) if hook_udp else None, admin,
                     share_report_port=settings["workers"] > 1, health=tuple(health) if health else None,
                     grpc=tuple(grpc) if grpc else None, rls=rls)
    freeze_loaded_objects()
    return app


def worker_service() -> Any:
    """The factory uvicorn's worker processes call."""
    return service(json.loads(os.environ[SERVE_SETTINGS]))


main.add_command(admin_commands)

if __name__ == "__main__":  # pragma: no cover
    main()
