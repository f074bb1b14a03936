"""What a client of Caddy sees with Sluice deciding through forward_auth.

A real Caddy runs the shipped examples/Caddyfile (imported into a file that
only adds Caddy's global options: no admin endpoint, loopback only) in front
of the demo upstream, asking a real Sluice's /v1/check. Rules:
rules/forward_auth.yaml, where Caddy is a trusted proxy, and
rules/forward_auth_untrusted.yaml, where it is not.
"""

from __future__ import annotations

import http.client
import itertools
import os
import shutil
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devstack.launcher import START_TIMEOUT_SECONDS, Component, StackError, accepts_connections
from tests.integration.clients import LOOPBACK, Client, Reply, assert_default_block, assert_observed
from tests.integration.test_challenge import pass_challenge

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_CADDYFILE = REPO / "examples" / "Caddyfile"
RULES = Path(__file__).parent / "rules"

# The Caddyfile's timeouts are 100 ms (connect) and 1 s (answer); a request
# slower than this waited for something it should not have.
PROMPT_SECONDS = 3.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


def find_caddy() -> str:
    found = shutil.which("caddy")
    if found is None:
        raise StackError("caddy is not installed: install Debian's 'caddy' package (make test does it as root)")
    return found


def _answers(port: int, path: str) -> bool:
    try:
        Client(port, timeout=1.0).request(path)
        return True
    except (OSError, http.client.HTTPException):
        return False


class CaddyStack:
    """Demo upstream, Sluice and Caddy on loopback, stopped in reverse order."""

    def __init__(self, run_dir: Path, rules: Path) -> None:
        self.run_dir = run_dir
        self.rules = rules
        self.caddy_port, self.sluice_port, self.upstream_port = free_port(), free_port(), free_port()
        self.components: dict[str, Component] = {}

    def start(self) -> None:
        caddy = find_caddy()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        caddyfile = self.run_dir / "Caddyfile"
        caddyfile.write_text(f'{{\n\tadmin off\n\tdefault_bind {LOOPBACK}\n}}\nimport "{EXAMPLE_CADDYFILE}"\n')
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        caddy_env = dict(
            env,
            SITE_ADDRESS=f"http://:{self.caddy_port}",
            SLUICE_ADDR=f"{LOOPBACK}:{self.sluice_port}",
            UPSTREAM_ADDR=f"{LOOPBACK}:{self.upstream_port}",
            # Caddy keeps state (an autosaved configuration, certificates)
            # under these; not in the user's home.
            XDG_CONFIG_HOME=str(self.run_dir / "caddy"),
            XDG_DATA_HOME=str(self.run_dir / "caddy"),
        )
        upstream_port, sluice_port, caddy_port = self.upstream_port, self.sluice_port, self.caddy_port
        try:
            self._start(
                "upstream",
                [sys.executable, "-m", "devstack.demo_upstream", "--host", LOOPBACK, "--port", str(upstream_port)],
                env,
                lambda: _answers(upstream_port, "/"),
            )
            self._start(
                "sluice",
                # Caddy sends no response reports: no UDP listener, which
                # would be one fixed port for every Sluice of the test run.
                [sys.executable, "-m", "sidecar", "serve", "--host", LOOPBACK, "--port", str(sluice_port),
                 "--hook-udp", "off", "--config", str(self.rules)],
                env,
                lambda: _answers(sluice_port, "/healthz"),
            )
            # Not an HTTP probe: a request through Caddy would be counted.
            self._start(
                "caddy",
                [caddy, "run", "--config", str(caddyfile), "--adapter", "caddyfile"],
                caddy_env,
                lambda: accepts_connections(LOOPBACK, caddy_port),
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for name in ("caddy", "sluice", "upstream"):
            component = self.components.pop(name, None)
            if component is not None:
                component.stop()

    def _start(self, name: str, argv: list[str], env: dict[str, str], ready: Callable[[], bool]) -> None:
        component = Component(name, argv, self.run_dir / "logs" / f"{name}.log", env)
        self.components[name] = component
        component.wait_until_ready(ready, START_TIMEOUT_SECONDS)


def _running_stack(run_dir: Path, rules: Path) -> Iterator[CaddyStack]:
    stack = CaddyStack(run_dir, rules)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def trusting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CaddyStack]:
    """Shared by the tests that only send requests; Caddy is a trusted proxy."""
    yield from _running_stack(tmp_path_factory.mktemp("caddy-trusted"), RULES / "forward_auth.yaml")


@pytest.fixture(scope="module")
def untrusting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CaddyStack]:
    yield from _running_stack(tmp_path_factory.mktemp("caddy-untrusted"), RULES / "forward_auth_untrusted.yaml")


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[CaddyStack]:
    """A stack of the test's own, for tests that stop Sluice."""
    yield from _running_stack(tmp_path, RULES / "forward_auth.yaml")


_client_numbers = itertools.count(1)


def new_client(stack: CaddyStack) -> Client:
    """A client of Caddy from a loopback address no other test of this module uses."""
    number = next(_client_numbers)
    return Client(stack.caddy_port, f"127.3.{number // 250}.{number % 250 + 1}")


def upstream_hits(stack: CaddyStack, path: str) -> int:
    """How many requests for path the upstream has seen, this one included."""
    hits: int = Client(stack.upstream_port).request(path).echo()["hits"]
    return hits


def unique_path(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def test_allowed_request_reaches_the_upstream_with_the_original_request(trusting: CaddyStack) -> None:
    client = new_client(trusting)

    reply = client.request("/hello/world?a=1&b=2", method="POST", headers={"X-Demo": "yes"}, body=b"payload")

    assert reply.status == 200
    echo = reply.echo()
    assert (echo["method"], echo["path"], echo["query"]) == ("POST", "/hello/world", "a=1&b=2")
    assert echo["headers"]["x-demo"] == "yes"
    assert echo["headers"]["x-forwarded-for"] == client.source
    assert echo["body_bytes"] == len(b"payload")
    assert not [name for name in echo["headers"] if name.startswith("x-ratelimit")]
    assert "X-RateLimit" not in reply.headers


def test_block_passes_status_headers_and_page_to_the_client_and_spares_the_upstream(
    trusting: CaddyStack,
) -> None:
    client = new_client(trusting)
    path = unique_path("/block/")

    assert [client.request(path).status for _ in range(3)] == [200, 200, 200]
    blocked = client.request(path)

    assert_default_block(blocked, limit=3, reset=3600)
    # The upstream saw the three allowed requests; this one is its fourth.
    assert upstream_hits(trusting, path) == 4


def test_block_with_custom_status_and_page_names_the_client_and_the_original_host(trusting: CaddyStack) -> None:
    client = new_client(trusting)
    path = unique_path("/busy/")

    assert [client.request(path, headers={"Host": "shop.example"}).status for _ in range(2)] == [200, 200]
    blocked = client.request(path, headers={"Host": "shop.example"})

    assert blocked.status == 503
    assert blocked.body == f"busy, {client.source} at shop.example".encode()
    assert blocked.headers["X-RateLimit-Limit"] == "2"


def test_close_is_an_empty_403_and_spares_the_upstream(trusting: CaddyStack) -> None:
    client = new_client(trusting)
    path = unique_path("/close/")

    assert client.request(path).status == 200
    refused = [client.request(path) for _ in range(2)]

    assert [(reply.status, reply.body) for reply in refused] == [(403, b""), (403, b"")]
    assert upstream_hits(trusting, path) == 2


def test_observe_headers_reach_the_client_and_not_the_upstream(trusting: CaddyStack) -> None:
    client = new_client(trusting)
    path = unique_path("/observe/")

    under = [client.request(path) for _ in range(2)]
    over = [client.request(path) for _ in range(2)]

    assert all(reply.status == 200 and "X-RateLimit" not in reply.headers for reply in under)
    for reply in over:
        assert_observed(reply, limit=2, reset=600)
        assert not [name for name in reply.echo()["headers"] if name.startswith("x-ratelimit")]


def test_a_client_cannot_add_over_limit_headers_itself(trusting: CaddyStack) -> None:
    reply = new_client(trusting).request(
        unique_path("/observe/"), headers={"X-RateLimit": "true", "X-RateLimit-Limit": "7"}
    )

    assert reply.status == 200
    assert "X-RateLimit" not in reply.headers
    assert "X-RateLimit-Limit" not in reply.headers


def test_clients_behind_a_trusted_caddy_get_budgets_of_their_own(trusting: CaddyStack) -> None:
    client, neighbour = new_client(trusting), new_client(trusting)
    path = unique_path("/block/")

    assert [client.request(path).status for _ in range(4)] == [200, 200, 200, 429]
    assert neighbour.request(path).status == 200


def test_a_client_supplied_x_forwarded_for_does_not_buy_a_new_budget(trusting: CaddyStack) -> None:
    client = new_client(trusting)
    path = unique_path("/block/")

    statuses = [
        client.request(path, headers={"X-Forwarded-For": f"203.0.113.{n}"}).status for n in range(1, 6)
    ]

    # Caddy trusts no client: it replaces the header with the peer's address.
    assert statuses == [200, 200, 200, 429, 429]


def test_with_caddy_not_trusted_every_client_shares_caddys_budget(untrusting: CaddyStack) -> None:
    path = unique_path("/busy/")

    replies = [new_client(untrusting).request(path) for _ in range(4)]

    assert [reply.status for reply in replies] == [200, 200, 200, 503]
    assert replies[-1].body == b"busy, 127.0.0.1"


def timed_request(client: Client, path: str, method: str = "GET", body: bytes | None = None) -> Reply:
    started = time.monotonic()
    reply = client.request(path, method=method, body=body)
    assert time.monotonic() - started < PROMPT_SECONDS
    return reply


def test_requests_reach_the_upstream_promptly_after_sluice_is_killed(own_stack: CaddyStack) -> None:
    client = new_client(own_stack)
    assert [client.request("/block/before").status for _ in range(4)] == [200, 200, 200, 429]

    own_stack.components["sluice"].kill()

    for attempt in range(3):
        reply = timed_request(client, f"/block/after-{attempt}")
        assert (reply.status, reply.echo()["path"]) == (200, f"/block/after-{attempt}")
    posted = timed_request(client, "/block/form", method="POST", body=b"name=value")
    assert posted.status == 200
    assert (posted.echo()["method"], posted.echo()["body_bytes"]) == ("POST", len(b"name=value"))


def test_a_stuck_sluice_delays_requests_by_the_read_timeout_only(own_stack: CaddyStack) -> None:
    client = new_client(own_stack)
    assert [client.request("/block/before").status for _ in range(4)] == [200, 200, 200, 429]
    sluice_pid = own_stack.components["sluice"].process.pid

    os.kill(sluice_pid, signal.SIGSTOP)
    try:
        replies = [timed_request(client, f"/block/stuck-{attempt}") for attempt in range(2)]
    finally:
        os.kill(sluice_pid, signal.SIGCONT)

    assert [(reply.status, reply.echo()["path"]) for reply in replies] == [
        (200, "/block/stuck-0"),
        (200, "/block/stuck-1"),
    ]


def test_a_challenge_solved_through_caddy_sets_a_credential_that_passes(trusting: CaddyStack) -> None:
    # The shipped Caddyfile routes /.sluice/challenge to Sluice, unchecked.
    client = new_client(trusting)
    path = unique_path("/challenge/")
    cookie = pass_challenge(client, path)
    assert [client.request(path, headers={"Cookie": cookie}).status for _ in range(3)] == [200, 200, 200]
    # The same cookie from another address behind Caddy is no credential.
    other = new_client(trusting)
    for _ in range(2):
        other.request(path)
    assert other.request(path, headers={"Cookie": cookie}).status == 403
