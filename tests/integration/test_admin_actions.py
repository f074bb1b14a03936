"""Undoing mistakes on a running stack: real nginx, Envoy (HTTP and gRPC
ext_authz) and Sluice, with the memory backend and with a real
redis-server, driven by ``sluice admin`` as an operator runs it.

A ban by hand refuses the client at every front door as an earned ban does
(the connection closed), and unban lets it in; a client a rule refuses is
let in right after ``sluice admin reset --ip``. With Redis, a second
``sluice serve`` on the same Redis acts for the first one: what lives in
Redis is seen at once, a network ban and the end of a cached penalty
within a second.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.launcher import Stack
from tests.integration.clients import (
    LOOPBACK,
    Client,
    assert_let_in_after_unban,
    assert_refused_by_closing,
    closed,
)
from tests.integration.conftest import fresh_client_address, front_door_port, start_stack, wait_until
from tests.integration.redis_server import RedisServer
from tests.integration.sluice_serve import SluiceServe

pytestmark = pytest.mark.integration

RULES = """\
node: {node}
{state}
tiers: {{names: [free, pro], default: free, identity: "header:x-api-key"}}
rules:
  - id: admin-login
    match: {{path: {{prefix: /admin-login}}}}
    key: [ip]
    limit: {{requests: 2, per: 1m}}
    penalty: 10m
    action: block
  - id: admin-metered
    match: {{path: {{prefix: /admin-metered/}}}}
    key: ["header:x-api-key", path]
    limit: {{requests: 1, per: 1h}}
    tiers: {{pro: 3}}
    action: block
"""

# Networks of their own for the network bans: no other test sends from them.
_networks = itertools.count(1)


def rules_file(directory: Path, node: str, redis_url: str | None) -> Path:
    state = f"state: {{backend: redis, url: '{redis_url}'}}" if redis_url else ""
    path = directory / f"rules-{node}.yaml"
    path.write_text(RULES.format(node=node, state=state))
    return path


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[dict[str, Stack]]:
    """A stack per backend, each on loopback: its Sluice serves the admin
    API to loopback peers without a token."""
    directory = tmp_path_factory.mktemp("admin-actions")
    started: dict[str, Stack] = {}
    try:
        for backend, url in (("memory", None), ("redis", redis_server.url)):
            started[backend] = start_stack(directory / backend, rules_file(directory, f"{backend}-a", url))
        yield started
    finally:
        for stack in started.values():
            stack.stop()


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def sluice_admin(port: int, *arguments: str) -> str:
    """``sluice admin ARGUMENTS`` against the Sluice on ``port``: its output."""
    done = subprocess.run([sys.executable, "-m", "sidecar", "admin", *arguments],
                          env={**os.environ, "SLUICE_ADMIN_URL": f"http://{LOOPBACK}:{port}"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def refused_by_the_rule(client: Client, front_door: str) -> bool:
    """nginx's and Envoy's refusal with the rule's page: 429."""
    return client.request("/admin-login").status == 429


def test_a_ban_by_hand_refuses_at_the_door_and_unban_lets_the_client_in(
        stacks: dict[str, Stack], backend: str, front_door: str) -> None:
    stack = stacks[backend]
    client = Client(front_door_port(stack, front_door), fresh_client_address())
    assert client.request("/").status == 200
    assert sluice_admin(stack.ports.sluice, "ban", client.source, "--for", "1h", "--reason", "test") == \
        f"banned {client.source} for 1h: test\n"
    assert_refused_by_closing(client, "/", front_door)
    assert_refused_by_closing(client, "/admin-login", front_door)
    assert sluice_admin(stack.ports.sluice, "unban", client.source) == f"lifted the ban of {client.source}\n"
    assert_let_in_after_unban(client, "/", front_door)


def test_a_network_ban_refuses_every_address_in_it_and_no_other(
        stacks: dict[str, Stack], backend: str, front_door: str) -> None:
    stack = stacks[backend]
    network = f"127.9.{next(_networks)}.0/30"
    inside, outside = network.replace(".0/30", ".2"), network.replace(".0/30", ".5")
    port = front_door_port(stack, front_door)
    sluice_admin(stack.ports.sluice, "ban", network, "--for", "10m")
    assert_refused_by_closing(Client(port, inside), "/", front_door)
    assert Client(port, outside).request("/").status == 200
    sluice_admin(stack.ports.sluice, "unban", network)
    assert Client(port, inside).request("/").status == 200


def test_a_client_refused_by_a_rule_is_let_in_right_after_reset(
        stacks: dict[str, Stack], backend: str, front_door: str) -> None:
    stack = stacks[backend]
    client = Client(front_door_port(stack, front_door), fresh_client_address())
    assert [client.request("/admin-login").status for _ in range(3)] == [200, 200, 429]
    assert refused_by_the_rule(client, front_door)  # in its penalty: refused again
    assert sluice_admin(stack.ports.sluice, "reset", "--ip", client.source) == \
        f"reset 1 counter of {client.source}\n"
    # Let in at once, and counted afresh: the threshold again, then the penalty.
    assert [client.request("/admin-login").status for _ in range(3)] == [200, 200, 429]


@pytest.fixture(scope="module")
def second_node(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer,
                stacks: dict[str, Stack]) -> Iterator[SluiceServe]:
    """Another ``sluice serve`` on the Redis the redis stack's Sluice uses."""
    directory = tmp_path_factory.mktemp("second-node")
    with SluiceServe(rules_file(directory, "redis-b", redis_server.url)) as serve:
        yield serve


def test_with_redis_what_one_node_does_the_other_nodes_door_sees(
        stacks: dict[str, Stack], second_node: SluiceServe, front_door: str) -> None:
    stack = stacks["redis"]
    port = front_door_port(stack, front_door)
    client = Client(port, fresh_client_address())
    # A ban by hand lives in Redis: the first node refuses the very next request.
    sluice_admin(second_node.port, "ban", client.source, "--for", "1h")
    assert_refused_by_closing(client, "/", front_door)
    listed = sluice_admin(stack.ports.sluice, "bans")
    assert client.source in listed and "redis-b" in listed
    sluice_admin(second_node.port, "unban", client.source)
    assert client.request("/").status == 200

    # The first node knows the client's key over limit, and answers it
    # without asking Redis; the reset on the second node reaches that
    # knowledge within a second (refusals answered so count nothing).
    assert [client.request("/admin-login").status for _ in range(4)] == [200, 200, 429, 429]
    sluice_admin(second_node.port, "reset", "--ip", client.source)
    started = time.monotonic()
    wait_until(lambda: client.request("/admin-login").status == 200, "let in after the reset", 3)
    assert time.monotonic() - started < 2.5
    assert client.request("/admin-login").status == 200  # the second of its two requests

    # A network ban: copied by the first node within a second.
    network = f"127.9.{next(_networks)}.0/30"
    inside = Client(port, network.replace(".0/30", ".1"))
    sluice_admin(second_node.port, "ban", network, "--for", "10m")
    started = time.monotonic()
    wait_until(lambda: closed(inside, front_door), "the network ban seen by the first node", 3)
    assert time.monotonic() - started < 2.5
    sluice_admin(second_node.port, "unban", network)
    wait_until(lambda: not closed(inside, front_door), "the lift seen by the first node", 3)
    assert inside.request("/").status == 200


def test_with_redis_a_tier_set_on_one_node_holds_at_the_other_nodes_door(
        stacks: dict[str, Stack], second_node: SluiceServe, front_door: str) -> None:
    client = Client(front_door_port(stacks["redis"], front_door), fresh_client_address())
    key = {"X-Api-Key": f"key-{uuid.uuid4().hex}"}

    def admitted(times: int) -> list[int]:
        """``times`` requests of the key on a path of their own: a count of its own."""
        path = f"/admin-metered/{uuid.uuid4().hex}"
        return [client.request(path, headers=key).status for _ in range(times)]

    assert admitted(2) == [200, 429]  # free: the rule's own 1
    assert sluice_admin(second_node.port, "tier", "set", key["X-Api-Key"], "pro") == "assigned to tier pro\n"
    started = time.monotonic()
    wait_until(lambda: admitted(2) == [200, 200], "the first node reading the assignment", 3)
    assert time.monotonic() - started < 2.5
    assert admitted(4) == [200, 200, 200, 429]
    assert sluice_admin(second_node.port, "tier", "unset", key["X-Api-Key"]) == "removed the run-time assignment\n"
    wait_until(lambda: admitted(2) == [200, 429], "the first node reading the removal", 3)


# --------------------------------------------------------------------------
# Each node's copy of the admin slot, on a single Redis and on a Redis
# Cluster (sidecar.store.redis_admin)
# --------------------------------------------------------------------------

NOW = 1_000_000.0
ADDRESS = "192.0.2.7"


@pytest.fixture(scope="module")
def lone_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis no running Sluice uses. The stacks' nodes read the admin slot
    on the real clock: at each new admin version they drop from the
    networks' index every ban ended by then, and a ban given at ``NOW``
    (1970) has ended for them."""
    server = RedisServer(tmp_path_factory.mktemp("lone-redis"))
    server.start(move=True)
    yield server
    server.stop()


@pytest.fixture(params=["redis", "cluster"])
def two_nodes(request: pytest.FixtureRequest, lone_redis: RedisServer):
    """Makes two nodes' stores on one shared Redis (in the test's loop)."""
    from sidecar.store.redis import RedisStore
    from sidecar.store.redis_cluster import parse_node

    if request.param == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        nodes = [parse_node(address) for address in cluster.addresses]
        return lambda: [RedisStore.from_url("redis://", name, server_time=False, cluster=nodes[i:i + 1],
                                            clock=lambda: NOW) for i, name in enumerate("ab")]
    lone_redis.client().flushdb()
    return lambda: [RedisStore.from_url(lone_redis.url, name, server_time=False, clock=lambda: NOW)
                    for name in "ab"]


def over_limit_check():
    from sidecar.limiters.window import WindowCounter
    from sidecar.state import Check

    return Check.of("w", (("w", ("ip",)), ADDRESS), WindowCounter(1, 60.0, 30.0), 1.0, True)


def test_a_node_copies_what_another_changed_when_it_asks_and_empties_its_cache_of_penalties(two_nodes) -> None:
    import asyncio
    import ipaddress

    from sidecar.counters import KeySelection

    async def test() -> list:
        a, b = two_nodes()
        try:
            seen = []
            check = over_limit_check()
            await b.admin.refresh(NOW)  # b's first look: nothing yet
            for at in (0, 1):
                await b.evaluate(NOW + at, ADDRESS, [check])
            seen.append(len(b.penalties))  # b answers the key itself now
            await a.ban_network(NOW, "198.51.100.0/24", 600.0, "range")
            member = ipaddress.ip_address("198.51.100.9")
            seen.append(b.network_bans.find(member, NOW + 2))  # not asked yet
            await b.admin.refresh(NOW + 2)
            seen.append((b.network_bans.find(member, NOW + 2).reason, len(b.penalties)))
            for at in (3, 4):
                await b.evaluate(NOW + at, ADDRESS, [check])
            await a.reset_keys(NOW + 5, await a.find_keys(NOW + 5, KeySelection(address=ADDRESS)))
            await b.admin.refresh(NOW + 5)
            seen.append((len(b.penalties), (await b.evaluate(NOW + 5, ADDRESS, [check])).hits[0].over_limit))
            await a.lift_network_ban(NOW + 6, "198.51.100.0/24")
            await b.admin.refresh(NOW + 6)
            seen.append(b.network_bans.find(member, NOW + 6))
            return seen
        finally:
            await a.close()
            await b.close()
    assert asyncio.run(test()) == [1, None, ("range", 0), (0, False), None]


def test_a_node_asks_every_interval_once_open(two_nodes) -> None:
    """Once open, a node copies another's change without being asked, and
    goes on asking every interval (0.05 s here: about ten asks in half a
    second, where the default interval would make none)."""
    import asyncio
    import ipaddress

    async def test() -> int:
        a, b = two_nodes()
        b.admin.interval = 0.05
        asks = 0
        read = b.admin._read

        async def counted(*args: object) -> object:
            nonlocal asks
            asks += 1
            return await read(*args)

        b.admin._read = counted
        try:
            await b.open()
            await a.ban_network(NOW, "203.0.113.0/24", 600.0, "")
            started = time.monotonic()
            member = ipaddress.ip_address("203.0.113.1")
            while b.network_bans.find(member, NOW) is None:
                # A bound for a machine busy with other work, far above the interval.
                if time.monotonic() - started >= 10:
                    # What the store holds now beside what b last read, to tell why.
                    held = await a._admin_state(NOW, "*", "*")
                    raise AssertionError(("the network ban was not copied", asks, b.admin.watching,
                                          b.admin._version, held))
                await asyncio.sleep(0.01)
            copied = asks
            await asyncio.sleep(0.5)
            return asks - copied
        finally:
            await a.close()
            await b.close()
    assert asyncio.run(test()) >= 3


def test_the_last_copy_stays_in_force_while_redis_does_not_answer(tmp_path: Path, caplog) -> None:
    import asyncio
    import ipaddress
    import logging

    from sidecar.store import StoreUnavailable
    from sidecar.store.redis import RedisStore

    caplog.set_level(logging.WARNING, logger="sluice")
    server = RedisServer(tmp_path / "redis")
    server.start(move=True)

    async def test() -> tuple:
        a, b = (RedisStore.from_url(server.url, name, server_time=False, clock=lambda: NOW) for name in "ab")
        b.admin.interval = 0.01
        try:
            await b.open()
            await a.ban_network(NOW, "198.51.100.0/24", 600.0, "")
            await b.admin.refresh(NOW)
            server.stop()
            with pytest.raises(StoreUnavailable):
                await b.admin.refresh(NOW, force=True)
            started = time.monotonic()
            while "could not read the network bans" not in caplog.text:  # the watch's ask failed too
                assert time.monotonic() - started < 5, "the watch did not ask"
                await asyncio.sleep(0.01)
            return b.network_bans.find(ipaddress.ip_address("198.51.100.1"), NOW + 1) is not None, \
                b.admin.watching
        finally:
            await a.close()
            await b.close()
    try:
        assert asyncio.run(test()) == (True, True)
    finally:
        server.stop()


# --------------------------------------------------------------------------
# Tier assignments made at run time, in the admin slot
# --------------------------------------------------------------------------


async def until(condition, what: str, seconds: float = 2.0) -> None:
    """Wait for ``condition`` in the loop, failing after ``seconds``."""
    import asyncio

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        await asyncio.sleep(0.01)


def test_a_tier_assigned_on_one_node_reaches_the_other_within_the_watch_interval(two_nodes) -> None:
    import asyncio

    async def test() -> tuple:
        a, b = two_nodes()
        b.admin.interval = 0.05
        try:
            await b.open()
            held = b.tier_assignments  # bound once, as the engine binds it
            await a.assign_tier("key-1", "pro")
            acting = a.tier_assignments.get("key-1")  # the acting node's copy, at once
            await until(lambda: held.get("key-1") == "pro", "node b's copy has the assignment")
            await a.assign_tier("sub|ünïcødé", "free")
            await until(lambda: held.get("sub|ünïcødé") == "free", "node b's copy has the second")
            listed = await b.assigned_tiers()
            removed = await a.unassign_tier("key-1")
            await until(lambda: "key-1" not in held, "node b's copy lost the removed assignment")
            return acting, listed, removed, await b.unassign_tier("key-1"), dict(held.items()), \
                await a.assigned_tiers()
        finally:
            await a.close()
            await b.close()
    assert asyncio.run(test()) == ("pro", {"key-1": "pro", "sub|ünïcødé": "free"}, True, False,
                                   {"sub|ünïcødé": "free"}, {"sub|ünïcødé": "free"})


def test_a_node_reads_the_assignments_again_only_when_they_changed(two_nodes) -> None:
    import asyncio

    async def test() -> list:
        a, b = two_nodes()
        replies: list = []
        read = b.admin._read

        async def recorded(now: float, known: str, known_tiers: str) -> list:
            reply = await read(now, known, known_tiers)
            replies.append(reply)
            return reply

        b.admin._read = recorded
        try:
            await a.assign_tier("key-1", "pro")
            await b.admin.refresh(NOW)
            await a.ban_network(NOW, "198.51.100.0/24", 600.0, "")
            await b.admin.refresh(NOW)  # the bans again, not the assignments
            await a.assign_tier("key-2", "free")
            await b.admin.refresh(NOW)
            # (read, the assignments sent, network bans) of each look, and b's copy
            return [(int(reply[1]), reply[3], len(reply[4:]) // 8) for reply in replies] + \
                [dict(b.tier_assignments.items())]
        finally:
            await a.close()
            await b.close()
    assert asyncio.run(test()) == [(1, ["key-1", "pro"], 0), (1, 0, 1), (1, ["key-1", "pro", "key-2", "free"], 1),
                                   {"key-1": "pro", "key-2": "free"}]


def test_the_store_refuses_one_assignment_past_the_most(two_nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from sidecar.store import redis

    monkeypatch.setattr(redis, "MAX_ASSIGNMENTS", 2)

    async def test() -> tuple:
        a, b = two_nodes()
        try:
            await a.assign_tier("key-1", "pro")
            await b.assign_tier("key-2", "pro")
            with pytest.raises(ValueError, match="holds 2 tier assignments .* remove one first") as refused:
                await a.assign_tier("key-3", "pro")
            await b.assign_tier("key-1", "free")  # a new tier for one held
            return "key-3" not in str(refused.value), await a.assigned_tiers(), "key-3" in a.tier_assignments
        finally:
            await a.close()
            await b.close()
    assert asyncio.run(test()) == (True, {"key-1": "free", "key-2": "pro"}, False)


def test_with_redis_down_a_tier_change_fails_and_every_copy_is_kept(tmp_path: Path) -> None:
    import asyncio

    from sidecar.store import StoreUnavailable
    from sidecar.store.redis import RedisStore

    server = RedisServer(tmp_path / "redis")
    server.start(move=True)

    async def test() -> tuple:
        a, b = (RedisStore.from_url(server.url, name, server_time=False, clock=lambda: NOW) for name in "ab")
        b.admin.interval = 0.01
        try:
            await b.open()
            await a.assign_tier("key-1", "pro")
            await until(lambda: b.tier_assignments.get("key-1") == "pro", "node b's copy has the assignment")
            server.stop()
            for call in (lambda: a.assign_tier("key-2", "free"), lambda: a.unassign_tier("key-1"),
                         a.assigned_tiers, lambda: b.admin.refresh(NOW, force=True)):
                with pytest.raises(StoreUnavailable):
                    await call()
            return dict(a.tier_assignments.items()), dict(b.tier_assignments.items()), b.admin.watching
        finally:
            await a.close()
            await b.close()
    try:
        assert asyncio.run(test()) == ({"key-1": "pro"}, {"key-1": "pro"}, True)
    finally:
        server.stop()
