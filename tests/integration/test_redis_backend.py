"""The shared Redis backend against a real redis-server on loopback.

Each test runs its engines in one event loop (the redis client's
connections belong to the loop that made them). Engines share a fake clock
passed to the scripts (``server_time=False``), so windows and penalties are
exact; one test uses the server's own TIME.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.engine import ALLOW, CLOSE, DENY, Engine
from sidecar.frontdoors.nginx import DenyToken
from sidecar.request import CheckRequest
from sidecar.store.memory import MemoryStore
from sidecar.store.redis import DEFAULT_TIMEOUT, RedisStore, _lua_string
from tests.integration.check_load import COUNTED_RULES, COUNTED_TOKENS, CheckLoad, percentile, remaining
from tests.integration.clients import LOOPBACK
from tests.integration.conftest import free_port, metric_at, wait_until
from tests.integration.redis_server import REDIS_SERVER, RedisServer
from tests.integration.sluice_serve import SluiceServe
from tests.unit.conftest import FakeClock, ruleset_from

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if not Path(REDIS_SERVER).exists():
        pytest.fail("redis-server is not installed (make test installs Debian's redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start(move=True)
    yield server
    server.stop()


@pytest.fixture
def url(redis_server: RedisServer) -> str:
    if not redis_server.running:  # a test before stopped it and failed before starting it again
        redis_server.start()
    redis_server.client().flushdb()
    return redis_server.url


def engine(url: str, rules: str, clock: FakeClock, node: str = "a", server_time: bool = False) -> Engine:
    ruleset = ruleset_from(f"node: {node}\nstate: {{backend: redis, url: '{url}'}}\n" + rules)
    store = RedisStore.from_url(url, node, server_time=server_time)
    return Engine(ruleset, store=store, clock=clock)


def request(e: Engine, ip: str = "192.0.2.1", path: str = "/", headers: dict | None = None) -> CheckRequest:
    return CheckRequest("GET", "example.com", path, dict(headers or {}), e.resolve_client(ip, None), "r")


async def outcomes(e: Engine, count: int, **kwargs) -> list[str]:
    return [(await e.decide(request(e, **kwargs))).outcome for _ in range(count)]


AXIS_NOW = """\
rules:
  - id: api-key
    match: {header: {name: x-api-key, present: true}}
    key: [ip, "header:x-api-key"]
    limit: {requests: 2, per: 10s, window: fixed}
    action: block
"""


def test_axis_now_example_only_key_a_third_request_is_refused(url: str) -> None:
    async def run() -> list[str]:
        e = engine(url, AXIS_NOW, FakeClock())
        keys = ["A", "A", "B", "A", "B"]
        return [(await e.decide(request(e, headers={"x-api-key": k}))).outcome for k in keys]
    assert asyncio.run(run()) == [ALLOW, ALLOW, ALLOW, DENY, ALLOW]


def test_server_time_counts_too(url: str) -> None:
    async def run() -> list[str]:
        e = engine(url, AXIS_NOW, FakeClock(), server_time=True)
        return await outcomes(e, 3, headers={"x-api-key": "A"})
    assert asyncio.run(run()) == [ALLOW, ALLOW, DENY]


SLIDING = """\
rules:
  - id: pages
    key: [ip]
    limit: {requests: 3, per: 10s}
    penalty: 30s
    action: block
"""


def test_threshold_reaching_request_is_allowed_and_starts_the_penalty(url: str) -> None:
    async def run() -> tuple[list[str], list[str], list[str], int]:
        clock = FakeClock(1000.0)
        e = engine(url, SLIDING, clock)
        first = await outcomes(e, 4)
        clock.advance(29.9)
        during = await outcomes(e, 1)
        deny = await e.decide(request(e))
        clock.advance(0.2)
        after = await outcomes(e, 1)
        return first, during, after, deny.retry_after
    first, during, after, retry_after = asyncio.run(run())
    assert first == [ALLOW, ALLOW, ALLOW, DENY]
    assert during == [DENY] and retry_after == 1
    assert after == [ALLOW]


def test_sliding_estimate_is_compared_as_a_real_number(url: str) -> None:
    # Threshold 4. Three requests in the window [1000, 1010); at 1012.5 they
    # weigh 3 * 0.75 = 2.25: the first request there estimates 3.25 (under),
    # the second 4.25 (reaches it: allowed, and the penalty starts).
    async def run() -> list[str]:
        clock = FakeClock(1005.0)
        e = engine(url, SLIDING.replace("requests: 3", "requests: 4"), clock)
        result = await outcomes(e, 3)
        clock.now = 1012.5
        return result + await outcomes(e, 3)
    assert asyncio.run(run()) == [ALLOW] * 5 + [DENY]


BAN = """\
rules:
  - id: flood
    key: [ip]
    limit: {requests: 2, per: 10s}
    action: ban
    ban: {duration: 1h}
"""


def test_a_ban_issued_by_one_node_is_seen_by_another(url: str, redis_server: RedisServer) -> None:
    async def run() -> tuple[list[str], list[str], list[str], list, bool, list[str]]:
        clock = FakeClock()
        a, b = engine(url, BAN, clock, node="a"), engine(url, BAN, clock, node="b")
        on_a = await outcomes(a, 3)
        on_b = await outcomes(b, 1)
        other = await outcomes(b, 1, ip="192.0.2.2")
        bans = await b.active_bans()
        lifted = await b.lift_ban("192.0.2.1")
        after = await outcomes(a, 1)
        return on_a, on_b, other, bans, lifted, after
    on_a, on_b, other, bans, lifted, after = asyncio.run(run())
    assert on_a == [ALLOW, ALLOW, CLOSE]
    assert on_b == [CLOSE] and other == [ALLOW]
    assert [(ban.address, ban.rule_id, ban.node, ban.duration) for ban in bans] == [
        ("192.0.2.1", "flood", "a", 3600.0)]
    assert bans[0].expires == pytest.approx(1000.0 + 3600.0)
    # Issuing the ban cleared the triggering key: the first request after
    # the ban is lifted counts from zero.
    assert lifted and after == [ALLOW]


SCORE = """\
rules:
  - id: not-found
    key: [ip]
    limit: {requests: 2, per: 10s}
    count_on: {status: [404]}
    action: block
"""


def test_response_phase_counts_arrive_through_record(url: str) -> None:
    async def run() -> list[str]:
        clock = FakeClock()
        a, b = engine(url, SCORE, clock, node="a"), engine(url, SCORE, clock, node="b")
        seen = []
        for node in (a, b):
            decision = await node.decide(request(node))
            seen.append(decision.outcome)
            assert decision.pending is not None
            assert await node.record_response(decision.pending, 404, {}) == 1
        seen += await outcomes(a, 1)
        return seen
    assert asyncio.run(run()) == [ALLOW, ALLOW, DENY]


def test_two_engines_share_one_budget(url: str) -> None:
    async def run() -> list[str]:
        clock = FakeClock()
        a, b = engine(url, SLIDING, clock, node="a"), engine(url, SLIDING, clock, node="b")
        return [(await node.decide(request(node))).outcome for node in (a, b, a, b)]
    assert asyncio.run(run()) == [ALLOW, ALLOW, ALLOW, DENY]


def test_every_key_expires(url: str, redis_server: RedisServer) -> None:
    async def run() -> None:
        e = engine(url, BAN + SLIDING.replace("rules:\n", ""), FakeClock())
        await outcomes(e, 3)
        await outcomes(e, 2, ip="192.0.2.7", path="/x")
    asyncio.run(run())
    client = redis_server.client()
    keys = client.keys("*")
    assert keys and all(key.startswith("sluice:") for key in keys)
    assert all(client.pttl(key) > 0 for key in keys), {key: client.pttl(key) for key in keys}


def test_a_window_key_is_written_and_given_its_expiry_only_when_they_change(url: str,
                                                                              redis_server: RedisServer) -> None:
    rules = """\
rules:
  - id: api
    key: [ip]
    limit: {requests: 100, per: 10s, window: fixed}
    action: block
"""
    client = redis_server.client()
    client.config_resetstat()

    async def run(clock: FakeClock) -> None:
        e = engine(url, rules, clock)
        await outcomes(e, 20)  # one window
        clock.advance(10)
        await outcomes(e, 5)  # the next one

    clock = FakeClock()
    asyncio.run(run(clock))
    stats = client.info("commandstats")
    key = client.keys("sluice:*:count:*")[0]
    # One expiry per window the key was counted in, and it still holds:
    # the end of the second window.
    assert stats["cmdstat_pexpire"]["calls"] == 2
    assert stats["cmdstat_hset"]["calls"] == 25
    assert client.hget(key, "c") == "5" and 0 < client.pttl(key) <= 10_000


CHALLENGE = """\
challenge:
  auto_ban: {challenges: 2, per: 60s, ban: 10m}
rules:
  - id: gate
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: challenge
"""


def test_challenges_past_the_auto_ban_threshold_ban_the_address(url: str) -> None:
    async def run() -> list[str]:
        e = engine(url, CHALLENGE, FakeClock())
        return await outcomes(e, 5)
    # 1 allowed (it reaches the threshold), 2 challenges, then the ban.
    assert asyncio.run(run()) == [ALLOW, DENY, DENY, CLOSE, CLOSE]


def test_same_decisions_as_the_memory_store(url: str) -> None:
    """One random trace through MemoryStore and RedisStore on the same clock."""
    rules = BAN.replace("requests: 2", "requests: 9") + SLIDING.replace("rules:\n", "") + """\
  - id: fixed
    key: [ip, path]
    limit: {requests: 2, per: 3s, window: fixed}
    penalty: 2s
    action: block
  - id: watch
    key: [path]
    limit: {requests: 3, per: 2s}
    action: log
"""
    rng = random.Random(7)
    trace = [(rng.choice(["192.0.2.1", "192.0.2.2", "192.0.2.3"]), rng.choice(["/a", "/b"]),
              rng.choice([0.0, 0.05, 0.4, 1.3, 2.9])) for _ in range(300)]

    async def run() -> tuple[list, list]:
        clock = FakeClock()
        shared = engine(url, rules, clock)
        local = Engine(shared.ruleset, store=MemoryStore(1000, "a", clock), clock=clock)
        got, expected = [], []
        for ip, path, step in trace:
            clock.advance(step)
            for e, into in ((shared, got), (local, expected)):
                decision = await e.decide(request(e, ip=ip, path=path))
                into.append((decision.outcome, decision.rule.id if decision.rule else None,
                             decision.retry_after))
        return got, expected
    got, expected = asyncio.run(run())
    assert got == expected
    assert {outcome for outcome, _, _ in got} == {ALLOW, DENY, CLOSE}


BUCKETS = """\
headers: draft
rules:
  - id: paced
    key: [ip]
    limit: {rate: 5r/s, burst: 4, delay: 1}
    action: block
  - id: minute
    match: {path: {prefix: /a}}
    key: [ip, path]
    limit: {rate: 6r/m, burst: 2, nodelay: true}
    penalty: 2s
    action: block
  - id: tokens
    key: [path]
    limit: {tokens: 5, refill: 3/s, cost: 2}
    action: block
  - id: held
    match: {path: {prefix: /b}}
    key: [ip]
    limit: {rate: 2r/s, burst: 6}
    action: block
  - id: watch
    key: [ip]
    limit: {tokens: 3, refill: 1/s}
    penalty: 1500ms
    action: log
  - id: window
    key: [ip]
    limit: {requests: 12, per: 5s}
    penalty: 3s
    action: block
"""


class Recording:
    """A store that keeps every evaluation it answers, exact floats and all."""

    def __init__(self, store) -> None:
        self.store = store
        self.evaluations: list[tuple] = []

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def _keep(self, evaluation):
        self.evaluations.append(([(hit.over_limit, hit.retry_after) for hit in evaluation.hits],
                                 evaluation.delay, evaluation.new_ban))
        return evaluation

    async def evaluate(self, *args, **kwargs):
        return self._keep(await self.store.evaluate(*args, **kwargs))


def test_buckets_make_the_same_decisions_as_the_memory_store(url: str) -> None:
    """A random trace through MemoryStore and RedisStore on the same clock:
    leaky buckets (delay and nodelay, r/s and r/m, an explicit penalty),
    token buckets, several bucket rules on one request, a full wait queue
    now and then, and the draft headers. Outcomes, hits with their exact
    retry times, exact delays and the RateLimit fields must all be equal."""
    rng = random.Random(11)
    trace = [(rng.choice(["192.0.2.1", "192.0.2.2"]), rng.choice(["/a", "/b", "/c"]),
              rng.choice([0.0, 0.0, 0.001, 0.0305, 0.1, 0.13, 0.25, 0.6, 1.7, 4.2]),
              rng.random() < 0.15) for _ in range(500)]

    async def run() -> tuple[list, list, Recording, Recording]:
        clock = FakeClock()
        shared = engine(url, BUCKETS, clock)
        shared.store = Recording(shared.store)
        local = Engine(shared.ruleset, store=Recording(MemoryStore(1000, "a", clock)), clock=clock)
        got, expected = [], []
        for ip, path, step, queue_full in trace:
            clock.advance(step)
            for e, into in ((shared, got), (local, expected)):
                e.delayed = e.ruleset.max_delayed if queue_full else 0
                decision = await e.decide(request(e, ip=ip, path=path))
                into.append((decision.outcome, decision.rule.id if decision.rule else None,
                             decision.retry_after, decision.reset, decision.delay, decision.quota))
        return got, expected, shared.store, local.store
    got, expected, shared_store, local_store = asyncio.run(run())
    assert got == expected
    assert shared_store.evaluations == local_store.evaluations
    # The trace exercises what it is meant to.
    assert {outcome for outcome, *_ in got} == {ALLOW, DENY}
    assert {rule for outcome, rule, *_ in got if outcome == DENY} >= {"paced", "minute", "tokens", "held"}
    assert any(rule == "watch" for outcome, rule, *_ in got if outcome == ALLOW)
    delays = {delay for *_, delay, _ in got}
    assert len(delays) > 3 and 0.0 in delays
    assert all(quota is not None for outcome, *_, quota in got if outcome == ALLOW)
    # Some requests were admitted with a hold by several buckets at once.
    assert any(sum(1 for over, _ in hits if not over) >= 4 and delay > 0
               for hits, delay, _ in shared_store.evaluations)


TOKENS = """\
rules:
  - id: tokens
    key: [ip, path]
    limit: {tokens: 3, refill: 2/s}
    action: block
"""


def test_token_bucket_seed_example_shared_by_two_nodes(url: str) -> None:
    """Capacity 3, refill 2/s: three pass at once, the fourth fails, one
    more passes after half a second, wherever each request lands."""
    async def run() -> tuple[list[str], list[str], int, int]:
        clock = FakeClock()
        a, b = engine(url, TOKENS, clock, node="a"), engine(url, TOKENS, clock, node="b")
        first = [(await node.decide(request(node))).outcome for node in (a, b, a, b)]
        clock.advance(0.5)
        later = [(await node.decide(request(node))).outcome for node in (b, a)]
        decision = await a.decide(request(a))
        return first, later, decision.limit, decision.retry_after
    first, later, limit, retry_after = asyncio.run(run())
    assert first == [ALLOW, ALLOW, ALLOW, DENY]
    assert later == [ALLOW, DENY]
    assert limit == 3 and retry_after == 1


LEAKY = """\
rules:
  - id: like-nginx
    key: [ip]
    limit: {rate: 10r/s, burst: 3, delay: 1}
    action: block
"""


def test_leaky_bucket_holds_and_refuses_like_the_memory_store(url: str) -> None:
    # 10r/s: 100 ms per request. The first passes, the second is within the
    # delay, the next two are held 100 and 200 ms, the fifth is refused.
    async def run() -> tuple[list[tuple[str, float]], list[str]]:
        clock = FakeClock()
        e = engine(url, LEAKY, clock)
        decisions = [await e.decide(request(e)) for _ in range(5)]
        e.delayed = e.ruleset.max_delayed  # the wait queue is full now
        clock.advance(0.1)
        full = [(await e.decide(request(e))).outcome]
        e.delayed = 0
        full.append((await e.decide(request(e))).outcome)
        return [(d.outcome, d.delay) for d in decisions], full
    decisions, full = asyncio.run(run())
    assert decisions == [(ALLOW, 0.0), (ALLOW, 0.0), (ALLOW, 0.1), (ALLOW, 0.2), (DENY, 0.0)]
    # A request that would be held with the queue full is refused and
    # charges nothing: the next one still gets the slot.
    assert full == [DENY, ALLOW]


def test_bucket_keys_expire(url: str, redis_server: RedisServer) -> None:
    async def run() -> None:
        e = engine(url, LEAKY + TOKENS.replace("rules:\n", ""), FakeClock(), server_time=True)
        await outcomes(e, 4)
    asyncio.run(run())
    client = redis_server.client()
    keys = client.keys("*")
    assert len(keys) == 2
    ttls = {key: client.pttl(key) for key in keys}
    # The leaky key lives 60 s after its last request (like nginx), the
    # token key until it is full again (3 tokens spent at 2/s: 1.5 s; the
    # fourth request was refused by the token bucket and charged neither).
    assert sorted(ttls.values())[0] in range(1, 1501) and 59_000 < sorted(ttls.values())[1] <= 60_000, ttls


def test_fail_open_then_recover_when_redis_returns(url: str, redis_server: RedisServer) -> None:
    async def run() -> tuple[list[str], float, list[str], int, list[str]]:
        e = engine(url, AXIS_NOW, FakeClock())
        before = await outcomes(e, 1, headers={"x-api-key": "A"})
        redis_server.stop()
        started = time.monotonic()
        down = await outcomes(e, 3, headers={"x-api-key": "A"})
        took = time.monotonic() - started
        errors = e.metrics.store_errors.value
        redis_server.start()
        after = await outcomes(e, 3, headers={"x-api-key": "A"})
        return before, took, down, errors, after
    before, took, down, errors, after = asyncio.run(run())
    assert before == [ALLOW] and down == [ALLOW] * 3 and errors == 3
    assert took < 2.0
    # A fresh server has no counts: two more allowed, then refused.
    assert after == [ALLOW, ALLOW, DENY]


def test_a_stuck_redis_fails_open_within_the_timeout_and_recovers(url: str, redis_server: RedisServer) -> None:
    async def run() -> tuple[list[str], float, list[str]]:
        e = engine(url, AXIS_NOW, FakeClock())
        assert await outcomes(e, 1, headers={"x-api-key": "A"}) == [ALLOW]
        assert redis_server.process is not None
        redis_server.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            stuck = await outcomes(e, 2, headers={"x-api-key": "A"})
            took = time.monotonic() - started
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
        return stuck, took, await outcomes(e, 3, headers={"x-api-key": "B"})
    stuck, took, after = asyncio.run(run())
    assert stuck == [ALLOW, ALLOW] and took < 1.5
    # Answers come from Redis again. (Requests that timed out may have been
    # counted all the same: Redis runs what it had already received.)
    assert after == [ALLOW, ALLOW, DENY]


def test_fail_closed_refuses_with_a_503_page(url: str, redis_server: RedisServer) -> None:
    async def run():
        e = Engine(ruleset_from(f"state: {{backend: redis, url: '{url}', fail: closed}}\n" + AXIS_NOW),
                   store=RedisStore.from_url(url, "a", server_time=False), clock=FakeClock())
        redis_server.stop()
        try:
            return await e.decide(request(e, headers={"x-api-key": "A"}))
        finally:
            redis_server.start()
    decision = asyncio.run(run())
    assert decision.outcome == DENY and decision.page is not None and decision.page.status == 503
    # nginx fetches the page with the deny token; no rule made the refusal.
    assert DenyToken.decode(DenyToken.encode(decision, "192.0.2.1"))[:5] == (503, 0, 0, 1, "-")


def test_workers_of_sluice_serve_share_one_budget(url: str, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"state: {{backend: redis, url: '{url}'}}\n" + SLIDING.replace("requests: 3", "requests: 5"))
    with SluiceServe(rules, workers=3) as sluice:
        # A fresh connection per request: uvicorn's workers take turns.
        assert [sluice.get("/v1/check", {"x-forwarded-uri": "/"}) for _ in range(7)] == [200] * 5 + [429] * 2


def test_a_request_sends_one_number_per_check_and_the_rules_once(url: str, redis_server: RedisServer) -> None:
    """The rules' parameters are written into the script, once per kind of
    check: a new version of it when a kind is first seen (an override's
    threshold here), never per request."""
    rules = """\
overrides:
  - cidrs: [198.51.100.0/24]
    rules: [per-ip]
    multiply: 3
rules:
  - id: per-ip
    key: [ip]
    limit: {requests: 50, per: 10s}
    action: block
  - id: per-page
    key: [ip, path]
    limit: {tokens: 20, refill: 1/s}
    action: block
  - id: watch
    key: [path]
    limit: {rate: 100r/s, burst: 50, nodelay: true}
    action: log
"""
    client = redis_server.client()
    sent: list[int] = []

    async def run() -> list[str]:
        e = engine(url, rules, FakeClock())
        execute = e.store.client.execute

        async def counting(*command):
            if command[0] == "EVALSHA":
                sent.append(len(command))
            return await execute(*command)
        e.store.client.execute = counting
        client.config_resetstat()
        outcomes = [(await e.decide(request(e, ip=f"192.0.2.{i % 50}", path=f"/{i % 3}"))).outcome
                    for i in range(300)]
        outcomes += [(await e.decide(request(e, ip="198.51.100.9"))).outcome for _ in range(3)]
        return outcomes
    assert set(asyncio.run(run())) == {ALLOW}
    # EVALSHA, digest, number of keys, 3 own keys + 3 checks, 15 request
    # arguments + one number per check.
    assert set(sent) == {3 + 6 + 15 + 3}
    # The six other scripts when connecting, then the evaluation with the
    # first request's kinds, then with the override's threshold too.
    assert client.info("commandstats")["cmdstat_script|load"]["calls"] == 6 + 2


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_text_written_into_a_script_reads_back_the_same(redis_server: RedisServer, text: str) -> None:
    # Rule ids are plain today; whatever a rule's part holds must survive.
    assert redis_server.client().eval("return " + _lua_string(text), 0) == text


# Redis killed under load: clients sending checks straight to one Sluice,
# back to back, each on its own connection, while redis-server is killed
# and started again on its port.
OUTAGE_CLIENTS = 64
# What a check may take beyond the store's timeout on the test machine:
# the queue of 64 clients in front of one Sluice process, and the clients'
# own event loop, on two cores shared with Redis.
LATENCY_SLACK = 0.15


def test_redis_killed_under_load_every_check_fails_open_promptly_and_counting_resumes(
        redis_server: RedisServer, tmp_path: Path) -> None:
    redis_server.client().flushdb()
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"state: {{backend: redis, url: '{redis_server.url}', fail: open}}\n" + COUNTED_RULES)
    with SluiceServe(rules) as sluice, \
            CheckLoad(sluice.port, OUTAGE_CLIENTS, {"X-Sluice-Client-Addr": "10.80.0.1", "x-k": "outage"}) as load:
        wait_until(lambda: load.count() >= 1000, "1000 checks decided before the kill", 20)
        redis_server.kill()
        killed = time.monotonic()
        try:
            wait_until(lambda: time.monotonic() > killed + 1 and sum(a.sent > killed for a in load.answers()) >= 2000,
                       "a second and 2000 checks of outage", 20)
        finally:
            restarted = time.monotonic()
            redis_server.start()  # for the module's next tests too, should this one fail
        back = time.monotonic()  # it answers PING
        wait_until(lambda: any(a.sent >= restarted and remaining(a) is not None for a in load.answers()),
                   "a check decided by the restarted Redis", 5)
        recovered = time.monotonic()
        wait_until(lambda: sum(a.sent > recovered for a in load.answers()) >= 1000, "1000 checks after it", 20)
        store_errors = metric_at(sluice.port, "sluice_store_errors_total")
        internal_errors = metric_at(sluice.port, "sluice_internal_errors_total")
    answers = load.answers()
    during = [a for a in answers if killed < a.sent and a.answered < restarted]
    first_counted = min(a.answered for a in answers if a.sent >= restarted and remaining(a) is not None)
    after = [a for a in answers if a.sent > first_counted]
    counted_again = [remaining(a) for a in answers if a.sent >= restarted and remaining(a) is not None]
    latencies = [a.took for a in during]
    print(f"\nRedis killed under {OUTAGE_CLIENTS} clients: {len(during)} checks during the outage "
          f"({restarted - killed:.2f} s), max {max(latencies) * 1000:.1f} ms, "
          f"p99 {percentile(latencies, 0.99) * 1000:.1f} ms, median {percentile(latencies, 0.5) * 1000:.1f} ms; "
          f"before: max {max(a.took for a in answers if a.answered < killed) * 1000:.1f} ms; "
          f"counted by Redis again {(first_counted - restarted) * 1000:.0f} ms after its start "
          f"({(back - restarted) * 1000:.0f} ms until it answered PING); "
          f"failed open after the restart: {sum(remaining(a) is None for a in answers if a.sent >= restarted)}")

    assert {a.status for a in answers} == {200}  # no 5xx, none left without an answer
    assert all(remaining(a) is None for a in during)  # each one failed open...
    assert max(latencies) <= DEFAULT_TIMEOUT + LATENCY_SLACK  # ...promptly
    assert first_counted - back <= 2.0
    assert all(remaining(a) is not None for a in after)
    # The restarted Redis (empty) counted every decision it made, once:
    # the tokens left after each are every number from the top down.
    top = COUNTED_TOKENS - 1
    assert sorted(counted_again, reverse=True) == list(range(top, top - len(counted_again), -1))
    assert store_errors == sum(remaining(a) is None for a in answers) and internal_errors == 0


def test_open_connects_and_loads_the_scripts_before_the_first_request(url: str, redis_server: RedisServer) -> None:
    """A process that starts under a burst must not make its first checks
    wait for the connection and the scripts (service.py opens the store)."""
    client = redis_server.client()
    client.script_flush()

    async def run() -> tuple[int, int]:
        store = RedisStore.from_url(url, "a")
        try:
            before = client.info("clients")["connected_clients"]
            await store.open()
            return before, client.info("clients")["connected_clients"]
        finally:
            await store.close()
    before, after = asyncio.run(run())
    assert after == before + 1
    record = RedisStore.from_url(url, "a")._record  # its digest
    assert client.script_exists(record) == [True]


def test_a_store_that_cannot_connect_at_start_is_counted_and_the_service_starts() -> None:
    from sidecar.service import build_api

    rules = f"state: {{backend: redis, url: 'redis://{LOOPBACK}:{free_port()}/0'}}\nrules: []\n"
    e = Engine(ruleset_from(rules), clock=FakeClock())
    api = build_api(e)

    async def start_and_stop() -> None:
        async with api.router.lifespan_context(api):
            pass
    asyncio.run(start_and_stop())
    assert e.metrics.store_errors.value == 1


REACTING = """\
challenge:
  auto_ban: {challenges: 100, per: 60s, ban: 10m}
rules:
  - id: flood
    match: {path: {prefix: /flood}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: ban
    ban: {duration: 5m, increment: {factor: 2, max: 1h, remember: 10m}}
  - id: gate
    key: [ip]
    limit: {requests: 1, per: 10s}
    penalty: 5s
    action: challenge
    challenge: {then_ban_after: 1}
"""


def test_a_ban_escalates_across_nodes_and_its_history_expires_beside_the_ban_record(
        url: str, redis_server: RedisServer) -> None:
    async def run() -> list[tuple[str, float, int]]:
        clock = FakeClock()
        a, b = engine(url, REACTING, clock, node="a"), engine(url, REACTING, clock, node="b")
        await outcomes(a, 2, path="/flood")
        [first] = await b.active_bans()
        await b.lift_ban("192.0.2.1")
        await outcomes(b, 2, path="/flood")
        [second] = await a.active_bans()
        return [(ban.node, ban.duration, ban.step) for ban in (first, second)]
    assert asyncio.run(run()) == [("a", 300.0, 0), ("b", 600.0, 1)]
    client = redis_server.client()
    history = "sluice:{192.0.2.1}:banstep:flood"
    assert client.hmget(history, "n", "d") == ["1", "600"]
    # Forgotten 10 minutes after the second ban ends.
    assert 1_190_000 < client.pttl(history) <= 1_200_000
    assert client.hget("sluice:{192.0.2.1}:ban", "step") == "1"


def test_unsolved_penalties_are_counted_beside_the_ban_record_and_expire(url: str,
                                                                          redis_server: RedisServer) -> None:
    async def run() -> list[str]:
        clock = FakeClock()
        e = engine(url, REACTING, clock)
        seen = await outcomes(e, 3)
        clock.advance(6)  # the penalty is over
        return seen + await outcomes(e, 3)
    # One penalty challenged (counted once); the next one's first challenged request bans.
    assert asyncio.run(run()) == [ALLOW, DENY, DENY, ALLOW, CLOSE, CLOSE]
    client = redis_server.client()
    counted = "sluice:{192.0.2.1}:counted:gate"
    assert 0 < client.pttl(counted) <= 5_000
    # The ban cleared the penalty counter it was issued for.
    assert not client.exists("sluice:{192.0.2.1}:penalties:gate")
    assert all(client.pttl(key) > 0 for key in client.keys("*"))
