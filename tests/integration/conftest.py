"""Real nginx, Envoy, Sluice and demo upstream on loopback, started with the launcher.

Tests send from loopback addresses of their own (127.1.x.y; Linux accepts any
127/8 source address without configuration), so per-address counters and bans
of one test never touch another's. Tests that take the `front_door` fixture
run through nginx, through Envoy with HTTP ext_authz and through Envoy with
gRPC ext_authz ("envoy-grpc"); the front doors of a stack share one Sluice, and
fresh addresses keep their counters apart too.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from devstack.launcher import FRONT_DOORS, Stack, StackError, find_envoy
from sidecar.rendering import StackPorts
from tests.integration.clients import LOOPBACK, Client

if TYPE_CHECKING:
    # redis_server imports this module: the fixtures import it when they run.
    from tests.integration.redis_server import RedisCluster, RedisServer

RULES = Path(__file__).parent / "rules"


def free_port(kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


def start_stack(run_dir: Path, rules: Path, variables: Mapping[str, str] | None = None,
                rls_config: Path | None = None) -> Stack:
    """A stack on free loopback ports; `variables` override template values;
    with `rls_config`, the Rate Limit Service and its Envoy door too.

    A port found free can be taken before the server binds it (by another
    connection's source port, in a suite that opens thousands): the stack
    is then started again on other ports, up to three times.
    """
    for attempt in range(3):
        ports = StackPorts(
            nginx=free_port(),
            sluice=free_port(),
            upstream=free_port(),
            envoy=free_port(),
            envoy_admin=free_port(),
            envoy_grpc=free_port(),
            envoy_grpc_admin=free_port(),
            sluice_grpc=free_port(),
            sluice_hook=free_port(socket.SOCK_DGRAM),
            envoy_rls=free_port(),
            envoy_rls_admin=free_port(),
        )
        stack = Stack(run_dir / f"attempt-{attempt}" if attempt else run_dir, rules=rules, ports=ports,
                      variables=variables, rls_config=rls_config)
        try:
            stack.start()
            return stack
        except StackError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def state_for(request: pytest.FixtureRequest, backend: str) -> str:
    """The rules file's `state:` line for a backend ("memory", "redis" or
    "cluster"), on the session's emptied Redis or Redis Cluster."""
    if backend == "redis":
        redis_server = request.getfixturevalue("redis_server")
        redis_server.client().flushdb()
        return f'state: {{backend: redis, url: "{redis_server.url}"}}\n'
    if backend == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        return f'state: {{backend: redis, cluster: {{nodes: ["{cluster.addresses[0]}"]}}}}\n'
    return ""


def stack_on_backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                     rules_text: str) -> Iterator[Stack]:
    """A module's stack with `rules_text` on the backend of the fixture's
    parameter; for a fixture to yield from."""
    directory = tmp_path_factory.mktemp(f"stack-{request.param}")
    rules = directory / "rules.yaml"
    rules.write_text(state_for(request, request.param) + rules_text)
    stack = start_stack(directory / "stack", rules)
    try:
        yield stack
    finally:
        stack.stop()


def front_door_port(stack: Stack, front_door: str) -> int:
    return {"nginx": stack.ports.nginx, "envoy": stack.ports.envoy,
            "envoy-grpc": stack.ports.envoy_grpc}[front_door]


_client_numbers = itertools.count(1)


def fresh_client_address() -> str:
    """A loopback address no other test of this run sends from."""
    number = next(_client_numbers)
    return f"127.1.{number // 250}.{number % 250 + 1}"


def unique_path(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def sluice_metric(stack: Stack, name: str, labels: str = "") -> float:
    """One sample of Sluice's /metrics, e.g. ("sluice_rule_hits_total", 'rule="x"'); 0 if absent."""
    return metric_at(stack.ports.sluice, name, labels)


def metric_at(port: int, name: str, labels: str = "") -> float:
    """One sample of the /metrics of the Sluice on ``port`` (of one worker, with
    several: each connection may reach another)."""
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=2.0)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    sample = re.escape(f"{name}{{{labels}}}" if labels else name)
    found = re.search(rf"^{sample} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def wait_until(condition: Callable[[], bool], what: str, seconds: float) -> None:
    """Check `condition` every 10 ms until it holds; fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {seconds} s: {what}")
        time.sleep(0.01)


@pytest.fixture(scope="session")
def limits_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The stack with rules/limits.yaml, shared by every test that only sends requests."""
    stack = start_stack(tmp_path_factory.mktemp("limits-stack"), RULES / "limits.yaml")
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def buckets_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The stack with rules/buckets.yaml (token and leaky buckets)."""
    stack = start_stack(tmp_path_factory.mktemp("buckets-stack"), RULES / "buckets.yaml")
    yield stack
    stack.stop()


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack of the test's own, for tests that kill a component."""
    stack = start_stack(tmp_path / "stack", RULES / "limits.yaml")
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A throwaway redis-server on loopback for the tests of one module."""
    from tests.integration.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start(move=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A throwaway three-master Redis Cluster on loopback, for the session."""
    from tests.integration.redis_server import RedisCluster

    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(params=FRONT_DOORS)
def front_door(request: pytest.FixtureRequest) -> str:
    """The proxy the test's clients talk to: "nginx", "envoy" or "envoy-grpc"."""
    name: str = request.param
    return name


@pytest.fixture
def new_client(limits_stack: Stack, front_door: str) -> Callable[..., Client]:
    """Clients of the front door in the shared stack; each call gives a new source address."""

    def make(source: str | None = None) -> Client:
        return Client(front_door_port(limits_stack, front_door), source or fresh_client_address())

    return make


@pytest.fixture
def upstream(limits_stack: Stack) -> Client:
    """The demo upstream itself, bypassing the front doors: to ask what reached it."""
    return Client(limits_stack.ports.upstream)


@contextlib.contextmanager
def another_envoy(bootstrap_text: str, directory: Path, name: str) -> Iterator[int]:
    """An Envoy of its own on ``bootstrap_text`` (a stack's, changed by the
    test), its listener and admin moved to free ports: the listener's port,
    once it accepts; stopped afterwards. Its log is ``DIRECTORY/NAME.log``."""
    port = free_port()
    bootstrap = yaml.safe_load(bootstrap_text)
    bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = port
    bootstrap["admin"]["address"]["socket_address"]["port_value"] = free_port()
    config = directory / f"{name}.yaml"
    config.write_text(yaml.safe_dump(bootstrap))
    log = directory / f"{name}.log"
    envoy = subprocess.Popen([find_envoy(), "-c", str(config), "--disable-hot-restart", "--log-level", "warning",
                              "--base-id", str(port)], stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    try:
        deadline = time.monotonic() + 20
        while not _accepts(port):
            assert envoy.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, f"{name}'s listener did not open"
            time.sleep(0.05)
        yield port
    finally:
        envoy.terminate()
        envoy.wait(10)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.2):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def stack_on(directory: Path, rules_text: str) -> Iterator[Stack]:
    """A stack on the rules ``rules_text`` (written to DIRECTORY/rules.yaml,
    so that files they name are found beside it), stopped afterwards."""
    rules = directory / "rules.yaml"
    rules.write_text(rules_text)
    stack = start_stack(directory / "stack", rules)
    try:
        yield stack
    finally:
        stack.stop()
