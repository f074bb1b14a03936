"""BoundedMap: expired entries go first, then the least recently used, at
O(1) cost per insertion. StateMap: the same, with a read marking the state
instead of moving it (a second chance when room is made); with the compiled
core, its C twin too (sidecar/_statemap.pyx), held to the pure one."""

import collections
import gc
import importlib
import sys
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sidecar import core
from sidecar.bounded import BoundedMap, StateMap
from sidecar.limiters.window import WindowCounter
from sidecar.state import Check
from sidecar.store.memory import MemoryTable


class Expiring:
    """A value whose expiry a test sets, counting how often it is asked."""

    calls = 0

    def __init__(self, expires: float) -> None:
        self.expires = expires


def expires_at(value: Expiring) -> float:
    Expiring.calls += 1
    return value.expires


def bounded(max_keys: int, clock: list[float]) -> BoundedMap:
    return BoundedMap(max_keys, expires_at, lambda: clock[0])


def test_expired_entries_go_before_older_live_ones():
    clock = [0.0]
    m = bounded(10, clock)
    for key in range(10):
        m[key] = Expiring(1e9 if key != 7 else 5.0)  # 7 expires at 5 s
    clock[0] = 6.0
    m[10] = Expiring(1e9)
    assert m.get(7) is None  # expired, though 0..6 are older
    assert all(m.get(key) is not None for key in range(7))
    assert len(m) == 10


def test_without_expired_entries_the_least_recently_used_go():
    clock = [0.0]
    m = bounded(10, clock)
    for key in range(10):
        m[key] = Expiring(1e9)
    m.get(0)
    m[10] = Expiring(1e9)
    assert m.get(0) is not None and m.get(1) is None and m.get(10) is not None


def test_an_entry_pushed_later_by_its_state_survives_the_sweep():
    clock = [0.0]
    m = bounded(4, clock)
    values = [Expiring(5.0) for _ in range(4)]
    for key, value in enumerate(values):
        m[key] = value
    values[3].expires = 100.0  # counted again: lives longer, in place
    clock[0] = 10.0
    m[4] = Expiring(1e9)
    assert m.get(3) is values[3] and [m.get(key) for key in range(3)] == [None] * 3


def test_sweeps_stay_amortized_when_entries_expire():
    clock = [0.0]
    m = bounded(1000, clock)
    Expiring.calls = 0
    for key in range(100_000):
        clock[0] = key / 1000
        m[key] = Expiring(clock[0] + 0.5)  # expire half a second later
        assert len(m) <= 1000
    assert Expiring.calls <= 100_000 * 11


def test_rotation_asks_each_expiry_about_once_per_insertion():
    """No sweep over the map: a key's expiry is asked when it is stored and
    when its slot has passed, not at every eviction."""
    clock = [0.0]
    m = bounded(1000, clock)
    Expiring.calls = 0
    for key in range(100_000):
        clock[0] = key / 1000
        # Half expire within a second, half outlive the run.
        m[key] = Expiring(clock[0] + (0.5 if key % 2 else 1e6))
    assert len(m) <= 1000
    # One when stored, one or two for a slot passed, and the wheel's
    # rebuilds; a sweep over the map at each eviction costs about 11.
    assert Expiring.calls <= 100_000 * 4


def test_an_entry_read_often_keeps_its_place_and_stale_references_stay_bounded():
    clock = [0.0]
    m = bounded(100, clock)
    kept = Expiring(1e9)
    m["kept"] = kept
    for key in range(50_000):
        m.get("kept")
        m[key] = Expiring(1e9)
        assert len(m) <= 100
    assert m.get("kept") is kept
    # Keys forgotten by recency leave references in the expiry wheel; the
    # wheel is rebuilt before they outnumber the map's keys by much.
    assert m._filed <= 2 * len(m) + 1024 + 1


def test_a_key_popped_and_stored_again_never_grows_the_wheel_of_a_map_that_is_not_full():
    """As a concurrency limit's key is, on every request: the map never
    fills, so no room is made, and its stale references are still dropped."""
    clock = [0.0]
    m = bounded(100_000, clock)
    for _ in range(20_000):
        m.add(("exports", "192.0.2.1"), Expiring(1e9))
        m.pop(("exports", "192.0.2.1"))
        assert m._filed <= 2 * 1 + 1024 + 1  # the bound while the key is stored
    assert len(m) == 0


def test_a_value_replaced_many_times_keeps_one_reference():
    """A ban or a step stored again over its key: a later expiry keeps the
    reference it has, an earlier one is filed anew, and the wheel stays
    bounded either way."""
    clock = [0.0]
    m = bounded(100_000, clock)
    for step in range(20_000):
        # Alternately later and earlier than the value it replaces.
        m["address"] = Expiring(1_000.0 + (step % 2) * 500 - step * 0.01)
        assert m._filed <= 2 * len(m) + 1024 + 1
    m["address"] = Expiring(0.5)
    clock[0] = 1.0
    for key in range(100_000):
        m.add(key, Expiring(1e9))
    assert m.get("address") is None  # found expired through its earliest reference


# --------------------------------------------------------------------------
# StateMap: the counting keys' states
# --------------------------------------------------------------------------

COUNTER = WindowCounter(10, 60.0, 60.0)


def state() -> object:
    """A limiter's state that expires long after every test's clock."""
    made = COUNTER.new_state()
    made.penalty_until = 1e9  # expires_at: the end of the penalty, at the latest
    return made


# The pure map, and the compiled one beside it when the compiled core runs.
STATE_MAPS: list[Callable[..., Any]] = [StateMap]
if not core.PURE:
    STATE_MAPS.append(importlib.import_module("sidecar._statemap").StateMap)


@pytest.fixture(params=STATE_MAPS, ids=lambda kind: kind.__module__)
def states(request: pytest.FixtureRequest) -> Callable[[int], Any]:
    """A maker of state maps of ``max_keys`` on a clock at 0, either kind."""
    return lambda max_keys: request.param(max_keys, lambda: 0.0)


def test_the_memory_store_uses_the_map_of_its_core():
    table = MemoryTable(10, lambda: 0.0)
    assert type(table.states).__module__ == ("sidecar.bounded" if core.PURE else "sidecar._statemap")


def test_a_state_read_is_marked_and_not_moved(states):
    m = states(10)
    for key in range(3):
        m.add(key, state())
    value = m.get(0)
    assert value is not None and m.marked(0)
    assert list(m.data) == [0, 1, 2]  # in place: one lookup, no move
    assert m.get("never stored") is None


@pytest.mark.parametrize(("max_keys", "left"), [(1_000, 990), (50, 49), (1, 0)])
def test_a_full_map_makes_room_by_a_hundredth_of_its_keys(states, max_keys, left):
    """Full, a new key makes room by a hundredth of the map, at least one
    key (the oldest), then is stored."""
    m = states(max_keys)
    for key in range(max_keys):
        m.add(key, state())
    m.add("new", state())
    assert list(m.data) == [*range(max_keys - left, max_keys), "new"]


def test_a_state_read_since_room_was_last_made_outlives_older_unread_ones(states):
    m = states(10)
    for key in range(10):
        m.add(key, state())
    m.get(0)
    m.add(10, state())
    assert m.get(0) is not None and m.get(1) is None and m.get(10) is not None
    assert len(m) == 10
    assert list(m.data)[-2:] == [0, 10]  # its second chance: moved to the end when room was made
    assert m.marked(0)  # marked again by the read above


def test_when_every_state_was_read_the_oldest_goes_and_every_mark_is_cleared(states):
    m = states(10)
    for key in range(10):
        m.add(key, state())
    for key in range(10):
        m.get(key)
    m.add(10, state())
    assert 0 not in m.data and len(m) == 10
    assert not any(m.marked(key) for key in m.data if key != 10)


def test_a_key_read_between_every_eviction_survives_a_rotation_of_new_keys(states):
    m = states(100)
    kept = state()
    m.add("kept", kept)
    for key in range(50_000):
        m.get("kept")
        m.add(key, state())
        assert len(m) <= 100
    assert m.get("kept") is kept
    assert m._filed <= 2 * len(m) + 1024 + 1


@pytest.mark.parametrize("kind", STATE_MAPS, ids=lambda kind: kind.__module__)
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=300), st.integers(1, 12))
def test_room_is_made_from_the_oldest_unread_states_first(kind, operations, max_keys):
    """Whatever the reads and stores: the map never holds more than
    ``max_keys``; making room drops the oldest states not read since they
    were stored or last passed over, in the map's order, and a read one
    only when fewer unread ones are left than must go."""
    m = kind(max_keys, lambda: 0.0)
    for is_read, key in operations:
        if is_read:
            value = m.get(key)
            assert value is None or m.marked(key)
            continue
        if key in m.data:
            continue
        before = list(m.data)
        unread = [name for name in before if not m.marked(name)]
        m.add(key, state())
        assert len(m) <= max_keys
        dropped = [name for name in before if name not in m.data]
        if len(unread) >= len(dropped):
            assert dropped == unread[:len(dropped)]


# --------------------------------------------------------------------------
# The compiled map against the pure one
# --------------------------------------------------------------------------

def expiring_state(expires: float) -> Any:
    """A window's state that expires at ``expires`` (its penalty's end)."""
    made = COUNTER.new_state()
    made.penalty_until = expires
    return made


def contents(m: Any) -> list[tuple[str, float, bool]]:
    """What a map holds, in its order: each key (written out: which of
    equal values it kept shows), its state's expiry and mark."""
    return [(repr(key), value.penalty_until, m.marked(key)) for key, value in m.items()]


# Half seconds: expiries that fall on the clock and on a slot's edge.
HALVES = st.integers(0, 24).map(lambda halves: halves / 2)


class Colliding:
    """A value whose hash is every other's: keys that differ in it alone
    share their hash, so that a lookup compares them item by item."""

    def __init__(self, number: int) -> None:
        self.number = number

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Colliding) and other.number == self.number

    def __repr__(self) -> str:
        return f"Colliding({self.number})"


# A key's values: equal ones of other types (1, 1.0 and True), text made anew
# each time (equal, never the same object; of one length, and of CPython's
# three widths of characters), and values of one hash.
VALUES = st.one_of(st.sampled_from(["a", "b", 1, 1.0, True]),
                   st.sampled_from(["ab", "cd", "ac", "éa", "€a", "€b", "😀a", "a😀"])
                   .map(lambda text: text[:1] + text[1:]),
                   st.integers(0, 2).map(Colliding))
Pair = collections.namedtuple("Pair", "prefix value")
# Counting keys' shapes: a prefix and one value or two (the compiled map
# keeps such a tuple as its items), three (kept whole), a tuple subclass
# equal to a pair, and keys that are no tuple.
KEYS = st.one_of(
    st.integers(0, 40),
    st.tuples(st.just(("rule", ("ip",))), VALUES),
    st.tuples(st.just(("two", ("ip", "path"))), VALUES, VALUES),
    st.tuples(st.just(("three", ("a", "b", "c"))), VALUES, VALUES, VALUES),
    st.tuples(st.just(("rule", ("ip",))), VALUES).map(lambda items: Pair(*items)),
)
OPERATIONS = st.lists(st.one_of(
    st.tuples(st.just("add"), KEYS, HALVES),
    st.tuples(st.just("set"), KEYS, HALVES),
    st.tuples(st.just("get"), KEYS, st.just(0.0)),
    st.tuples(st.just("pop"), KEYS, st.just(0.0)),
    st.tuples(st.just("advance"), st.just(0), HALVES),
    st.tuples(st.just("max_keys"), st.integers(1, 16), st.just(0.0)),
    # A hint of the keys read next, then the first so many of them read in
    # turn (the very objects, as the policy reads its checks' keys).
    st.tuples(st.just("expect"), st.lists(KEYS, max_size=6), st.integers(0, 6)),
    # The same, each key hinted first as the matching program hints it (its
    # position in the request), then expected (odd: not) and read.
    st.tuples(st.just("hint"), st.lists(KEYS, max_size=6), st.integers(0, 13)),
), max_size=400)


def checks_of(keys: list[Any]) -> list[Check]:
    """A request's checks of these keys (``StateMap.expect``'s argument)."""
    return [Check.of("rule", key, COUNTER, 10.0, True) for key in keys]


@pytest.mark.skipif(core.PURE, reason="the compiled map: the compiled core only")
@settings(max_examples=300, deadline=None)
@given(OPERATIONS, st.integers(1, 16))
# A key dropped and stored again, expiring within the second when room is
# made: the pure map meets it through the reference its slot held before.
@example([("add", ("k", "cd"), 0.0), ("add", 0, 0.0), ("pop", ("k", "cd"), 0.0),
          ("add", ("k", "cd"), 1.0), ("advance", 0, 1.0), ("add", 1, 0.0)], 2)
# Keys held, told and read in turn: each read takes the hash the hint kept.
@example([("add", ("rule", "a"), 5.0), ("add", ("two", "a", 1), 5.0),
          ("expect", [("rule", "a"), ("two", "a", 1), ("rule", "b")], 3)], 4)
# The same hinted one by one first, then expected, then without expect.
@example([("add", ("rule", "a"), 5.0), ("add", ("two", "a", 1), 5.0),
          ("hint", [("rule", "a"), ("two", "a", 1), ("rule", "b")], 6),
          ("hint", [("rule", "b"), ("rule", "a")], 5)], 4)
def test_the_compiled_map_keeps_what_the_pure_map_keeps_in_its_order(operations, max_keys):
    """Any stores (new keys and held ones), reads, removals, passing time,
    changes of the cap and hints of the keys read next (``expect``, and
    ``hint`` key by key before it or instead of it, asked of the compiled
    map whatever its size, and followed by reads): both maps answer alike and hold the same keys in the same
    order, with the same states and marks."""
    compiled = importlib.import_module("sidecar._statemap").StateMap
    clock = [0.0]
    pure, other = StateMap(max_keys, lambda: clock[0]), compiled(max_keys, lambda: clock[0])
    other.expect_from = 0
    for kind, key, number in operations:
        if kind in ("expect", "hint"):
            if kind == "hint":
                for position, hinted in enumerate(key):
                    pure.hint(hinted, position)
                    other.hint(hinted, position)
                number, expected = number // 2, number % 2 == 0
            else:
                expected = True
            if expected:
                pure.expect(checks_of(key))
                other.expect(checks_of(key))
            for read in key[:number]:
                assert (pure.get(read) is None) == (other.get(read) is None)
                assert contents(other) == contents(pure)
            continue
        if kind == "advance":
            clock[0] += number
        elif kind == "max_keys":
            pure.max_keys = other.max_keys = key
        elif kind == "add":
            pure.add(key, expiring_state(clock[0] + number))
            other.add(key, expiring_state(clock[0] + number))
        elif kind == "set":
            pure[key] = expiring_state(clock[0] + number)
            other[key] = expiring_state(clock[0] + number)
        elif kind == "get":
            assert (pure.get(key) is None) == (other.get(key) is None)
        else:
            assert (pure.pop(key) is None) == (other.pop(key) is None)
        assert contents(other) == contents(pure)
        assert len(other) == len(pure) and (key in other) == (key in pure.data)
        assert (other.peek(key) is None) == (pure.peek(key) is None)


@pytest.mark.skipif(core.PURE, reason="the compiled map: the compiled core only")
def test_the_compiled_map_grows_and_drops_keys_under_rotation_without_losing_one():
    """Many more keys than its first records, then a rotation that evicts:
    every key it says it holds is found, and no other."""
    m = importlib.import_module("sidecar._statemap").StateMap(5_000, lambda: 0.0)
    for key in range(5_000):
        m.add(("rule", str(key)), expiring_state(1e9))
    assert len(m) == 5_000 and all(m.peek(("rule", str(key))) is not None for key in range(5_000))
    for key in range(5_000, 50_000):
        m.add(("rule", str(key)), expiring_state(1e9))
        assert len(m) <= 5_000
    held = [key for key, _ in m.items()]
    assert len(held) == len(m) and all(key in m for key in held)
    assert not any(("rule", str(key)) in m for key in range(40_000))


@pytest.mark.skipif(core.PURE, reason="the compiled map: the compiled core only")
def test_the_compiled_maps_recency_ring_keeps_the_order_through_its_compactions():
    """The compiled map's order is a ring of entries, one each time a key
    is made the newest, compacted when full. Keys stored again without
    room made (stale entries only: compacted by dropping them), then a
    rotation with keys read between (entries moved: compacted by moving
    them), then both: the same keys as the pure map's, in its order."""
    compiled = importlib.import_module("sidecar._statemap").StateMap
    pure, other = StateMap(50, lambda: 0.0), compiled(50, lambda: 0.0)

    def add(key: Any) -> None:
        pure.add(key, expiring_state(1e9))
        other.add(key, expiring_state(1e9))

    def pop(key: Any) -> None:
        assert (pure.pop(key) is None) == (other.pop(key) is None)

    for number in range(50):
        add(("rule", str(number)))
    for turn in range(1_000):  # each a stale entry: the ring fills without room made
        pop(("rule", str(turn * 7 % 50)))
        add(("rule", str(turn * 7 % 50)))
        assert contents(other) == contents(pure)
    for turn in range(1_000):  # room made: entries passed, a read one moved
        assert (pure.get(("rule", str(turn * 3 % 50))) is None) == (other.get(("rule", str(turn * 3 % 50))) is None)
        add(("new", str(turn)))
        if turn % 5 == 0:
            pop(("new", str(turn)))
            add(("new", str(turn)))
        assert contents(other) == contents(pure)
    assert len(other) == len(pure) >= 45


@pytest.mark.skipif(core.PURE, reason="the compiled map: the compiled core only")
def test_the_compiled_map_keeps_a_short_tuple_key_as_its_items_and_a_longer_one_whole():
    """A key of two or three items is held by its items, not by the tuple
    (no object more a key); one of four is held itself. Both are found by
    an equal tuple and listed as equal tuples."""
    m = importlib.import_module("sidecar._statemap").StateMap(10, lambda: 0.0)
    prefix = ("rule", ("ip", "path"))
    short, long = (prefix, "192.0.2.1", "/a"), (prefix, "192.0.2.1", "/a", "x")
    short_references, long_references = sys.getrefcount(short), sys.getrefcount(long)
    m.add(short, expiring_state(1e9))
    m.add(long, expiring_state(1e9))
    assert sys.getrefcount(short) == short_references
    assert sys.getrefcount(long) == long_references + 1
    assert m.peek((prefix, "192.0.2." + "1", "/a")) is not None and m.peek(tuple(long)) is not None
    assert [key for key, _ in m.items()] == [short, long]


class StoringWhenDropped:
    """A state whose deallocation stores a key into a map."""

    def __init__(self, into: Any, key: Any) -> None:
        self.into, self.key = into, key
        self.used = False  # the pure map's read mark

    def __del__(self) -> None:
        self.into.add(self.key, expiring_state(1e9), 1e9)


def test_a_key_missed_then_stored_while_room_is_made_is_held_once(states: Callable[..., Any]) -> None:
    """A read misses a key; storing it then makes room, and the state
    dropped stores that key as it goes: the key is held once."""
    m = states(1)
    m.add("old", StoringWhenDropped(m, "new"), 1e9)
    assert m.get("new") is None
    m.add("new", expiring_state(1e9), 1e9)
    assert len(m) == 1 and [key for key, _ in m.items()] == ["new"]


class PoppingWhenDropped:
    """A key whose deallocation stores a new key in a map and removes
    another: code run while room is made, between the records it took."""

    def __init__(self, name: str, into: Any, victim: Any = None) -> None:
        self.name, self.into, self.victim = name, into, victim

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PoppingWhenDropped) and other.name == self.name

    def __del__(self) -> None:
        if self.victim is not None:
            self.into.add(("stored", self.name), expiring_state(1e9), 1e9)
            self.into.pop(PoppingWhenDropped(self.victim, None))


@pytest.mark.skipif(core.PURE, reason="the compiled map: the compiled core only")
def test_keys_dropped_or_stored_while_expired_keys_go_are_not_lost_or_read_freed():
    """Expired keys of one expiry slot go together; dropping each stores
    another key and removes a later one of the same slot. The compiled map
    takes the slot's records a batch at a time: a record removed since is
    passed over, the new keys stay, and every key it lists is found."""
    m = importlib.import_module("sidecar._statemap").StateMap(100, lambda: clock[0])
    clock = [0.0]
    for number in range(0, 40, 2):  # each even key removes the odd one after it
        m.add(PoppingWhenDropped(str(number), m, str(number + 1)), expiring_state(0.5))
        m.add(PoppingWhenDropped(str(number + 1), m), expiring_state(0.5))
    for number in range(60):
        m.add(("long", str(number)), expiring_state(1e9))
    clock[0] = 2.0
    m.add(("long", "last"), expiring_state(1e9))  # full: room made, the slot's keys expired
    held = [key for key, _ in m.items()]
    assert len(held) == len(m) == 81 and all(key in m for key in held)
    assert {key[1] for key in held if key[0] == "stored"} == {str(number) for number in range(0, 40, 2)}
    assert not any(isinstance(key, PoppingWhenDropped) for key in held)


@pytest.mark.skipif(core.PURE, reason="the compiled map: the compiled core only")
def test_the_compiled_map_takes_no_more_memory_however_many_keys_rotate_through_it():
    """Full at 2,000 keys, then 60,000 new keys through it: what it holds
    (records, index, keys and states) does not grow past what it held
    when it first filled."""
    tracemalloc.start()
    try:
        m = importlib.import_module("sidecar._statemap").StateMap(2_000, lambda: 0.0)
        for key in range(2_000):
            m.add(("rule", str(key)), expiring_state(1e9))
        gc.collect()
        full = tracemalloc.get_traced_memory()[0]
        for key in range(2_000, 62_000):
            m.add(("rule", str(key)), expiring_state(1e9))
        gc.collect()
        rotated = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(m) <= 2_000
    assert rotated - full < 16 * 1024  # a key's worth of its 2,000 is about 200 bytes


@pytest.mark.skipif(core.PURE, reason="the compiled map: the compiled core only")
def test_the_compiled_map_holds_the_keys_it_was_told_to_expect_until_the_next_hint_only() -> None:
    """``expect`` keeps the keys it hashed for their reads, and lets go of
    them at the next hint and with the map: no key outlives its request's
    next one. A map smaller than ``expect_from`` keeps none."""
    compiled = importlib.import_module("sidecar._statemap").StateMap
    key = ("rule", "".join(["192.0.2.", "7"]))  # made here: only this test holds it
    held = sys.getrefcount(key)
    small = compiled(10, lambda: 0.0)
    small.expect(checks_of([key, ("rule", "other")]))
    assert sys.getrefcount(key) == held  # under expect_from: a hint ignored
    m = compiled(10, lambda: 0.0)
    m.expect_from = 0
    m.expect(checks_of([key, ("rule", "other")]))
    assert sys.getrefcount(key) == held + 1
    assert m.get(key) is None and m.get(("rule", "other")) is None  # read with the hashes kept
    m.add(key, expiring_state(1e9))  # held as its items: the tuple itself is not kept
    assert m.get(key) is not None
    m.expect([])
    assert sys.getrefcount(key) == held
    m.expect(checks_of([key, key]))
    assert sys.getrefcount(key) == held + 2
    m.hint(key, 0)  # a request's first key: the last request's let go
    assert sys.getrefcount(key) == held + 1
    m.hint(key, 2)  # not the next position: ignored
    assert sys.getrefcount(key) == held + 1
    m.hint(("rule", "other"), 0)
    assert sys.getrefcount(key) == held
    small.hint(key, 0)  # under expect_from: ignored
    assert sys.getrefcount(key) == held
    m.hint(key, 0)
    m.expect(checks_of([key]))  # the hinted keys taken as they are
    assert sys.getrefcount(key) == held + 1
    m.expect(checks_of([("rule", "other")]))  # other keys: the hints let go
    assert sys.getrefcount(key) == held
    m.hint(key, 0)
    del m
    gc.collect()
    assert sys.getrefcount(key) == held


@pytest.mark.skipif(core.PURE, reason="the compiled map: the compiled core only")
def test_the_compiled_map_takes_only_checks_as_a_hint() -> None:
    m = importlib.import_module("sidecar._statemap").StateMap(10, lambda: 0.0)
    m.expect_from = 0
    with pytest.raises(TypeError):
        m.expect([("rule", "a"), ("rule", "b")])
    m.add(("rule", "a"), expiring_state(1e9))
    assert m.get(("rule", "a")) is not None


@pytest.mark.skipif(core.PURE, reason="the compiled map: the compiled core only")
@settings(max_examples=500, deadline=None)
@given(st.one_of(KEYS, st.tuples(st.tuples(st.text(max_size=3), st.tuples(st.text(max_size=3))),
                                  st.text(), st.text(), st.text()),
                 st.tuples(st.tuples(), st.integers()), st.tuples(), st.text(), st.none()))
def test_the_compiled_map_hashes_a_key_as_python_does(key: Any) -> None:
    """A counting key's prefix hash is kept by the prefix; the key's hash is
    still ``hash(key)``, for a prefix met before or not, and an equal key
    with another prefix object hashes alike."""
    hash_of = importlib.import_module("sidecar._statemap").hash_of
    assert hash_of(key) == hash_of(key) == hash(key)
    if isinstance(key, tuple) and key and isinstance(key[0], tuple):
        copied = (tuple(list(key[0])), *key[1:])  # an equal prefix, another object (unless empty)
        assert hash_of(copied) == hash(key)


# Texts of one length, mostly: equal or not at one place, of CPython's
# three widths of characters.
SAME_LENGTH_TEXTS = st.integers(1, 12).flatmap(
    lambda length: st.tuples(*[st.text(alphabet="aé€😀", min_size=length, max_size=length)] * 2))


@pytest.mark.skipif(core.PURE, reason="the compiled map: the compiled core only")
@given(SAME_LENGTH_TEXTS | st.tuples(st.text(), st.text()), st.booleans())
@example(("ab", "ac"), False)
@example(("a€", "a€"), True)
def test_the_compiled_map_finds_texts_equal_as_python_does(texts: tuple[str, str], copied: bool) -> None:
    """The map compares a stored key's texts with a request's in C (the same
    length, kind and code units): equal exactly when Python finds them so,
    whatever their characters' width."""
    same_text = importlib.import_module("sidecar._statemap").same_text
    one, other = texts
    if copied:
        other = one[:1] + one[1:]  # equal, and another object unless one character or none
    assert same_text(one, other) == (one == other) == same_text(other, one)
