"""The node-wide memory store (sidecar.store.node) over the zone's pure
twin: it decides as the per-process memory store does, trace by trace and
for random rule sets; every primitive and role works over the zones' bytes;
two stores over the same zones (two workers) see one state; records keep
every field; the zones are bounded, private files. The compiled zone and
real workers are the integration tests' (test_workers_memory.py)."""

from __future__ import annotations

import importlib
import logging
import os
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sidecar import core, shm
from sidecar.at_once import run_at_once
from sidecar.bounded import SeenLately
from sidecar.config import Rate
from sidecar.counters import KeySelection
from sidecar.engine import Engine
from sidecar.limiters.concurrent import ConcurrencyLimiter, LeaseState
from sidecar.limiters.leaky import LeakyBucket, LeakyState
from sidecar.limiters.token import TokenBucket, TokenState
from sidecar.limiters.window import WindowCounter, WindowState
from sidecar.policy import BAN_STEP, COUNTED_PENALTY
from sidecar.request import CheckRequest
from sidecar.shm.pure_zone import Zone as PureZone
from sidecar.shm.pure_zone import layout
from sidecar.state import AutoBan, BanIncrement, BanRecord, Check, CheckSpec, PenaltyBan, ResponseCount
from sidecar.store import records
from sidecar.store.memory import MemoryStore
from sidecar.store.node import (
    BAN_VALUE,
    LABEL_VALUE,
    STALE_KEPT,
    TIER_ASSIGNMENTS,
    ZONE_ORDER,
    NodeStore,
    NodeTable,
    NodeZones,
    NotPlanned,
    compiled_zone,
    decode_tier,
    encode_tier,
    remove_orphans,
    same_key,
    zone_sizes,
)
from tests.unit.conftest import ruleset_from
from tests.unit.policy_traces import START, Request, Step, replay, traces

NOW = START


# The pure twin always; the compiled zone too where it is built.
ZONE_TYPES = [PureZone, *([shm.Zone] if shm.COMPILED else [])]


def node_store(max_keys: int = 1000, largest_concurrency: int = 2, clock: Callable[[], float] = lambda: NOW,
               zones: NodeZones | None = None, zone_type: Any = PureZone) -> NodeStore:
    zones = zones if zones is not None else NodeZones.private(max_keys, largest_concurrency, zone_type=zone_type)
    return NodeStore(zones, "node", clock=clock, wall_clock=lambda: 1_700_000_000.0)


def memory_store(clock: Callable[[], float] = lambda: NOW) -> MemoryStore:
    return MemoryStore(10_000, "node", clock=clock, wall_clock=lambda: 1_700_000_000.0)


# -- deciding as the memory store -----------------------------------------------


@pytest.mark.parametrize("zone_type", ZONE_TYPES, ids=lambda zone: zone.__module__)
@settings(max_examples=300, deadline=None)
@given(trace=traces)
def test_the_node_store_decides_as_the_memory_store(zone_type: Any, trace: list[Step]) -> None:
    """Every kind of check, ban, note, response and release of the policy's
    traces, answer for answer, while nothing is evicted."""
    assert run_at_once(replay(node_store(zone_type=zone_type), trace)) == run_at_once(replay(memory_store(), trace))


def window_limiters() -> st.SearchStrategy[Any]:
    return st.builds(WindowCounter, st.integers(1, 4), st.sampled_from([2.0, 5.0, 10.0]),
                     st.sampled_from([1.0, 5.0, 10.0]), st.booleans(), st.booleans())


def limiters() -> st.SearchStrategy[Any]:
    tokens = st.integers(1, 4).flatmap(lambda capacity: st.builds(
        TokenBucket, st.just(capacity), st.sampled_from([0.5, 1.0, 3.0]), st.integers(1, capacity),
        st.sampled_from([None, 2.0])))
    leaky = st.integers(0, 3).flatmap(lambda burst: st.builds(
        LeakyBucket, st.builds(Rate, st.integers(1, 3), st.just(1)), st.just(burst),
        st.one_of(st.none(), st.integers(0, burst)), st.sampled_from([None, 2.0])))
    slots = st.builds(ConcurrencyLimiter, st.integers(1, 3), st.sampled_from([3.0, 8.0]))
    return st.one_of(window_limiters(), tokens, leaky, slots)


@st.composite
def rule_specs(draw: st.DrawFn, rule_id: str) -> CheckSpec:
    limiter = draw(limiters())
    window = isinstance(limiter, WindowCounter)
    return CheckSpec(
        rule_id, limiter, float(getattr(limiter, "threshold", 1)), draw(st.booleans()),
        ban_duration=draw(st.sampled_from([None, 15.0])) if window else None,
        count=draw(st.booleans()) if window else True,
        auto_ban=draw(st.one_of(st.none(), st.builds(AutoBan, window_limiters(), st.integers(1, 3),
                                                     st.just(30.0)))) if window else None,
        amount=draw(st.integers(0, 2)) if window else 1,
        ban_increment=draw(st.one_of(st.none(), st.just(BanIncrement(2.0, 80.0, 60.0)))),
        penalty_ban=draw(st.one_of(st.none(), st.just(PenaltyBan.after(1, 40.0)))) if window else None)


@dataclass(frozen=True)
class Ask:
    address: str
    rules: tuple[int, ...]
    can_delay: bool
    quotas: bool


@dataclass(frozen=True)
class Report:
    address: str
    rule: int
    amount: int
    release: int


ADDRESSES = ("192.0.2.1", "192.0.2.1", "192.0.2.2", "")


@st.composite
def rule_sets_and_traces(draw: st.DrawFn) -> tuple[list[CheckSpec], list[tuple[float, Ask | Report]]]:
    count = draw(st.integers(1, 4))
    specs = [draw(rule_specs(f"r{n}")) for n in range(count)]
    asks = st.builds(Ask, st.sampled_from(ADDRESSES),
                     st.lists(st.integers(0, count - 1), min_size=1, max_size=3, unique=True).map(tuple),
                     st.booleans(), st.booleans())
    reports = st.builds(Report, st.sampled_from(ADDRESSES), st.integers(0, count - 1), st.integers(1, 2),
                        st.integers(1, 3))
    steps = st.tuples(st.sampled_from([0.0, 0.0, 0.2, 0.7, 1.5, 4.0, 12.0, 70.0]),
                      st.one_of(asks, asks, asks, reports))
    return specs, draw(st.lists(steps, min_size=3, max_size=40))


def spec_key(spec: CheckSpec, address: str) -> Any:
    return ((spec.rule_id, ("ip",)), address)


async def play(store: Any, specs: list[CheckSpec], trace: list[tuple[float, Ask | Report]]) -> list[Any]:
    now = NOW
    leases: list[str] = []
    answers: list[Any] = []
    for n, (advance, step) in enumerate(trace):
        now += advance
        if isinstance(step, Ask):
            leases.append(f"{n:x}" * 4)  # short and long lease ids alike
            checks = [Check(specs[rule], spec_key(specs[rule], step.address), leases[-1]) for rule in step.rules]
            evaluation = await store.evaluate(now, step.address, checks, step.can_delay, step.quotas)
            ban = evaluation.ban
            answers.append((None if ban is None else (ban.address, ban.rule_id, round(ban.expires - now, 9),
                                                      ban.step),
                            evaluation.new_ban, [(hit.over_limit, round(hit.retry_after, 9), round(hit.delay, 9))
                                                 for hit in evaluation.hits],
                            None if evaluation.quotas is None else
                            [None if quota is None else tuple(round(part, 9) for part in quota)
                             for quota in evaluation.quotas]))
        else:
            spec = specs[step.rule]
            key = spec_key(spec, step.address)
            hits = await store.record(now, [ResponseCount(key, spec.limiter, spec.threshold, step.amount)])
            lease = leases[-step.release] if len(leases) >= step.release else "none"
            answers.append(([(hit.over_limit, round(hit.retry_after, 9)) for hit in hits],
                            await store.release(lease, [key])))
    return answers


@pytest.mark.parametrize("zone_type", ZONE_TYPES, ids=lambda zone: zone.__module__)
@settings(max_examples=300, deadline=None)
@given(case=rule_sets_and_traces())
def test_the_node_store_decides_as_the_memory_store_for_random_rule_sets(
        zone_type: Any, case: tuple[list[CheckSpec], list[tuple[float, Ask | Report]]]) -> None:
    specs, trace = case
    largest = max((spec.limiter.limit for spec in specs if isinstance(spec.limiter, ConcurrencyLimiter)), default=0)
    on_node = run_at_once(play(node_store(largest_concurrency=largest, zone_type=zone_type), specs, trace))
    assert on_node == run_at_once(play(memory_store(), specs, trace))


@settings(max_examples=100, deadline=None)
@given(trace=traces)
# A lease state left without a lease, written at the last step: the admin's
# clock (the steps summed at once) is a hair before the store's (summed one
# by one); neither store lists it.
@example(trace=[(0.0, Request("192.0.2.1", ("block",), False, False, 1)),
                (0.05, Request("192.0.2.1", ("ban",), False, False, 1)),
                (0.05, Request("192.0.2.1", ("slots",), False, False, 2)),
                (4.0, Request("192.0.2.1", ("ban",), False, False, 1)),
                (4.0, Request("192.0.2.1", ("slots", "ban"), False, False, 1))])
def test_the_admin_view_is_the_memory_stores(trace: list[Step]) -> None:
    """After any trace, the keys found by address and by rule, and how each
    is described, are what the memory store says."""
    clock = [NOW]
    node, memory = node_store(clock=lambda: clock[0]), memory_store(clock=lambda: clock[0])
    run_at_once(replay(node, trace))
    run_at_once(replay(memory, trace))
    clock[0] = NOW + sum(advance for advance, _ in trace)
    now = clock[0]
    for selection in (KeySelection(address="192.0.2.1"), KeySelection(address="192.0.2.2"),
                      KeySelection(rule="block"), KeySelection(rule="slots"), KeySelection()):
        found = run_at_once(node.find_keys(now, selection))
        assert sorted(map(repr, found)) == sorted(map(repr, run_at_once(memory.find_keys(now, selection))))
        described = [(key, WindowCounter(3, 10.0, 5.0), 3.0) for key in found] + \
            [(key, None, 0.0) for key in found]
        assert run_at_once(node.describe_keys(now, described)) == \
            run_at_once(memory.describe_keys(now, described))
    assert sorted(map(repr, run_at_once(node.active_bans(now)))) == \
        sorted(map(repr, run_at_once(memory.active_bans(now))))


# -- the primitives, one transaction at a time ---------------------------------------


def test_every_primitive_reads_and_writes_the_zones() -> None:
    zones = NodeZones.private(1000, zone_type=PureZone)
    table = NodeTable(zones)
    window = WindowCounter(3, 10.0, 5.0)
    key = (("r", ("ip",)), "192.0.2.1")
    note = (BAN_STEP, "192.0.2.1", "r")
    ban = BanRecord("192.0.2.1", "r", "node", 1.0, NOW + 60, 60.0, step=2)

    def write() -> None:
        assert table.state(key) is None and table.ban("192.0.2.1") is None and table.note(note, NOW) is None
        state = window.new_state()
        window.hit(state, NOW, 3.0)
        table.keep(key, state)
        table.keep_ban(ban)
        table.keep_note(note, (2, 60.0), NOW + 100)
        assert table.state(key) is state and table.note(note, NOW) == (2, 60.0)

    def read() -> tuple[Any, Any, Any]:
        return table.state(key), table.ban("192.0.2.1"), table.note(note, NOW + 99)

    for action in (write, read):
        table.begin(NOW)
        table.plan_key(key, window)
        table.plan_ban("192.0.2.1")
        table.plan_note(note)
        result = table.run(action)
    state, found_ban, found_note = result
    assert (state.window, state.previous, state.current, state.limiter) == (int(NOW // 10), 0, 1, window)
    assert found_ban == ban and found_note == (2, 60.0)
    table.begin(NOW + 100)
    table.plan_note(note)
    assert table.run(table.note, note, NOW + 100) is None  # kept until, not at

    table.begin(NOW)
    table.plan_key(key, window)
    assert table.run(table.forget, key) is True
    table.begin(NOW)
    table.plan_key(key, window)
    assert table.run(table.state, key) is None


@pytest.mark.parametrize("zone_type", ZONE_TYPES)
def test_a_worker_writes_a_rule_s_prefix_once_for_all_its_keys(zone_type: Any) -> None:
    """The first key of a rule a worker writes writes its prefix too (for
    the admin API's listings); no later transaction plans it again, for
    that key or any other of the rule's, while a key of another rule
    plans its own."""
    zones = NodeZones.private(1000, zone_type=zone_type)
    table = NodeTable(zones)
    window = WindowCounter(3, 10.0, 5.0)
    rule, other = ("r", ("ip",)), ("s", ("ip",))

    def planned_prefix(key: Any) -> bytes | None:
        table.begin(NOW)
        slot = table.plan_key(key, window)
        prefix = slot.prefix
        table.run(lambda: table.keep(key, window.new_state()))
        return prefix

    assert planned_prefix((rule, "192.0.2.1")) == records.prefix_of((rule,))[1]
    assert len(zones.prefixes) == 1
    assert planned_prefix((rule, "192.0.2.1")) is None
    assert planned_prefix((rule, "192.0.2.2")) is None
    assert planned_prefix((other, "192.0.2.1")) == records.prefix_of((other,))[1]
    assert len(zones.prefixes) == 2
    worker = NodeTable(zones)  # another worker keeps its own count of the prefixes it wrote
    worker.begin(NOW)
    assert worker.plan_key((rule, "192.0.2.3"), window).prefix is not None


key_items = st.one_of(st.text(max_size=6), st.integers(), st.tuples(st.text(max_size=3)))


@given(prefix=st.tuples(st.text(max_size=3), st.tuples(st.text(max_size=3))), values=st.lists(key_items, max_size=3),
       others=st.lists(key_items, max_size=3))
def test_a_key_is_the_same_as_another_only_when_equal_and_is_when_its_texts_are(
        prefix: tuple[Any, ...], values: list[Any], others: list[Any]) -> None:
    key, other = (prefix, *values), (prefix, *others)
    assert not same_key(key, other) or key == other
    # Equal texts (not the same objects) after the same prefix: certainly the same.
    texts = [value for value in values if type(value) is str]
    assert same_key((prefix, *texts), (prefix, *("".join([text, "."])[:-1] for text in texts)))
    assert not same_key(list(key), list(key))  # not a tuple: unsure


@pytest.mark.parametrize("zone_type", ZONE_TYPES)
@pytest.mark.parametrize("replaced_by", ["names forgotten", "the other zone"])
def test_a_key_planned_twice_in_a_transaction_has_one_slot_whatever_its_place_remembers(
        zone_type: Any, replaced_by: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot remembers the key it was planned for last and its name (a
    request like the last one finds its keys' names in place); when the
    worker has another name for the key since (it forgot its names, or
    named the key again for the other zone), the key planned twice (equal,
    not the same object) is still planned in one slot."""
    import sidecar.store.node as node

    table = NodeTable(NodeZones.private(1000, 2, zone_type=zone_type))
    window = WindowCounter(3, 10.0, 5.0)
    rule = ("r", ("ip",))
    key = (rule, "192.0.2.1")

    def again() -> tuple[Any, ...]:
        return (rule, key[1][:4] + key[1][4:])

    for _ in range(2):  # planned again in its place: its name kept
        table.begin(NOW)
        table.plan_key((rule, "192.0.2.9"), window)
        table.plan_key(key, window)  # the second slot remembers the key
        table.run(lambda: None)
    assert key in table._names
    leases = replaced_by == "the other zone"
    if not leases:
        monkeypatch.setattr(node, "NAMES_KEPT", 1)
    table.begin(NOW)
    first = table.plan_key(again(), window, leases)
    assert table.plan_key(again(), window, leases) is first
    assert table._used == 1
    table.run(lambda: None)


def name_in_a_transaction(table: NodeTable, *keys: Any) -> None:
    """A transaction that plans the keys (a window's) and the ban of the
    last one's address, and writes nothing: what it names is all it does."""
    table.begin(NOW)
    for key in keys:
        table.plan_key(key, WindowCounter(3, 10.0, 5.0))
    table.plan_ban(keys[-1][1])
    table.run(lambda: None)


def test_a_worker_keeps_a_key_s_name_from_its_second_naming_and_none_of_a_rotation() -> None:
    """Under rotation no key is named twice, and none is kept (a few are,
    whose digests share a bit with an earlier one); a key named again, or
    planned again where it was planned last, is kept; so is an address's
    ban name named again (by a worker that named few keys: its digests'
    bits are their own)."""
    zones = NodeZones.private(5000, zone_type=PureZone)
    table = NodeTable(zones)
    rule = ("r", ("ip",))

    def transaction(*keys: Any) -> None:
        name_in_a_transaction(table, *keys)

    for number in range(2000):
        transaction((rule, f"10.1.{number >> 8}.{number & 255}"))
    assert len(table._names) <= 150 and len(table._ban_names) <= 150
    table = NodeTable(zones)
    key, other = (rule, "192.0.2.1"), (rule, "192.0.2.2")
    transaction(key)
    assert key not in table._names and "192.0.2.1" not in table._ban_names
    transaction(other, key)  # named again, elsewhere
    assert key in table._names and "192.0.2.1" in table._ban_names
    assert other not in table._names
    transaction(other, (rule, "192.0.2.3"))  # planned again in its place
    assert other in table._names


def test_the_names_kept_are_forgotten_when_the_filter_of_names_is_cleared() -> None:
    """A worker forgets the names it keeps (keys' and addresses') at the
    first transaction after its filter of names was cleared: under a
    rotation the few names it keeps (new keys whose bit an earlier key
    had set) never fill its dicts. A name kept again after that is kept."""
    table = NodeTable(NodeZones.private(5000, zone_type=PureZone))
    table._seen = SeenLately(256)  # its bits cleared after 32 first namings
    rule = ("r", ("ip",))

    def transaction(*keys: Any) -> None:
        name_in_a_transaction(table, *keys)

    key = (rule, "192.0.2.1")
    transaction(key)
    transaction(key, (rule, "192.0.2.2"))  # key named again: kept, as the address's ban name
    assert key in table._names and "192.0.2.1" not in table._ban_names  # the ban was named last, not again
    transaction((rule, "192.0.2.3"), key)
    assert key in table._names and "192.0.2.1" in table._ban_names
    generation = table._seen.generation
    number = 0
    while table._seen.generation == generation:  # new keys until the filter is cleared
        number += 1
        transaction((rule, f"10.2.{number >> 8}.{number & 255}"))
    assert number <= 40
    transaction((rule, "198.51.100.1"))
    assert key not in table._names and "192.0.2.1" not in table._ban_names
    transaction(key)
    transaction(key)  # planned again in its place: kept again
    assert key in table._names


def test_a_name_a_slot_still_holds_is_kept_again_once_the_names_are_forgotten() -> None:
    """A key planned again in its place after the worker forgot the names
    it keeps (its filter of names cleared between two transactions) is
    kept again: the slot still holds its name, which forgetting made not
    kept."""
    table = NodeTable(NodeZones.private(5000, zone_type=PureZone))
    table._seen = SeenLately(256)  # its bits cleared after 32 first namings
    key = (("r", ("ip",)), "192.0.2.1")
    name_in_a_transaction(table, key)
    name_in_a_transaction(table, key)  # planned again in its place: kept
    assert key in table._names
    generation = table._seen.generation
    number = 0
    while table._seen.generation == generation:  # first namings elsewhere, until the filter is cleared
        number += 1
        table._seen.again_at(number * 7919)
    assert number <= 40
    name_in_a_transaction(table, key)  # the names forgotten first, then the key planned in its place
    assert key in table._names


def test_a_key_whose_name_is_not_kept_is_planned_once_and_found_by_an_equal_key() -> None:
    table = NodeTable(NodeZones.private(1000, zone_type=PureZone))
    window = WindowCounter(3, 10.0, 5.0)
    rule = ("r", ("ip",))
    address = "192.0.2.7"
    table.begin(NOW)
    first = table.plan_key((rule, address), window)
    assert (rule, address) not in table._names
    assert table.plan_key((rule, address[:3] + address[3:]), window) is first
    assert table._used == 1
    state = window.new_state()
    window.hit(state, NOW, 3.0, 1)
    table.run(lambda: table.keep((rule, address[:2] + address[2:]), state))
    table.begin(NOW)
    table.plan_key((rule, address), window)
    assert table.run(table.state, (rule, address[:4] + address[4:])) == state


@settings(max_examples=100, deadline=None)
@given(order=st.permutations(range(5)), before=st.integers(0, 7))
def test_a_planned_key_is_found_whatever_order_it_is_read_in(order: list[int], before: int) -> None:
    """The policy reads a transaction's keys in the order planned, and the
    table looks for each from the last it found: read in any other order, or
    after a longer transaction left more slots behind, each is still found,
    and no key of another is."""
    table = NodeTable(NodeZones.private(1000, zone_type=PureZone))
    window = WindowCounter(3, 10.0, 5.0)
    table.begin(NOW)
    for number in range(before):
        table.plan_key((("old", ("ip",)), f"192.0.2.{number}"), window)
    table.run(lambda: [table.state((("old", ("ip",)), f"192.0.2.{number}")) for number in range(before)])
    keys = [(("r", ("ip",)), f"198.51.100.{number}") for number in range(5)]
    table.begin(NOW)
    for key in keys:
        table.plan_key(key, window)

    def read() -> list[Any]:
        states = []
        for number in order:
            table.keep(keys[number], window.new_state())
            states.append(table.state(keys[number]))
        for number in range(before):
            with pytest.raises(NotPlanned):
                table.state((("old", ("ip",)), f"192.0.2.{number}"))
        return states

    assert all(state is not None for state in table.run(read))


def test_a_record_the_store_did_not_lock_is_refused_and_a_failed_action_writes_nothing() -> None:
    zones = NodeZones.private(1000, zone_type=PureZone)
    table = NodeTable(zones)
    window = WindowCounter(3, 10.0, 5.0)
    key = (("r", ("ip",)), "192.0.2.1")
    table.begin(NOW)
    with pytest.raises(NotPlanned):
        table.run(table.state, key)
    with pytest.raises(NotPlanned):
        table.run(table.ban, "192.0.2.1")
    with pytest.raises(NotPlanned):
        table.run(table.note, (COUNTED_PENALTY, "192.0.2.1", "r"), NOW)

    def fails() -> None:
        table.keep(key, window.new_state())
        raise ZeroDivisionError

    table.begin(NOW)
    table.plan_key(key, window)
    with pytest.raises(ZeroDivisionError):
        table.run(fails)
    table.begin(NOW)
    table.plan_key(key, window)
    assert table.run(table.state, key) is None
    # Every stripe was unlocked: the pure zone refuses to lock one twice.
    table.begin(NOW)
    table.plan_key(key, window)
    assert table.run(table.state, key) is None


@pytest.mark.parametrize("zone_type", ZONE_TYPES, ids=lambda zone: zone.__module__)
@settings(max_examples=20, deadline=None)
@given(hits=st.lists(st.tuples(st.floats(min_value=0.0, max_value=30.0), st.booleans()), min_size=1, max_size=12))
def test_a_state_kept_decoded_is_the_record_s_even_after_a_failed_action_changed_it(
        zone_type: Any, hits: list[tuple[float, bool]]) -> None:
    # A worker keeps the states it decoded beside their bytes; an action that
    # changed a state and then failed wrote nothing, so the next read is the
    # record's as written last: only the hits that did not fail counted.
    zones = NodeZones.private(1000, zone_type=zone_type)
    table = NodeTable(zones)
    window = WindowCounter(3, 10.0, 5.0)
    key = (("r", ("ip",)), "192.0.2.1")
    expected = None
    at = NOW

    def count(fail: bool) -> None:
        state = table.state(key)
        if state is None:
            state = window.new_state()
            table.keep(key, state)
        window.hit(state, at, 3, 1)
        if fail:
            raise ZeroDivisionError

    def encoded(state: Any) -> bytes | None:
        return None if state is None else records.encode_state(state, zones.lease_slots)

    for later, fail in hits:
        at += later
        table.begin(at)
        table.plan_key(key, window)
        try:
            table.run(count, fail)
        except ZeroDivisionError:
            pass
        if not fail:
            expected = expected if expected is not None else window.new_state()
            window.hit(expected, at, 3, 1)
        table.begin(at)
        table.plan_key(key, window)
        state, raw = table.run(lambda: (table.state(key), table._slot(key).raw))
        assert encoded(state) == encoded(expected)
        assert encoded(state) == encoded(None if raw is None else records.decode_state(raw, window))


# -- two workers over one table -------------------------------------------------------


def two_workers(max_keys: int = 1000) -> tuple[NodeStore, NodeStore]:
    zones = NodeZones.private(max_keys, 2, zone_type=PureZone)
    return node_store(zones=zones), node_store(zones=zones)


def test_two_workers_count_one_budget() -> None:
    first, second = two_workers()
    spec = CheckSpec("r", WindowCounter(5, 60.0, 60.0), 5.0, True)
    tokens = CheckSpec("t", TokenBucket(5, 0.001, 1, None), 5.0, True)
    slots = CheckSpec("c", ConcurrencyLimiter(5, 60.0), 5.0, True)
    for check_spec in (spec, tokens, slots):
        admitted = 0
        for n in range(40):
            store = (first, second)[n % 2]
            checks = [Check(check_spec, ((check_spec.rule_id, ("ip",)), "a"), f"lease{n}")]
            evaluation = store.decide(NOW, "a", checks)
            admitted += not evaluation.hits[-1].over_limit
        assert admitted == 5
    # A slot taken through one worker is given back through the other.
    assert run_at_once(second.release("lease0", [(("c", ("ip",)), "a")])) == 1
    assert not first.decide(NOW, "a", [Check(slots, (("c", ("ip",)), "a"), "again")]).hits[-1].over_limit


def test_what_an_administrator_does_through_one_worker_every_worker_sees() -> None:
    first, second = two_workers()
    changes: list[str] = []
    second.follow(lambda: changes.append("change"), lambda: changes.append("reload"))
    run_at_once(first.ban(NOW, "192.0.2.9", 60.0, "abuse"))
    spec = CheckSpec("r", WindowCounter(5, 60.0, 60.0), 5.0, True)
    evaluation = second.decide(NOW, "192.0.2.9", [Check(spec, (("r", ("ip",)), "192.0.2.9"))])
    assert evaluation.ban is not None and evaluation.ban.reason == "abuse" and not evaluation.new_ban
    assert [ban.address for ban in run_at_once(second.active_bans(NOW))] == ["192.0.2.9"]
    assert second.may_be_banned()

    run_at_once(first.ban_network(NOW, "198.51.100.0/24", 60.0, "range"))
    assert [ban.address for ban in second.network_bans.in_force(NOW)] == ["198.51.100.0/24"]
    assert changes[-1] == "change"
    assert run_at_once(second.lift_network_ban(NOW, "198.51.100.0/24"))
    assert not first.network_bans.in_force(NOW)

    assert run_at_once(second.lift_ban("192.0.2.9"))
    assert run_at_once(first.ban_of(NOW, "192.0.2.9")) is None
    assert not first.decide(NOW, "192.0.2.9", [Check(spec, (("r", ("ip",)), "192.0.2.9"))]).hits[-1].over_limit

    first.record_shadow_ban(BanRecord("192.0.2.7", "r", "node", 1.0, NOW + 30, 30.0, shadow=True))
    assert [ban.shadow for ban in run_at_once(second.shadow_bans(NOW))] == [True]
    assert run_at_once(second.lift_shadow_ban("192.0.2.7"))
    assert not run_at_once(first.shadow_bans(NOW))

    assert "reload" not in changes
    first.announce_reload()
    second.refresh()
    assert changes.count("reload") == 1
    first.refresh()  # the worker that announced does not reload again


ONE_RULE = """
rules:
  - id: everyone
    key: [ip]
    limit: {requests: 3, per: 60s}
    action: block
"""


@pytest.mark.parametrize("zone_type", ZONE_TYPES)
def test_an_engine_over_a_worker_closes_a_network_another_worker_banned(zone_type: Any) -> None:
    """The engine asks its worker's table to catch up before every check
    (``TableInC.catch_up``, in C) and then reads the network bans: a
    network banned through another worker is closed at the next check,
    lifted it is open again; a store put in the engine's place is the one
    asked from then on."""
    zones = NodeZones.private(1000, 2, zone_type=zone_type)
    first, second = node_store(zones=zones), node_store(zones=zones)
    engine = Engine(ruleset_from(ONE_RULE), store=second, clock=lambda: NOW)

    def outcome(address: str) -> str:
        request = CheckRequest("GET", "h", "/", {}, engine.resolve_client(address, None), "r")
        return str(engine.decide_now(request).outcome)

    assert outcome("198.51.100.7") == "allow"
    run_at_once(first.ban_network(NOW, "198.51.100.0/24", 60.0, "range"))
    assert outcome("198.51.100.7") == "close"
    assert outcome("192.0.2.1") == "allow"
    run_at_once(first.lift_network_ban(NOW, "198.51.100.0/24"))
    assert [outcome("198.51.100.7") for _ in range(3)] == ["allow", "allow", "deny"]  # counted in the zones

    other = NodeZones.private(1000, 2, zone_type=zone_type)
    third, fourth = node_store(zones=other), node_store(zones=other)
    engine.store = fourth
    run_at_once(third.ban_network(NOW, "198.51.100.0/24", 60.0, "range"))
    assert outcome("198.51.100.7") == "close"
    assert [outcome("192.0.2.1") for _ in range(3)] == ["allow"] * 3  # the new store's count: 3 left


def test_resetting_keys_and_forgetting_history_act_for_every_worker() -> None:
    first, second = two_workers()
    gate = CheckSpec("gate", WindowCounter(1, 10.0, 10.0), 1.0, True, ban_duration=20.0,
                     ban_increment=BanIncrement(2.0, 80.0, 60.0))
    key = (("gate", ("ip",)), "192.0.2.3")
    first.decide(NOW, "192.0.2.3", [Check(gate, key)])
    first.decide(NOW, "192.0.2.3", [Check(gate, key)])
    banned = first.decide(NOW, "192.0.2.3", [Check(gate, key)])
    assert banned.ban is not None and banned.new_ban is False  # banned by the first refusal already
    assert run_at_once(second.forget_history("192.0.2.3")) == 1  # the escalation's note
    assert run_at_once(second.lift_ban("192.0.2.3"))
    first.decide(NOW, "192.0.2.3", [Check(gate, key)])
    assert run_at_once(second.find_keys(NOW, KeySelection(address="192.0.2.3"))) == [key]
    assert run_at_once(second.reset_keys(NOW, [key])) == 1
    assert run_at_once(first.find_keys(NOW, KeySelection(address="192.0.2.3"))) == []
    assert not first.decide(NOW, "192.0.2.3", [Check(gate, key)]).hits[-1].over_limit


# -- tier assignments made at run time ---------------------------------------------------


@pytest.mark.parametrize("zone_type", ZONE_TYPES, ids=lambda zone: zone.__module__)
def test_tiers_are_assigned_replaced_listed_and_removed(zone_type: Any) -> None:
    store = node_store(zone_type=zone_type)
    copy = store.tier_assignments  # as the engine holds it: changed in place
    run_at_once(store.assign_tier("key-1", "pro"))
    run_at_once(store.assign_tier("sub|ünïcødé", "free"))
    run_at_once(store.assign_tier("key-1", "enterprise"))  # replaces its tier
    longest = "k" * 256
    run_at_once(store.assign_tier(longest, "gold.2024-Q1_x"))
    held = {"key-1": "enterprise", "sub|ünïcødé": "free", longest: "gold.2024-Q1_x"}
    assert run_at_once(store.assigned_tiers()) == held
    assert dict(copy.items()) == held and store.tier_assignments is copy
    assert len(store.zones.tiers) == 3
    assert run_at_once(store.unassign_tier("key-1")) is True
    assert run_at_once(store.unassign_tier("key-1")) is False
    assert run_at_once(store.unassign_tier("never-assigned")) is False
    assert copy.get("key-1") is None and "key-1" not in run_at_once(store.assigned_tiers())
    assert store.tracked_keys() == 0  # assignments are no counting keys


def test_a_tier_assigned_through_one_worker_every_worker_sees(tmp_path: Path) -> None:
    prefix = str(tmp_path / "sluice-tiers")
    made = NodeZones.create(prefix, 1000, zone_type=PureZone)
    first = node_store(zones=NodeZones.attach(prefix, zone_type=PureZone))
    second = node_store(zones=NodeZones.attach(prefix, zone_type=PureZone))
    try:
        held = second.tier_assignments  # bound once, before any assignment
        changes: list[str] = []
        second.follow(lambda: changes.append("change"))
        run_at_once(first.assign_tier("key-1", "pro"))
        assert held.get("key-1") is None  # not looked yet: no zone read on a lookup
        assert second.refresh()
        assert held.get("key-1") == "pro" and changes == ["change"]
        assert run_at_once(second.assigned_tiers()) == {"key-1": "pro"}

        run_at_once(second.assign_tier("key-2", "free"))
        assert dict(first.tier_assignments.items()) == {"key-1": "pro", "key-2": "free"}
        assert run_at_once(second.unassign_tier("key-1"))
        assert dict(first.tier_assignments.items()) == {"key-2": "free"}
        assert dict(held.items()) == {"key-2": "free"}

        # Another change of the admin's is no reason to read the assignments again.
        reads: list[int] = []
        read_tiers = second._read_tiers

        def counted() -> dict[str, str]:
            reads.append(1)
            return read_tiers()

        second._read_tiers = counted  # type: ignore[method-assign]
        run_at_once(first.ban_network(NOW, "198.51.100.0/24", 60.0, "range"))
        assert second.refresh() and second.network_bans.in_force(NOW) and reads == []
        run_at_once(first.assign_tier("key-3", "pro"))
        assert second.refresh() and reads == [1] and held.get("key-3") == "pro"
    finally:
        for store in (first, second):
            store.zones.close()
        made.unlink()
        made.close()


@pytest.mark.parametrize("zone_type", ZONE_TYPES, ids=lambda zone: zone.__module__)
def test_a_full_tiers_zone_refuses_a_new_identity_and_evicts_no_assignment(zone_type: Any) -> None:
    zones = NodeZones.private(1000, 2, zone_type=zone_type, tiers=3)
    store, other = node_store(zones=zones), node_store(zones=zones)
    for number in range(3):
        run_at_once(store.assign_tier(f"secret-{number}", "pro"))
    with pytest.raises(ValueError, match="holds 3 tier assignments .* remove one first") as refused:
        run_at_once(other.assign_tier("secret-new", "free"))
    assert "secret" not in str(refused.value)  # an identity may be an API key: never in a message
    held = {f"secret-{number}": "pro" for number in range(3)}
    assert run_at_once(store.assigned_tiers()) == held and dict(other.tier_assignments.items()) == held
    assert zones.tiers.evictions == 0
    run_at_once(other.assign_tier("secret-1", "free"))  # a new tier for one held: no new record
    assert run_at_once(other.unassign_tier("secret-0"))
    run_at_once(other.assign_tier("secret-new", "free"))
    assert dict(store.tier_assignments.items()) == {"secret-1": "free", "secret-2": "pro", "secret-new": "free"}


def test_an_identity_or_tier_that_does_not_fit_a_record_is_refused_without_naming_it() -> None:
    store = node_store()
    wide = "é" * 200  # 200 characters: an identity, but 400 bytes of UTF-8
    with pytest.raises(ValueError, match="at most 256 bytes in UTF-8; this one takes 400") as refused:
        run_at_once(store.assign_tier(wide, "pro"))
    assert "é" not in str(refused.value)
    with pytest.raises(ValueError, match="1 to 32 characters"):
        run_at_once(store.assign_tier("key", "t" * 33))
    assert run_at_once(store.assigned_tiers()) == {} and len(store.tier_assignments) == 0
    assert decode_tier(encode_tier("é" * 128, "t" * 32)) == ("é" * 128, "t" * 32)
    assert decode_tier(b"") is None and decode_tier(b"\x05pro") is None and decode_tier(b"\x00key") is None


def test_the_tiers_zone_holds_its_assignments_within_a_container_s_default_shm() -> None:
    """The tiers zone is one stripe of TIER_ASSIGNMENTS records (none of a
    tracked key's 128 bytes), and the whole table for the default 100,000
    keys still fits a container's default 64 MB of /dev/shm."""
    sizes = zone_sizes(100_000, 16)
    assert sizes["tiers"].capacity == TIER_ASSIGNMENTS and sizes["tiers"].stripes == 1
    assert layout(*sizes["tiers"]).file_size < 3.5 * 2 ** 20
    assert sum(layout(*size).file_size for size in sizes.values()) < 64_000_000


# -- keys' text and the bounds ------------------------------------------------------------


def test_long_keys_are_listed_from_the_labels_zone_and_the_longest_can_still_be_named() -> None:
    store = node_store()
    spec = CheckSpec("path", WindowCounter(5, 60.0, 60.0), 5.0, True)
    short = (("path", ("path",)), "/a")
    long = (("path", ("path",)), "/" + "l" * 150)
    longest = (("path", ("path",)), "/" + "x" * (LABEL_VALUE + 10))
    for key in (short, long, longest):
        store.decide(NOW, "", [Check(spec, key)])
    listed = run_at_once(store.find_keys(NOW, KeySelection(rule="path")))
    assert sorted(listed) == sorted([short, long])
    assert run_at_once(store.find_keys(NOW, KeySelection(key=longest))) == [longest]
    [state] = run_at_once(store.describe_keys(NOW, [(longest, spec.limiter, 5.0)]))
    assert state is not None and state.quota is not None and state.quota.remaining == 4
    assert run_at_once(store.reset_keys(NOW, [long, longest])) == 2
    assert run_at_once(store.find_keys(NOW, KeySelection(rule="path"))) == [short]


def test_the_zones_hold_at_most_their_records_and_evict_the_least_recently_used() -> None:
    store = node_store(max_keys=256)
    spec = CheckSpec("r", WindowCounter(5, 60.0, 60.0), 5.0, True)
    for n in range(5000):
        store.decide(NOW, f"10.0.{n // 250}.{n % 250}", [Check(spec, (("r", ("ip",)), f"10.0.{n // 250}.{n % 250}"))])
    assert len(store.zones.states) <= store.zones.states.capacity <= 256
    assert len(store.zones.bans) == 0
    assert store.tracked_keys() == len(store.zones.states)


def test_states_stay_readable_after_they_stop_mattering_then_are_gone() -> None:
    clock = [NOW]
    store = node_store(clock=lambda: clock[0])
    slots = CheckSpec("c", ConcurrencyLimiter(2, 5.0), 2.0, True)
    key = (("c", ("ip",)), "a")
    store.decide(NOW, "a", [Check(slots, key, "lease")])
    clock[0] = NOW + 10  # the lease ended, as the memory store still knows
    assert run_at_once(store.release("lease", [key])) == 1
    store.decide(NOW, "a", [Check(slots, key, "other")])
    clock[0] = NOW + 5 + STALE_KEPT + 1
    assert run_at_once(store.release("other", [key])) == 0


def test_a_concurrency_limit_raised_past_the_records_size_runs_at_that_size(caplog: pytest.LogCaptureFixture) -> None:
    store = node_store(largest_concurrency=2)
    slots = store.zones.lease_slots
    spec = CheckSpec("c", ConcurrencyLimiter(slots + 10, 60.0), float(slots + 10), True)
    key = (("c", ("ip",)), "a")
    with caplog.at_level(logging.WARNING, logger="sluice"):
        admitted = sum(not store.decide(NOW, "a", [Check(spec, key, f"l{n}")]).hits[-1].over_limit
                       for n in range(slots + 20))
    assert admitted == slots
    assert sum("runs as" in record.getMessage() for record in caplog.records) == 1


def test_a_new_max_keys_is_told_to_wait_for_a_restart(caplog: pytest.LogCaptureFixture) -> None:
    store = node_store(max_keys=1000)
    with caplog.at_level(logging.WARNING, logger="sluice"):
        store.configure(1000, "other")
        assert not caplog.records and store.node == "other"
        store.configure(5000, "other")
    assert "until Sluice restarts" in caplog.records[0].getMessage()


@pytest.mark.parametrize("max_keys", [5000, 100_000, 1_000_000])
def test_a_tracked_key_takes_at_most_128_bytes(max_keys: int) -> None:
    """A state's record, with its share of the zone's hash buckets and
    stripe headers (a few hundred bytes a zone and a stripe, which a
    smaller table shares among fewer keys); every zone's size is fixed by
    max_keys alone."""
    sizes = zone_sizes(max_keys, 16)
    assert layout(*sizes["states"]).bytes_per_key <= 128
    assert sizes["states"].capacity >= max_keys and sizes["bans"].capacity >= max_keys
    assert records.lease_value_bytes(16) < sizes["leases"].value_size


# -- records ---------------------------------------------------------------------------

finite = st.floats(-1e12, 1e12, allow_nan=False)


@given(window=st.integers(-(1 << 62), 1 << 62), previous=st.integers(0, 1 << 40), current=st.integers(0, 1 << 40),
       penalty=st.one_of(finite, st.just(float("-inf"))))
def test_a_window_state_keeps_every_field(window: int, previous: int, current: int, penalty: float) -> None:
    limiter = WindowCounter(3, 10.0, 5.0)
    state = WindowState(window, previous, current, penalty, limiter)
    assert records.decode_state(records.encode_state(state, 16), limiter) == state


@given(tokens=finite, last=st.one_of(st.none(), finite), penalty=finite,
       excess=st.integers(0, 1 << 50), last_ms=st.one_of(st.none(), st.integers(0, 1 << 50)))
def test_bucket_states_keep_every_field(tokens: float, last: float | None, penalty: float, excess: int,
                                        last_ms: int | None) -> None:
    token, leaky = TokenBucket(3, 1.0, 1, None), LeakyBucket(Rate(1, 1), 2, None, None)
    assert records.decode_state(records.encode_state(TokenState(tokens, last, penalty, token), 16), token) == \
        TokenState(tokens, last, penalty, token)
    assert records.decode_state(records.encode_state(LeakyState(excess, last_ms, penalty, leaky), 16), leaky) == \
        LeakyState(excess, last_ms, penalty, leaky)


words = st.integers(-(1 << 63), (1 << 63) - 1)
doubles = st.floats(allow_nan=True, allow_infinity=True)


@given(window=words, previous=words, current=words, tokens=doubles, last=st.one_of(st.none(), doubles),
       penalty=doubles, excess=words, last_ms=st.one_of(st.none(), words))
@example(window=0, previous=0, current=0, tokens=-0.0, last=float("nan"), penalty=float("-inf"), excess=-1,
         last_ms=records.NO_LAST)
def test_a_states_bytes_are_its_layouts_whatever_its_fields(window: int, previous: int, current: int,
                                                            tokens: float, last: float | None, penalty: float,
                                                            excess: int, last_ms: int | None) -> None:
    """The states' bytes, written in C by the compiled core, are struct's
    packing of each layout, field for field: every 64-bit integer, and
    every double's bits (NaN, infinities and -0.0 too)."""
    import struct

    assert records.encode_state(WindowState(window, previous, current, penalty), 16) == \
        struct.pack("<Bqqqd", records.WINDOW, window, previous, current, penalty)
    assert records.encode_state(TokenState(tokens, last, penalty), 16) == \
        struct.pack("<Bddd", records.TOKEN, tokens, float("nan") if last is None else last, penalty)
    assert records.encode_state(LeakyState(excess, last_ms, penalty), 16) == \
        struct.pack("<Bqqd", records.LEAKY, excess, records.NO_LAST if last_ms is None else last_ms, penalty)


record_states = st.one_of(
    st.builds(WindowState, words, words, words, doubles),
    st.builds(TokenState, doubles, st.one_of(st.none(), doubles), doubles),
    st.builds(LeakyState, words, st.one_of(st.none(), words), doubles),
    st.builds(LeaseState, st.dictionaries(st.text(max_size=9).filter(lambda lease: len(lease.encode()) <= 9), finite,
                                          max_size=3)))


@given(state=record_states, text=st.one_of(st.none(), st.binary(max_size=600)), room=st.integers(-1, 700),
       flags=st.sampled_from([0, records.SPENT]))
@example(state=WindowState(1, 2, 3, 4.0), text=b"k" * 67, room=100, flags=0)  # fits exactly
@example(state=WindowState(1, 2, 3, 4.0), text=b"k" * 68, room=100, flags=0)  # one byte over
@example(state=TokenState(1.0, None, 0.0), text=b"k" * 480, room=600, flags=records.SPENT)  # past the copy space
@example(state=LeakyState(1, None, 0.0), text=b"k", room=-1, flags=records.SPENT)  # no record
def test_a_states_record_is_its_bytes_then_the_text_that_fits(state: Any, text: bytes | None, room: int,
                                                              flags: int) -> None:
    """In a zone's record (room >= 0) a state's bytes are followed by the
    key's text when both fit (else the flag ELSEWHERE), with the flags
    in the first byte: one object, made in C for the three fixed layouts.
    Outside a record, the state's bytes alone."""
    value = records.encode_state(state, 16)
    if room >= 0:
        if text is not None and len(value) + len(text) <= room:
            value += text
        else:
            flags |= records.ELSEWHERE
        value = bytes((value[0] | flags,)) + value[1:]
    assert records.encode_state(state, 16, text, room, flags) == value


short_ids = st.text(max_size=9).filter(lambda lease: len(lease.encode()) <= 9)
engine_ids = st.binary(min_size=9, max_size=9).map(bytes.hex)  # os.urandom(9).hex(), as the engine makes them


@given(held=st.dictionaries(st.one_of(short_ids, engine_ids), finite, max_size=8),
       longer=st.text(min_size=10).filter(lambda lease: len(lease) != 18))
def test_a_lease_state_keeps_its_leases_ids(held: dict[str, float], longer: str) -> None:
    limiter = ConcurrencyLimiter(8, 60.0)
    value = records.encode_state(LeaseState(dict(held), limiter), 16)
    assert records.state_length(value) == len(value)
    assert records.decode_state(value, limiter) == LeaseState(held, limiter)
    # A longer id of another form is kept as a hash no report names: the
    # slot ends with its lease.
    kept = records.decode_state(records.encode_state(LeaseState({longer: 1.0}, limiter), 16), limiter)
    assert list(kept.held.values()) == [1.0] and longer not in kept.held


def test_a_state_of_another_algorithm_belongs_to_a_stand_in_and_a_lease_state_to_at_most_its_slots() -> None:
    window, token = WindowCounter(3, 10.0, 5.0), TokenBucket(3, 1.0, 1, None)
    state = records.decode_state(records.encode_state(WindowState(1, 2, 3, 4.0, window), 16), token)
    assert isinstance(state, WindowState) and type(state.limiter) is WindowCounter and state.limiter is not window
    held = {f"l{n}": float(n) for n in range(20)}
    kept = records.decode_state(records.encode_state(LeaseState(held, ConcurrencyLimiter(20, 9.0)), 4), None)
    assert kept.held == {"l16": 16.0, "l17": 17.0, "l18": 18.0, "l19": 19.0} and kept.limiter.leases


@given(address=st.text(max_size=43).filter(lambda text: len(text.encode()) <= 43),
       rule_id=st.text(st.characters(max_codepoint=127), max_size=64),
       node=st.text(max_size=300), reason=st.text(max_size=256), shadow=st.booleans(), step=st.integers(0, 1000),
       times=st.tuples(finite, finite, finite))
def test_a_ban_record_keeps_its_fields_and_shortens_only_its_node_and_reason(
        address: str, rule_id: str, node: str, reason: str, shadow: bool, step: int,
        times: tuple[float, float, float]) -> None:
    """Any client key or network (43 characters at most) and rule id (64)
    fit a record of the bans zone whole."""
    record = BanRecord(address, rule_id, node, *times, shadow=shadow, step=step, reason=reason)
    value = records.encode_ban(record, BAN_VALUE)
    assert len(value) <= BAN_VALUE
    back = records.decode_ban(value)
    assert (back.address, back.rule_id, back.started_wall, back.expires, back.duration, back.shadow, back.step) == \
        (address, rule_id, *times, shadow, step)
    assert node.startswith(back.node) and reason.startswith(back.reason)
    if len(value) < BAN_VALUE - 4:
        assert (back.node, back.reason) == (node, reason)


@given(texts=st.lists(st.text(max_size=400), min_size=4, max_size=4), room=st.integers(33, 400))
def test_a_ban_record_always_fits_its_room(texts: list[str], room: int) -> None:
    value = records.encode_ban(BanRecord(texts[0], texts[1], texts[2], 1.0, 2.0, 3.0, reason=texts[3]), room)
    assert len(value) <= room
    back = records.decode_ban(value)
    assert all(whole.startswith(part) for whole, part in zip(texts, (back.address, back.rule_id, back.node,
                                                                     back.reason)))


@given(key=st.tuples(st.tuples(st.text(), st.lists(st.text(), max_size=3).map(tuple)),
                     st.one_of(st.text(), st.tuples(st.text(), st.text()))))
def test_a_keys_text_reads_back_as_the_key(key: Any) -> None:
    text = records.key_text(key)
    code, prefix = records.prefix_of(key)
    assert text.startswith(code) and records.parse_prefix(prefix) == key[0]
    assert records.parse_key(text, {code: key[0]}) == key
    assert records.parse_key(text, {}) is None  # a prefix no worker wrote: not listed
    # Worked out in one call, as the store does for each key it meets.
    names = records.Namer(bytes(range(16)))
    assert names.key_name(key) == (text, names.digest(text), prefix)


# A key's values: texts (printable ASCII, quotes and backslashes, or any),
# numbers, None, and tuples of them, one level deep or two.
_TEXTS = st.one_of(st.text(st.characters(min_codepoint=32, max_codepoint=126)), st.text(),
                   st.sampled_from(["", "'", "\\", '"', "it's", "a\tb", "é", "10.0.0.7"]))
_VALUES = st.recursive(st.one_of(_TEXTS, st.integers(), st.none()),
                       lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=6)


@given(values=st.lists(_VALUES, max_size=4))
@example(values=["10.0.0.7"])
@example(values=["key-7", "10.0.0.7"])
@example(values=[("ip", "10.0.0.7")])
@example(values=["it's", ("a\\b",)])
def test_a_keys_values_are_written_as_repr_writes_them(values: list[Any]) -> None:
    """values_text, written out for the common key, is repr's text of the
    key's values whatever they are (parse_key reads repr's)."""
    key = (("rule", ("ip",)), *values)
    assert records.values_text(key) == repr(key[1:]).encode()


# SipHash-2-4 with its 128-bit output: the reference's vectors (veorq/SipHash,
# vectors.h: the key 00 01 .. 0f, the message 00 01 .. of each length).
SIPHASH128_VECTORS = {0: "a3817f04ba25a8e66df67214c7550293", 1: "da87c1d86b99af44347659119b22fc45",
                      7: "a1f1ebbed8dbc153c0b84aa61ff08239", 8: "3b62a9ba6258f5610f83e264f31497b4",
                      15: "5493e99933b0a8117e08ec0f97cfc3d9", 16: "6ee2a4ca67b054bbfd3315bf85230577",
                      31: "2939b0183223fafc1723de4f52c43d35", 63: "5150d1772f50834a503e069a973fbd7c"}


# The pure namer always; the compiled one (names made in C) beside it where
# the compiled core runs.
NAMERS = [records.Namer, *([importlib.import_module("sidecar.store._naming").FastNamer] if not core.PURE else [])]


@pytest.mark.parametrize("namer", NAMERS)
@pytest.mark.parametrize(("length", "expected"), SIPHASH128_VECTORS.items())
def test_a_record_s_digest_is_siphash_2_4_of_128_bits(length: int, expected: str, namer: type) -> None:
    assert namer(bytes(range(16))).digest(bytes(range(length))).hex() == expected


def test_the_node_s_records_are_named_by_the_core_s_namer() -> None:
    names = NodeZones.private(100, zone_type=PureZone).names
    assert type(names) is NAMERS[-1]
    assert isinstance(names, records.Namer)


# Counting keys as rules make them (a prefix, then one value or two, plain
# texts most often) and any other shape a key may take.
_PREFIXES = st.tuples(st.sampled_from(["per-ip", "login", "it's"]),
                      st.lists(st.sampled_from(["ip", "path", "header:x-api-key"]), max_size=2).map(tuple))
_PLAIN = st.one_of(st.text(st.characters(min_codepoint=32, max_codepoint=126)),
                   st.sampled_from(["10.0.0.7", "2001:db8:7::", "key-7", "", "~ !", "a'b", "a\\b"]))


@pytest.mark.skipif(core.PURE, reason="the compiled namer: the compiled core only")
@settings(max_examples=300)
@given(secret=st.binary(min_size=16, max_size=16), prefix=_PREFIXES,
       values=st.one_of(st.lists(_PLAIN, min_size=1, max_size=2), st.lists(_VALUES, max_size=3)),
       address=st.one_of(_PLAIN, st.text()), text=st.binary(max_size=300))
@example(secret=bytes(16), prefix=("per-ip", ("ip",)), values=["10.0.0.7"], address="10.0.0.7", text=b"")
@example(secret=bytes(16), prefix=("api", ("ip", "header:x-api-key")), values=["2001:db8::", "k"],
         address="é", text=bytes(range(200)))  # a length past 127: SipHash's last word keeps its low byte
def test_the_compiled_namer_names_as_the_pure_one(secret: bytes, prefix: Any, values: list[Any], address: str,
                                                  text: bytes) -> None:
    """Every name the compiled namer makes (a key's text, digest and
    prefix text; a ban's and any text's digest) is the pure namer's."""
    fast, pure = NAMERS[-1](secret), records.Namer(secret)
    key = (prefix, *values)
    assert fast.key_name(key) == pure.key_name(key)
    assert fast.ban_name(address) == pure.ban_name(address)
    assert fast.digest(text) == pure.digest(text)


@pytest.mark.skipif(core.PURE, reason="the compiled namer: the compiled core only")
def test_the_compiled_namer_keeps_only_prefixes_whose_value_cannot_change() -> None:
    """Texts and tuples of texts are kept by identity; a prefix holding
    anything else (an object whose text may change) is named each time,
    and not held."""

    class Label:
        def __init__(self, text: str) -> None:
            self.text = text

        def __repr__(self) -> str:
            return self.text

    changing, kept = ("rule", ("ip", Label("first"))), ("rule", ("ip",))
    keys = [(changing, "192.0.2.1"), (kept, "192.0.2.1")]
    names = [records.Namer(bytes(16)).key_name(key) for key in keys]  # records.prefix_of keeps their texts
    held = sys.getrefcount(changing), sys.getrefcount(kept)
    fast = NAMERS[-1](bytes(16))
    assert [fast.key_name(key) for key in keys] == names
    assert (sys.getrefcount(changing), sys.getrefcount(kept)) == (held[0], held[1] + 1)


@pytest.mark.skipif(core.PURE, reason="the compiled namer: the compiled core only")
@pytest.mark.parametrize("name", ["key_name", "ban_name", "digest"])
@pytest.mark.parametrize("odd", [None, 7, ("rule",), (), b"text", "text"])
def test_the_compiled_namer_answers_anything_as_the_pure_one(name: str, odd: Any) -> None:
    """Whatever it is given (None first: C would read it as a text), the
    compiled namer gives the pure namer's name or raises its error."""

    def outcome(namer: Any) -> Any:
        try:
            return getattr(namer, name)(odd)
        except (TypeError, AttributeError, IndexError) as refused:
            return type(refused)

    assert outcome(NAMERS[-1](bytes(16))) == outcome(records.Namer(bytes(16)))


@pytest.mark.skipif(core.PURE, reason="the compiled namer: the compiled core only")
@settings(max_examples=50)
@given(order=st.lists(st.integers(0, 99), min_size=1, max_size=400), value=_PLAIN)
def test_the_compiled_namer_keeps_rules_prefixes_by_identity_and_names_as_the_pure_one(order: list[int],
                                                                                          value: str) -> None:
    """A rule's keys share its prefix object, whose code and text the
    compiled namer keeps by identity: a hundred rules' prefixes met in any
    order (more than it keeps, so some replace others) name their keys as
    the pure namer does, and a namer let go holds none of them."""
    prefixes = [(f"rule-{number}", ("ip",)) for number in range(100)]
    keys = [(prefixes[number], value) for number in order]
    names = [records.Namer(bytes(16)).key_name(key) for key in keys]  # records.prefix_of keeps their texts
    held = [sys.getrefcount(prefix) for prefix in prefixes]
    fast = NAMERS[-1](bytes(16))
    assert [fast.key_name(key) for key in keys] == names
    del fast
    assert [sys.getrefcount(prefix) for prefix in prefixes] == held


@settings(max_examples=200)
@given(secret=st.binary(min_size=16, max_size=16), other=st.binary(min_size=16, max_size=16),
       text=st.binary(max_size=100))
def test_a_digest_depends_on_the_node_s_secret(secret: bytes, other: bytes, text: bytes) -> None:
    names = records.Namer(secret)
    assert names.digest(text) == records.Namer(secret).digest(text)  # the same in every worker
    if other != secret:
        assert names.digest(text) != records.Namer(other).digest(text)


def test_a_secret_that_is_not_16_bytes_is_refused() -> None:
    for wrong in (b"", bytes(15), bytes(17)):
        with pytest.raises(ValueError, match="16 bytes"):
            records.Namer(wrong)


def test_every_worker_names_records_with_its_node_s_secret_and_other_nodes_differ(tmp_path: Path) -> None:
    made = [NodeZones.create(str(tmp_path / f"sluice-{n}"), 1000, zone_type=PureZone) for n in range(2)]
    worker = NodeZones.attach(str(tmp_path / "sluice-0"), zone_type=PureZone)
    key = (("r", ("ip",)), "192.0.2.1")
    assert worker.names.key_name(key) == made[0].names.key_name(key)
    assert made[0].states.secret != made[1].states.secret
    assert made[0].names.key_name(key)[1] != made[1].names.key_name(key)[1]
    for zones in (*made, worker):
        zones.close()


@pytest.mark.parametrize("text", [b"", b"nonsense", b"(1, 2)", b"('a', 3)", b"\xff", b"(('a', 'b', 'c'),)",
                                  b"'a'", b"__import__('os')"])
def test_text_that_is_no_key_reads_as_none(text: bytes) -> None:
    prefix = (("r", ("ip",)), "v")
    code = records.prefix_of(prefix)[0]
    assert records.parse_key(code + text, {code: prefix[0]}) is None
    assert records.parse_prefix(text) is None


# -- the zones' files, and serve -------------------------------------------------------------


def test_the_zones_are_private_files_attached_by_name_and_removed(tmp_path: Path) -> None:
    prefix = str(tmp_path / "sluice-test")
    zones = NodeZones.create(prefix, 1000, 4, zone_type=PureZone)
    files = sorted(tmp_path.iterdir())
    assert len(files) == len(ZONE_ORDER) and all(stat.S_IMODE(file.stat().st_mode) == 0o600 for file in files)
    with pytest.raises(FileExistsError):
        NodeZones.create(prefix, 1000, 4, zone_type=PureZone)
    assert sorted(tmp_path.iterdir()) == files  # the second attempt left the first's alone
    worker = node_store(zones=NodeZones.attach(prefix, zone_type=PureZone))
    assert worker.zones.lease_slots == 16 and worker.zones.max_keys == zones.max_keys
    zones.unlink()
    assert not list(tmp_path.iterdir())
    worker.zones.close()
    zones.close()
    with pytest.raises((OSError, ValueError)):
        NodeZones.attach(prefix, zone_type=PureZone)


def test_zone_files_left_by_a_serve_that_is_gone_are_removed_and_no_others(tmp_path: Path) -> None:
    gone = 2 ** 22 + 1  # above pid_max's default: no process has it
    for pid in (gone, os.getpid()):
        NodeZones.create(str(tmp_path / f"sluice-{pid}-0123456789ab"), 1000, zone_type=PureZone).close()
    (tmp_path / f"sluice-{gone}-0123456789ab-other").write_text("not a zone of ours")
    (tmp_path / "unrelated").write_text("")
    removed = remove_orphans(str(tmp_path))
    assert sorted(Path(path).name for path in removed) == sorted(f"sluice-{gone}-0123456789ab-{name}"
                                                                 for name in ZONE_ORDER)
    assert sorted(file.name for file in tmp_path.iterdir()) == sorted(
        [f"sluice-{gone}-0123456789ab-other", "unrelated",
         *(f"sluice-{os.getpid()}-0123456789ab-{name}" for name in ZONE_ORDER)])
    assert remove_orphans(str(tmp_path / "missing")) == []


def test_serve_refuses_several_workers_on_the_memory_backend_with_the_pure_core(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar import cli, core

    monkeypatch.setattr(core, "PURE", True)
    monkeypatch.setattr(core, "which", lambda: "pure-Python core (SLUICE_PURE_PYTHON=1)")
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - id: r\n    match: {path: {prefix: /}}\n    limit: {requests: 1, per: 1s}\n"
                     "    action: block\n")
    result = CliRunner().invoke(cli.main, ["serve", "--config", str(rules), "--workers", "2", "--port", "1"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1
    assert "--workers > 1 with the memory backend needs the compiled core (this is the pure-Python core " \
        "(SLUICE_PURE_PYTHON=1))" in result.output


def test_a_store_opened_by_name_is_the_node_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar import shm
    from sidecar.store import open_store

    monkeypatch.setattr(shm, "Zone", PureZone, raising=False)
    prefix = str(tmp_path / "sluice-open")
    zones = NodeZones.create(prefix, 1000, zone_type=PureZone)
    store = open_store("memory", "", 1000, "node", lambda: NOW, zones=prefix)
    assert isinstance(store, NodeStore) and store.answers_at_once
    assert isinstance(open_store("memory", "", 1000, "node", lambda: NOW), MemoryStore)
    zones.unlink()



def test_a_table_calls_the_compiled_zone_in_c_and_the_pure_one_as_any_object() -> None:
    zone = shm.Zone.private(100, 16, 4)
    assert compiled_zone(zone) is (zone if shm.COMPILED else None)
    assert compiled_zone(PureZone.private(100, 16, 4)) is None
    key, limiter = ("r", ("ip", "192.0.2.1")), WindowCounter(1, 60.0, 0.0)
    for zone_type in ZONE_TYPES:
        table = NodeTable(NodeZones.private(100, zone_type=zone_type))
        table.begin(NOW)
        slot = table.plan_key(key, limiter)
        assert slot.compiled is (slot.zone if zone_type is not PureZone else None)
        state = limiter.new_state()
        limiter.hit(state, NOW, 1.0)
        table.run(table.keep, key, state)  # written, then read back in another transaction
        table.begin(NOW)
        table.plan_key(key, limiter)
        assert table.run(table.state, key) == state


def test_a_table_refuses_a_zone_of_more_stripes_than_a_mask_has_bits() -> None:
    sizes = zone_sizes(100, 16)
    made = {name: PureZone.private(*size) for name, size in sizes.items()}
    made["notes"] = PureZone.private(65 * 64, sizes["notes"].value_size, 65)
    with pytest.raises(ValueError, match="the notes zone has 65 stripes; a transaction locks zones of at most 64"):
        NodeTable(NodeZones("", made))


@pytest.mark.parametrize("zone_type", ZONE_TYPES, ids=lambda zone: zone.__module__)
def test_the_engine_asks_the_node_store_without_a_coroutine_unless_evaluate_is_overridden(zone_type: Any) -> None:
    from sidecar.store.local import plain_evaluation, plain_table

    store = node_store(zone_type=zone_type)
    assert plain_table(store) == (store.table, store.policy, store.network_bans)
    assert plain_evaluation(store) is None  # its transaction is asked of its table

    class Watched(NodeStore):
        async def evaluate(self, *arguments: Any, **options: Any) -> Any:
            return await super().evaluate(*arguments, **options)

    assert plain_table(Watched(NodeZones.private(100, zone_type=zone_type), "node")) is None


# -- the table's counters -------------------------------------------------------------


@pytest.mark.parametrize("zone_type", ZONE_TYPES, ids=lambda zone: zone.__module__)
@settings(max_examples=10, deadline=None)
@given(keys=st.integers(min_value=1, max_value=300))
def test_the_store_counts_each_zone_s_evictions_and_records(zone_type: Any, keys: int) -> None:
    store = node_store(max_keys=64, zone_type=zone_type)
    capacity = store.zones.states.capacity
    assert store.zones.states.stripes == 1  # one stripe: the least recently used key goes first
    limiter = WindowCounter(10, 60.0, 0.0)
    for number in range(keys):
        store.count_now((("r", ("ip",)), f"10.0.0.{number}"), limiter, NOW, 10, 1)
    figures = store.zone_statistics()
    assert set(figures) == set(ZONE_ORDER)
    assert figures["states"] == {"recoveries": 0, "evictions": max(0, keys - capacity), "waits": 0,
                                 "records": min(keys, capacity), "capacity": capacity}
    assert all(figure["evictions"] == 0 for name, figure in figures.items() if name != "states")
    # ...which /metrics reports, summed over the zones.
    gauges = {name: read() for name, (_, read) in store.gauges().items()}
    assert gauges["sluice_node_table_evictions"] == max(0, keys - capacity)
    assert gauges["sluice_node_table_records"] == sum(figure["records"] for figure in figures.values())
    assert gauges["sluice_node_table_capacity"] == sum(figure["capacity"] for figure in figures.values())
    assert gauges["sluice_node_table_lock_recoveries"] == gauges["sluice_node_table_lock_waits"] == 0


@pytest.mark.skipif(not shm.COMPILED, reason="the pure twin takes no lock between threads")
def test_the_store_counts_a_lock_found_busy() -> None:
    import threading
    import time

    store = node_store(zone_type=shm.Zone)
    key = (("r", ("ip",)), "10.0.0.1")
    states = store.zones.states
    stripe = [states.stripe_of(store.zones.names.digest(records.key_text(key)))]
    counted: list[Any] = []
    states.lock(stripe)
    try:
        counter = threading.Thread(target=lambda: counted.append(
            store.count_now(key, WindowCounter(10, 60.0, 0.0), NOW, 10, 1)), daemon=True)
        counter.start()
        deadline = time.monotonic() + 10
        while store.zone_statistics()["states"]["waits"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # the other thread asks for the lock this one holds
    finally:
        states.unlock(stripe)
    counter.join(10)
    assert len(counted) == 1 and not counted[0].over_limit
    assert store.zone_statistics()["states"]["waits"] == 1

