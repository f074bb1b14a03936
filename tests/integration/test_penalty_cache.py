"""Keys over limit on the shared store are answered on the node until their
wait ends, without a round trip (sidecar/store/penalties.py): counted with
a real redis-server's own command statistics."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.engine import ALLOW, CLOSE, DENY, Engine
from sidecar.request import CheckRequest
from sidecar.store.redis import RedisStore, shadow_ban_key
from tests.integration.redis_server import RedisServer
from tests.unit.conftest import FakeClock, ruleset_from

pytestmark = pytest.mark.integration

RULES = """\
rules:
  - id: watch
    match: {path: {prefix: /watched}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: log
  - id: api
    key: [ip]
    limit: {requests: 3, per: 10s}
    action: block
  - id: scrapers
    match: {path: {prefix: /scrape}}
    key: [ip, path]
    limit: {requests: 2, per: 60s}
    action: ban
    ban: {duration: 1h}
"""


def make_engine(redis_server: RedisServer, clock: FakeClock) -> Engine:
    ruleset = ruleset_from(f"state: {{backend: redis, url: '{redis_server.url}'}}\n" + RULES)
    return Engine(ruleset, store=RedisStore.from_url(redis_server.url, "a", server_time=False), clock=clock)


def round_trips(redis_server: RedisServer) -> int:
    stats = redis_server.client().info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def request(e: Engine, ip: str, path: str = "/") -> CheckRequest:
    return CheckRequest("GET", "example.com", path, {}, e.resolve_client(ip, None), "r")


def test_a_client_in_penalty_is_refused_without_a_round_trip_until_it_ends(redis_server: RedisServer) -> None:
    redis_server.client().flushdb()

    async def run() -> tuple[list[str], int, list[tuple[str, int]], int, str, int]:
        clock = FakeClock()
        e = make_engine(redis_server, clock)
        first = [(await e.decide(request(e, "192.0.2.1"))).outcome for _ in range(4)]
        before = round_trips(redis_server)
        during = []
        for _ in range(50):
            clock.advance(0.1)
            decision = await e.decide(request(e, "192.0.2.1"))
            during.append((decision.outcome, decision.retry_after))
        trips_during = round_trips(redis_server) - before
        clock.advance(6)  # the 10 s penalty started with the third request
        after = (await e.decide(request(e, "192.0.2.1"))).outcome
        trips_after = round_trips(redis_server) - before
        return first, trips_during, during, trips_after, after, int(e.store.gauges()[
            "sluice_penalty_cache_answers_total"][1]())

    first, trips_during, during, trips_after, after, answered = asyncio.run(run())
    assert first == [ALLOW, ALLOW, ALLOW, DENY]
    assert trips_during == 0 and answered == 50
    assert {outcome for outcome, _ in during} == {DENY}
    # Retry-After counts down with the penalty, as the store would say.
    assert during[0][1] == 10 and during[-1][1] == 5
    assert (trips_after, after) == (1, ALLOW)


def test_rules_that_ban_or_still_count_are_always_asked(redis_server: RedisServer) -> None:
    redis_server.client().flushdb()

    async def run() -> tuple[list[str], int, list[str], int]:
        e = make_engine(redis_server, FakeClock())
        # "watch" (log) is over limit after one request, but "api" after it
        # still counts: every request goes to the store.
        before = round_trips(redis_server)
        watched = [(await e.decide(request(e, "192.0.2.2", "/watched"))).outcome for _ in range(3)]
        watched_trips = round_trips(redis_server) - before
        # A ban rule's refusal is a ban issued on the store, and the ban
        # then answers there: nothing of it is answered from the cache.
        before = round_trips(redis_server)
        scraped = [(await e.decide(request(e, "192.0.2.3", "/scrape"))).outcome for _ in range(5)]
        return watched, watched_trips, scraped, round_trips(redis_server) - before

    watched, watched_trips, scraped, scrape_trips = asyncio.run(run())
    assert watched == [ALLOW, ALLOW, ALLOW] and watched_trips == 3
    assert scraped == [ALLOW, ALLOW, CLOSE, CLOSE, CLOSE] and scrape_trips == 5


SHADOW_RULES = """\
rules:
  - id: scrapers
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: ban
    ban: {duration: 1h}
    shadow: true
"""


def test_a_shadow_ban_is_written_once_while_it_is_in_force(redis_server: RedisServer) -> None:
    """Every request over a shadow ban rule's limit calls for the ban again;
    the shared store gets it once, and again once it has ended."""
    redis_server.client().flushdb()
    redis_server.client().config_resetstat()

    def writes() -> int:
        return int(redis_server.client().info("commandstats").get("cmdstat_hset", {}).get("calls", 0))

    async def run() -> tuple[list[str], int, int, list[str]]:
        clock = FakeClock()
        ruleset = ruleset_from(f"state: {{backend: redis, url: '{redis_server.url}'}}\n" + SHADOW_RULES)
        e = Engine(ruleset, store=RedisStore.from_url(redis_server.url, "a", server_time=False), clock=clock)
        outcomes = [(await e.decide(request(e, "192.0.2.9"))).outcome for _ in range(50)]
        await asyncio.sleep(0.2)  # the background writes
        during = writes()
        listed = [ban.address for ban in await e.active_bans() if ban.shadow]
        clock.advance(3601)  # the shadow ban has ended: the next over-limit request writes it again
        for _ in range(5):
            clock.advance(3601)
            await e.decide(request(e, "192.0.2.9"))
        await asyncio.sleep(0.2)
        return outcomes, during, writes(), listed

    outcomes, during, after, listed = asyncio.run(run())
    assert set(outcomes) == {ALLOW}
    assert listed == ["192.0.2.9"]
    # One HSET is the counter's, in the evaluation script (the first
    # request); the other the shadow ban's, once for the 49 over the limit.
    assert during == 2
    assert after > during


def test_a_shadow_ban_is_written_with_its_expiry(redis_server: RedisServer) -> None:
    """The record and its expiry are one script: a shadow ban's record never
    outlives the ban, and lifting it removes it."""
    redis_server.client().flushdb()

    async def run() -> tuple[dict, int, bool, int, str]:
        clock = FakeClock()
        ruleset = ruleset_from(f"state: {{backend: redis, url: '{redis_server.url}'}}\n" + SHADOW_RULES)
        e = Engine(ruleset, store=RedisStore.from_url(redis_server.url, "a", server_time=False), clock=clock)
        for _ in range(3):
            await e.decide(request(e, "192.0.2.9"))
        await asyncio.sleep(0.2)  # the background write
        name = shadow_ban_key("192.0.2.9")
        fields = redis_server.client().hgetall(name)
        ttl = redis_server.client().pttl(name)
        lifted = await e.lift_ban("192.0.2.9")
        return fields, ttl, lifted, redis_server.client().exists(name), e.ruleset.node

    fields, ttl, lifted, left, node = asyncio.run(run())
    assert fields == {"rule": "scrapers", "node": node, "started": fields["started"], "duration": "3600.0"}
    assert 3_590_000 < ttl <= 3_600_000
    assert lifted and left == 0
