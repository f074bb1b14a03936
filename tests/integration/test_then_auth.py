"""Sluice in front of a site's own auth service, through real nginx: ``sluice
serve --then-auth``.

The site is what an oauth2-proxy site looks like: its protected location
reads the auth service's user with ``auth_request_set`` and sends a 401 to
the sign-in page with its own ``error_page 401`` (before Sluice's include:
nginx takes the first error_page of a status), and names its auth location
in ``$sluice_then_auth``. Its ``auth_request`` is Sluice's; Sluice asks the
auth service (tests/integration/auth_service.py) after admitting a request.
/open/ is checked by Sluice without authentication. Every component runs on
loopback.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devstack.launcher import Component, find_nginx
from sidecar.rendering import nginx_main_config
from tests.integration.auth_service import SIGN_IN_PAGE, USER
from tests.integration.burst import burst
from tests.integration.clients import CONNECTION_CLOSED, LOOPBACK, Client
from tests.integration.conftest import free_port, fresh_client_address, metric_at, unique_path, wait_until
from tests.integration.test_drop_in import accepts_connections, answers_200, child_environment, render, started

pytestmark = pytest.mark.integration

START_SECONDS = 30.0
BURST_BUDGET = 50
# Sluice's limit on a request head, lowered so that a client can make
# Sluice give nginx an answer a check should never get (431).
SLUICE_MAX_HEADER_BYTES = 16384

RULES = f"""\
rules:
  - id: limited
    match: {{path: {{prefix: /limited/}}}}
    key: [ip]
    limit: {{requests: 3, per: 1h}}
    action: block

  - id: close
    match: {{path: {{prefix: /close/}}}}
    key: [ip]
    limit: {{requests: 1, per: 1h}}
    action: block
    block: {{close: true}}

  - id: burst
    match: {{path: {{prefix: /burst/}}}}
    key: [ip]
    limit: {{requests: {BURST_BUDGET}, per: 1h, window: fixed}}
    action: block
"""

NGINX_SITE = """\
include snippets/sluice-http.conf;

upstream app {{
    server 127.0.0.1:{app};
    keepalive 8;
}}

upstream auth {{
    server 127.0.0.1:{auth};
}}

server {{
    listen 127.0.0.1:{nginx};
    proxy_http_version 1.1;
    proxy_set_header Connection "";

    include snippets/sluice-server.conf;

    # The site's auth_request location before Sluice: now asked by nginx
    # only when Sluice cannot answer ($sluice_then_auth).
    location = /oauth2/auth {{
        internal;
        proxy_pass http://auth;
        proxy_pass_request_body off;
        proxy_set_header Content-Length "";
        proxy_set_header Connection "";
        proxy_set_header X-Original-URI $request_uri;
    }}

    # The auth service's own pages, unchecked, as the site had them.
    location /oauth2/ {{
        proxy_pass http://auth;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_set_header X-Original-URI $request_uri;
    }}

    # Rate limited, no sign-in.
    location /open/ {{
        set $sluice_upstream http://app;
        include snippets/sluice-location.conf;
        proxy_pass http://app;
    }}

    location / {{
        # The auth service's 401 (sluice serve --then-auth): its sign-in.
        error_page 401 = /oauth2/sign_in;
        set $sluice_upstream http://app;
        set $sluice_then_auth /oauth2/auth;
        include snippets/sluice-location.conf;
        # What the auth service says, as it was read before Sluice.
        auth_request_set $auth_user $upstream_http_x_auth_request_user;
        auth_request_set $auth_email $upstream_http_x_auth_request_email;
        proxy_set_header Connection "";
        proxy_set_header X-User $auth_user;
        proxy_set_header X-Email $auth_email;
        proxy_pass http://app;
    }}
}}
"""


class ThenAuthSite:
    """nginx, Sluice with --then-auth, the auth service and the application."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.nginx_port, self.sluice_port, self.app_port, self.auth_port = (free_port() for _ in range(4))
        self.hook_port = free_port(socket.SOCK_DGRAM)
        self.components: dict[str, Component] = {}
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "tmp").mkdir(exist_ok=True)
        self.rules = run_dir / "rules.yaml"
        self.rules.write_text(RULES)
        render("nginx/snippets", run_dir / "snippets", SLUICE_ADDR=f"{LOOPBACK}:{self.sluice_port}",
               SLUICE_HOOK_ADDR=f"{LOOPBACK}:{self.hook_port}")
        site = run_dir / "site.conf"
        site.write_text(NGINX_SITE.format(app=self.app_port, auth=self.auth_port, nginx=self.nginx_port))
        self.nginx_config = run_dir / "nginx.conf"
        self.nginx_config.write_text(nginx_main_config(run_dir, site))

    def start(self) -> None:
        try:
            self._start("app", [sys.executable, "-m", "devstack.demo_upstream", "--port", str(self.app_port)],
                        lambda: accepts_connections(self.app_port))
            self.start_auth()
            self.start_sluice()
            self._start("nginx", [find_nginx(), "-p", str(self.run_dir), "-c", str(self.nginx_config),
                                  "-g", "daemon off;"], lambda: accepts_connections(self.nginx_port))
        except BaseException:
            self.stop()
            raise

    def start_sluice(self) -> None:
        self._start("sluice", [
            sys.executable, "-m", "sidecar", "serve", "--host", LOOPBACK, "--port", str(self.sluice_port),
            "--hook-udp", f"{LOOPBACK}:{self.hook_port}", "--config", str(self.rules),
            "--max-header-bytes", str(SLUICE_MAX_HEADER_BYTES),
            "--then-auth", f"http://{LOOPBACK}:{self.auth_port}/oauth2/auth",
        ], lambda: answers_200(self.sluice_port, "/healthz"))

    def kill_sluice(self) -> None:
        self.components.pop("sluice").kill()

    def start_auth(self) -> None:
        self._start("auth", [sys.executable, "-m", "tests.integration.auth_service", "--port", str(self.auth_port)],
                    lambda: answers_200(self.auth_port, "/_asked"))

    def stop_auth(self) -> None:
        self.components.pop("auth").stop()

    def _start(self, name: str, argv: list[str], ready: Callable[[], bool]) -> None:
        log = self.run_dir / "logs" / f"{name}-{time.monotonic_ns()}.log"
        self.components[name] = Component(name, argv, log, child_environment())
        self.components[name].wait_until_ready(ready, START_SECONDS)

    def stop(self) -> None:
        for name in ("nginx", "sluice", "auth", "app"):
            component = self.components.pop(name, None)
            if component is not None:
                component.stop()

    def client(self) -> Client:
        return Client(self.nginx_port, fresh_client_address())

    def auth_asked(self) -> dict[str, Any]:
        """How often the auth service was asked, and what it saw last."""
        asked: dict[str, Any] = json.loads(Client(self.auth_port).request("/_asked").body)
        return asked

    def reached(self, path: str) -> int:
        """How many requests for ``path`` reached the application."""
        hits: int = Client(self.app_port).request(path).echo()["hits"]
        return hits - 1

    def metric(self, name: str, labels: str = "") -> float:
        return metric_at(self.sluice_port, name, labels)

    def sluice_logs(self) -> str:
        return "".join(log.read_text(errors="replace") for log in sorted(self.run_dir.glob("logs/sluice-*.log")))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThenAuthSite]:
    yield from started(lambda: ThenAuthSite(tmp_path_factory.mktemp("then-auth")))


SIGNED_IN = {"Cookie": "session=ok"}


def test_nginx_accepts_a_site_with_its_own_error_page_and_sluices_includes(site: ThenAuthSite) -> None:
    result = subprocess.run([find_nginx(), "-t", "-q", "-e", "stderr", "-p", str(site.run_dir),
                             "-c", str(site.nginx_config)], capture_output=True, text=True, timeout=30)

    assert result.returncode == 0, result.stderr


def test_a_request_without_a_session_goes_to_the_sign_in_page(site: ThenAuthSite) -> None:
    path = unique_path("/account/")
    asked = site.auth_asked()["asked"]

    reply = site.client().request(path)

    assert reply.status == 302
    assert reply.headers["Location"] == SIGN_IN_PAGE
    assert site.reached(path) == 0
    assert site.auth_asked()["asked"] == asked + 1


def test_a_signed_in_request_reaches_the_application_with_the_user(site: ThenAuthSite) -> None:
    path = unique_path("/account/")
    client = site.client()

    reply = client.request(path + "?tab=1", headers={**SIGNED_IN, "X-Real-IP": "10.9.9.9",
                                                     "X-Forwarded-Host": "admin.example"})

    assert reply.status == 200
    echoed = reply.echo()["headers"]
    assert (echoed["x-user"], echoed["x-email"]) == (USER, f"{USER}@example.com")
    assert site.reached(path) == 1
    # What the auth service saw: the client's cookie and the request as
    # nginx had it, never Sluice's own fields nor the client's forged ones.
    seen = site.auth_asked()["seen"][-1]
    assert seen["cookie"] == ["session=ok"]
    assert seen["host"] == [LOOPBACK]
    assert seen["x-original-uri"] == [path + "?tab=1"]
    assert seen["x-forwarded-host"] == [LOOPBACK]
    assert seen["x-real-ip"] == [client.source]
    assert [name for name in seen if name.startswith("x-sluice-")] == []


def test_the_auth_services_403_is_a_403(site: ThenAuthSite) -> None:
    path = unique_path("/account/")

    reply = site.client().request(path, headers={"Cookie": "session=forbidden"})

    assert reply.status == 403
    assert b"403 Forbidden" in reply.body
    assert site.reached(path) == 0


def test_past_the_limit_sluices_429_comes_back_without_asking_the_auth_service(site: ThenAuthSite) -> None:
    client = site.client()
    path = unique_path("/limited/")
    asked = site.auth_asked()["asked"]

    statuses = [client.request(path, headers=SIGNED_IN).status for _ in range(5)]

    assert statuses == [200, 200, 200, 429, 429]
    assert site.auth_asked()["asked"] == asked + 3
    assert site.reached(path) == 3


# @sluice_deny: if ($sluice_page_status = 444) { return 444; }
def test_sluices_close_closes_the_connection_and_is_never_the_sign_in_page(site: ThenAuthSite) -> None:
    client = site.client()
    path = unique_path("/close/")
    assert client.request(path, headers=SIGNED_IN).status == 200
    asked = site.auth_asked()["asked"]

    with pytest.raises(CONNECTION_CLOSED):
        client.request(path, headers=SIGNED_IN)

    assert site.auth_asked()["asked"] == asked
    assert site.reached(path) == 1


# the check sends X-Sluice-Then-Auth $sluice_then_auth (default off)
def test_a_location_without_then_auth_is_rate_limited_without_signing_in(site: ThenAuthSite) -> None:
    client = site.client()
    path = unique_path("/open/")
    asked = site.auth_asked()["asked"]

    statuses = [client.request(path).status for _ in range(2)]

    assert statuses == [200, 200]
    assert site.auth_asked()["asked"] == asked


def test_a_burst_admits_exactly_the_budget_and_asks_the_auth_service_for_those_only(site: ThenAuthSite) -> None:
    path = unique_path("/burst/")
    asked = site.auth_asked()["asked"]

    statuses = burst(site.nginx_port, 300, path, headers=SIGNED_IN, source=fresh_client_address())

    assert statuses == {200: BURST_BUDGET, 429: 300 - BURST_BUDGET}
    assert site.auth_asked()["asked"] == asked + BURST_BUDGET
    assert site.reached(path) == BURST_BUDGET


def test_with_the_auth_service_down_requests_are_refused_with_503(site: ThenAuthSite) -> None:
    path = unique_path("/account/")
    failed = site.metric("sluice_then_auth_errors_total", 'reason="connect"')
    site.stop_auth()
    try:
        reply = site.client().request(path, headers=SIGNED_IN)
    finally:
        site.start_auth()

    assert reply.status == 503
    assert reply.headers["Retry-After"] == "1"
    assert site.reached(path) == 0
    assert site.metric("sluice_then_auth_errors_total", 'reason="connect"') == failed + 1
    # Back: the next request is let in again.
    wait_until(lambda: site.client().request(unique_path("/account/"), headers=SIGNED_IN).status == 200,
               "a signed-in request admitted after the auth service came back", 10)


# @sluice_fail_open: if ($sluice_then_auth != off) { return 503; }
def test_an_answer_a_check_never_gets_is_refused_never_let_in_unauthenticated(site: ThenAuthSite) -> None:
    # A request head larger than Sluice's limit gets Sluice's 431, which
    # auth_request takes for a failure (500).
    path = unique_path("/account/")
    padding = {f"X-Padding-{index}": "p" * 7000 for index in range(3)}

    reply = site.client().request(path, headers=padding)

    assert reply.status == 503
    assert site.reached(path) == 0


# @sluice_unreachable: if ($sluice_then_auth != off) { rewrite ^ $sluice_then_auth last; }
def test_with_sluice_stopped_nginx_asks_the_auth_service_itself(site: ThenAuthSite) -> None:
    signed_in, signed_out = unique_path("/account/"), unique_path("/account/")
    site.kill_sluice()
    try:
        admitted = site.client().request(signed_in, headers=SIGNED_IN)
        refused = site.client().request(signed_out)
    finally:
        site.start_sluice()

    assert (admitted.status, admitted.echo()["headers"]["x-user"]) == (200, USER)
    assert (refused.status, refused.headers["Location"]) == (302, SIGN_IN_PAGE)
    assert (site.reached(signed_in), site.reached(signed_out)) == (1, 0)
