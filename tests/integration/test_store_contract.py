"""The state store contract: every test here runs on every backend, through
the one ``StateStore`` interface the engine uses — the memory store, the
Redis store against a real redis-server, and the Redis store against a
real three-master Redis Cluster (on the time the test passes, so all see
the same clock)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest

from sidecar.config import Rate
from sidecar.limiters.concurrent import ConcurrencyLimiter
from sidecar.limiters.leaky import LeakyBucket
from sidecar.limiters.token import TokenBucket
from sidecar.limiters.window import WindowCounter
from sidecar.state import AutoBan, BanIncrement, BanRecord, Check, Evaluation, PenaltyBan, ResponseCount
from sidecar.store import StateStore
from sidecar.store.local import LocalStore
from sidecar.store.memory import MemoryStore
from sidecar.store.redis import RedisStore
from sidecar.store.redis_cluster import parse_node
from tests.integration.redis_server import RedisCluster, RedisServer
from tests.unit.dict_table import DictTable

pytestmark = pytest.mark.integration

NOW = 1_000_000.0
ADDRESS = "192.0.2.7"



def beyond_deciding(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test that needs a role beyond deciding (bans and admin,
    inspection): it runs on the whole backends only."""
    test.beyond_deciding = True  # type: ignore[attr-defined]
    return test


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test on every backend; a deciding test also on the smallest
    in-process table (``tests.unit.dict_table``) under the policy."""
    if "open_store" in metafunc.fixturenames:
        backends = ["memory", "redis", "cluster"]
        if not getattr(metafunc.function, "beyond_deciding", False):
            backends.append("table")
        metafunc.parametrize("open_store", backends, indirect=True)


@pytest.fixture
def open_store(request: pytest.FixtureRequest, redis_server: RedisServer) -> Callable[[], StateStore]:
    """Makes the backend under test (inside the test's event loop)."""
    if request.param == "memory":
        return lambda: MemoryStore(1000, "node-a", clock=lambda: NOW)
    if request.param == "table":
        return lambda: cast(StateStore, TableStore(DictTable(), "node-a"))
    if request.param == "cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        nodes = [parse_node(cluster.addresses[0])]
        return lambda: RedisStore.from_url("redis://", "node-a", server_time=False, cluster=nodes)
    redis_server.client().flushdb()
    return lambda: RedisStore.from_url(redis_server.url, "node-a", server_time=False)


class TableStore(LocalStore):
    """The deciding role over a table, and nothing to close."""

    async def close(self) -> None:
        """Nothing to close."""


def run(open_store: Callable[[], StateStore], test: Callable[[StateStore], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        store = open_store()
        try:
            return await test(store)
        finally:
            await store.close()
    return asyncio.run(go())


def window(rule: str = "w", threshold: int = 3, per: float = 60.0, penalty: float = 30.0,
           **options: Any) -> Check:
    return Check.of(rule, ((rule, ("ip",)), ADDRESS), WindowCounter(threshold, per, penalty), float(threshold),
                 True, **options)


def test_a_window_counts_to_its_threshold_then_refuses_for_its_penalty(open_store) -> None:
    async def test(store: StateStore) -> list[bool]:
        check = window()
        over = [(await store.evaluate(NOW + i, ADDRESS, [check])).hits[0].over_limit for i in range(4)]
        # The third request reached the threshold: the penalty runs 30 s from it.
        over.append((await store.evaluate(NOW + 31.9, ADDRESS, [check])).hits[0].over_limit)
        over.append((await store.evaluate(NOW + 32.1, ADDRESS, [check])).hits[0].over_limit)
        return over
    assert run(open_store, test) == [False, False, False, True, True, False]


def test_a_refusal_ends_evaluation_and_later_checks_are_not_counted(open_store) -> None:
    async def test(store: StateStore) -> tuple[int, int]:
        first, second = window("first", threshold=1), window("second", threshold=5)
        await store.evaluate(NOW, ADDRESS, [first])
        refused = await store.evaluate(NOW + 1, ADDRESS, [first, second])
        quota = await store.evaluate(NOW + 2, ADDRESS, [second], quotas=True)
        assert quota.quotas is not None and quota.quotas[0] is not None
        return len(refused.hits), quota.quotas[0][0]
    evaluated, remaining = run(open_store, test)
    # The refusal stopped at the first rule; the second counted only its own
    # request since: 5 - 1 left.
    assert (evaluated, remaining) == (1, 4)


@beyond_deciding
def test_a_ban_is_recorded_listed_and_lifted(open_store) -> None:
    async def test(store: StateStore) -> tuple:
        check = window("scrapers", threshold=1, ban_duration=600.0)
        await store.evaluate(NOW, ADDRESS, [check])
        banning = await store.evaluate(NOW + 1, ADDRESS, [check])
        banned = await store.evaluate(NOW + 2, ADDRESS, [window("other", threshold=100)])
        bans = await store.active_bans(NOW + 2)
        lifted = await store.lift_ban(ADDRESS), await store.lift_ban(ADDRESS)
        after = await store.evaluate(NOW + 3, ADDRESS, [window("other", threshold=100)])
        return banning.new_ban, banned.ban is not None and not banned.new_ban, \
            [(ban.address, ban.rule_id, ban.node, ban.duration) for ban in bans], lifted, after.ban
    new_ban, still_banned, bans, lifted, after = run(open_store, test)
    assert new_ban and still_banned
    assert bans == [(ADDRESS, "scrapers", "node-a", 600.0)]
    assert lifted == (True, False) and after is None


def test_buckets_are_charged_only_when_every_bucket_admits(open_store) -> None:
    async def test(store: StateStore) -> list[tuple[bool, ...]]:
        roomy = Check.of("roomy", (("roomy", ("ip",)), ADDRESS), TokenBucket(10, 0.001, 1, None), 10.0, True)
        tight = Check.of("tight", (("tight", ("ip",)), ADDRESS), TokenBucket(1, 0.001, 1, None), 1.0, True)
        outcomes = []
        for i in range(3):
            evaluation = await store.evaluate(NOW + i, ADDRESS, [roomy, tight], quotas=True)
            outcomes.append(tuple(hit.over_limit for hit in evaluation.hits))
        # What is left of the roomy bucket: charged once, by the admitted request.
        evaluation = await store.evaluate(NOW + 3, ADDRESS, [roomy], quotas=True)
        assert evaluation.quotas is not None and evaluation.quotas[0] is not None
        outcomes.append((evaluation.quotas[0][0],))
        return outcomes
    assert run(open_store, test) == [(False, False), (False, True), (False, True), (8,)]


def test_a_full_wait_queue_refuses_a_request_a_leaky_bucket_would_hold(open_store) -> None:
    async def test(store: StateStore) -> tuple:
        check = Check.of("slow", (("slow", ("ip",)), ADDRESS), LeakyBucket(Rate(1, 1), 5, 0, None), 6.0, True)
        first = await store.evaluate(NOW, ADDRESS, [check], can_delay=True)
        held = await store.evaluate(NOW, ADDRESS, [check], can_delay=True)
        refused = await store.evaluate(NOW, ADDRESS, [check], can_delay=False)
        return first.delay, held.delay, refused.hits[0].over_limit, refused.delay
    assert run(open_store, test) == (0.0, 1.0, True, 0.0)


def test_reported_responses_count_toward_the_threshold(open_store) -> None:
    async def test(store: StateStore) -> list[bool]:
        limiter = WindowCounter(2, 60.0, 60.0)
        key = (("login", ("ip",)), ADDRESS)
        hits = []
        for i in range(3):
            [hit] = await store.record(NOW + i, [ResponseCount(key, limiter, 2.0)])
            hits.append(hit.over_limit)
        # At request time the key is only checked for its penalty.
        peek = Check.of("login", key, limiter, 2.0, True, count=False)
        hits.append((await store.evaluate(NOW + 3, ADDRESS, [peek])).hits[0].over_limit)
        return hits
    assert run(open_store, test) == [False, False, True, True]


def by_header(rule: str, value: str, threshold: int, **options: Any) -> Check:
    """A check whose key has no address: on a cluster, in another slot than
    the address's ban record (most likely; every slot is covered below)."""
    return Check.of(rule, ((rule, ("header:x-k",)), value), WindowCounter(threshold, 60.0, 30.0),
                 float(threshold), True, **options)


@beyond_deciding
def test_a_check_keyed_without_the_address_bans_the_address(open_store) -> None:
    async def test(store: StateStore) -> tuple:
        banning_rule = by_header("shared-key", "k1", 1, ban_duration=600.0)
        other = window("other", threshold=100)
        await store.evaluate(NOW, ADDRESS, [other, banning_rule])
        banning = await store.evaluate(NOW + 1, ADDRESS, [other, banning_rule])
        # Banned everywhere: a request with no check of that rule is refused.
        banned = await store.evaluate(NOW + 2, ADDRESS, [by_header("third", "k2", 100)])
        bans = await store.active_bans(NOW + 2)
        # The ban cleared the key that triggered it.
        lifted = await store.lift_ban(ADDRESS)
        after = await store.evaluate(NOW + 3, ADDRESS, [banning_rule])
        return ([hit.over_limit for hit in banning.hits], banning.new_ban, banning.ban is not None,
                banned.ban is not None, [(ban.address, ban.rule_id, ban.duration) for ban in bans],
                lifted, after.ban is None and not after.hits[0].over_limit)
    assert run(open_store, test) == ([False, True], True, True, True, [(ADDRESS, "shared-key", 600.0)],
                                     True, True)


def test_challenges_counted_from_another_slot_ban_past_the_auto_ban_threshold(open_store) -> None:
    auto_ban = AutoBan(WindowCounter(2, 60.0, 60.0), 2, 300.0)

    async def test(store: StateStore) -> list[tuple[bool, bool]]:
        gate = by_header("gate", "k1", 1, auto_ban=auto_ban)
        answers = []
        for i in range(5):
            evaluation = await store.evaluate(NOW + i, ADDRESS, [gate])
            answers.append((evaluation.hits[0].over_limit if evaluation.hits else True,
                            evaluation.ban is not None))
        return answers
    # 1 allowed (it reaches the threshold), 2 challenges (the second brings
    # the counter to its threshold), then the ban, then banned.
    assert run(open_store, test) == [(False, False), (True, False), (True, False), (True, True), (True, True)]


def test_responses_of_many_keys_are_counted_each_on_its_own(open_store) -> None:
    async def test(store: StateStore) -> list[list[bool]]:
        limiter = WindowCounter(2, 60.0, 60.0)
        counts = [ResponseCount(((f"r{i}", ("header:x-k",)), f"v{i}"), limiter, 2.0, amount=i % 3 + 1)
                  for i in range(12)]
        return [[hit.over_limit for hit in await store.record(NOW + step, counts)] for step in range(2)]
    first, second = run(open_store, test)
    # Amounts 1, 2, 3 against a threshold of 2, reached at or past it.
    assert first == [i % 3 + 1 >= 2 and False for i in range(12)]
    assert second == [i % 3 + 1 >= 2 for i in range(12)]


def test_a_key_counted_by_another_algorithm_starts_anew(open_store) -> None:
    """A reload that turns a rule into another algorithm: the key's old state
    (and its penalty) does not carry over, either way."""
    async def test(store: StateStore) -> list[bool]:
        key = (("switch", ("ip",)), ADDRESS)
        as_window = Check.of("switch", key, WindowCounter(1, 60.0, 60.0), 1.0, True)
        as_bucket = Check.of("switch", key, TokenBucket(2, 0.001, 1, None), 2.0, True)
        over = []
        for check in (as_window, as_window, as_bucket, as_bucket, as_bucket, as_window, as_window):
            over.append((await store.evaluate(NOW, ADDRESS, [check])).hits[0].over_limit)
        return over
    # The window's penalty starts at its first request; the bucket starts
    # full (2 tokens); the window starts again with its own first request.
    assert run(open_store, test) == [False, True, False, False, True, False, True]


def slots(rule: str = "c", limit: int = 2, lease: float = 30.0, request: str = "r1", stops: bool = True) -> Check:
    return Check.of(rule, ((rule, ("ip",)), ADDRESS), ConcurrencyLimiter(limit, lease), float(limit), stops,
                 lease=request)


def test_concurrency_admits_n_refuses_until_the_shortest_lease_ends_and_a_release_frees_a_slot(
        open_store) -> None:
    async def test(store: StateStore) -> list:
        key = slots().key
        seen = []
        for i, request in enumerate(["r1", "r2", "r3"]):
            [hit] = (await store.evaluate(NOW + i, ADDRESS, [slots(request=request)])).hits
            seen.append((hit.over_limit, hit.retry_after))
        seen.append(await store.release("r1", [key]))
        seen.append(await store.release("r1", [key]))  # given back already
        [hit] = (await store.evaluate(NOW + 3, ADDRESS, [slots(request="r4")])).hits
        seen.append(hit.over_limit)
        # r2 (taken at NOW + 1) is the shortest lease now: it ends at NOW + 31.
        [hit] = (await store.evaluate(NOW + 4, ADDRESS, [slots(request="r5")])).hits
        seen.append((hit.over_limit, hit.retry_after))
        [hit] = (await store.evaluate(NOW + 31, ADDRESS, [slots(request="r5")])).hits
        seen.append(hit.over_limit)
        # r2's lease ended without a report: nothing to give back.
        seen.append(await store.release("r2", [key]))
        return seen
    assert run(open_store, test) == [(False, 0.0), (False, 0.0), (True, 28.0), 1, 0, False, (True, 27.0),
                                     False, 0]


def test_a_slot_is_taken_only_when_no_rule_refuses_the_request(open_store) -> None:
    async def test(store: StateStore) -> tuple:
        gate = window("gate", threshold=1)
        await store.evaluate(NOW, ADDRESS, [gate])  # reaches the threshold: the penalty starts
        refused = await store.evaluate(NOW + 1, ADDRESS, [slots(limit=1, request="r1"), gate])
        admitted = await store.evaluate(NOW + 2, ADDRESS, [slots(limit=1, request="r2")])
        full = await store.evaluate(NOW + 3, ADDRESS, [slots(limit=1, request="r3")])
        return ([hit.over_limit for hit in refused.hits], admitted.hits[0].over_limit,
                full.hits[0].over_limit)
    assert run(open_store, test) == ([False, True], False, True)


def test_an_observe_limit_over_its_limit_takes_no_slot_and_keeps_none_from_the_others(open_store) -> None:
    async def test(store: StateStore) -> list:
        seen = []
        for i in range(3):
            evaluation = await store.evaluate(
                NOW + i, ADDRESS, [slots("watch", limit=1, request=f"r{i}", stops=False),
                                   slots("enforce", limit=2, request=f"r{i}")])
            seen.append(tuple(hit.over_limit for hit in evaluation.hits))
        return seen
    # The second request is over the observe limit and admitted: it takes
    # a slot of enforce only, so the third finds enforce full.
    assert run(open_store, test) == [(False, False), (True, False), (True, True)]


def test_concurrency_quotas_are_the_free_slots_after_the_decision(open_store) -> None:
    async def test(store: StateStore) -> list:
        quotas = []
        for i in range(3):
            evaluation = await store.evaluate(NOW + 10 * i, ADDRESS, [slots(limit=2, request=f"r{i}")],
                                              quotas=True)
            quotas.append(evaluation.quotas)
        return quotas
    # Taken at NOW and NOW + 10 (30 s leases); at NOW + 20 both run.
    assert run(open_store, test) == [[(1, 30.0, 30.0)], [(0, 20.0, 30.0)], [(0, 10.0, 30.0)]]


def test_a_reload_that_changes_a_keys_kind_starts_it_afresh(open_store) -> None:
    async def test(store: StateStore) -> list:
        key = ((("k", ("ip",)), ADDRESS))
        as_window = Check.of("k", key, WindowCounter(2, 60.0, 60.0), 2.0, True)
        as_slots = Check.of("k", key, ConcurrencyLimiter(1, 30.0), 1.0, True, lease="r1")
        as_bucket = Check.of("k", key, TokenBucket(1, 0.001, 1, None), 1.0, True)
        peek = Check.of("k", key, WindowCounter(2, 60.0, 60.0), 2.0, True, count=False)
        seen: list = []
        await store.evaluate(NOW, ADDRESS, [as_window])
        for check in (as_slots, as_window, as_slots, as_bucket):
            seen.append((await store.evaluate(NOW + 1, ADDRESS, [check])).hits[0].over_limit)
        seen.append(await store.release("r1", [key]))  # the key is a bucket's now
        for check in (as_slots, peek):
            seen.append((await store.evaluate(NOW + 2, ADDRESS, [check])).hits[0].over_limit)
        return seen
    assert run(open_store, test) == [False, False, False, False, 0, False, False]


def fitting(rule: str = "f", threshold: int = 10, per: float = 60.0, sliding: bool = False,
            penalty: float = 0.0, amount: int = 1) -> Check:
    """A Rate Limit Service descriptor's counter: admitted only when the request fits whole."""
    return Check.of(rule, ((rule, ("k",)), "v"), WindowCounter(threshold, per, penalty, sliding=sliding, fit=True),
                 float(threshold), False, amount=amount)


def test_a_fitting_window_admits_what_fits_whole_and_counts_no_refusal(open_store) -> None:
    async def test(store: StateStore) -> list[Any]:
        start = NOW - NOW % 60  # the start of a window
        seen = []
        for amount in (4, 5, 2, 1, 0, 1):
            evaluation = await store.evaluate(start + 1, "", [fitting(amount=amount)], quotas=True)
            seen.append((evaluation.hits[0].over_limit, evaluation.quotas[0][0]))
        # A new window counts from nothing.
        evaluation = await store.evaluate(start + 60, "", [fitting(amount=10)], quotas=True)
        seen.append((evaluation.hits[0].over_limit, evaluation.quotas[0][0]))
        return seen
    # 4 and 5 fit (9 of 10); 2 does not and is not counted; 1 fits (10);
    # a look (0) fits and counts nothing; one more does not fit.
    assert run(open_store, test) == [(False, 6), (False, 1), (True, 1), (False, 0), (False, 0), (True, 0),
                                     (False, 0)]


def test_a_fitting_window_refuses_until_its_window_ends_then_a_penalty_when_it_has_one(open_store) -> None:
    async def test(store: StateStore) -> list[Any]:
        start = NOW - NOW % 60
        plain, penalized = fitting("plain", threshold=2), fitting("penalized", threshold=2, penalty=90.0)
        answers = []
        for check in (plain, penalized):
            for _ in range(2):
                await store.evaluate(start + 10, "", [check])
            refused = (await store.evaluate(start + 20, "", [check])).hits[0]
            later = (await store.evaluate(start + 61, "", [check])).hits[0]
            answers.append((refused.over_limit, round(refused.retry_after, 3), later.over_limit))
        return answers
    assert run(open_store, test) == [(True, 40.0, False), (True, 90.0, True)]


def test_a_fitting_sliding_window_weighs_the_previous_window_in(open_store) -> None:
    async def test(store: StateStore) -> list[Any]:
        start = NOW - NOW % 60
        check = fitting(threshold=10, sliding=True)
        await store.evaluate(start + 30, "", [fitting(threshold=10, sliding=True, amount=10)])
        # A quarter into the next window, the previous 10 weigh 7.5: 2 fit, 3 do not.
        three = (await store.evaluate(start + 75, "", [fitting(threshold=10, sliding=True, amount=3)])).hits[0]
        two = (await store.evaluate(start + 75, "", [fitting(threshold=10, sliding=True, amount=2)])).hits[0]
        one = (await store.evaluate(start + 75, "", [check])).hits[0]
        return [three.over_limit, two.over_limit, one.over_limit, round(one.retry_after, 3)]
    # After 2, 10 - 2 - 1 = 7 of the previous 10 may weigh: at 30% of the window, 3 s from now.
    assert run(open_store, test) == [True, False, True, 3.0]


def test_buckets_take_a_requests_amount_at_once_and_a_look_takes_nothing(open_store) -> None:
    async def test(store: StateStore) -> list[bool]:
        token = TokenBucket(10, 1.0, 1, None)
        leaky = LeakyBucket(Rate(1, 1.0), 4, None, None)
        over = []
        for limiter in (token, leaky):
            key = ((f"b-{limiter.__class__.__name__}", ("k",)), "v")
            for amount in (0, 5, 6, 5, 0):
                check = Check.of("b", key, limiter, 10.0, False, amount=amount)
                over.append((await store.evaluate(NOW, "", [check])).hits[0].over_limit)
        return over
    # Ten tokens: a look, 5, then 6 does not fit, 5 does, a look still passes.
    # A burst of 4 holds 5 at once: the look, 5, then nothing more fits.
    assert run(open_store, test) == [False, False, True, False, False, False, False, True, True, False]


# --------------------------------------------------------------------------
# Bans that react to behaviour: escalating bans, challenge then ban
# --------------------------------------------------------------------------

ESCALATING = BanIncrement(factor=2.0, longest=1000.0, remember=100.0)


async def banned_once(store: StateStore, at: float, check: Check) -> Evaluation:
    """A threshold-1 ban rule's second request: the one that bans."""
    await store.evaluate(at, ADDRESS, [check])
    return await store.evaluate(at + 0.5, ADDRESS, [check])


@beyond_deciding
def test_each_repeat_ban_lasts_factor_times_the_last_up_to_max(open_store) -> None:
    async def test(store: StateStore) -> list[tuple]:
        check = window("scrapers", threshold=1, ban_duration=300.0, ban_increment=ESCALATING)
        seen = []
        at = NOW
        for _ in range(4):
            banning = await banned_once(store, at, check)
            assert banning.new_ban and banning.ban is not None
            [listed] = await store.active_bans(at + 1)
            seen.append((banning.ban.step, banning.ban.duration, listed.step, listed.duration,
                         round(listed.expires - (at + 1), 3)))
            at = banning.ban.expires + 10  # within remember (100 s) of the ban's end
        return seen
    # 300, 600, then 1000 (max) twice; each listed with its step and the
    # time left from one second into it.
    assert run(open_store, test) == [(0, 300.0, 0, 300.0, 299.5), (1, 600.0, 1, 600.0, 599.5),
                                     (2, 1000.0, 2, 1000.0, 999.5), (3, 1000.0, 3, 1000.0, 999.5)]


@beyond_deciding
def test_a_lifted_ban_is_remembered_and_the_next_escalates(open_store) -> None:
    async def test(store: StateStore) -> list[tuple[int, float]]:
        check = window("scrapers", threshold=1, ban_duration=300.0, ban_increment=ESCALATING)
        first = await banned_once(store, NOW, check)
        assert await store.lift_ban(ADDRESS)
        second = await banned_once(store, NOW + 5, check)
        assert first.ban is not None and second.ban is not None
        return [(first.ban.step, first.ban.duration), (second.ban.step, second.ban.duration)]
    assert run(open_store, test) == [(0, 300.0), (1, 600.0)]


def test_a_ban_more_than_remember_after_the_last_ended_starts_at_step_zero(open_store) -> None:
    async def test(store: StateStore) -> list[tuple[int, float]]:
        check = window("scrapers", threshold=1, ban_duration=300.0, ban_increment=ESCALATING)
        other_rule = window("other", threshold=1, ban_duration=300.0, ban_increment=ESCALATING)
        steps = []
        for at in (NOW, NOW + 300.5 + 99, NOW + 300.5 + 99 + 600.5 + 101):
            ban = (await banned_once(store, at, check)).ban
            assert ban is not None
            steps.append((ban.step, ban.duration))
        # Another rule keeps a history of its own.
        ban = (await banned_once(store, NOW + 5000, other_rule)).ban
        assert ban is not None
        steps.append((ban.step, ban.duration))
        return steps
    # The second comes 99 s after the first ended; the third 101 s after
    # the second did: forgotten.
    assert run(open_store, test) == [(0, 300.0), (1, 600.0), (0, 300.0), (0, 300.0)]


def test_a_ban_without_increment_is_step_zero_every_time(open_store) -> None:
    async def test(store: StateStore) -> list[tuple[int, float]]:
        check = window("scrapers", threshold=1, ban_duration=300.0)
        bans = []
        for at in (NOW, NOW + 310):
            ban = (await banned_once(store, at, check)).ban
            assert ban is not None
            bans.append((ban.step, ban.duration))
        return bans
    assert run(open_store, test) == [(0, 300.0), (0, 300.0)]


@beyond_deciding
def test_an_escalating_ban_called_for_from_another_slot_escalates_in_the_addresss_slot(open_store) -> None:
    async def test(store: StateStore) -> list[tuple]:
        check = by_header("shared-key", "k1", 1, ban_duration=300.0, ban_increment=ESCALATING)
        seen = []
        for at in (NOW, NOW + 301, NOW + 301 + 601):
            banning = await banned_once(store, at, check)
            [listed] = await store.active_bans(at + 1)
            assert banning.ban is not None
            seen.append((banning.ban.step, banning.ban.duration, listed.rule_id, listed.step, listed.duration))
        return seen
    assert run(open_store, test) == [(0, 300.0, "shared-key", 0, 300.0), (1, 600.0, "shared-key", 1, 600.0),
                                     (2, 1000.0, "shared-key", 2, 1000.0)]


def challenge(rule: str = "pages", then_ban_after: int = 2, penalty: float = 10.0) -> Check:
    """A challenge rule over 1 request a minute with a 10 s penalty,
    banning for 300 s past ``then_ban_after`` unsolved penalties."""
    return Check.of(rule, ((rule, ("ip",)), ADDRESS), WindowCounter(1, 60.0, penalty), 1.0, True,
                 penalty_ban=PenaltyBan.after(then_ban_after, 300.0))


@beyond_deciding
def test_unsolved_penalties_past_then_ban_after_ban_the_address(open_store) -> None:
    async def test(store: StateStore) -> list[str]:
        check = challenge()
        seen = []
        at = NOW
        for _ in range(3):
            # The request that reaches the threshold starts a penalty; every
            # request in it is challenged, and the penalty counts once.
            evaluations = [await store.evaluate(at + i, ADDRESS, [check]) for i in range(4)]
            seen.append("".join("B" if e.new_ban else "b" if e.ban else "C" if e.hits[0].over_limit else "."
                                for e in evaluations))
            at += 11  # the penalty (10 s from its first request) is over
        [ban] = await store.active_bans(at)
        seen.append(f"{ban.rule_id} {ban.duration} {ban.step}")
        return seen
    # Two penalties challenged; the first challenged request of the third is a ban.
    assert run(open_store, test) == [".CCC", ".CCC", ".Bbb", "pages 300.0 0"]


def test_penalties_of_one_rule_do_not_count_for_another(open_store) -> None:
    async def test(store: StateStore) -> list[bool]:
        banned = []
        at = NOW
        for rule in ("a", "b", "a", "b"):
            check = challenge(rule)
            await store.evaluate(at, ADDRESS, [check])
            banned.append((await store.evaluate(at + 1, ADDRESS, [check])).ban is not None)
            at += 11
        return banned
    # Two penalties each: within then_ban_after for both.
    assert run(open_store, test) == [False, False, False, False]


def test_penalties_more_than_a_day_apart_do_not_add_up(open_store) -> None:
    async def test(store: StateStore) -> list[bool]:
        check = challenge(then_ban_after=1)
        banned = []
        for at in (NOW, NOW + 2 * 86400, NOW + 4 * 86400):
            await store.evaluate(at, ADDRESS, [check])
            banned.append((await store.evaluate(at + 1, ADDRESS, [check])).ban is not None)
        return banned
    assert run(open_store, test) == [False, False, False]


# What administrators do (sidecar.admin): bans by hand, counters found,
# described and reset
# --------------------------------------------------------------------------

OTHER_ADDRESS = "192.0.2.8"


@beyond_deciding
def test_a_ban_by_hand_refuses_is_listed_with_its_reason_and_is_lifted(open_store) -> None:
    async def test(store: StateStore) -> tuple:
        issued = await store.ban(NOW, ADDRESS, 600.0, "credential stuffing")
        refused = await store.evaluate(NOW + 1, ADDRESS, [window()])
        others = await store.evaluate(NOW + 1, OTHER_ADDRESS, [window()])
        listed = [(ban.address, ban.rule_id, ban.reason, ban.node, ban.duration, ban.expires)
                  for ban in await store.active_bans(NOW + 1)]
        own = await store.ban_of(NOW + 1, ADDRESS)
        lifted = await store.lift_ban(ADDRESS)
        after = await store.evaluate(NOW + 2, ADDRESS, [window()])
        return (issued.manual, issued.reason, refused.ban is not None and not refused.new_ban, others.ban,
                listed, own is not None and own.reason, lifted, after.ban, await store.ban_of(NOW + 2, ADDRESS))
    assert run(open_store, test) == (
        True, "credential stuffing", True, None,
        [(ADDRESS, "", "credential stuffing", "node-a", 600.0, NOW + 600.0)],
        "credential stuffing", True, None, None)


@beyond_deciding
def test_a_ban_by_hand_replaces_an_earned_ban_and_ends_when_its_duration_does(open_store) -> None:
    async def test(store: StateStore) -> tuple:
        check = window("scrapers", threshold=1, ban_duration=600.0)
        await store.evaluate(NOW, ADDRESS, [check])
        await store.evaluate(NOW + 1, ADDRESS, [check])  # banned by the rule for 600 s
        await store.ban(NOW + 2, ADDRESS, 10.0, "shorter")
        [ban] = await store.active_bans(NOW + 3)
        still = await store.evaluate(NOW + 11.5, ADDRESS, [window("other")])
        ended = await store.evaluate(NOW + 12.5, ADDRESS, [window("other")])
        return ban.rule_id, ban.reason, ban.expires, still.ban is not None, ended.ban
    assert run(open_store, test) == ("", "shorter", NOW + 12.0, True, None)


@beyond_deciding
def test_a_network_ban_is_held_for_the_node_listed_and_lifted(open_store) -> None:
    import ipaddress

    async def test(store: StateStore) -> tuple:
        ban = await store.ban_network(NOW, "198.51.100.0/24", 600.0, "a scanner's range")
        inside = store.network_bans.find(ipaddress.ip_address("198.51.100.77"), NOW + 1)
        outside = store.network_bans.find(ipaddress.ip_address("198.51.101.1"), NOW + 1)
        listed = [(b.address, b.rule_id, b.reason, b.expires) for b in await store.active_network_bans(NOW + 1)]
        lifted = (await store.lift_network_ban(NOW + 1, "198.51.100.0/24"),
                  await store.lift_network_ban(NOW + 1, "198.51.100.0/24"))
        after = store.network_bans.find(ipaddress.ip_address("198.51.100.77"), NOW + 2)
        listed_after = await store.active_network_bans(NOW + 2)
        await store.ban_network(NOW, "2001:db8::/32", 60.0, "")
        until = [store.network_bans.find(ipaddress.ip_address("2001:db8:1::1"), NOW + at) is not None
                 for at in (59.9, 60.0)]
        return (ban.manual, inside is not None and inside.address, outside, listed, lifted, after,
                listed_after, until)
    assert run(open_store, test) == (
        True, "198.51.100.0/24", None, [("198.51.100.0/24", "", "a scanner's range", NOW + 600.0)],
        (True, False), None, [], [True, False])


def counted_keys() -> list[Check]:
    """Keys of ADDRESS under every shape that counts it, and keys that do not."""
    return [
        window("per-ip"),
        Check.of("per-page", (("per-page", ("ip", "path")), ADDRESS, "/a"), TokenBucket(5, 0.01, 1, None), 5.0,
              True),
        # A session rule's fallback to the address, tagged as such.
        Check.of("sess", (("sess", ("session:sid",)), ("ip", ADDRESS)), WindowCounter(10, 60.0, 60.0), 10.0, True),
        Check.of("sess", (("sess", ("session:sid",)), ("cookie", ADDRESS)), WindowCounter(10, 60.0, 60.0), 10.0, True),
        by_header("per-key", ADDRESS, 10),
    ]


@beyond_deciding
def test_the_keys_counted_for_an_address_are_found_and_no_others(open_store) -> None:
    from sidecar.counters import KeySelection

    async def test(store: StateStore) -> tuple:
        await store.evaluate(NOW, ADDRESS, counted_keys())
        await store.evaluate(NOW, OTHER_ADDRESS, [Check.of("per-ip", (("per-ip", ("ip",)), OTHER_ADDRESS),
                                                        WindowCounter(3, 60.0, 30.0), 3.0, True)])
        of_address = await store.find_keys(NOW + 1, KeySelection(address=ADDRESS))
        of_rule = await store.find_keys(NOW + 1, KeySelection(rule="per-ip"))
        both = await store.find_keys(NOW + 1, KeySelection(address=ADDRESS, rule="sess"))
        exact = await store.find_keys(NOW + 1, KeySelection(key=(("per-ip", ("ip",)), OTHER_ADDRESS)))
        missing = await store.find_keys(NOW + 1, KeySelection(key=(("per-ip", ("ip",)), "192.0.2.99")))
        bounded = await store.find_keys(NOW + 1, KeySelection(address=ADDRESS), limit=2)
        return sorted(map(str, of_address)), sorted(map(str, of_rule)), both, exact, missing, len(bounded)
    of_address, of_rule, both, exact, missing, bounded = run(open_store, test)
    keys = [check.key for check in counted_keys()]
    assert of_address == sorted(map(str, keys[:3]))
    assert of_rule == sorted(map(str, [keys[0], (("per-ip", ("ip",)), OTHER_ADDRESS)]))
    assert both == [keys[2]]
    assert exact == [(("per-ip", ("ip",)), OTHER_ADDRESS)] and missing == [] and bounded == 2


@beyond_deciding
def test_keys_are_described_by_the_limiter_given_as_the_draft_fields_describe_them(open_store) -> None:
    async def test(store: StateStore) -> list:
        tight = window("tight", threshold=2)  # 30 s penalty once reached
        # Full again 200 s after two requests: still stored when described.
        bucket = Check.of("bucket", (("bucket", ("ip",)), ADDRESS), TokenBucket(5, 0.01, 1, None), 5.0, True)
        for request in ("r1", "r2"):
            await store.evaluate(NOW, ADDRESS, [tight, bucket, slots(limit=3, request=request)])
        keys = [(tight.key, tight.limiter, 2.0), (bucket.key, bucket.limiter, 5.0),
                (slots().key, ConcurrencyLimiter(3, 30.0), 3.0),
                # No rule counts it now: its penalty only.
                (tight.key, None, 0.0),
                # Counted by another algorithm now: the rule's starts anew.
                (tight.key, TokenBucket(4, 1.0, 1, None), 4.0),
                ((("gone", ("ip",)), ADDRESS), tight.limiter, 2.0)]
        return [None if state is None else (state.key, state.penalty, state.quota)
                for state in await store.describe_keys(NOW + 10, keys)]
    assert run(open_store, test) == [
        (window("tight").key, 20.0, (0, 20.0, 60.0)),
        ((("bucket", ("ip",)), ADDRESS), 0.0, (3, 190.0, 500.0)),
        (slots().key, 0.0, (1, 20.0, 30.0)),
        (window("tight").key, 20.0, None),
        (window("tight").key, 0.0, (4, 0.0, 4.0)),
        None,
    ]


@beyond_deciding
def test_reset_keys_forget_counts_and_penalties_and_say_how_many_were_stored(open_store) -> None:
    from sidecar.counters import KeySelection

    async def test(store: StateStore) -> tuple:
        tight = window("tight", threshold=1)
        await store.evaluate(NOW, ADDRESS, [tight])
        refused = (await store.evaluate(NOW + 1, ADDRESS, [tight])).hits[0].over_limit
        found = await store.find_keys(NOW + 1, KeySelection(address=ADDRESS))
        reset = await store.reset_keys(NOW + 1, [*found, (("never", ("ip",)), ADDRESS)])
        allowed = not (await store.evaluate(NOW + 2, ADDRESS, [tight])).hits[0].over_limit
        return refused, reset, allowed, await store.reset_keys(NOW + 2, [])
    assert run(open_store, test) == (True, 1, True, 0)


@beyond_deciding
def test_a_ban_by_hand_over_an_escalated_ban_is_listed_as_a_first_ban(open_store) -> None:
    async def test(store: StateStore) -> tuple:
        check = window("scrapers", threshold=1, ban_duration=300.0, ban_increment=ESCALATING)
        first = await banned_once(store, NOW, check)
        second = await banned_once(store, first.ban.expires + 10, check)
        await store.ban(second.ban.expires - 100, ADDRESS, 60.0, "by hand")
        [listed] = await store.active_bans(second.ban.expires - 99)
        return second.ban.step, (listed.rule_id, listed.reason, listed.step)
    assert run(open_store, test) == (1, ("", "by hand", 0))


@beyond_deciding
def test_a_shadow_ban_is_listed_for_every_node_refuses_nobody_and_can_be_lifted(open_store) -> None:
    async def test(store: StateStore) -> tuple[Any, ...]:
        store.record_shadow_ban(BanRecord(ADDRESS, "scrapers", "node-b", 1.7e9, NOW + 600, 600.0, shadow=True))
        listed: list[BanRecord] = []
        for _ in range(200):  # written in the background by a shared store: wait for it, bounded
            listed = await store.shadow_bans(NOW)
            if listed:
                break
            await asyncio.sleep(0.01)
        evaluation = await store.evaluate(NOW, ADDRESS, [window("other", threshold=100)])
        real = await store.active_bans(NOW)
        lifted = await store.lift_shadow_ban(ADDRESS)
        return ([(b.address, b.rule_id, b.node, b.shadow, b.duration, 599 <= b.expires - NOW <= 600) for b in listed],
                evaluation.ban, real, lifted, await store.shadow_bans(NOW))
    listed, ban, real, lifted, after = run(open_store, test)
    assert listed == [(ADDRESS, "scrapers", "node-b", True, 600.0, True)]
    assert (ban, real, lifted, after) == (None, [], True, [])


@beyond_deciding
def test_forgetting_an_address_history_starts_its_escalation_over(open_store) -> None:
    async def test(store: StateStore) -> tuple[int, int, int]:
        check = window("scrapers", threshold=1, ban_duration=300.0, ban_increment=ESCALATING)
        first = await banned_once(store, NOW, check)
        assert first.ban is not None
        forgotten = await store.forget_history(ADDRESS)
        at = first.ban.expires + 10
        again = await banned_once(store, at, check)
        assert again.ban is not None
        return first.ban.step, forgotten, again.ban.step
    # Without the history the second ban would be step 1 (600 s).
    assert run(open_store, test) == (0, 1, 0)


@beyond_deciding
def test_tiers_are_assigned_replaced_listed_and_removed_in_this_node_s_copy_at_once(open_store) -> None:
    async def test(store: StateStore) -> tuple:
        copy = store.tier_assignments  # as the engine holds it
        await store.assign_tier("key-1", "pro")
        await store.assign_tier("sub|ünïcødé", "free")
        await store.assign_tier("key-1", "enterprise")  # replaces its tier
        at_once = dict(copy.items())
        listed = await store.assigned_tiers()
        removed = await store.unassign_tier("key-1"), await store.unassign_tier("key-1")
        return at_once, listed, removed, dict(copy.items()), await store.assigned_tiers(), \
            store.tier_assignments is copy
    held = {"key-1": "enterprise", "sub|ünïcødé": "free"}
    assert run(open_store, test) == (held, held, (True, False), {"sub|ünïcødé": "free"},
                                     {"sub|ünïcødé": "free"}, True)
