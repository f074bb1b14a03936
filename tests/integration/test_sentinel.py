"""Redis Sentinel on real servers: a master, one replica and three
sentinels on loopback, Sluice started by the test stack with
``state.sentinel``, steady traffic of checks straight to Sluice and through
nginx, and then the master fails over (``SENTINEL FAILOVER``) or is killed.

Every check is answered promptly and none gets a 5xx; decisions move to
the new master within seconds, and the counts carry on there from what
was replicated to it. What the switch costs is measured and printed: the
checks that failed open, and the counts the new master never saw
(decisions the old master made after the replica's promotion).

The rule is a token bucket no test empties, read after every decision
(``check_load.COUNTED_RULES``): each answer says whether Redis decided it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.launcher import Stack
from sidecar.store.redis import DEFAULT_TIMEOUT
from tests.integration.check_load import COUNTED_RULES, COUNTED_TOKENS, CheckLoad, percentile, remaining
from tests.integration.conftest import sluice_metric, start_stack, wait_until
from tests.integration.redis_server import RedisServer, SentinelGroup

pytestmark = pytest.mark.integration

CHECK_CLIENTS = 16
DOOR_CLIENTS = 2
# Beyond the store's timeout, what a check may take on the 2-core test
# machine running five Redis processes, nginx, Envoy, Sluice and the
# clients (see docs/redis.md).
LATENCY_SLACK = 0.25
# From the failover (or the kill) until the sentinels name the new master:
# Sentinel's own time to notice (down-after-milliseconds 400) and to agree,
# which a split vote puts off by twice the failover-timeout (2 s) each time.
SENTINEL_SECONDS = 20.0
# From then until the new master decides: Sluice's own part, asking the
# sentinels again and reconnecting.
SWITCH_SECONDS = 5.0
# Decisions a replica may not have received when its master dies: the
# replication stream of a few milliseconds.
REPLICATION_LAG = 50


def evaluations(server: RedisServer) -> int:
    """Scripts the server ran for clients (a replica applies its master's
    writes, not EVALSHA calls)."""
    stats = server.client().info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)) - int(stats.get("failed_calls", 0))


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    group = SentinelGroup(tmp_path / "redis")
    group.start()
    yield group
    group.stop()


@pytest.fixture
def sentinel_stack(tmp_path: Path, group: SentinelGroup) -> Iterator[Stack]:
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"state:\n  backend: redis\n  fail: open\n"
                     f"  sentinel: {{master: {group.MASTER}, nodes: {group.nodes}}}\n" + COUNTED_RULES)
    stack = start_stack(tmp_path / "stack", rules)
    yield stack
    stack.stop()


@pytest.mark.parametrize("switch", ["failover", "kill"])
def test_a_failover_moves_decisions_to_the_new_master_and_counting_carries_on(
        group: SentinelGroup, sentinel_stack: Stack, switch: str) -> None:
    old, new = group.servers
    check_headers = {"X-Sluice-Client-Addr": "10.90.0.1", "x-k": "one-budget"}
    with CheckLoad(sentinel_stack.ports.sluice, CHECK_CLIENTS, check_headers) as checks, \
            CheckLoad(sentinel_stack.ports.nginx, DOOR_CLIENTS, {"x-k": "one-budget"}, path="/sentinel") as door:
        wait_until(lambda: checks.count() >= 1000 and door.count() >= 50, "checks before the switch", 20)
        switched = time.monotonic()
        if switch == "failover":
            group.sentinels[0].client().sentinel_failover(group.MASTER)
        else:
            old.kill()
        wait_until(lambda: group.master() is new, "the sentinels naming the new master", SENTINEL_SECONDS)
        wait_until(lambda: evaluations(new) > 0, "decisions by the new master", SWITCH_SECONDS)
        moved = time.monotonic()
        wait_until(lambda: sum(a.sent > moved for a in checks.answers()) >= 1000, "checks after the switch", 20)
        store_errors = sluice_metric(sentinel_stack, "sluice_store_errors_total")
        internal_errors = sluice_metric(sentinel_stack, "sluice_internal_errors_total")
    answers = checks.answers() + door.answers()
    before = [remaining(a) for a in answers if a.answered < switched and remaining(a) is not None]
    failed_open = [a for a in answers if remaining(a) is None]
    # The first decisions of the new master: after it was seen deciding.
    on_new = [remaining(a) for a in answers if a.sent > moved and remaining(a) is not None]
    # A token handed out twice was taken on the old master after the new
    # one had its copy: a count the switch lost.
    handed_out = collections.Counter(remaining(a) for a in answers if remaining(a) is not None)
    lost = sum(times - 1 for times in handed_out.values())
    latencies = [a.took for a in answers]
    during = sum(switched <= a.sent < moved for a in answers) / (moved - switched)
    print(f"\n{switch}: {during:.0f} checks/s during the switch; "
          f"{len(failed_open)} of {len(answers)} checks failed open, the last "
          f"{max((a.answered for a in failed_open), default=switched) - switched:.2f} s after the switch began; "
          f"the new master decided {moved - switched:.2f} s after it, from {COUNTED_TOKENS - max(on_new)} tokens spent "
          f"({COUNTED_TOKENS - min(before)} when the switch began); counts lost: {lost}; "
          f"latency max {max(latencies) * 1000:.0f} ms, p99 {percentile(latencies, 0.99) * 1000:.0f} ms")

    assert {a.status for a in answers} == {200}  # no 5xx, every check answered
    assert max(latencies) <= DEFAULT_TIMEOUT + LATENCY_SLACK
    assert all(a.answered < moved + 1.0 for a in failed_open)  # recovered
    assert store_errors == len(failed_open) and internal_errors == 0
    # The new master went on from the old one's count, not from a full
    # bucket: the state was replicated (all but what the replica had not
    # received yet when the master died).
    assert COUNTED_TOKENS - max(on_new) >= COUNTED_TOKENS - min(before) - REPLICATION_LAG


def test_tier_assignments_reach_every_node_and_survive_a_failover(group: SentinelGroup) -> None:
    """Through the sentinels' master: one node assigns, the other's copy has
    it within its watch interval; the assignments were replicated, and the
    new master takes the next one."""
    import asyncio

    from sidecar.config import SentinelConfig
    from sidecar.store import StoreUnavailable
    from sidecar.store.redis import RedisStore
    from sidecar.store.redis_admin import TIERS
    from sidecar.store.sentinel import sentinel_client

    config = SentinelConfig.model_validate({"master": group.MASTER, "nodes": group.nodes})

    async def until(condition, what: str, seconds: float = SWITCH_SECONDS) -> None:
        deadline = time.monotonic() + seconds
        while not await condition():
            assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
            await asyncio.sleep(0.02)

    async def test() -> tuple:
        a, b = (RedisStore(sentinel_client(config, 1.0), name, server_time=False) for name in "ab")
        b.admin.interval = 0.05
        try:
            await b.open()
            await a.assign_tier("key-1", "pro")

            async def copied(identity: str) -> bool:
                return b.tier_assignments.get(identity) is not None

            await until(lambda: copied("key-1"), "node b's copy has the assignment")
            old = group.master()
            assert old.client().wait(1, 5000) == 1  # the replica has it
            group.sentinels[0].client().sentinel_failover(group.MASTER)

            async def assigned() -> bool:
                try:
                    await a.assign_tier("key-2", "free")
                except StoreUnavailable:
                    return False
                # Written to the new master (not to the old one as it was demoted).
                new = group.master()
                return new is not old and new.client().hget(TIERS, "key-2") == "free"

            await until(assigned, "an assignment taken by the new master")
            await until(lambda: copied("key-2"), "node b's copy has the assignment made on the new master")
            return dict(b.tier_assignments.items()), await b.assigned_tiers()
        finally:
            await a.close()
            await b.close()
    held = {"key-1": "pro", "key-2": "free"}
    assert asyncio.run(test()) == (held, held)
