"""The nginx and Envoy templates the package ships, and how they are rendered.

The templates are the repository's nginx/ and envoy/ folders, package data
here. They are rendered as the official nginx image renders its templates
(`envsubst` of the defined variables), after their `@include` lines are
expanded and their maintainers' notes dropped. The values come from the
addresses given (`sluice config`), or from the local stack's ports
(`make run`, devstack/ in the repository, which is not shipped), each
replaced by the environment variable of the same name if set:

`python -m sidecar.rendering --render PATH DIR` renders the templates of
one folder (`nginx/snippets`, `envoy/fragments`, `nginx`: the site, `envoy`:
the three bootstraps) or one template (`envoy/envoy-grpc.yaml.template`)
into DIR, for an nginx or Envoy of your own (compose.yaml's Envoy), and
starts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from sidecar.config import ConfigError
from sidecar.rules import Ruleset, default_ruleset, load_ruleset

# The repository's nginx/ and envoy/ folders, the one copy of the templates:
# sidecar/templates/nginx and sidecar/templates/envoy are links to them, which
# the wheel and the sdist carry as files (package data), so that they are
# found wherever the package is installed. A Traversable rather than a Path:
# the package need not be files on disk. One folder a proxy, as the official
# images render every *.template of the folder they are given (compose.yaml).
PACKAGE_TEMPLATES = files("sidecar") / "templates"
DEFAULT_TEMPLATE = PACKAGE_TEMPLATES / "nginx" / "sluice.conf.template"
DEFAULT_ENVOY_TEMPLATE = PACKAGE_TEMPLATES / "envoy" / "envoy.yaml.template"
# The same bootstrap with gRPC ext_authz: the third front door.
DEFAULT_ENVOY_GRPC_TEMPLATE = PACKAGE_TEMPLATES / "envoy" / "envoy-grpc.yaml.template"
# Envoy's ratelimit filter asking Sluice's Rate Limit Service: the fourth.
DEFAULT_ENVOY_RLS_TEMPLATE = PACKAGE_TEMPLATES / "envoy" / "envoy-rls.yaml.template"
# The domain of the package's default_rls.yaml, which the envoy-rls filter asks about.
DEFAULT_RLS_DOMAIN = "sluice"
# What an existing nginx includes (the site template includes them too):
# rendered into SNIPPETS_DIR beside the site, as the nginx image renders
# the templates' subfolders into conf.d/.
NGINX_SNIPPETS = PACKAGE_TEMPLATES / "nginx" / "snippets"
# Envoy's first tier, written in by `sluice config envoy --guard`.
ENVOY_GUARD_FILTER = PACKAGE_TEMPLATES / "envoy" / "guard" / "sluice-guard-filter.yaml.template"
SNIPPETS_DIR = "snippets"
TEMPLATE_SUFFIX = ".template"

# Envoy sends requests under it to the application without a check.
ENVOY_UNCHECKED_PREFIX = "/healthz"
# How long the front doors wait for Sluice's answer, in whole seconds: at
# least this long, and longer than the longest hold of a leaky bucket rule
# by at least CHECK_TIMEOUT_MARGIN_SECONDS (the answer still has to travel
# after the slot). A shorter wait would let a held request in at the
# timeout, unchecked (fail open). Connecting stays short (100 ms for nginx,
# 0.25 s for Envoy): a Sluice that is down is not waited for.
MIN_CHECK_TIMEOUT_SECONDS = 1
CHECK_TIMEOUT_MARGIN_SECONDS = 1.0


class RenderError(RuntimeError):
    """A template cannot be rendered for these values; the message says what to change."""


@dataclass(frozen=True)
class StackPorts:
    """The ports of the local stack (`make run`): the templates' values
    unless others are given, on 127.0.0.1."""

    nginx: int = 8080
    sluice: int = 8181
    upstream: int = 9000
    envoy: int = 10000
    # UDP: where Sluice takes response reports (`sluice serve --hook-udp`).
    sluice_hook: int = 8182
    # Envoy's admin interface, on 127.0.0.1 whatever the stack's host.
    envoy_admin: int = 9901
    # The second Envoy, checking over gRPC (`sluice serve --grpc-port`).
    envoy_grpc: int = 10001
    envoy_grpc_admin: int = 9902
    sluice_grpc: int = 8183
    # The Envoy whose ratelimit filter asks Sluice's Rate Limit Service.
    envoy_rls: int = 10002
    envoy_rls_admin: int = 9903


_TEMPLATE_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def render_template(text: str, variables: Mapping[str, str]) -> str:
    """Substitute variables as the official nginx image does.

    The image runs `envsubst "$defined"` over each template, with the list of
    defined environment variables: `${NAME}` and `$NAME` are replaced for
    those names, and everything else, nginx's `$host` included, is kept.
    """

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return variables.get(name, match.group(0))

    return _TEMPLATE_VARIABLE.sub(substitute, text)


def check_timeout_seconds(longest_hold: float) -> int:
    """The front doors' timeout for Sluice's answer, given the longest hold
    of the rules (`sluice check` prints it)."""
    return max(MIN_CHECK_TIMEOUT_SECONDS, math.ceil(longest_hold + CHECK_TIMEOUT_MARGIN_SECONDS))


def ruleset_of(rules: Path | None) -> Ruleset:
    """The rules of this file (or the built-in rules), which the proxies'
    configuration is rendered for."""
    try:
        return load_ruleset(str(rules)) if rules is not None else default_ruleset()
    except ConfigError as error:
        raise RenderError(f"the rules cannot be used:\n{error}") from error


def template_variables(ports: StackPorts, host: str, ruleset: Ruleset | None = None) -> dict[str, str]:
    """The values the local stack gives the variables of both templates,
    for these rules (see ``proxy_variables``)."""
    return proxy_variables(listen=(host, ports.nginx), envoy_listen=(host, ports.envoy),
                           sluice=(host, ports.sluice), hook_udp=(host, ports.sluice_hook),
                           upstream=(host, ports.upstream), envoy_admin_port=ports.envoy_admin,
                           ruleset=ruleset, sluice_grpc_port=ports.sluice_grpc)


def proxy_variables(listen: tuple[str, int], envoy_listen: tuple[str, int], sluice: tuple[str, int],
                    hook_udp: tuple[str, int], upstream: tuple[str, int], envoy_admin_port: int = 9901,
                    ruleset: Ruleset | None = None, sluice_grpc_port: int = StackPorts.sluice_grpc,
                    unchecked_rate: float | None = None) -> dict[str, str]:
    """The variables of the nginx and Envoy templates for these addresses:
    where the proxy listens, where Sluice and its UDP report hook are, and
    the application's upstream. From the rules: the timeouts for Sluice's
    answer outlast the longest a leaky bucket rule holds a request, and the
    proxies' limit on requests they let in unchecked is the guard's rate,
    unless `unchecked_rate` (requests a second per address) is given."""
    longest_hold = ruleset.longest_hold if ruleset is not None else 0.0
    # "Ns" is a duration in both nginx's and Envoy's syntax.
    check_timeout = f"{check_timeout_seconds(longest_hold)}s"
    if unchecked_rate is None:
        unchecked_rate = guard_rate(ruleset)
    unchecked = envoy_token_bucket(unchecked_rate, "--unchecked-rate")
    return {
        # nginx
        "SLUICE_LISTEN": host_port(*listen),
        "SLUICE_ADDR": host_port(*sluice),
        "UPSTREAM_ADDR": host_port(*upstream),
        "SLUICE_CONNECT_TIMEOUT": "1s",
        "SLUICE_READ_TIMEOUT": check_timeout,
        # Relative to nginx's prefix (the local stack's run folder).
        "SLUICE_CACHE_DIR": "sluice-cache",
        # With a cache, nginx does not tell Sluice that a held request's
        # client has gone (sluice-server.conf).
        "SLUICE_REFUSAL_CACHE": "off" if longest_hold > 0 else "sluice_refusals",
        # Requests nginx lets in when Sluice did not answer in time, per
        # client address (sluice-server.conf's @sluice_late); the burst is
        # Envoy's too.
        "SLUICE_UNCHECKED_RATE": nginx_rate(unchecked_rate),
        "SLUICE_UNCHECKED_BURST": str(unchecked.max_tokens),
        # Response reports, syslog over UDP.
        "SLUICE_HOOK_ADDR": host_port(*hook_udp),
        # Envoy
        "ENVOY_LISTEN_ADDRESS": envoy_listen[0],
        "ENVOY_LISTEN_PORT": str(envoy_listen[1]),
        "ENVOY_ADMIN_PORT": str(envoy_admin_port),
        "SLUICE_HOST": sluice[0],
        "SLUICE_PORT": str(sluice[1]),
        "SLUICE_GRPC_PORT": str(sluice_grpc_port),
        # Response reports, POST /v1/hook on Sluice's HTTP port.
        "SLUICE_HOOK_HOST": sluice[0],
        "SLUICE_HOOK_PORT": str(sluice[1]),
        "UPSTREAM_HOST": upstream[0],
        "UPSTREAM_PORT": str(upstream[1]),
        "SLUICE_CHECK_TIMEOUT": check_timeout,
        "ENVOY_UNCHECKED_PREFIX": ENVOY_UNCHECKED_PREFIX,
        # Requests Envoy lets in after a failed check, per client address
        # (sluice-unchecked-filter.yaml), in bursts of SLUICE_UNCHECKED_BURST.
        "ENVOY_UNCHECKED_TOKENS": str(unchecked.tokens_per_fill),
        "ENVOY_UNCHECKED_FILL_INTERVAL": f"{unchecked.fill_seconds}s",
        "SLUICE_RLS_DOMAIN": DEFAULT_RLS_DOMAIN,
    }


# Where `sluice config nginx --guard` writes nginx's first tier (the
# templates hold these comment lines, which stay comments without --guard).
GUARD_ZONE_MARKER = "# @sluice-guard-zone"
GUARD_MARKER = "# @sluice-guard"
# The guard never goes below this rate per client address, and stays this
# many times above the fastest rule's: wide enough for an honest client
# whom Sluice's own rules let through.
GUARD_MIN_RATE = 10.0
GUARD_HEADROOM = 10.0
# An address may spend this many seconds' worth of the guard's rate at once.
GUARD_BURST_SECONDS = 2
# Envoy's guard and its limit on unchecked requests (envoy/guard's and
# sluice-unchecked-filter.yaml's max_dynamic_descriptors) keep a token bucket
# for this many addresses, forgetting the least recently seen first: about
# 450 bytes each (measured on Envoy 1.40), some 30 MB when full. A forgotten
# address starts again with a full bucket.
ENVOY_GUARD_ADDRESSES = 65536
# Envoy's token buckets count in 32-bit integers; a bucket this large, filled
# as much each second, is no limit (both filters' default bucket).
ENVOY_MAX_TOKENS = 2**32 - 1
# Where `sluice config envoy --guard` writes Envoy's first tier: a comment
# line of the filters fragments (sluice-http-filters.yaml and its gRPC twin),
# which stays a comment without --guard.
_ENVOY_GUARD_MARKER = re.compile(r"^( *)# @sluice-envoy-guard$", re.MULTILINE)


def guard_rate(ruleset: Ruleset | None) -> float:
    """Requests per second per address that the guard (nginx's or Envoy's)
    lets through: GUARD_HEADROOM times the fastest sustained rate of any rule
    (a window's threshold per period, a bucket's refill), and at least
    GUARD_MIN_RATE."""
    fastest = max((rule.limiter.sustained_rate() for rule in ruleset.rules), default=0.0) \
        if ruleset is not None else 0.0
    return max(GUARD_MIN_RATE, math.ceil(fastest * GUARD_HEADROOM))


def nginx_rate(rate: float) -> str:
    """A rate a second as nginx's limit_req_zone writes it: whole requests
    a second, or else a minute (nginx reads neither a fraction nor an
    exponent), rounded up."""
    per_minute = math.ceil(rate * 60 - 1e-9)
    return f"{per_minute // 60}r/s" if per_minute % 60 == 0 else f"{per_minute}r/m"


def guard_burst(rate: float) -> int:
    """The requests an address may send at once: GUARD_BURST_SECONDS' worth."""
    return math.ceil(rate * GUARD_BURST_SECONDS)


@dataclass(frozen=True)
class EnvoyTokenBucket:
    """A rate as Envoy's token bucket holds it: `tokens_per_fill` whole
    tokens every `fill_seconds` whole seconds (Envoy refills continuously at
    that ratio), and at most `max_tokens` at once."""

    max_tokens: int
    tokens_per_fill: int
    fill_seconds: int


def envoy_token_bucket(rate: float, option: str) -> EnvoyTokenBucket:
    """`rate` requests a second with a burst of guard_burst(rate), as an
    Envoy token bucket (7.5 r/s: 15 tokens every 2 s, at most 15 at once);
    beyond Envoy's 32-bit counts, an error that names the `option` to lower."""
    tokens, seconds = Fraction(rate).limit_denominator(1000).as_integer_ratio()
    burst = guard_burst(rate)
    if max(tokens, burst) > ENVOY_MAX_TOKENS:
        raise RenderError(f"{rate:g} requests a second is beyond Envoy's token buckets "
                         f"(a burst of {ENVOY_MAX_TOKENS:,} at most): give a lower {option}")
    return EnvoyTokenBucket(max_tokens=burst, tokens_per_fill=tokens, fill_seconds=seconds)


def with_nginx_guard(files: Mapping[str, str], rate: float) -> dict[str, str]:
    """The rendered nginx files with the first tier written in: a zone keyed
    by nginx's own client address (after realip, never a forwarded header),
    and a limit with a burst of two seconds' worth, refused at once (429)."""
    zone = (f"limit_req_zone $binary_remote_addr zone=sluice_guard:10m rate={nginx_rate(rate)};\n"
            "limit_req_status 429;\n"
            "# A refusal of the guard is not an error of nginx's: logged at info.\n"
            "limit_req_log_level info;")
    limit = f"limit_req zone=sluice_guard burst={guard_burst(rate)} nodelay;"
    return {name: text.replace(GUARD_ZONE_MARKER, zone).replace(GUARD_MARKER, limit) for name, text in files.items()}


def with_envoy_guard(files: Mapping[str, str], rate: float) -> dict[str, str]:
    """The rendered Envoy files with the first tier written in at the guard
    marker of the filters fragments, ahead of every HTTP filter of Sluice's
    (so a refusal costs no check): envoy/guard's filter, for this rate."""
    bucket = envoy_token_bucket(rate, "--guard-rate")
    guard = render_template_file(ENVOY_GUARD_FILTER, {
        "ENVOY_GUARD_RATE": f"{rate:g}", "ENVOY_GUARD_BURST": str(bucket.max_tokens),
        "ENVOY_GUARD_TOKENS": str(bucket.tokens_per_fill), "ENVOY_GUARD_FILL_INTERVAL": f"{bucket.fill_seconds}s",
    }, "package")

    def written(marker: re.Match[str]) -> str:
        return marker.group(0) + "\n" + textwrap.indent(guard, marker.group(1)).rstrip("\n")

    return {name: _ENVOY_GUARD_MARKER.sub(written, text) for name, text in files.items()}


# A bootstrap's listener, as the three shipped bootstraps write it.
_ENVOY_FILTER_CHAIN = re.compile(r"^( *)filter_chains:\n\1  - filters:$", re.MULTILINE)
_ENVOY_TLS = """\
{indent}# TLS (sluice config --tls-cert/--tls-key), the client's JA3 and JA4
{indent}# computed by the tls_inspector for Sluice's ja3 and ja4 keys
{indent}# (sluice-fingerprint-filter.yaml sends them).
{indent}listener_filters:
{indent}  - name: envoy.filters.listener.tls_inspector
{indent}    typed_config:
{indent}      "@type": type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector
{indent}      enable_ja3_fingerprinting: true
{indent}      enable_ja4_fingerprinting: true
{indent}filter_chains:
{indent}  - transport_socket:
{indent}      name: envoy.transport_sockets.tls
{indent}      typed_config:
{indent}        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
{indent}        common_tls_context:
{indent}          tls_certificates:
{indent}            - certificate_chain: {{filename: {cert}}}
{indent}              private_key: {{filename: {key}}}
{indent}    filters:"""


def with_envoy_tls(files: Mapping[str, str], cert: str, key: str) -> dict[str, str]:
    """The rendered Envoy bootstraps with a TLS listener: the certificate
    chain and key files given, and the tls_inspector computing JA3 and JA4.
    RenderError for a file that has no listener to change (the fragments)."""
    for path in (cert, key):
        if not re.fullmatch(r"[^\s\"'{}#]+", path):
            raise RenderError(f"{path!r}: a path without spaces, quotes, braces or #")

    def tls(chain: re.Match[str]) -> str:
        return _ENVOY_TLS.format(indent=chain.group(1), cert=json.dumps(cert), key=json.dumps(key))

    changed = {}
    for name, text in files.items():
        changed[name], found = _ENVOY_FILTER_CHAIN.subn(tls, text)
        if found != 1:
            raise RenderError(f"{name}: no listener for TLS (--tls-cert goes with envoy, envoy-grpc or envoy-rls)")
    return changed


def host_port(host: str, port: int) -> str:
    """host:port, an IPv6 address in brackets, as nginx and Sluice's options read it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def nginx_main_config(run_dir: Path, site_config: Path) -> str:
    """The nginx.conf wrapper: everything nginx writes stays in the run directory."""
    # As root, nginx would switch its workers to an unprivileged user that
    # may not be able to reach the run directory (pytest's are mode 0700).
    user = "user root;\n" if os.geteuid() == 0 else ""
    return (
        "# Written by sidecar.rendering for a run directory; rewritten at every start.\n"
        f"{user}"
        "worker_processes 1;\n"
        # A checked request holds up to three connections at once (the
        # client's, the check's and the application's): room for bursts of
        # a few thousand clients.
        "worker_rlimit_nofile 16384;\n"
        f"pid {_nginx_path(run_dir / 'nginx.pid')};\n"
        "error_log stderr warn;\n"
        "events {\n"
        "    worker_connections 8192;\n"
        "}\n"
        "http {\n"
        f"    access_log {_nginx_path(run_dir / 'logs' / 'access.log')};\n"
        f"    client_body_temp_path {_nginx_path(run_dir / 'tmp' / 'client_body')};\n"
        f"    proxy_temp_path {_nginx_path(run_dir / 'tmp' / 'proxy')};\n"
        f"    fastcgi_temp_path {_nginx_path(run_dir / 'tmp' / 'fastcgi')};\n"
        f"    uwsgi_temp_path {_nginx_path(run_dir / 'tmp' / 'uwsgi')};\n"
        f"    scgi_temp_path {_nginx_path(run_dir / 'tmp' / 'scgi')};\n"
        f"    include {_nginx_path(site_config)};\n"
        "}\n"
    )


def _nginx_path(path: Path) -> str:
    text = str(path)
    if any(char in text for char in '"\\$'):
        raise RenderError(f"{text}: the run directory's path must not contain '\"', '\\' or '$' (nginx syntax)")
    return f'"{text}"'


# A line "@include envoy/fragments/NAME" stands for that template of the
# package, indented as the line is: YAML has no include, and the Envoy
# bootstrap is the fragments an existing Envoy pastes in, put in place. A
# YAML line cannot start with "@", so a template rendered by a tool that
# does not know these lines fails to load instead of silently missing a
# fragment.
_INCLUDE = re.compile(r"^([ ]*)@include[ ]+(\S+)[ ]*$", re.MULTILINE)


def expand_includes(text: str, root: Traversable = PACKAGE_TEMPLATES) -> str:
    """The template text with every `@include` line replaced by the named
    template (a path under `root`, the package's templates, its own
    includes expanded), indented alike."""

    def include(match: re.Match[str]) -> str:
        indent, name = match.group(1), match.group(2)
        fragment = _descendant(root, name)
        if not fragment.is_file():
            raise RenderError(f"@include {name}: no such template in {root}")
        # The line's own end of line follows; blank lines stay empty, which
        # YAML's block scalars allow. A fragment may include another (both
        # filter fragments include the Lua filter's).
        return textwrap.indent(expand_includes(fragment.read_text(), root).removesuffix("\n"), indent)

    return _INCLUDE.sub(include, text)


def _descendant(root: Traversable, path: str) -> Traversable:
    """`root / "a/b"` for a Traversable, which takes one name at a time;
    never a path outside `root`."""
    for part in path.strip("/").split("/"):
        if part in ("", ".", ".."):
            raise RenderError(f"{path}: not a path of a template under {root}")
        root = root / part
    return root


# A line of a template that starts with "##" (after its indentation) is a
# note for whoever edits the template: how it is rendered, what each
# ${NAME} stands for. Rendering drops it: the rendered file keeps the
# comments that help whoever runs it. The nginx image's envsubst keeps
# them, as comments.
_MAINTAINER_NOTE = re.compile(r"^[ \t]*##.*(?:\n|\Z)", re.MULTILINE)


def without_maintainer_notes(text: str) -> str:
    """The template text without its "##" lines."""
    return _MAINTAINER_NOTE.sub("", text)


def render_template_file(template: Traversable, variables: Mapping[str, str], what: str) -> str:
    """The rendered text of a template file, its `@include` lines expanded
    and its maintainers' notes dropped; every `${NAME}` left in it must have
    a value."""
    try:
        template_text = template.read_text()
    except OSError as error:
        raise RenderError(f"cannot read the {what} template: {error}") from error
    rendered = render_template(without_maintainer_notes(expand_includes(template_text)), variables)
    left = sorted(set(re.findall(r"\$\{(\w+)\}", rendered)))
    if left:
        raise RenderError(f"{template}: no value for {', '.join(left)}")
    return rendered


def render_folder(folder: Traversable, variables: Mapping[str, str]) -> dict[str, str]:
    """Every template directly in `folder`, rendered, by the name it is
    rendered to (without `.template`), as the nginx image names them."""
    rendered = {}
    for template in sorted(folder.iterdir(), key=lambda entry: entry.name):
        if template.is_file() and template.name.endswith(TEMPLATE_SUFFIX):
            rendered[template.name.removesuffix(TEMPLATE_SUFFIX)] = render_template_file(template, variables, "package")
    return rendered


def write_rendered(directory: Path, rendered: Mapping[str, str]) -> list[Path]:
    """Write each rendered text under its name in `directory`; the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered.items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


def write_nginx_config(run_dir: Path, template: Traversable, variables: Mapping[str, str]) -> Path:
    """Render the template into run_dir/conf.d, the package's snippets into
    run_dir/conf.d/snippets, and write the nginx.conf that includes the site."""
    site = render_template_file(template, variables, "nginx")
    snippets = render_folder(NGINX_SNIPPETS, variables)
    for directory in ("conf.d", "logs", "tmp"):
        (run_dir / directory).mkdir(parents=True, exist_ok=True)
    (run_dir / "logs" / "access.log").unlink(missing_ok=True)
    write_rendered(run_dir / "conf.d" / SNIPPETS_DIR, snippets)
    site_config = run_dir / "conf.d" / "sluice.conf"
    site_config.write_text(site)
    main_config = run_dir / "nginx.conf"
    main_config.write_text(nginx_main_config(run_dir, site_config))
    return main_config


def write_envoy_config(run_dir: Path, template: Traversable, variables: Mapping[str, str],
                       name: str = "envoy.yaml") -> Path:
    """Render the Envoy bootstrap into run_dir/NAME."""
    bootstrap = render_template_file(template, variables, "Envoy")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config = run_dir / name
    config.write_text(bootstrap)
    return config


def render_package_templates(path: str, variables: Mapping[str, str]) -> dict[str, str]:
    """The package's templates at `path`, rendered, by the name each is
    rendered to: every template directly in a folder (`nginx/snippets`,
    `envoy/fragments`, ...), or one template (`envoy/envoy.yaml.template`)."""
    source = _descendant(PACKAGE_TEMPLATES, path)
    if source.is_dir():
        return render_folder(source, variables)
    if source.is_file() and source.name.endswith(TEMPLATE_SUFFIX):
        return {source.name.removesuffix(TEMPLATE_SUFFIX): render_template_file(source, variables, "package")}
    raise RenderError(f"{path}: no such folder of templates or template; a folder is one of "
                     f"{', '.join(template_folders())}")


def render_package_folder(folder: str, destination: Path, variables: Mapping[str, str]) -> list[Path]:
    """Render the package's templates at `folder` (a folder or one template,
    see ``render_package_templates``) into `destination`; nothing is written
    unless every template has all its values."""
    return write_rendered(destination, render_package_templates(folder, variables))


def template_folders() -> list[str]:
    """The package's folders that hold templates, as `--render` names them."""
    found = []
    for proxy in sorted(PACKAGE_TEMPLATES.iterdir(), key=lambda entry: entry.name):
        if proxy.is_dir():
            found.append(proxy.name)
            found += [f"{proxy.name}/{sub.name}" for sub in sorted(proxy.iterdir(), key=lambda entry: entry.name)
                      if sub.is_dir()]
    return found


def rendering_variables(ports: StackPorts, ruleset: Ruleset, environment: Mapping[str, str]) -> dict[str, str]:
    """What `--render` fills in: the values of the local stack (`make run`),
    each replaced by the environment variable of the same name if set."""
    defaults = template_variables(ports, "127.0.0.1", ruleset)
    return {name: environment.get(name, value) for name, value in defaults.items()}


def render_only(folder: str, destination: Path, ports: StackPorts, rules: Path | None) -> int:
    """The body of `--render`: exit status 0, or 1 with the reason on stderr."""
    try:
        variables = rendering_variables(ports, ruleset_of(rules), os.environ)
        written = render_package_folder(folder, destination, variables)
    except (RenderError, OSError) as error:
        print(f"sluice render: {error}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sidecar.rendering",
                                     description="Render the package's nginx or Envoy templates into a folder.")
    parser.add_argument("--render", nargs=2, required=True, metavar=("PATH", "DIR"),
                        help="render the package's templates of the folder PATH (nginx/snippets, "
                             "envoy/fragments, nginx, envoy) or the one template PATH "
                             "(envoy/envoy-grpc.yaml.template) into DIR, with the values of the local stack "
                             "(make run) or, for each one set, the environment variable's")
    parser.add_argument("--rules", type=Path, help="rules file the timeouts and limits are rendered for "
                                                   "(default: Sluice's built-in rules)")
    args = parser.parse_args(argv)
    return render_only(args.render[0], Path(args.render[1]), StackPorts(), args.rules)


if __name__ == "__main__":
    sys.exit(main())
