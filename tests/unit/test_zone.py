"""The zone (sidecar.shm): the compiled zone and its pure-Python twin held
to a reference model of a few lines and to each other, operation by
operation, eviction by eviction and byte by byte after a rebuild; its
layout, its answers to bad input, and attaching to files that are not zones.

The compiled zone is tested when it is built (``make test`` builds the
core); its tests across processes are in test_zone_processes.py.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import math
import mmap
import multiprocessing
import os
import resource
import signal
import struct
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sidecar.shm import pure_zone
from sidecar.shm.pure_zone import (
    DIGEST_SIZE,
    EXPIRED_SCAN,
    HEADER_SIZE,
    LIVE,
    LOCK_SLOT,
    RECORD,
    STRIPE_HEADER,
    WRITING,
)

SHM = Path(pure_zone.__file__).parent


def compiled_zone_class() -> type | None:
    """The compiled zone, or None when it is not built or the pure-Python
    core is forced. Built by hand in place (cythonize -i) while the rest of
    the core is not, it is loaded from its file, if newer than its source."""
    if os.environ.get("SLUICE_PURE_PYTHON") == "1":
        return None
    try:
        return importlib.import_module("sidecar.shm._zone").Zone
    except ImportError:
        pass
    source = SHM / "_zone.pyx"
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        built = SHM / f"_zone{suffix}"
        if built.is_file() and built.stat().st_mtime >= source.stat().st_mtime:
            loader = importlib.machinery.ExtensionFileLoader("sidecar.shm._zone", str(built))
            spec = importlib.util.spec_from_file_location("sidecar.shm._zone", built, loader=loader)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            sys.modules["sidecar.shm._zone"] = module
            return module.Zone
    return None


CompiledZone = compiled_zone_class()
PureZone = pure_zone.Zone
needs_compiled = pytest.mark.skipif(CompiledZone is None, reason="the compiled zone is not built")
ZONES = [pytest.param(PureZone, id="pure"),
         pytest.param(CompiledZone, id="compiled", marks=needs_compiled)]
BUILT = [PureZone] + ([CompiledZone] if CompiledZone is not None else [])


def digest(name: object) -> bytes:
    return hashlib.blake2b(str(name).encode(), digest_size=DIGEST_SIZE).digest()


def digests_in_stripe(zone, stripe: int, count: int) -> list[bytes]:
    """``count`` digests that fall in ``stripe``."""
    found = []
    number = 0
    while len(found) < count:
        candidate = digest(number)
        if zone.stripe_of(candidate) == stripe:
            found.append(candidate)
        number += 1
    return found


def put(zone, key: bytes, value: bytes, expires: float, now: float) -> None:
    with zone.locked([zone.stripe_of(key)]):
        zone.put(key, value, expires, now)


def get(zone, key: bytes, now: float) -> bytes | None:
    with zone.locked([zone.stripe_of(key)]):
        return zone.get(key, now)


def live(zone, stripe: int, now: float = -math.inf) -> list[tuple[bytes, bytes, float]]:
    with zone.locked([stripe]):
        return zone.scan(stripe, now)


class Model:
    """What a zone promises, in a few lines: per stripe, an ordered dict from
    least to most recently used, of at most ``capacity // stripes`` digests;
    a new digest in a full stripe replaces the least recently used expired
    digest among the EXPIRED_SCAN least recently used, else the least
    recently used (an eviction)."""

    def __init__(self, zone) -> None:
        self.zone = zone
        self.per_stripe = zone.per_stripe
        self.stripes: list[OrderedDict[bytes, tuple[bytes, float]]] = [OrderedDict() for _ in range(zone.stripes)]
        self.evictions = 0

    def _stripe(self, key: bytes) -> OrderedDict[bytes, tuple[bytes, float]]:
        return self.stripes[self.zone.stripe_of(key)]

    def put(self, key: bytes, value: bytes, expires: float, now: float) -> None:
        table = self._stripe(key)
        if key not in table and len(table) >= self.per_stripe:
            oldest = list(table)[:EXPIRED_SCAN]
            victim = next((candidate for candidate in oldest if table[candidate][1] <= now), None)
            if victim is None:
                victim = oldest[0]
                self.evictions += 1
            del table[victim]
        table[key] = (value, expires)
        table.move_to_end(key)

    def get(self, key: bytes, now: float, refresh: bool = True) -> bytes | None:
        table = self._stripe(key)
        if key not in table or table[key][1] <= now:
            return None
        if refresh:
            table.move_to_end(key)
        return table[key][0]

    def delete(self, key: bytes) -> bool:
        return self._stripe(key).pop(key, None) is not None

    def scan(self, stripe: int, now: float) -> list[tuple[bytes, bytes, float]]:
        return [(key, value, expires) for key, (value, expires) in reversed(self.stripes[stripe].items())
                if expires > now]

    def __len__(self) -> int:
        return sum(len(table) for table in self.stripes)


class ZoneMachine(RuleBasedStateMachine):
    """Every zone built and the model, through the same operations: each
    answer, each stripe's records in LRU order, the count and the evictions
    must agree, and each stripe must stay consistent."""

    @initialize(stripes=st.integers(1, 3), per_stripe=st.integers(1, 6), spare=st.integers(0, 2),
                value_size=st.integers(1, 24), keys=st.integers(1, 24))
    def make(self, stripes: int, per_stripe: int, spare: int, value_size: int, keys: int) -> None:
        capacity = stripes * per_stripe + min(spare, stripes - 1)  # a remainder is not held
        self.zones = [kind.private(capacity, value_size, stripes) for kind in BUILT]
        self.model = Model(self.zones[0])
        self.keys = [digest(("machine", number)) for number in range(keys)]
        self.now = 1000.0

    def each(self, key: bytes, operation):
        answers = []
        for zone in self.zones:
            with zone.locked([zone.stripe_of(key)]):
                answers.append(operation(zone))
        return answers

    @rule(number=st.integers(0, 23), value=st.binary(max_size=24), lasts=st.integers(-3, 12))
    def put(self, number: int, value: bytes, lasts: int) -> None:
        key = self.keys[number % len(self.keys)]
        value = value[:self.zones[0].value_size]
        self.each(key, lambda zone: zone.put(key, value, self.now + lasts, self.now))
        self.model.put(key, value, self.now + lasts, self.now)

    @rule(number=st.integers(0, 23))
    def get(self, number: int) -> None:
        key = self.keys[number % len(self.keys)]
        expected = self.model.get(key, self.now)
        assert self.each(key, lambda zone: zone.get(key, self.now)) == [expected] * len(self.zones)

    @rule(number=st.integers(0, 23))
    def peek(self, number: int) -> None:
        key = self.keys[number % len(self.keys)]
        expected = self.model.get(key, self.now, refresh=False)
        assert self.each(key, lambda zone: zone.peek(key, self.now)) == [expected] * len(self.zones)

    @rule(number=st.integers(0, 23))
    def delete(self, number: int) -> None:
        key = self.keys[number % len(self.keys)]
        expected = self.model.delete(key)
        assert self.each(key, lambda zone: zone.delete(key)) == [expected] * len(self.zones)

    @rule(seconds=st.sampled_from([0, 0.5, 1, 3]))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    @rule(stripe=st.integers(0, 2))
    def rebuild(self, stripe: int) -> None:
        """A rebuild of a consistent stripe changes nothing, the order included."""
        stripe %= self.zones[0].stripes
        for zone in self.zones:
            with zone.locked([stripe]):
                zone._rebuild(stripe)

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "zones"):
            return
        for stripe in range(self.model.zone.stripes):
            expected = self.model.scan(stripe, self.now)
            for zone in self.zones:
                assert live(zone, stripe, self.now) == expected
        for zone in self.zones:
            assert len(zone) == len(self.model)
            assert zone.evictions == self.model.evictions
        twin = self.zones[0]
        for stripe in range(twin.stripes):
            with twin.locked([stripe]):
                assert twin.verify(stripe) == []

    @rule()
    def bump(self) -> None:
        assert len({zone.bump_generation() for zone in self.zones}) == 1


ZoneMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestZoneAgainstTheModel = ZoneMachine.TestCase


# -- layout --------------------------------------------------------------------


@pytest.mark.parametrize(("value_size", "record_size"), [(1, 48), (24, 64), (80, 120), (88, 128), (89, 136)])
def test_a_record_is_a_40_byte_header_and_its_value_rounded_to_8(value_size, record_size):
    assert pure_zone.layout(1000, value_size, 4).record_size == record_size


def test_a_key_costs_at_most_133_bytes_with_88_byte_values_everything_counted():
    found = pure_zone.layout(1_000_000, 88, 64)
    assert found.capacity == 1_000_000 - 1_000_000 % 64
    assert found.record_size == 128
    assert found.bytes_per_key <= 133  # records, buckets, undo copies and headers


@pytest.mark.parametrize(("per_stripe", "value_size", "buckets"),
                         [(1, 80, 1), (2, 80, 2), (3, 80, 4), (78, 80, 64), (1563, 80, 2048), (16385, 80, 16384),
                          (1563, 152, 2048), (1563, 32, 1024), (1563, 8, 1024), (400, 32, 256)])
def test_a_stripe_has_buckets_for_chains_of_4_3_records_unless_they_outweigh_a_sixteenth_of_its_records(
        per_stripe, value_size, buckets):
    """The fewest buckets (a power of two) for chains of 4/3 records at
    most on average; for records so small that those buckets would take more
    than a sixteenth of their memory, the fewest for chains of 2."""
    found = pure_zone.layout(per_stripe * 4, value_size, 4)
    assert found.bucket_count == buckets
    dense = per_stripe <= buckets * 4 / 3 and buckets * 4 * 16 <= per_stripe * found.record_size
    assert dense or per_stripe <= buckets * 2


@pytest.mark.parametrize("zone_class", ZONES)
def test_the_capacity_held_is_whole_records_per_stripe(tmp_path, zone_class):
    zone = zone_class.create(tmp_path / "zone", 103, 16, 4)  # a path-like will do
    assert (zone.capacity, zone.per_stripe, zone.stripes, zone.value_size) == (100, 25, 4, 16)
    assert zone.path == str(tmp_path / "zone")
    assert os.path.getsize(tmp_path / "zone") == zone.file_size == pure_zone.layout(103, 16, 4).file_size
    zone.close()


@pytest.mark.parametrize(("capacity", "value_size", "stripes", "words"), [
    (10, 8, 0, "1 to 65536 stripes"),
    (10, 8, 70000, "1 to 65536 stripes"),
    (3, 8, 4, "at least 4 records"),
    (10, 0, 1, "1 to 65535 bytes"),
    (10, 70000, 1, "1 to 65535 bytes"),
    (10.5, 8, 1, "whole number"),
    (10, "8", 1, "whole number"),
    (2**40, 8, 1, "at most"),
])
@pytest.mark.parametrize("zone_class", ZONES)
def test_a_zone_that_cannot_be_made_is_refused_with_the_number_at_fault(zone_class, capacity, value_size, stripes,
                                                                         words):
    with pytest.raises(ValueError, match=words):
        zone_class.private(capacity, value_size, stripes)


@pytest.mark.parametrize("zone_class", ZONES)
def test_a_zone_file_is_new_and_private_to_its_owner(tmp_path, zone_class):
    path = tmp_path / "zone"
    zone = zone_class.create(str(path), 8, 8, 1)
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        zone_class.create(str(path), 8, 8, 1)
    zone.close()
    zone.unlink()
    assert not path.exists()
    zone.unlink()  # already gone: nothing to do


def make_beyond_a_file_size_limit(compiled: bool, path: str, answers) -> None:
    """In a process of its own: make a zone bigger than the files this
    process may write (as a full /dev/shm would refuse it), say what happened."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        (CompiledZone if compiled else PureZone).create(path, 100_000, 88, 64)
    except OSError as error:
        answers.put((type(error).__name__, str(error)))
    else:
        answers.put(("made", ""))


@pytest.mark.parametrize("zone_class", ZONES)
def test_a_zone_whose_memory_cannot_be_reserved_fails_at_once_and_leaves_no_file(tmp_path, zone_class):
    spawn = multiprocessing.get_context("spawn")
    answers = spawn.Queue()
    path = str(tmp_path / "zone")
    process = spawn.Process(target=make_beyond_a_file_size_limit, args=(zone_class is CompiledZone, path, answers))
    process.start()
    process.join(60)
    kind, message = answers.get(timeout=5)
    size = pure_zone.layout(100_000, 88, 64).file_size
    assert kind == "OSError" and message == f"[Errno 27] reserving {size} bytes for a zone: File too large"
    assert not os.path.exists(path)


@needs_compiled
def test_the_twin_reads_what_the_compiled_zone_wrote_the_layout_is_one(tmp_path):
    path = str(tmp_path / "zone")
    compiled = CompiledZone.create(path, 64, 20, 4)
    for number in range(40):
        put(compiled, digest(number), b"v%d" % number, 2000.0 + number, 1000.0)
    compiled.bump_generation()
    twin = PureZone.attach(path)
    for stripe in range(4):
        assert live(twin, stripe) == live(compiled, stripe)
        with twin.locked([stripe]):
            assert twin.verify(stripe) == []
    assert (len(twin), twin.generation(), twin.evictions) == (len(compiled), 1, compiled.evictions)
    twin.close()
    compiled.close()


@needs_compiled
def test_the_compiled_zone_refuses_a_file_the_twin_made_it_has_no_mutexes(tmp_path):
    path = str(tmp_path / "zone")
    PureZone.create(path, 8, 8, 1).close()
    with pytest.raises(ValueError, match="pure-Python zone, which has no locks"):
        CompiledZone.attach(path)


# -- attaching to what is not a zone -------------------------------------------------


def header_of(path: Path) -> bytearray:
    return bytearray(path.read_bytes())


@pytest.mark.parametrize("zone_class", ZONES)
@pytest.mark.parametrize(("damage", "words"), [
    (lambda data: data[:100], "shorter than a zone's header"),
    (lambda data: b"", "shorter than a zone's header"),
    (lambda data: b"\x07" * len(data), "is not a Sluice zone"),
    (lambda data: data[:8] + struct.pack("=I", 99) + data[12:], "version 99"),
    (lambda data: data[:56] + struct.pack("=I", 0) + data[60:], "still being made"),
    (lambda data: data[:32] + struct.pack("=I", 999) + data[36:], "damaged zone header"),
    (lambda data: data[:20] + struct.pack("=I", 0) + data[24:], "damaged zone header"),
    (lambda data: data + b"\0" * 64, "the file has"),
    (lambda data: data[:-64], "the file has"),
], ids=["short", "empty", "not-a-zone", "version", "not-ready", "sizes", "no-stripes", "longer", "shorter"])
def test_attaching_to_a_file_that_is_not_a_whole_zone_says_what_is_wrong(tmp_path, zone_class, damage, words):
    path = tmp_path / "zone"
    maker = CompiledZone if zone_class is CompiledZone else PureZone
    maker.create(str(path), 16, 8, 2).close()
    path.write_bytes(damage(header_of(path)))
    with pytest.raises(ValueError, match=words):
        zone_class.attach(str(path))


@pytest.mark.parametrize("zone_class", ZONES)
def test_attaching_to_nothing_is_the_system_s_error(tmp_path, zone_class):
    with pytest.raises(FileNotFoundError):
        zone_class.attach(str(tmp_path / "absent"))


# -- bad input -------------------------------------------------------------------------


@pytest.fixture(params=ZONES)
def zone(request):
    made = request.param.private(16, 8, 2)
    yield made
    made.close()


@pytest.mark.parametrize("bad", [b"", b"x" * 15, b"x" * 17, "x" * 16, None, 16, bytearray(16)])
def test_a_digest_is_16_bytes_or_a_value_error(zone, bad):
    with pytest.raises(ValueError, match="16-byte digest"):
        zone.stripe_of(bad)
    with zone.locked([0, 1]):
        for operation in (lambda: zone.get(bad, 0.0), lambda: zone.peek(bad, 0.0), lambda: zone.delete(bad),
                          lambda: zone.put(bad, b"v", 1.0, 0.0)):
            with pytest.raises(ValueError, match="16-byte digest"):
                operation()


@pytest.mark.parametrize(("value", "words"), [(b"123456789", "9 bytes is longer than the zone's 8"),
                                              ("text", "value is bytes"), (None, "value is bytes"),
                                              (8, "value is bytes")])
def test_a_value_too_long_or_not_bytes_is_refused_and_the_record_kept(zone, value, words):
    key = digest("kept")
    put(zone, key, b"before", 10.0, 0.0)
    with zone.locked([zone.stripe_of(key)]):
        with pytest.raises(ValueError, match=words):
            zone.put(key, value, 10.0, 0.0)
        with pytest.raises(ValueError, match=words):
            zone.put(digest("new"), value, 10.0, 0.0)
    assert get(zone, key, 0.0) == b"before"
    assert get(zone, digest("new"), 0.0) is None


def test_values_of_every_length_up_to_the_size_come_back_whole(zone):
    for length in range(9):
        key, value = digest(("length", length)), bytes(range(1, length + 1))
        put(zone, key, bytearray(value), 10.0, 0.0)
        assert get(zone, key, 0.0) == value
        put(zone, key, memoryview(value[::-1]), 10.0, 0.0)
        assert get(zone, key, 0.0) == value[::-1]


def test_a_time_that_is_not_a_number_is_refused(zone):
    key = digest("time")
    with zone.locked([zone.stripe_of(key)]):
        with pytest.raises(ValueError, match="NaN"):
            zone.get(key, math.nan)
        with pytest.raises(ValueError, match="NaN"):
            zone.put(key, b"v", math.nan, 0.0)
        with pytest.raises(ValueError, match="NaN"):
            zone.put(key, b"v", 1.0, math.nan)
        with pytest.raises(TypeError):
            zone.get(key, "now")
        zone.put(key, b"forever", math.inf, 0.0)
        assert zone.get(key, 1e300) == b"forever"


@pytest.mark.parametrize("stripes", [[1, 0], [0, 0], [2], [-1], [0.0], ["0"], [True]])
def test_stripes_are_locked_in_increasing_order_each_once(zone, stripes):
    with pytest.raises(ValueError, match="stripe"):
        zone.lock(stripes)
    zone.lock([0, 1])  # nothing was left locked
    zone.unlock([0, 1])


def test_a_stripe_locked_twice_or_unlocked_unheld_is_a_runtime_error(zone):
    zone.lock([1])
    with pytest.raises(RuntimeError, match="already locked"):
        zone.lock([1])
    with pytest.raises(RuntimeError, match="not locked"):
        zone.unlock([0, 1])
    zone.lock([0, 1])  # both were unlocked by the unlock that failed on 0
    zone.unlock([0, 1])


def test_a_mask_locks_the_stripes_of_its_bits_and_no_other(zone):
    on_zero, on_one = (next(digest(n) for n in range(100) if zone.stripe_of(digest(n)) == stripe) for stripe in (0, 1))
    zone.lock_mask(0b10)
    zone.put(on_one, b"one", 10.0, 0.0)
    with pytest.raises(RuntimeError, match="not locked"):
        zone.put(on_zero, b"zero", 10.0, 0.0)
    zone.unlock_mask(0b10)
    with pytest.raises(RuntimeError, match="not locked"):
        zone.get(on_one, 0.0)
    zone.lock_mask(0b11)
    assert (zone.get(on_zero, 0.0), zone.get(on_one, 0.0)) == (None, b"one")
    zone.unlock_mask(0b11)
    zone.lock_mask(0)  # no stripe: nothing to lock
    zone.unlock_mask(0)
    zone.lock([0, 1])  # nothing was left locked
    zone.unlock([0, 1])


@pytest.mark.parametrize("zone_class", ZONES)
def test_a_mask_that_fails_leaves_none_of_its_stripes_locked(zone_class):
    zone = zone_class.private(64, 8, 4)
    with pytest.raises(ValueError, match="stripes 0 to 3"):
        zone.lock_mask(0b10001)  # bit 4: past the last stripe
    zone.lock([2])
    with pytest.raises(RuntimeError, match="already locked"):
        zone.lock_mask(0b0111)
    zone.lock([0, 1])  # the mask's stripes before the busy one were unlocked again
    with pytest.raises(RuntimeError, match="not locked"):
        zone.unlock_mask(0b1111)  # stripe 3 is not held...
    zone.lock([0, 1, 2, 3])  # ...and the others were unlocked all the same
    zone.unlock([0, 1, 2, 3])
    zone.close()


@pytest.mark.parametrize("zone_class", ZONES)
def test_a_zone_of_more_stripes_than_a_mask_has_bits_is_locked_by_list(zone_class):
    zone = zone_class.private(65 * 8, 8, 65)
    with pytest.raises(ValueError, match="64 stripes at most"):
        zone.lock_mask(1)
    zone.lock([0, 64])
    zone.unlock([0, 64])
    zone.close()


def test_a_zone_s_secret_is_drawn_when_it_is_made_and_read_by_every_process(tmp_path):
    made = {zone_class: [zone_class.create(tmp_path / f"{zone_class.__module__}-{n}", 64, 8, 2) for n in range(2)]
            for zone_class in BUILT}
    for zone_class, zones in made.items():
        secrets = [zone.secret for zone in zones]
        assert all(len(secret) == 16 for secret in secrets) and secrets[0] != secrets[1]
        assert zone_class.private(64, 8, 2).secret != zone_class.private(64, 8, 2).secret
    for zone_class, zones in made.items():
        zone = zones[0]
        for reader in {PureZone, zone_class}:  # the twin reads any zone; the compiled zone, its own
            attached = reader.attach(zone.path)
            assert attached.secret == zone.secret
            attached.close()
        for each in zones:
            each.close()


def test_a_record_of_a_stripe_nobody_locked_is_not_touched(zone):
    key = digest("unlocked")
    for operation in (lambda: zone.get(key, 0.0), lambda: zone.put(key, b"v", 1.0, 0.0),
                      lambda: zone.delete(key), lambda: zone.scan(zone.stripe_of(key), 0.0)):
        with pytest.raises(RuntimeError, match="not locked"):
            operation()
    assert len(zone) == 0


def test_the_with_block_unlocks_on_an_error(zone):
    with pytest.raises(KeyError):
        with zone.locked([0, 1]):
            raise KeyError("inside")
    zone.lock([0, 1])
    zone.unlock([0, 1])


def test_a_closed_zone_answers_value_error_and_a_locked_one_does_not_close(zone):
    zone.lock([0])
    with pytest.raises(RuntimeError, match="still locked"):
        zone.close()
    zone.unlock([0])
    zone.close()
    for operation in (lambda: zone.lock([0]), lambda: len(zone), lambda: zone.generation(),
                      lambda: zone.get(digest(1), 0.0), lambda: zone.recoveries):
        with pytest.raises(ValueError, match="closed"):
            operation()
    zone.close()  # twice: nothing to do


# -- expiry and eviction -----------------------------------------------------------------


@pytest.fixture(params=ZONES)
def one_stripe(request):
    """A zone of one stripe of 4 records."""
    made = request.param.private(4, 8, 1)
    yield made
    made.close()


def fill(zone, names, expires=100.0, now=0.0):
    keys = [digest(name) for name in names]
    for key, name in zip(keys, names):
        put(zone, key, name.encode(), expires, now)
    return keys


def test_a_full_stripe_evicts_its_least_recently_used_record(one_stripe):
    a, b, c, d = fill(one_stripe, "abcd")
    assert get(one_stripe, a, 1.0) == b"a"  # a is now the most recently used
    put(one_stripe, digest("e"), b"e", 100.0, 1.0)
    assert [value for _, value, _ in live(one_stripe, 0)] == [b"e", b"a", b"d", b"c"]
    assert one_stripe.evictions == 1 and len(one_stripe) == 4


def test_a_peek_leaves_the_order_as_it_was(one_stripe):
    a, *_ = fill(one_stripe, "abcd")
    with one_stripe.locked([0]):
        assert one_stripe.peek(a, 1.0) == b"a"
    put(one_stripe, digest("e"), b"e", 100.0, 1.0)
    assert get(one_stripe, a, 1.0) is None


def test_a_full_stripe_takes_an_expired_record_before_evicting(one_stripe):
    keys = fill(one_stripe, "abcd")
    put(one_stripe, keys[2], b"c", 5.0, 0.0)  # c expires first, though used last
    put(one_stripe, digest("e"), b"e", 100.0, 6.0)
    assert [value for _, value, _ in live(one_stripe, 0)] == [b"e", b"d", b"b", b"a"]
    assert one_stripe.evictions == 0


def test_an_expired_record_is_none_but_kept_until_its_room_is_needed(one_stripe):
    a, *_ = fill(one_stripe, "a", expires=5.0)
    assert get(one_stripe, a, 5.0) is None  # expired at its expiry
    assert get(one_stripe, a, 4.999) == b"a"
    assert len(one_stripe) == 1 and live(one_stripe, 0, 5.0) == []
    put(one_stripe, a, b"again", 10.0, 6.0)  # the same record, anew
    assert get(one_stripe, a, 6.0) == b"again" and len(one_stripe) == 1


@pytest.mark.parametrize("zone_class", ZONES)
def test_only_the_least_recently_used_few_are_looked_at_for_an_expired_one(zone_class):
    """The bound that keeps an insert cheap: an expired record more recently
    used than the EXPIRED_SCAN least recently used is not found."""
    zone = zone_class.private(EXPIRED_SCAN + 1, 8, 1)
    names = [str(number) for number in range(EXPIRED_SCAN + 1)]
    keys = fill(zone, names)
    put(zone, keys[-1], b"short", 5.0, 0.0)  # the most recently used, expired at 6
    put(zone, digest("new"), b"new", 100.0, 6.0)
    assert zone.evictions == 1 and get(zone, keys[0], 6.0) is None  # the LRU went, not the expired one
    zone.close()


class Stripe:
    """Offsets into one stripe of a zone file, from the twin's layout."""

    def __init__(self, zone, stripe: int) -> None:
        self.layout = pure_zone.layout(zone.capacity, zone.value_size, zone.stripes)
        self.base = HEADER_SIZE + stripe * self.layout.stripe_size

    def field(self, number: int) -> int:
        return self.base + LOCK_SLOT + 4 * number

    def record(self, index: int) -> int:
        return self.base + self.layout.records_at + index * self.layout.record_size

    def bucket(self, number: int) -> int:
        return self.base + self.layout.buckets_at + 4 * number

    @property
    def body(self) -> slice:
        """Everything of the stripe but its lock."""
        return slice(self.base + LOCK_SLOT, self.base + self.layout.stripe_size)


def bucket_chain(path: str, zone, stripe: int, bucket: int) -> list[bytes]:
    """The digests of a bucket's chain, in its order, read from the zone file."""
    where = Stripe(zone, stripe)
    chain = []
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as memory:
        at = struct.unpack_from("=I", memory, where.bucket(bucket))[0]
        while at != pure_zone.NIL and len(chain) <= zone.per_stripe:
            chain.append(bytes(memory[where.record(at - 1):where.record(at - 1) + DIGEST_SIZE]))
            at = struct.unpack_from("=I", memory, where.record(at - 1) + pure_zone.CHAIN_AT)[0]
    return chain


@pytest.mark.parametrize("zone_class", ZONES)
def test_a_bucket_s_chain_holds_its_records_oldest_first(tmp_path, zone_class):
    """A new record goes last in its bucket's chain: under a rotation of
    keys the least recently used, which a full stripe evicts, is first in
    its chain, and taking it out of the chain reads no other record."""
    path = str(tmp_path / "zone")
    zone = zone_class.create(path, 4, 8, 1)
    # The last 8 bytes pick the bucket: 0 for all three.
    keys = [bytes([number]) + bytes(15) for number in (3, 1, 2)]
    for number, key in enumerate(keys):
        put(zone, key, b"v", 100.0, float(number))
    assert bucket_chain(path, zone, 0, 0) == keys
    put(zone, keys[0], b"again", 100.0, 4.0)  # replaced in place: its place in the chain kept
    other_bucket = [bytes([number]) + bytes(7) + (1).to_bytes(8, sys.byteorder) for number in (1, 2)]
    put(zone, other_bucket[0], b"v", 100.0, 5.0)
    put(zone, other_bucket[1], b"v", 100.0, 6.0)  # full: the least recently used, keys[1], goes
    assert bucket_chain(path, zone, 0, 0) == [keys[0], keys[2]]
    zone.close()


@needs_compiled
@settings(max_examples=100, deadline=None)
@given(operations=st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 30),
                                     st.integers(-2, 8)), max_size=60))
def test_the_twins_leave_every_stripe_byte_for_byte_alike(tmp_path_factory, operations):
    """The compiled zone and its twin, through the same operations, leave
    each stripe the same bytes (its lock aside): one layout and one
    algorithm, down to the order of a bucket's chain."""
    folder = tmp_path_factory.mktemp("twins")
    paths = [str(folder / "compiled"), str(folder / "pure")]
    zones = [CompiledZone.create(paths[0], 12, 8, 2), PureZone.create(paths[1], 12, 8, 2)]
    now = 1000.0
    for kind, number, lasts in operations:
        key = digest(("twins", number))
        for zone in zones:
            with zone.locked([zone.stripe_of(key)]):
                if kind == "put":
                    zone.put(key, b"%d" % number, now + lasts, now)
                elif kind == "get":
                    zone.get(key, now)
                else:
                    zone.delete(key)
        now += 0.5
    stripes = []
    for zone, path in zip(zones, paths):
        zone.close()
        data = Path(path).read_bytes()
        stripes.append([data[Stripe(zone, stripe).body] for stripe in range(2)])
    assert stripes[0] == stripes[1]


def test_a_deleted_record_is_gone_and_its_room_reused(one_stripe):
    keys = fill(one_stripe, "abcd")
    with one_stripe.locked([0]):
        assert one_stripe.delete(keys[1]) is True
        assert one_stripe.delete(keys[1]) is False
        assert one_stripe.get(keys[1], 0.0) is None
    put(one_stripe, digest("e"), b"e", 100.0, 0.0)
    assert one_stripe.evictions == 0 and len(one_stripe) == 4


def test_the_generation_counts_up_for_every_process(zone):
    assert zone.generation() == 0
    assert [zone.bump_generation() for _ in range(3)] == [1, 2, 3]
    assert zone.generation() == 3


# -- rebuilding a stripe a dead owner left -----------------------------------------------


LINKS = {"newer": pure_zone.NEWER_AT, "older": pure_zone.OLDER_AT, "chain": pure_zone.CHAIN_AT}
damages = st.one_of(
    st.tuples(st.sampled_from(sorted(LINKS)), st.integers(0, 15), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("field"), st.sampled_from([pure_zone.NEWEST, pure_zone.OLDEST, pure_zone.FREE_HEAD,
                                                 pure_zone.USED]), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("bucket"), st.integers(0, 7), st.integers(0, 20)),
    st.tuples(st.just("torn"), st.integers(0, 15), st.just(WRITING)),
)


def small(number: int) -> int:
    """Half the damage points at records that exist, as a half-made link does."""
    return number % 20 if number % 2 else number


@settings(max_examples=200, deadline=None)
@given(names=st.lists(st.integers(0, 40), max_size=30), deleted=st.lists(st.integers(0, 40), max_size=5),
       damage=st.lists(damages, max_size=6))
def test_a_rebuilt_stripe_keeps_every_whole_record_and_drops_only_torn_ones(tmp_path_factory, names, deleted,
                                                                          damage):
    """Whatever a dead owner left in a stripe's links, counts and buckets, or
    records it was writing: the rebuild leaves a consistent stripe holding
    every whole record, in the same order when the LRU links were intact,
    and the compiled zone's rebuild writes the very same bytes as the twin's."""
    path = str(tmp_path_factory.mktemp("zone") / "zone")
    maker = CompiledZone or PureZone
    zone = maker.create(path, 16, 8, 1)
    for name in names:
        put(zone, digest(name), str(name).encode(), 2000.0 + name, 1000.0)
    for name in deleted:
        with zone.locked([0]):
            zone.delete(digest(name))
    before = live(zone, 0)
    twin = PureZone.attach(path)
    where = Stripe(zone, 0)
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), 0) as memory:
        torn = set()
        used = memory[where.field(pure_zone.FRESH):where.field(pure_zone.FRESH) + 4]
        fresh = struct.unpack("=I", used)[0]
        for kind, number, value in damage:
            if kind in LINKS:
                struct.pack_into("=I", memory, where.record(number) + LINKS[kind], small(value))
            elif kind == "field":
                struct.pack_into("=I", memory, where.field(number), small(value))
            elif kind == "bucket":
                struct.pack_into("=I", memory, where.bucket(number % where.layout.bucket_count), value)
            elif number < fresh and memory[where.record(number) + pure_zone.STATE_AT] == LIVE:
                memory[where.record(number) + pure_zone.STATE_AT] = WRITING
                torn.add(bytes(memory[where.record(number):where.record(number) + DIGEST_SIZE]))
        damaged = memory[where.body]
        results = []
        for rebuilder in {zone, twin}:
            memory[where.body] = damaged
            with rebuilder.locked([0]):
                rebuilder._rebuild(0)
            results.append(memory[where.body])
    assert len(set(results)) == 1  # the compiled zone's rebuild is the twin's, byte for byte
    with twin.locked([0]):
        assert twin.verify(0) == []
    after = live(twin, 0)
    expected = [record for record in before if record[0] not in torn]
    assert sorted(after) == sorted(expected)
    if not any(kind in ("newer", "older", "field", "torn") for kind, _, _ in damage):
        assert after == expected
    put(zone, digest("after"), b"works", 3000.0, 1000.0)
    assert get(zone, digest("after"), 1000.0) == b"works"
    twin.close()
    zone.close()


@pytest.mark.parametrize("zone_class", ZONES)
def test_a_record_replaced_halfway_gets_its_undo_copy_back(tmp_path, zone_class):
    """A counter being rewritten when its writer died keeps its count from
    before: the undo copy, written before the record, is put back."""
    path = str(tmp_path / "zone")
    zone = zone_class.create(path, 8, 8, 1)
    names = fill(zone, "abc")
    where = Stripe(zone, 0)
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), 0) as memory:
        index = next(number for number in range(3)
                     if memory[where.record(number):where.record(number) + DIGEST_SIZE] == names[1])
        record, size = where.record(index), where.layout.record_size
        memory[where.base + STRIPE_HEADER:where.base + STRIPE_HEADER + size] = memory[record:record + size]
        struct.pack_into("=I", memory, where.field(pure_zone.UNDO), index + 1)
        memory[record + pure_zone.STATE_AT] = WRITING  # then died, halfway through the new value
        memory[record + RECORD.size:record + RECORD.size + 3] = b"XYZ"
    with zone.locked([0]):
        zone._rebuild(0)
        assert [value for _, value, _ in zone.scan(0, 0.0)] == [b"c", b"b", b"a"]
    zone.close()


@pytest.mark.parametrize("zone_class", ZONES)
def test_a_live_record_whose_length_cannot_be_is_dropped(tmp_path, zone_class):
    path = str(tmp_path / "zone")
    zone = zone_class.create(path, 8, 8, 1)
    fill(zone, "ab")
    where = Stripe(zone, 0)
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), 0) as memory:
        struct.pack_into("=H", memory, where.record(0) + pure_zone.LENGTH_AT, 9)
    with zone.locked([0]):
        assert [value for _, value, _ in zone.scan(0, 0.0)] == [b"b", b"a\0\0\0\0\0\0\0"]  # read, bounded
        zone._rebuild(0)
        assert [value for _, value, _ in zone.scan(0, 0.0)] == [b"b"]
    zone.close()


# -- hints: memory asked for ahead, nothing read that is not the zone's ------------------


HINTS = ("ask", "ask_records", "ask_victim")


@settings(max_examples=200, deadline=None)
@given(names=st.lists(st.integers(0, 40), max_size=30), damage=st.lists(damages, max_size=6),
       asked=st.lists(st.one_of(st.integers(0, 60).map(digest), st.binary(max_size=20), st.none(), st.integers()),
                      max_size=12))
def test_hints_take_no_lock_change_nothing_and_follow_no_link_out_of_the_zone(tmp_path_factory, names, damage,
                                                                             asked):
    """``ask``, ``ask_records`` and ``ask_victim`` read the zone without its
    lock, so whatever its links say (torn, stale, past the stripe: a dead
    owner's or a writer's halfway): they read nothing outside the zone (a
    link out of the stripe would crash the process here), write nothing, and
    ignore what is not a digest."""
    path = str(tmp_path_factory.mktemp("zone") / "zone")
    zone = (CompiledZone or PureZone).create(path, 16, 8, 1)
    for name in names:  # past 16 names: a full stripe, whose oldest record a victim's hint reads
        put(zone, digest(name), str(name).encode(), 2000.0 + name, 1000.0)
    where = Stripe(zone, 0)
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), 0) as memory:
        for kind, number, value in damage:
            if kind in LINKS:
                struct.pack_into("=I", memory, where.record(number) + LINKS[kind], value)
            elif kind == "field":
                struct.pack_into("=I", memory, where.field(number), value)
            elif kind == "bucket":
                struct.pack_into("=I", memory, where.bucket(number % where.layout.bucket_count), 2**32 - 1 - value)
        before = memory[:]
        for key in asked:
            for hint in HINTS:
                getattr(zone, hint)(key)
        assert memory[:] == before
    zone.close()
    for hint in HINTS:
        getattr(zone, hint)(digest(1))  # a closed zone's memory is gone: nothing read


@pytest.mark.parametrize("oldest", [17, 2**16, 2**31 - 1, 2**32 - 1])
def test_a_victim_s_hint_reads_no_record_past_the_stripe(tmp_path, oldest):
    """A full stripe whose least recently used link is torn: the hint that
    reads that record's digest and links reads none (a record that far
    away is outside the zone's memory)."""
    path = str(tmp_path / "zone")
    zone = (CompiledZone or PureZone).create(path, 16, 8, 1)
    fill(zone, [str(number) for number in range(20)])
    where = Stripe(zone, 0)
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), 0) as memory:
        struct.pack_into("=I", memory, where.field(pure_zone.OLDEST), oldest)
        before = memory[:]
        zone.ask_records(digest(1))
        zone.ask_victim(digest(1))
        assert memory[:] == before
    zone.close()


@pytest.mark.parametrize("zone_class", BUILT)
def test_a_zone_given_hints_holds_and_evicts_what_one_given_none_does(zone_class):
    hinted, plain = zone_class.private(16, 8, 2), zone_class.private(16, 8, 2)
    for number in range(60):
        key = digest(number % 40)
        for hint in HINTS:
            getattr(hinted, hint)(key)
        for made in (hinted, plain):
            if get(made, key, float(number)) is None:
                put(made, key, str(number).encode(), 100.0, float(number))
    assert [live(hinted, stripe) for stripe in (0, 1)] == [live(plain, stripe) for stripe in (0, 1)]
    assert hinted.evictions == plain.evictions > 0
    hinted.close()
    plain.close()
