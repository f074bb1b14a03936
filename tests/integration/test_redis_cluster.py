"""The shared backend on a real three-master Redis Cluster on loopback: the
keys of many clients spread over every master, and a random trace is
decided exactly as a single Redis decides it.

Engines share a fake clock passed to the scripts (``server_time=False``).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess

import pytest

from sidecar.engine import ALLOW, CLOSE, DENY, Engine
from sidecar.request import CheckRequest
from sidecar.store.memory import MemoryStore
from sidecar.store.redis import RedisStore, ban_key, counting_key
from sidecar.store.redis_cluster import key_slot, parse_node
from tests.integration.redis_server import RedisCluster, RedisServer
from tests.unit.conftest import FakeClock, ruleset_from

pytestmark = pytest.mark.integration


def cluster_store(cluster: RedisCluster, node: str = "a") -> RedisStore:
    # One node named: the others are learnt from its slot map.
    return RedisStore.from_url("redis://", node, server_time=False, cluster=[parse_node(cluster.addresses[1])])


def request(e: Engine, ip: str, path: str = "/", headers: dict | None = None) -> CheckRequest:
    return CheckRequest("GET", "example.com", path, dict(headers or {}), e.resolve_client(ip, None), "r")


SPREAD = """\
rules:
  - id: per-ip
    key: [ip]
    limit: {requests: 100, per: 60s}
    action: block
  - id: per-page
    key: [ip, path]
    limit: {tokens: 10, refill: 1/s}
    action: block
  - id: per-key
    key: ["header:x-api-key"]
    limit: {requests: 100, per: 60s}
    action: ban
    ban: {duration: 10m}
"""


def test_the_keys_of_many_clients_spread_over_every_master(redis_cluster: RedisCluster) -> None:
    redis_cluster.flush()
    clients = [f"198.51.{i // 250}.{i % 250}" for i in range(300)] + \
              [f"2001:db8:{i:x}::1" for i in range(300)]

    async def run() -> list[str]:
        e = Engine(ruleset_from(SPREAD), store=cluster_store(redis_cluster), clock=FakeClock())
        try:
            return [(await e.decide(request(e, ip, f"/p{i % 7}", {"x-api-key": f"k{i % 40}"}))).outcome
                    for i, ip in enumerate(clients)]
        finally:
            await e.store.close()

    assert set(asyncio.run(run())) == {ALLOW}
    per_master = [node.client().keys("sluice:*") for node in redis_cluster.nodes]
    # Two keys per client (ip; ip and path), one per API key, nothing else.
    assert sum(len(keys) for keys in per_master) == 2 * len(clients) + 40
    # Every master holds its fair share: about a third each.
    assert all(len(keys) > 0.25 * (2 * len(clients) + 40) for keys in per_master), \
        [len(keys) for keys in per_master]
    # A client's per-address keys share one slot (the slot of its ban record).
    for keys in per_master:
        for key in keys:
            if '"ip"' in key.split("]", 1)[0]:
                address = key.split("{", 1)[1].split("}", 1)[0]
                assert key_slot(key) == key_slot(ban_key(address))


# Per-client rules: every algorithm, a ban and a challenge with its
# auto-ban. On a cluster each request is one script, in its client's slot.
PER_CLIENT = """\
challenge:
  auto_ban: {challenges: 3, per: 60s, ban: 10m}
rules:
  - id: flood
    key: [ip]
    limit: {requests: 6, per: 5s}
    action: ban
    ban: {duration: 1h}
  - id: pages
    key: [ip]
    limit: {requests: 4, per: 5s}
    penalty: 3s
    action: block
  - id: fixed
    key: [ip, path]
    limit: {requests: 2, per: 3s, window: fixed}
    penalty: 2s
    action: block
  - id: paced
    key: [ip]
    limit: {rate: 5r/s, burst: 4, nodelay: true}
    action: block
  - id: tokens
    key: [ip, path]
    limit: {tokens: 3, refill: 2/s}
    action: block
  - id: gate
    match: {path: {prefix: /c}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: challenge
"""

# Rules keyed without the address too, so a request is a script in each of
# several slots at once, placed where a cluster decides as one script does:
# before every rule that refuses, and no bans. (A rule of another slot is
# counted on a cluster after a refusal, or for a banned address, and not on
# one Redis: see docs/redis.md.)
ACROSS_SLOTS = """\
rules:
  - id: watch
    key: [path]
    limit: {requests: 3, per: 2s}
    action: log
  - id: page-tokens
    key: [path]
    limit: {tokens: 4, refill: 1/s}
    action: log
  - id: pages
    key: [ip]
    limit: {requests: 4, per: 5s}
    penalty: 3s
    action: block
  - id: fixed
    key: [ip, path]
    limit: {requests: 2, per: 3s, window: fixed}
    action: block
  - id: paced
    key: [ip]
    limit: {rate: 5r/s, burst: 4, nodelay: true}
    action: block
"""


# Per-client rules that react to behaviour: short bans that escalate, and
# a challenge whose unsolved penalties ban.
REACTING = """\
challenge:
  auto_ban: {challenges: 6, per: 10s, ban: 3s}
rules:
  - id: flood
    key: [ip]
    limit: {requests: 6, per: 5s}
    action: ban
    ban: {duration: 1s, increment: {factor: 2, max: 6s, remember: 20s}}
  - id: gate
    match: {path: {prefix: /c}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    penalty: 1s
    action: challenge
    challenge: {then_ban_after: 2}
"""


@pytest.mark.parametrize("rules, seen", [
    (PER_CLIENT, ({ALLOW, DENY, CLOSE}, {"flood", "pages", "fixed", "gate"})),
    (ACROSS_SLOTS, ({ALLOW, DENY}, {"watch", "pages", "fixed"})),
    (REACTING, ({ALLOW, DENY, CLOSE}, {"flood", "gate"})),
], ids=["per-client", "across-slots", "reacting"])
def test_a_random_trace_is_decided_as_a_single_redis_decides_it(redis_cluster: RedisCluster,
                                                                redis_server: RedisServer, rules: str,
                                                                seen: tuple[set, set]) -> None:
    redis_cluster.flush()
    redis_server.client().flushdb()
    rng = random.Random(5)
    trace = [(rng.choice(["192.0.2.1", "2001:db8::1"]), rng.choice(["/a", "/b", "/c"]),
              rng.choice([0.0, 0.0, 0.05, 0.2, 0.4, 1.3, 2.9, 7.0]))
             for _ in range(400)]

    async def run() -> list[list[tuple]]:
        clock = FakeClock()
        ruleset = ruleset_from(rules)
        engines = [Engine(ruleset, store=cluster_store(redis_cluster), clock=clock),
                   Engine(ruleset, store=RedisStore.from_url(redis_server.url, "a", server_time=False),
                          clock=clock),
                   Engine(ruleset, store=MemoryStore(1000, "a", clock), clock=clock)]
        decisions: list[list[tuple]] = [[], [], []]
        for ip, path, step in trace:
            clock.advance(step)
            for e, into in zip(engines, decisions):
                decision = await e.decide(request(e, ip, path))
                into.append((decision.outcome, decision.rule.id if decision.rule else None,
                             decision.retry_after, decision.reset))
        for e in engines:
            await e.store.close()
        return decisions

    on_cluster, on_redis, in_memory = asyncio.run(run())
    assert on_cluster == on_redis == in_memory
    # The trace exercises what it is meant to.
    outcomes, rules_seen = seen
    assert {outcome for outcome, *_ in on_cluster} == outcomes
    assert rules_seen <= {rule for _, rule, *_ in on_cluster}
    # And the keys without an address were in other slots than the clients'.
    watch = counting_key((("watch", ("path",)), "/a"))
    assert all(key_slot(watch) != key_slot(ban_key(ip)) for ip in ("192.0.2.1", "2001:db8::/64"))


BUDGET = """\
rules:
  - id: per-key
    key: ["header:x-k"]
    limit: {requests: 200, per: 60s}
    action: block
  - id: per-ip
    key: [ip]
    limit: {requests: 100000, per: 60s}
    action: block
"""


def test_a_burst_on_one_key_admits_exactly_its_budget(redis_cluster: RedisCluster) -> None:
    """800 decisions at once, each a script on two masters."""
    redis_cluster.flush()

    async def run() -> tuple[list[str], float]:
        e = Engine(ruleset_from(BUDGET), store=cluster_store(redis_cluster), clock=FakeClock())
        try:
            decisions = await asyncio.gather(*(
                e.decide(request(e, f"203.0.113.{i % 200}", headers={"x-k": "one"})) for i in range(800)))
            return [decision.outcome for decision in decisions], e.metrics.store_errors.value
        finally:
            await e.store.close()

    outcomes, store_errors = asyncio.run(run())
    assert (outcomes.count(ALLOW), outcomes.count(DENY), store_errors) == (200, 600, 0)


PER_IP = SPREAD.split("  - id: per-key")[0]


def reshard(cluster: RedisCluster, source: str, target: str) -> None:
    """3000 slots, with their keys, from one master to another."""
    subprocess.run([shutil.which("redis-cli") or "/usr/bin/redis-cli", "--cluster", "reshard",
                    cluster.addresses[0], "--cluster-from", source, "--cluster-to", target,
                    "--cluster-slots", "3000", "--cluster-yes"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)


def test_slots_moved_to_another_master_are_followed(redis_cluster: RedisCluster) -> None:
    """Slots resharded while Sluice runs: its map is stale, Redis answers
    MOVED, and the store follows without a failed decision; the counts
    moved with their keys."""
    redis_cluster.flush()
    redis_cluster.nodes[0].client().config_resetstat()
    clients = [f"198.51.100.{i}" for i in range(200)]
    ids = [node.client().execute_command("CLUSTER", "MYID") for node in redis_cluster.nodes]

    async def run() -> tuple[list[str], list[str], float]:
        e = Engine(ruleset_from(PER_IP), store=cluster_store(redis_cluster), clock=FakeClock())
        try:
            first = [(await e.decide(request(e, ip))).outcome for ip in clients]
            await asyncio.to_thread(reshard, redis_cluster, ids[0], ids[1])
            # Each client once more, and its count carried over: the per-ip
            # rule's quota is its threshold less two.
            e.ruleset = ruleset_from("headers: draft\n" + PER_IP)
            second = [await e.decide(request(e, ip)) for ip in clients]
            return first, [d.quota[1] if d.quota else "" for d in second], e.metrics.store_errors.value
        finally:
            await e.store.close()

    try:
        first, quotas, store_errors = asyncio.run(run())
    finally:
        reshard(redis_cluster, ids[1], ids[0])  # as the other tests found it
    assert set(first) == {ALLOW} and store_errors == 0
    assert all("per-ip" in quota and "r=98" in quota for quota in quotas), quotas[:3]
    # The old master did answer MOVED for the slots it gave away.
    errors = redis_cluster.nodes[0].client().info("errorstats")
    assert errors.get("errorstat_MOVED", {}).get("count", 0) > 0, errors
