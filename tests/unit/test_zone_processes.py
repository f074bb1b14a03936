"""The compiled zone across real processes (spawned, as uvicorn starts its
workers, each attaching to the zone file): exact counts under contention,
and a process SIGKILLed while it holds a stripe's lock, or while it writes a
record, or at any moment of a flood, never wedges the others nor loses a
count that was written.

No proxy and no network: processes, a zone file and pipes.
"""

from __future__ import annotations

import mmap
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from sidecar.shm import pure_zone
from tests.unit.test_zone import CompiledZone, PureZone, Stripe, digest

pytestmark = pytest.mark.skipif(CompiledZone is None, reason="the compiled zone is not built")

SPAWN = multiprocessing.get_context("spawn")
NOW, FOREVER = 1000.0, 1e12
COUNT = struct.Struct("=Q")
STRIPES = 4


def keys_by_stripe() -> dict[int, list[bytes]]:
    """Two digests in each stripe of a zone of STRIPES stripes."""
    probe = PureZone.private(STRIPES, 8, STRIPES)
    found: dict[int, list[bytes]] = {stripe: [] for stripe in range(STRIPES)}
    number = 0
    while any(len(keys) < 2 for keys in found.values()):
        key = digest(("process", number))
        keys = found[probe.stripe_of(key)]
        if len(keys) < 2:
            keys.append(key)
        number += 1
    return found


KEYS = keys_by_stripe()
# Pairs counted together in one transaction: in one stripe, and across two.
PAIRS = [(KEYS[0][0], KEYS[0][1]), (KEYS[0][0], KEYS[1][0]), (KEYS[1][0], KEYS[2][0]), (KEYS[3][0], KEYS[0][1])]


def count_of(zone: Any, key: bytes) -> int:
    value = zone.get(key, NOW)
    return 0 if value is None else int(COUNT.unpack(value)[0])


def add_one(zone: Any, keys: tuple[bytes, ...]) -> list[int]:
    """One transaction: every key's count read and written plus one, under
    the locks of all their stripes."""
    counts = []
    with zone.locked(zone.stripes_for(keys)):
        for key in keys:
            counts.append(count_of(zone, key) + 1)
            zone.put(key, COUNT.pack(counts[-1]), FOREVER, NOW)
    return counts


# -- what the spawned processes run -------------------------------------------


def increment(path: str, worker: int, rounds: int, start: Any) -> None:
    zone = CompiledZone.attach(path)
    start.wait()
    for number in range(rounds):
        add_one(zone, PAIRS[(number + worker) % len(PAIRS)])
    zone.close()


def hold(path: str, stripe: int, pipe: Any) -> None:
    """Lock a stripe, say so, and wait to be killed."""
    zone = CompiledZone.attach(path)
    zone.lock([stripe])
    pipe.send("locked")
    time.sleep(120)


def hold_halfway_through_a_replace(path: str, key: bytes, pipe: Any) -> None:
    """Lock a key's stripe and leave its record as a process killed in the
    middle of replacing it would: the undo copy made, the record being
    written, half its new value there; then wait to be killed."""
    zone = CompiledZone.attach(path)
    stripe = zone.stripe_of(key)
    zone.lock([stripe])
    where = Stripe(zone, stripe)
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), 0) as memory:
        index = next(number for number in range(zone.per_stripe)
                     if memory[where.record(number):where.record(number) + 16] == key)
        record, size = where.record(index), where.layout.record_size
        undo = where.base + pure_zone.STRIPE_HEADER
        memory[undo:undo + size] = memory[record:record + size]
        struct.pack_into("=I", memory, where.field(pure_zone.UNDO), index + 1)
        memory[record + pure_zone.STATE_AT] = pure_zone.WRITING
        memory[record + pure_zone.RECORD_HEADER:record + pure_zone.RECORD_HEADER + 4] = b"\xff" * 4
    pipe.send("torn")
    time.sleep(120)


def count_forever(path: str, keys: list[bytes], said_path: str, pipe: Any) -> None:
    """Add one to every key's count in one transaction, again and again,
    saying the counts of each transaction once it is written (in ``said``)."""
    zone = CompiledZone.attach(path)
    with open(said_path, "r+b") as file, mmap.mmap(file.fileno(), 0) as memory:
        said = Said(memory, len(keys))
        pipe.send("counting")
        while True:
            said.write(add_one(zone, tuple(keys)))


class Said:
    """The counts a process last said it wrote, in a file it maps: two
    slots and a byte naming the whole one, so that a process killed while
    writing a slot leaves the other to read."""

    def __init__(self, memory: Any, count: int) -> None:
        self.memory = memory
        self.slot = struct.Struct(f"={count}Q")
        self.turn = memory[0]  # the whole slot: the next write goes to the other

    @staticmethod
    def size(count: int) -> int:
        return 8 + 2 * 8 * count

    def write(self, counts: list[int]) -> None:
        self.turn ^= 1
        self.slot.pack_into(self.memory, 8 + self.turn * self.slot.size, *counts)
        self.memory[0] = self.turn

    def read(self) -> list[int]:
        return list(self.slot.unpack_from(self.memory, 8 + self.memory[0] * self.slot.size))


def spawn(target: Callable[..., None], *args: Any) -> Any:
    """A process running ``target``; a pipe end among ``args`` is closed
    here once the process has its own (so that its death is an end of file)."""
    process = SPAWN.Process(target=target, args=args, daemon=True)
    process.start()
    for arg in args:
        if isinstance(arg, multiprocessing.connection.Connection):
            arg.close()
    return process


def kill(process: Any) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    assert process.exitcode == -signal.SIGKILL


def under_lock(zone: Any, stripes: list[int], action: Callable[[], Any], timeout: float = 10.0) -> tuple[float, Any]:
    """Run ``action`` holding ``stripes`` in a thread of its own: the seconds
    the lock took and what the action returned. A lock that never comes fails
    the test after ``timeout`` instead of hanging it."""
    outcome: dict[str, Any] = {}

    def locked() -> None:
        began = time.monotonic()
        with zone.locked(stripes):
            outcome["took"] = time.monotonic() - began
            outcome["result"] = action()

    thread = threading.Thread(target=locked, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"stripes {stripes} still not locked after {timeout} s"
    return outcome["took"], outcome["result"]


def everything(zone: Any) -> list[list[tuple[bytes, bytes, float]]]:
    def scan() -> list[list[tuple[bytes, bytes, float]]]:
        return [zone.scan(stripe, NOW) for stripe in range(zone.stripes)]

    return under_lock(zone, list(range(zone.stripes)), scan)[1]


def consistent(path: str, zone: Any) -> list[str]:
    """What the twin finds wrong in every stripe, each read under the
    compiled zone's lock."""
    twin = PureZone.attach(path)
    problems = []
    for stripe in range(zone.stripes):
        def check(stripe: int = stripe) -> list[str]:
            with twin.locked([stripe]):
                return twin.verify(stripe)

        problems += under_lock(zone, [stripe], check)[1]
    twin.close()
    return problems


@pytest.fixture
def zone_file(tmp_path):
    path = str(tmp_path / "zone")
    zone = CompiledZone.create(path, 64, 16, STRIPES)
    yield path, zone
    zone.close()


# -- the tests -------------------------------------------------------------------------


def test_three_processes_counting_in_transactions_lose_no_count(zone_file):
    path, zone = zone_file
    workers, rounds = 3, 4000
    start = SPAWN.Event()
    processes = [spawn(increment, path, worker, rounds, start) for worker in range(workers)]
    start.set()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0
    expected: Counter[bytes] = Counter()
    for worker in range(workers):
        for number in range(rounds):
            expected.update(PAIRS[(number + worker) % len(PAIRS)])
    counts = under_lock(zone, list(range(STRIPES)), lambda: {key: count_of(zone, key) for key in expected})[1]
    assert counts == dict(expected)
    assert zone.recoveries == 0
    assert consistent(path, zone) == []


def test_a_lock_whose_owner_was_killed_is_taken_over_within_a_second(zone_file):
    path, zone = zone_file
    for number, (stripe, keys) in enumerate(KEYS.items()):
        for key in keys:
            under_lock(zone, [stripe], lambda key=key, number=number: zone.put(key, b"kept %d" % number, FOREVER, NOW))
    before = everything(zone)
    ours, theirs = SPAWN.Pipe()
    holder = spawn(hold, path, 1, theirs)
    assert ours.poll(60) and ours.recv() == "locked"
    kill(holder)
    took, after = under_lock(zone, [1], lambda: zone.scan(1, NOW))
    assert took < 1.0
    assert zone.recoveries == 1
    assert after == before[1]
    assert everything(zone) == before  # every stripe's records, the dead owner's included
    under_lock(zone, [1], lambda: zone.put(KEYS[1][0], b"new", FOREVER, NOW))
    assert under_lock(zone, [1], lambda: zone.get(KEYS[1][0], NOW))[1] == b"new"
    assert zone.recoveries == 1  # counted once, when taken over
    assert consistent(path, zone) == []


def test_a_thread_waiting_for_a_lock_lets_the_others_run_and_gets_it_when_its_owner_dies(zone_file):
    path, zone = zone_file
    ours, theirs = SPAWN.Pipe()
    holder = spawn(hold, path, 2, theirs)
    assert ours.poll(60) and ours.recv() == "locked"
    result: dict[str, float] = {}

    def wait_for_it() -> None:
        with zone.locked([2]):
            result["at"] = time.monotonic()

    waiter = threading.Thread(target=wait_for_it, daemon=True)
    waiter.start()
    turns = 0
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # the waiter must not hold the GIL
        turns += 1
    assert waiter.is_alive() and turns > 1000
    killed = time.monotonic()
    kill(holder)
    waiter.join(5)
    assert not waiter.is_alive()
    assert result["at"] - killed < 1.0
    assert (zone.recoveries, zone.waits) == (1, 1)  # it waited once, for the lock it then took over


def test_a_record_its_writer_died_replacing_keeps_its_value_from_before(zone_file):
    path, zone = zone_file
    key, neighbour = KEYS[3]
    under_lock(zone, [3], lambda: (zone.put(key, COUNT.pack(41), FOREVER, NOW),
                                   zone.put(neighbour, COUNT.pack(7), FOREVER, NOW)))
    ours, theirs = SPAWN.Pipe()
    writer = spawn(hold_halfway_through_a_replace, path, key, theirs)
    assert ours.poll(60) and ours.recv() == "torn"
    kill(writer)
    counts = under_lock(zone, [3], lambda: (count_of(zone, key), count_of(zone, neighbour)))[1]
    assert counts == (41, 7)
    assert zone.recoveries == 1
    assert consistent(path, zone) == []


def test_counters_killed_at_any_moment_keep_every_count_they_wrote(tmp_path):
    """Killed at random moments of a flood of transactions (most of its time
    inside the lock): every count is the last one the process said it wrote,
    or one more for the keys its last transaction reached before it died, in
    the transaction's order; the zone stays consistent and the next process
    goes on from there."""
    path = str(tmp_path / "zone")
    zone = CompiledZone.create(path, 4 * 128, 16, 4)
    probe = PureZone.private(4, 8, 4)
    keys = [key for key in (digest(("flood", number)) for number in range(2000)) if probe.stripe_of(key) == 0][:64]
    said_path = tmp_path / "said"
    said_path.write_bytes(bytes(Said.size(len(keys))))
    chance = random.Random(25)
    kills = 8
    with open(said_path, "r+b") as file, mmap.mmap(file.fileno(), 0) as memory:
        said = Said(memory, len(keys))
        for _ in range(kills):
            ours, theirs = SPAWN.Pipe()
            counter = spawn(count_forever, path, keys, str(said_path), theirs)
            assert ours.poll(60) and ours.recv() == "counting"
            before, started = said.read(), time.monotonic()
            while said.read() == before:  # until it has counted once
                assert time.monotonic() - started < 60
            time.sleep(chance.uniform(0.01, 0.2))  # a moment to die at, not a measure
            kill(counter)
            took, counts = under_lock(zone, [0], lambda: [count_of(zone, key) for key in keys])
            assert took < 1.0
            reached = [count - before for count, before in zip(counts, said.read())]
            assert set(reached) <= {0, 1} and reached == sorted(reached, reverse=True), reached
    assert consistent(path, zone) == []
    assert 1 <= zone.recoveries <= kills  # some deaths came inside the lock
    zone.close()
