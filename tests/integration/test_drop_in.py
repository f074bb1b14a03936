"""Sluice added to an nginx and an Envoy of one's own, as docs/nginx.md and
docs/envoy.md say.

The nginx snippets and the Envoy fragments are rendered from the package's
templates (`python -m sidecar.rendering --render`, as `sluice config
nginx-snippets` and `sluice config envoy-fragments` render them). The
nginx site is the test's own: two applications ("shop" for every path,
"reports" for /reports/), each location protected with the three includes
and its own `$sluice_upstream`, and /public/ left unchecked. The Envoy
bootstrap is the test's own too, with the same routes (/public/ with
ext_authz disabled), into which the fragments are pasted: the YAML merge a
user does by hand. Both are checked by nginx and `envoy --mode validate`,
then run against a real Sluice with rules/drop_in.yaml.
"""

from __future__ import annotations

import http.client
import json
import os
import posixpath
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from devstack.launcher import (
    FRONT_DOORS,
    PACKAGE_PARENT,
    Component,
    StackError,
    find_envoy,
    find_nginx,
)
from sidecar.rendering import StackPorts, nginx_main_config
from tests.integration.burst import burst
from tests.integration.clients import (
    CONNECTION_CLOSED,
    LOOPBACK,
    Client,
    Reply,
    assert_default_block,
    assert_observed,
    assert_refused_by_closing,
)
from tests.integration.conftest import (
    RULES,
    free_port,
    fresh_client_address,
    metric_at,
    unique_path,
    wait_until,
)

pytestmark = pytest.mark.integration

START_SECONDS = 30.0
# Both proxies give up on Sluice within a second; a request slower than
# this when Sluice is gone waited for something it should not have.
PROMPT_SECONDS = 3.0
REPORT_DEADLINE_SECONDS = 5.0
# Sluice's limit on a request head, lowered so that a client can make
# Sluice give nginx an answer a check should never get (431).
SLUICE_MAX_HEADER_BYTES = 16384
PENALTY_SECONDS = 3600  # the rules' `per: 1h`

NGINX_SITE = """\
# The test's own site: two applications, and Sluice added with three includes.
include snippets/sluice-http.conf;

upstream shop {{
    server 127.0.0.1:{shop};
    keepalive 8;
}}

upstream reports {{
    server 127.0.0.1:{reports};
}}

server {{
    listen 127.0.0.1:{nginx};
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_set_header Host $host;
    proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;

    include snippets/sluice-server.conf;

    location / {{
        set $sluice_upstream http://shop;
        include snippets/sluice-location.conf;
        proxy_pass http://shop;
    }}

    location /reports/ {{
        set $sluice_upstream http://reports;
        include snippets/sluice-location.conf;
        proxy_pass http://reports;
    }}

    location /public/ {{
        proxy_set_header X-Location public;
        proxy_pass http://shop;
    }}
}}
"""

UNCHECKED = {
    "envoy.filters.http.ext_authz": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute",
        "disabled": True,
    },
}


def envoy_cluster(name: str, port: int) -> dict[str, Any]:
    endpoint = {"endpoint": {"address": {"socket_address": {"address": LOOPBACK, "port_value": port}}}}
    return {"name": name, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [endpoint]}]}}


def envoy_bootstrap(ports: StackPorts, reports_port: int, listen_port: int, admin_port: int) -> dict[str, Any]:
    """The test's own Envoy, before Sluice: the same routes as the nginx site."""
    routes = [
        {"match": {"prefix": "/public/"}, "route": {"cluster": "shop"}, "typed_per_filter_config": UNCHECKED,
         "request_headers_to_add": [{"header": {"key": "x-location", "value": "public"},
                                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]},
        {"match": {"prefix": "/reports/"}, "route": {"cluster": "reports"}},
        {"match": {"prefix": "/"}, "route": {"cluster": "shop"}},
    ]
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                 ".HttpConnectionManager",
        "stat_prefix": "shop",
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
        "route_config": {"name": "shop", "virtual_hosts": [{"name": "shop", "domains": ["*"], "routes": routes}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    listener = {"name": "shop", "address": {"socket_address": {"address": LOOPBACK, "port_value": listen_port}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": manager}]}]}
    return {
        "admin": {"address": {"socket_address": {"address": LOOPBACK, "port_value": admin_port}}},
        "static_resources": {"listeners": [listener],
                             "clusters": [envoy_cluster("shop", ports.upstream),
                                          envoy_cluster("reports", reports_port)]},
    }


def paste_fragments(bootstrap: dict[str, Any], fragments: Path, grpc: bool = False) -> None:
    """What docs/envoy.md tells a user to paste, and where (with gRPC
    ext_authz: the gRPC filters, and the gRPC cluster too)."""
    def load(name: str) -> Any:
        return yaml.safe_load((fragments / name).read_text())

    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"][0:0] = load("sluice-grpc-http-filters.yaml" if grpc else "sluice-http-filters.yaml")
    virtual_host = manager["route_config"]["virtual_hosts"][0]
    virtual_host["routes"][0:0] = load("sluice-routes.yaml")
    virtual_host["request_headers_to_remove"] = ["x-sluice-pending", "x-envoy-auth-failure-mode-allowed"]
    bootstrap["static_resources"]["clusters"] += load("sluice-clusters.yaml")
    if grpc:
        bootstrap["static_resources"]["clusters"] += load("sluice-grpc-clusters.yaml")


def child_environment(**values: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(PACKAGE_PARENT), "PYTHONUNBUFFERED": "1", **values}


def render(folder: str, destination: Path, **values: str) -> None:
    """The package's templates of `folder`, rendered as the docs' commands render them."""
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.rendering", "--render", folder, str(destination)],
        capture_output=True, text=True, env=child_environment(**values), timeout=60,
    )
    assert result.returncode == 0, result.stderr


def accepts_connections(port: int) -> bool:
    try:
        Client(port, timeout=0.5).connect().close()
        return True
    except OSError:
        return False


def answers_200(port: int, path: str) -> bool:
    try:
        return Client(port, timeout=1.0).request(path).status == 200
    except (OSError, http.client.HTTPException):
        return False


class DropIn:
    """Sluice, the two applications, and the nginx and Envoy of the test's own."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.ports = StackPorts(nginx=free_port(), sluice=free_port(), upstream=free_port(), envoy=free_port(),
                                envoy_admin=free_port(), envoy_grpc=free_port(), envoy_grpc_admin=free_port(),
                                sluice_grpc=free_port(), sluice_hook=free_port(socket.SOCK_DGRAM))
        self.reports_port = free_port()
        self.components: dict[str, Component] = {}
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "tmp").mkdir(exist_ok=True)
        self.nginx_config = self._configure_nginx()
        self.envoy_config = self._configure_envoy("envoy.yaml", self.ports.envoy, self.ports.envoy_admin)
        self.envoy_grpc_config = self._configure_envoy("envoy-grpc.yaml", self.ports.envoy_grpc,
                                                       self.ports.envoy_grpc_admin, grpc=True)

    def _configure_nginx(self) -> Path:
        render("nginx/snippets", self.run_dir / "snippets",
               SLUICE_ADDR=f"{LOOPBACK}:{self.ports.sluice}",
               SLUICE_HOOK_ADDR=f"{LOOPBACK}:{self.ports.sluice_hook}")
        site = self.run_dir / "site.conf"
        site.write_text(NGINX_SITE.format(shop=self.ports.upstream, reports=self.reports_port,
                                          nginx=self.ports.nginx))
        config = self.run_dir / "nginx.conf"
        config.write_text(nginx_main_config(self.run_dir, site))
        return config

    def _configure_envoy(self, name: str, listen_port: int, admin_port: int, grpc: bool = False) -> Path:
        render("envoy/fragments", self.run_dir / "fragments",
               SLUICE_HOST=LOOPBACK, SLUICE_PORT=str(self.ports.sluice),
               SLUICE_GRPC_PORT=str(self.ports.sluice_grpc),
               SLUICE_HOOK_HOST=LOOPBACK, SLUICE_HOOK_PORT=str(self.ports.sluice))
        bootstrap = envoy_bootstrap(self.ports, self.reports_port, listen_port, admin_port)
        paste_fragments(bootstrap, self.run_dir / "fragments", grpc)
        config = self.run_dir / name
        config.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        return config

    def start(self) -> None:
        try:
            for name, port in (("shop", self.ports.upstream), ("reports", self.reports_port)):
                self._start(name, [sys.executable, "-m", "devstack.demo_upstream", "--port", str(port)],
                            lambda port=port: accepts_connections(port))
            self.start_sluice()
            self._start("nginx", [find_nginx(), "-p", str(self.run_dir), "-c", str(self.nginx_config),
                                  "-g", "daemon off;"], lambda: accepts_connections(self.ports.nginx))
            # As the launcher waits for it: LIVE, and the listener bound.
            for name, config, port, admin_port in (
                ("envoy", self.envoy_config, self.ports.envoy, self.ports.envoy_admin),
                ("envoy-grpc", self.envoy_grpc_config, self.ports.envoy_grpc, self.ports.envoy_grpc_admin),
            ):
                self._start(name, [find_envoy(), "-c", str(config), "--disable-hot-restart", "--log-level", "warning"],
                            lambda port=port, admin_port=admin_port: answers_200(admin_port, "/ready")
                            and accepts_connections(port))
        except BaseException:
            self.stop()
            raise

    def start_sluice(self) -> None:
        self._start("sluice", [
            sys.executable, "-m", "sidecar", "serve", "--host", LOOPBACK, "--port", str(self.ports.sluice),
            "--hook-udp", f"{LOOPBACK}:{self.ports.sluice_hook}", "--config", str(RULES / "drop_in.yaml"),
            "--max-header-bytes", str(SLUICE_MAX_HEADER_BYTES), "--grpc-port", str(self.ports.sluice_grpc),
        ], lambda: answers_200(self.ports.sluice, "/healthz"))

    def kill_sluice(self) -> None:
        self.components.pop("sluice").kill()

    def _start(self, name: str, argv: list[str], ready: Callable[[], bool]) -> None:
        # Each start writes a log of its own: a restarted Sluice keeps the first one's.
        log = self.run_dir / "logs" / f"{name}-{time.monotonic_ns()}.log"
        self.components[name] = Component(name, argv, log, child_environment())
        self.components[name].wait_until_ready(ready, START_SECONDS)

    def stop(self) -> None:
        for name in ("envoy-grpc", "envoy", "nginx", "sluice", "reports", "shop"):
            component = self.components.pop(name, None)
            if component is not None:
                component.stop()

    def port(self, front_door: str) -> int:
        return {"nginx": self.ports.nginx, "envoy": self.ports.envoy, "envoy-grpc": self.ports.envoy_grpc}[front_door]

    def reached(self, application: str, path: str) -> int:
        """How many requests for `path` reached the application so far."""
        port = {"shop": self.ports.upstream, "reports": self.reports_port}[application]
        hits: int = Client(port).request(path).echo()["hits"]
        return hits - 1

    def metric(self, name: str, labels: str = "") -> float:
        return metric_at(self.ports.sluice, name, labels)

    def sluice_logs(self) -> str:
        return "".join(log.read_text(errors="replace") for log in sorted(self.run_dir.glob("logs/sluice-*.log")))


class Site(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def metric(self, name: str, labels: str = "") -> float: ...
    def sluice_logs(self) -> str: ...


SiteT = TypeVar("SiteT", bound=Site)


def started(make: Callable[[], SiteT]) -> Iterator[SiteT]:
    """A module fixture's site: started (a port found free can be taken
    before its server binds it, see start_stack: three tries), then, once
    the tests are done, checked that Sluice never failed inside whatever
    they sent, and stopped."""
    for attempt in range(3):
        setup = make()
        try:
            setup.start()
            break
        except StackError:
            if attempt == 2:
                raise
    yield setup
    try:
        assert setup.metric("sluice_internal_errors_total") == 0
        assert "Traceback" not in setup.sluice_logs()
    finally:
        setup.stop()


@pytest.fixture(scope="module")
def drop_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DropIn]:
    yield from started(lambda: DropIn(tmp_path_factory.mktemp("drop-in")))


def client_of(drop_in: DropIn, front_door: str) -> Client:
    return Client(drop_in.port(front_door), fresh_client_address())


# -- the configurations ------------------------------------------------------


def test_nginx_accepts_the_site_with_the_three_includes(drop_in: DropIn) -> None:
    result = subprocess.run([find_nginx(), "-t", "-q", "-e", "stderr", "-p", str(drop_in.run_dir),
                             "-c", str(drop_in.nginx_config)], capture_output=True, text=True, timeout=30)

    assert result.returncode == 0, result.stderr


def test_envoy_validates_the_bootstrap_with_the_fragments_pasted_in(drop_in: DropIn) -> None:
    result = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(drop_in.envoy_config),
                             "--disable-hot-restart", "--log-level", "error"],
                            capture_output=True, text=True, timeout=60)

    assert result.returncode == 0, result.stdout + result.stderr


# -- through either proxy ------------------------------------------------------


def test_an_allowed_request_reaches_its_locations_own_application(drop_in: DropIn, front_door: str) -> None:
    client = client_of(drop_in, front_door)
    shop_path, reports_path = unique_path("/shop/item/"), unique_path("/reports/")

    shop, reports = client.request(shop_path + "?a=1"), client.request(reports_path)

    assert (shop.status, reports.status) == (200, 200)
    assert (shop.echo()["path"], shop.echo()["query"]) == (shop_path, "a=1")
    assert "X-RateLimit" not in shop.headers
    assert (drop_in.reached("shop", shop_path), drop_in.reached("reports", shop_path)) == (1, 0)
    assert (drop_in.reached("reports", reports_path), drop_in.reached("shop", reports_path)) == (1, 0)


def test_an_unprotected_location_is_never_checked(drop_in: DropIn, front_door: str) -> None:
    client = client_of(drop_in, front_door)
    path = unique_path("/public/")
    checks = drop_in.metric("sluice_checks_total")

    replies = [client.request(path) for _ in range(3)]

    # The `public` rule would refuse the second one.
    assert [reply.status for reply in replies] == [200, 200, 200]
    assert drop_in.metric("sluice_checks_total") == checks
    assert drop_in.metric("sluice_rule_hits_total", 'rule="public"') == 0


def test_a_refusal_has_the_rules_status_and_page(drop_in: DropIn, front_door: str) -> None:
    client = client_of(drop_in, front_door)
    busy, limited = unique_path("/shop/busy/"), unique_path("/reports/limited/")

    assert [client.request(busy).status, client.request(limited).status] == [200, 200]
    refused_busy, refused_limited = client.request(busy), client.request(limited)

    # A 5xx refusal: through Envoy the fragment's Lua filter restores it.
    assert refused_busy.status == 503
    assert refused_busy.body == f"busy, {client.source}".encode()
    assert refused_busy.headers["X-RateLimit-Limit"] == "1"
    assert_default_block(refused_limited, limit=1, reset=PENALTY_SECONDS)
    assert (drop_in.reached("shop", busy), drop_in.reached("reports", limited)) == (1, 1)


def test_close_and_ban_close_the_connection(drop_in: DropIn, front_door: str) -> None:
    client = client_of(drop_in, front_door)
    close, ban = unique_path("/shop/close/"), unique_path("/shop/ban/")

    assert client.request(close).status == 200
    assert_refused_by_closing(client, close, front_door)
    assert client.request(ban).status == 200
    assert_refused_by_closing(client, ban, front_door)
    # Banned: every checked request of the address, in either location.
    assert_refused_by_closing(client, unique_path("/reports/after-the-ban/"), front_door)
    assert client_of(drop_in, front_door).request(unique_path("/reports/neighbour/")).status == 200


def test_observe_mode_adds_its_headers_to_the_allowed_response(drop_in: DropIn, front_door: str) -> None:
    client = client_of(drop_in, front_door)
    path = unique_path("/reports/observe/")

    under, over = client.request(path), client.request(path)

    assert under.status == 200 and "X-RateLimit" not in under.headers
    assert_observed(over, limit=1, reset=PENALTY_SECONDS)
    assert drop_in.reached("reports", path) == 2


def test_reported_401s_refuse_the_next_request(drop_in: DropIn, front_door: str) -> None:
    client = client_of(drop_in, front_door)
    path = unique_path("/shop/login/")

    for _ in range(2):
        reported = drop_in.metric("sluice_responses_reported_total")
        assert client.request(path + "?status=401").status == 401
        # The report travels after the response: the next request waits for it.
        wait_until(lambda reported=reported: drop_in.metric("sluice_responses_reported_total") > reported,
                   "the report of the 401", REPORT_DEADLINE_SECONDS)
    refused = client.request(path + "?status=401")

    assert_default_block(refused, limit=2, reset=PENALTY_SECONDS)
    assert drop_in.reached("shop", path) == 2


def test_a_burst_on_one_key_admits_exactly_the_budget(drop_in: DropIn, front_door: str) -> None:
    statuses = burst(drop_in.port(front_door), 300, unique_path("/shop/burst/"), source=fresh_client_address())

    assert statuses == {200: 50, 429: 250}


def test_with_sluice_stopped_each_location_still_reaches_its_own_application(drop_in: DropIn,
                                                                             front_door: str) -> None:
    client = client_of(drop_in, front_door)
    busy, reports = unique_path("/shop/busy/"), unique_path("/reports/")
    assert [client.request(busy).status for _ in range(2)] == [200, 503]

    drop_in.kill_sluice()
    try:
        started = time.monotonic()
        replies = [client.request(busy), client.request(reports)]
        waited = time.monotonic() - started
    finally:
        drop_in.start_sluice()

    assert [reply.status for reply in replies] == [200, 200]
    assert waited < PROMPT_SECONDS
    assert drop_in.reached("shop", busy) == 2
    assert drop_in.reached("reports", reports) == 1


def test_an_answer_a_check_never_gets_fails_open_to_the_locations_own_application(drop_in: DropIn) -> None:
    # nginx only: a request head larger than Sluice's limit gets Sluice's 431,
    # which auth_request takes for a failure (500): @sluice_fail_open sends
    # the request to $sluice_upstream. Envoy passes a 431 on as a refusal.
    client = Client(drop_in.port("nginx"), fresh_client_address())
    padding = {f"X-Padding-{index}": "p" * 7000 for index in range(3)}
    path = unique_path("/reports/large/")

    reply = client.request(path, headers=padding)

    assert reply.status == 200
    assert reply.echo()["headers"]["x-padding-0"] == padding["X-Padding-0"]
    assert (drop_in.reached("reports", path), drop_in.reached("shop", path)) == (1, 0)


# -- whatever the path, a banned client reaches an application only unchecked --

SEGMENTS = st.sampled_from([
    "shop", "reports", "public", "busy", "x", "", ".", "..", "%2e%2e", "%2E", "%2F", "%2f", "%5C", "%70ublic",
    "_sluice", "auth", ".sluice", "challenge", "%00", "a;b", "%3F",
])
# Half of them start in the unchecked location, where a path that leaves it
# again (dot segments, escapes) would be a way past the check.
PATHS = st.builds(lambda start, segments, query: start + "/".join(segments) + query,
                  st.sampled_from(["/", "/public/"]), st.lists(SEGMENTS, min_size=1, max_size=5),
                  st.sampled_from(["", "?q=1", "?status=401"]))


def application_echo(reply: Reply) -> dict[str, Any] | None:
    try:
        echo = json.loads(reply.body)
    except ValueError:
        return None
    return echo if isinstance(echo, dict) and "hits" in echo else None


def resolved(path: str) -> str:
    return posixpath.normpath(re.sub("/+", "/", path))


@pytest.fixture(scope="module")
def banned_sources(drop_in: DropIn) -> dict[str, str]:
    """A banned loopback address per front door."""
    sources = {}
    for front_door in FRONT_DOORS:
        client = client_of(drop_in, front_door)
        path = unique_path("/shop/ban/")
        assert client.request(path).status == 200
        assert_refused_by_closing(client, path, front_door)
        sources[front_door] = client.source
    return sources


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=PATHS)
def test_a_banned_client_reaches_an_application_only_through_the_unchecked_location(
    drop_in: DropIn, banned_sources: dict[str, str], front_door: str, path: str
) -> None:
    client = Client(drop_in.port(front_door), banned_sources[front_door])
    try:
        reply = client.request(path)
    except CONNECTION_CLOSED:
        assert front_door == "nginx"  # 444: the ban
        event("closed without a response")
        return

    assert reply.status < 500, (reply.status, reply.body[:200])
    echo = application_echo(reply)
    event("reached an application" if echo is not None else f"answered {reply.status}")
    if echo is not None:
        assert echo["headers"].get("x-location") == "public", echo
        assert resolved(echo["path"]) == "/public" or resolved(echo["path"]).startswith("/public/"), echo
