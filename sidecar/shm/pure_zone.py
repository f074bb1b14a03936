"""The zone's pure-Python twin: the same layout and algorithm as the compiled
zone (``_zone.pyx``), over a bytearray or a file mapped in this process.

A zone is a table of fixed-size records in one block of memory, nginx's
``limit_req`` zone design: sized once at start, split into stripes by a key's
digest, each stripe with its own lock, hash index, LRU list and share of the
records. The compiled zone puts a robust process-shared mutex in each stripe
so that every worker of a node works on one table; this twin takes no real
lock (one process, one thread) and checks instead that the caller locked the
stripe it works on, so that the store above can be tested without compiling.
It also serves as the reference the compiled zone is tested against, and
reads any zone file for tests (``verify``).

The layout, in native byte order (a zone never leaves its machine):

- the zone's header (``HEADER_SIZE`` bytes): its magic, version, the kind of
  locks it carries, the layout's numbers, four counters on a cache line of
  their own (a generation the store bumps, locks recovered, LRU evictions,
  locks that had to wait), and on the next line a secret of 16 random
  bytes drawn when the zone is made (``secret``: the store keys the
  digests that name its records with it, so that nobody outside the node
  can tell which stripe or bucket a key of their choosing falls in);
- ``stripes`` stripes of ``stripe_size`` bytes, each: a lock slot
  (``LOCK_SLOT`` bytes, a ``pthread_mutex_t`` in the compiled zone), the
  stripe's own fields (the newest and oldest record, the free list, how many
  records were ever taken, how many are in use, which record the undo copy
  is of), the undo copy (one record), its hash buckets, then ``per_stripe``
  records.
- a record: its 16-byte digest, its expiry, its newer and older neighbour in
  the LRU list, the next record of its hash bucket (a bucket's chain holds
  its records in the order they were stored: a full stripe's least
  recently used is near its chain's head) or of the free list,
  the value's length, its state (free, live, being written) and a mark
  used while a stripe is rebuilt; then ``value_size`` bytes of value.

Links are record index + 1, so that 0 is "none" and a zeroed file is a valid
empty zone. A record is written between two changes of its state (being
written, then live), so when a lock's owner dies, the stripe is rebuilt from
its live records alone (``_rebuild``): a new record torn halfway is dropped.
A record replaced in place (a counter updated) is first copied to the
stripe's undo copy, which the rebuild puts back: a count survives the death
of the process that was updating it, as it was before the update.

A stripe that needs a record and has none free takes the least recently
used expired record among its ``EXPIRED_SCAN`` least recently used, else
evicts its least recently used record (an eviction, counted). Looking no
further keeps an insert's cost bounded under key rotation, as nginx does.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

MAGIC = b"SLUICEZN"
VERSION = 2  # 2: the header holds a secret
LOCKS_NONE = 0  # made by this twin: no process-shared lock in the slots
LOCKS_ROBUST = 1  # made by the compiled zone: robust process-shared mutexes
HEADER_SIZE = 256
LOCK_SLOT = 64  # bytes for a pthread_mutex_t (40 on x86-64, 48 on arm64)
STRIPE_HEADER = 128  # the lock slot, then the stripe's fields, two cache lines
RECORD_HEADER = 40
ALIGN = 64
EXPIRED_SCAN = 8  # least recently used records looked at for an expired one
MASK_STRIPES = 64  # stripes a mask of stripes names (Zone.lock_mask): one bit each
DIGEST_SIZE = 16
MAX_STRIPES = 1 << 16
MAX_VALUE_SIZE = 0xFFFF  # the length is a u16
MAX_PER_STRIPE = 0xFFFFFFFE  # links are u32, index + 1

FREE, LIVE, WRITING = 0, 1, 2
NIL = 0

# The header: magic, version, lock kind, header size, stripes, records per
# stripe, value size, record size, buckets per stripe, stripe size, file
# size, ready (set last when made), reserved.
LAYOUT = struct.Struct("=8sIIIIIIIIQQII")
COUNTERS_AT = 64
GENERATION_AT, RECOVERIES_AT, EVICTIONS_AT, WAITS_AT = 64, 72, 80, 88
READY_AT = 56
SECRET_AT, SECRET_SIZE = 128, 16
# A stripe's fields after its lock slot: newest, oldest, free list head,
# records ever taken (fresh), records in use, the record the undo copy is of.
STRIPE_FIELDS = struct.Struct("=IIIIII")
NEWEST, OLDEST, FREE_HEAD, FRESH, USED, UNDO = range(6)
# A record's header: digest, expires, newer, older, chain, length, state, mark.
RECORD = struct.Struct("=16sdIIIHBB")
EXPIRES_AT, NEWER_AT, OLDER_AT, CHAIN_AT, LENGTH_AT, STATE_AT, MARK_AT = 16, 24, 28, 32, 36, 38, 39

_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_F64 = struct.Struct("=d")

assert LAYOUT.size == 64 and RECORD.size == RECORD_HEADER


def _round_up(size: int, unit: int) -> int:
    return (size + unit - 1) // unit * unit


@dataclass(frozen=True)
class Layout:
    """Where everything is in a zone of ``stripes`` stripes of ``per_stripe``
    records of up to ``value_size`` bytes: computed once, from the three
    numbers, by both zones."""

    stripes: int
    per_stripe: int
    value_size: int

    @property
    def capacity(self) -> int:
        return self.stripes * self.per_stripe

    @property
    def record_size(self) -> int:
        """Bytes per record, its header included (a multiple of 8)."""
        return _round_up(RECORD_HEADER + self.value_size, 8)

    @property
    def bucket_count(self) -> int:
        """Hash buckets per stripe: a power of two, at least three quarters
        of the stripe's records (chains of 4/3 records at most on average:
        a key looked for, found or not, reads about one record besides its
        bucket, each a miss under a rotation of keys), unless those buckets
        would take more than a sixteenth of the records' memory (small
        records): then at least half the records (chains of 2 at most)."""
        dense = 1 << max(0, (self.per_stripe * 3 + 3) // 4 - 1).bit_length()
        if dense * 4 * 16 <= self.per_stripe * self.record_size:
            return dense
        return 1 << max(0, (self.per_stripe + 1) // 2 - 1).bit_length()

    @property
    def buckets_at(self) -> int:
        """Where a stripe's buckets start, after its header and undo copy."""
        return STRIPE_HEADER + _round_up(self.record_size, ALIGN)

    @property
    def records_at(self) -> int:
        """Where a stripe's records start, from the stripe's start."""
        return self.buckets_at + _round_up(self.bucket_count * 4, ALIGN)

    @property
    def stripe_size(self) -> int:
        return _round_up(self.records_at + self.per_stripe * self.record_size, ALIGN)

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.stripes * self.stripe_size

    @property
    def bytes_per_key(self) -> float:
        """The whole zone's memory per record it can hold: records, buckets,
        stripe headers and the zone's header."""
        return self.file_size / self.capacity


def layout(capacity: int, value_size: int, stripes: int) -> Layout:
    """The layout of a zone for ``capacity`` records of up to ``value_size``
    bytes in ``stripes`` stripes (``capacity // stripes`` records each), or
    ValueError saying which number is wrong."""
    for name, number in (("capacity", capacity), ("value_size", value_size), ("stripes", stripes)):
        if type(number) is not int:
            raise ValueError(f"a zone's {name} is a whole number, not {number!r}")
    if not 1 <= stripes <= MAX_STRIPES:
        raise ValueError(f"a zone has 1 to {MAX_STRIPES} stripes, not {stripes}")
    if not 1 <= value_size <= MAX_VALUE_SIZE:
        raise ValueError(f"a zone's values are 1 to {MAX_VALUE_SIZE} bytes, not {value_size}")
    if capacity < stripes:
        raise ValueError(f"a zone of {stripes} stripes holds at least {stripes} records, not {capacity}")
    per_stripe = capacity // stripes
    if per_stripe > MAX_PER_STRIPE:
        raise ValueError(f"a zone's stripe holds at most {MAX_PER_STRIPE} records, not {per_stripe}")
    return Layout(stripes, per_stripe, value_size)


def read_layout(header: bytes, file_size: int, where: str) -> tuple[Layout, int]:
    """The layout and lock kind a zone's header says, checked against itself
    and the file's size; ValueError saying what is wrong with ``where``."""
    if len(header) < LAYOUT.size or file_size < HEADER_SIZE:
        raise ValueError(f"{where} is not a Sluice zone: {file_size} bytes, shorter than a zone's header")
    (magic, version, locks, header_size, stripes, per_stripe, value_size, record_size, buckets,
     stripe_size, size, ready, _) = LAYOUT.unpack_from(header, 0)
    if magic != MAGIC:
        raise ValueError(f"{where} is not a Sluice zone (its first bytes are {magic!r})")
    if version != VERSION:
        raise ValueError(f"{where} is a Sluice zone of version {version}; this Sluice reads version {VERSION}")
    if not ready:
        raise ValueError(f"{where} is a Sluice zone still being made (or whose maker died making it)")
    if locks not in (LOCKS_NONE, LOCKS_ROBUST):
        raise ValueError(f"{where}: unknown kind of locks {locks}")
    try:
        found = layout(stripes * per_stripe, value_size, stripes)
    except ValueError as error:
        raise ValueError(f"{where}: a damaged zone header ({error})") from None
    expected = (HEADER_SIZE, found.record_size, found.bucket_count, found.stripe_size, found.file_size)
    if (header_size, record_size, buckets, stripe_size, size) != expected:
        raise ValueError(f"{where}: a damaged zone header (its sizes disagree with its numbers)")
    if file_size != size:
        raise ValueError(f"{where}: the zone's header says {size} bytes, the file has {file_size}")
    return found, locks


def write_layout(buffer: bytearray | mmap.mmap, found: Layout, locks: int) -> None:
    """Write a new zone's header, not yet ready (``mark_ready`` does that last)."""
    LAYOUT.pack_into(buffer, 0, MAGIC, VERSION, locks, HEADER_SIZE, found.stripes, found.per_stripe,
                     found.value_size, found.record_size, found.bucket_count, found.stripe_size,
                     found.file_size, 0, 0)


def write_secret(buffer: bytearray | mmap.mmap) -> None:
    """Draw a new zone's secret (see ``Zone.secret``)."""
    buffer[SECRET_AT:SECRET_AT + SECRET_SIZE] = os.urandom(SECRET_SIZE)


def mark_ready(buffer: bytearray | mmap.mmap) -> None:
    _U32.pack_into(buffer, READY_AT, 1)


def check_digest(digest: object) -> bytes:
    """``digest`` itself when it is 16 bytes; ValueError otherwise."""
    if not isinstance(digest, bytes) or len(digest) != DIGEST_SIZE:
        raise ValueError(f"a zone's key is a {DIGEST_SIZE}-byte digest, not {_describe(digest)}")
    return digest


def check_value(value: object, value_size: int) -> bytes:
    """``value`` as bytes when it fits in a record; ValueError otherwise."""
    if not isinstance(value, bytes):
        if not isinstance(value, (bytearray, memoryview)):
            raise ValueError(f"a zone's value is bytes, not {_describe(value)}")
        value = bytes(value)
    if len(value) > value_size:
        raise ValueError(f"a value of {len(value)} bytes is longer than the zone's {value_size}")
    return value


def check_time(name: str, when: float) -> float:
    """``when`` as a float: TypeError for what is not a number, ValueError
    for NaN (infinity is a time that never comes: a record that never
    expires)."""
    if isinstance(when, (str, bytes, bytearray)):
        raise TypeError(f"{name} is a number of seconds, not {_describe(when)}")
    seconds = float(when)
    if math.isnan(seconds):
        raise ValueError(f"{name} is a number of seconds, not NaN")
    return seconds


def check_stripes(stripes: Iterable[int], count: int) -> list[int]:
    """The stripes to lock or unlock, checked: whole numbers in range, in
    increasing order (the order that makes locking deadlock-free)."""
    checked = list(stripes)
    previous = -1
    for stripe in checked:
        if type(stripe) is not int or not 0 <= stripe < count:
            raise ValueError(f"a stripe is a whole number from 0 to {count - 1}, not {stripe!r}")
        if stripe <= previous:
            raise ValueError(f"stripes are locked in increasing order, each once: {checked}")
        previous = stripe
    return checked


def check_mask(mask: object, count: int) -> list[int]:
    """The stripes a mask of stripes names (stripe n: bit n), in increasing
    order, checked: a zone of at most MASK_STRIPES stripes, no bit past its last."""
    if type(mask) is not int or mask < 0 or mask >> MASK_STRIPES:
        raise ValueError(f"a mask of stripes is a whole number of {MASK_STRIPES} bits, not {mask!r}")
    if count > MASK_STRIPES:
        raise ValueError(f"a mask names {MASK_STRIPES} stripes at most; this zone has {count}: lock a list")
    if mask >> count:
        raise ValueError(f"a mask of stripes names stripes 0 to {count - 1}: {mask:#x}")
    return [stripe for stripe in range(count) if mask >> stripe & 1]


def _describe(thing: object) -> str:
    if isinstance(thing, (bytes, bytearray, memoryview)):
        return f"{type(thing).__name__} of {len(thing)} bytes"
    return f"{type(thing).__name__} {thing!r:.40}"


class Zone:
    """A zone over a bytearray or a mapped file, for one process and thread:
    see the module's docstring. The API is the compiled zone's."""

    def __init__(self, buffer: bytearray | mmap.mmap, found: Layout, path: str | None) -> None:
        self._buffer: bytearray | mmap.mmap | None = buffer
        self._layout = found
        self.path = path
        self.capacity = found.capacity
        self.value_size = found.value_size
        self.stripes = found.stripes
        self.per_stripe = found.per_stripe
        self.record_size = found.record_size
        self.file_size = found.file_size
        self._bucket_mask = found.bucket_count - 1
        self._held: set[int] = set()

    # -- making, attaching, closing --------------------------------------

    @staticmethod
    def create(path: str | os.PathLike[str], capacity: int, value_size: int, stripes: int) -> Zone:
        """A new zone file at ``path`` (which must not exist; mode 0600), its
        memory reserved now: a full tmpfs fails here, not on a later write."""
        found = layout(capacity, value_size, stripes)
        path = os.fspath(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            reserve(fd, found.file_size)
            mapped = mmap.mmap(fd, found.file_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        write_layout(mapped, found, LOCKS_NONE)
        write_secret(mapped)
        mark_ready(mapped)
        return Zone(mapped, found, path)

    @staticmethod
    def attach(path: str | os.PathLike[str]) -> Zone:
        """The zone at ``path``, made by this twin or the compiled zone. This
        twin takes no real lock: attach to a zone that no other process is
        using (tests, inspection)."""
        path = os.fspath(path)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            found, _ = read_layout(os.pread(fd, HEADER_SIZE, 0), size, path)
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return Zone(mapped, found, path)

    @staticmethod
    def private(capacity: int, value_size: int, stripes: int) -> Zone:
        """A zone in this process's own memory, without a file."""
        found = layout(capacity, value_size, stripes)
        buffer = bytearray(found.file_size)
        write_layout(buffer, found, LOCKS_NONE)
        write_secret(buffer)
        mark_ready(buffer)
        return Zone(buffer, found, None)

    def close(self) -> None:
        """Unmap the zone; every later operation raises ValueError. Closing
        with stripes still locked is a mistake (RuntimeError)."""
        if self._held:
            raise RuntimeError(f"closing a zone with stripes still locked: {sorted(self._held)}")
        buffer, self._buffer = self._buffer, None
        if isinstance(buffer, mmap.mmap):
            buffer.close()

    def unlink(self) -> None:
        """Remove the zone's file (the processes attached keep their mapping)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _memory(self) -> bytearray | mmap.mmap:
        buffer = self._buffer
        if buffer is None:
            raise ValueError("the zone is closed")
        return buffer

    # -- stripes and locks -----------------------------------------------

    def stripe_of(self, digest: bytes) -> int:
        """The stripe of a 16-byte digest (its first 8 bytes; the last 8 pick
        its hash bucket)."""
        return int.from_bytes(check_digest(digest)[:8], sys.byteorder) % self.stripes

    def stripes_for(self, digests: Iterable[bytes]) -> list[int]:
        """The stripes of these digests, sorted and once each: what to lock."""
        return sorted({self.stripe_of(digest) for digest in digests})

    def lock(self, stripes: Sequence[int]) -> None:
        """Lock these stripes (increasing order, each once). This twin only
        notes them: locking one already locked is an error, as it is for the
        compiled zone's error-checking mutexes."""
        self._memory()
        checked = check_stripes(stripes, self.stripes)
        for stripe in checked:
            if stripe in self._held:
                raise RuntimeError(f"stripe {stripe} is already locked by this thread")
        self._held.update(checked)

    def unlock(self, stripes: Sequence[int]) -> None:
        """Unlock these stripes (as given to ``lock``); unlocking one this
        thread does not hold is a RuntimeError, after the others are unlocked."""
        self._memory()
        checked = check_stripes(stripes, self.stripes)
        unheld = [stripe for stripe in checked if stripe not in self._held]
        self._held.difference_update(checked)
        if unheld:
            raise RuntimeError(f"stripe {unheld[-1]} is not locked by this thread")

    def lock_mask(self, mask: int) -> None:
        """``lock`` of the stripes whose bits are set in ``mask`` (stripe n: bit n)."""
        self.lock(check_mask(mask, self.stripes))

    def unlock_mask(self, mask: int) -> None:
        """``unlock`` of the stripes whose bits are set in ``mask``."""
        self.unlock(check_mask(mask, self.stripes))

    @contextmanager
    def locked(self, stripes: Sequence[int]) -> Iterator[None]:
        """Hold these stripes' locks for a ``with`` block."""
        self.lock(stripes)
        try:
            yield
        finally:
            self.unlock(stripes)

    def _stripe_base(self, stripe: int) -> int:
        if stripe not in self._held:
            raise RuntimeError(f"stripe {stripe} is not locked: lock it before using it")
        return HEADER_SIZE + stripe * self._layout.stripe_size

    # -- records -----------------------------------------------------------

    def get(self, digest: bytes, now: float) -> bytes | None:
        """The value stored under ``digest``, None when absent or expired at
        ``now``; a value found becomes the stripe's most recently used."""
        return self._read(digest, now, refresh=True)

    def peek(self, digest: bytes, now: float) -> bytes | None:
        """As ``get``, without changing the LRU order (an administrator's read)."""
        return self._read(digest, now, refresh=False)

    def _read(self, digest: bytes, now: float, refresh: bool) -> bytes | None:
        buffer = self._memory()
        check_digest(digest)
        now = check_time("now", now)
        base = self._stripe_base(self.stripe_of(digest))
        found = self._find(buffer, base, digest)
        if found == NIL:
            return None
        record = self._record_at(base, found - 1)
        if _F64.unpack_from(buffer, record + EXPIRES_AT)[0] <= now:
            return None
        if refresh:
            self._to_front(buffer, base, found)
        length = min(struct.unpack_from("=H", buffer, record + LENGTH_AT)[0], self.value_size)
        return bytes(buffer[record + RECORD_HEADER:record + RECORD_HEADER + length])

    def put(self, digest: bytes, value: bytes, expires: float, now: float) -> None:
        """Store ``value`` under ``digest`` until ``expires``, as the stripe's
        most recently used. A new digest in a full stripe takes an expired
        record, else the least recently used (see the module's docstring)."""
        buffer = self._memory()
        check_digest(digest)
        value = check_value(value, self.value_size)
        expires = check_time("expires", expires)
        now = check_time("now", now)
        base = self._stripe_base(self.stripe_of(digest))
        found = self._find(buffer, base, digest)
        if found != NIL:
            self._replace(buffer, base, found, digest, value, expires)
            self._to_front(buffer, base, found)
            return
        found = self._take(buffer, base, now)
        record = self._record_at(base, found - 1)
        self._write(buffer, record, digest, value, expires)
        # Last in its bucket's chain: a chain holds its records oldest
        # first, so the least recently used, which a full stripe evicts, is
        # found at once (the compiled zone reads no other record for it).
        _U32.pack_into(buffer, record + CHAIN_AT, NIL)
        link = self._bucket_at(base, digest)
        while (following := _U32.unpack_from(buffer, link)[0]) != NIL:
            link = self._record_at(base, following - 1) + CHAIN_AT
        _U32.pack_into(buffer, link, found)
        self._link_front(buffer, base, found)
        self._add_field(buffer, base, USED, 1)

    def delete(self, digest: bytes) -> bool:
        """Remove ``digest``'s record, expired or not; whether there was one."""
        buffer = self._memory()
        check_digest(digest)
        base = self._stripe_base(self.stripe_of(digest))
        found = self._find(buffer, base, digest)
        if found == NIL:
            return False
        # Freed first: a delete whose process dies halfway is done.
        buffer[self._record_at(base, found - 1) + STATE_AT] = FREE
        self._remove(buffer, base, found)
        self._push_free(buffer, base, found)
        return True

    def scan(self, stripe: int, now: float) -> list[tuple[bytes, bytes, float]]:
        """The stripe's records unexpired at ``now``: (digest, value, expires),
        most recently used first."""
        buffer = self._memory()
        check_stripes([stripe], self.stripes)
        now = check_time("now", now)
        base = self._stripe_base(stripe)
        live = []
        at = self._field(buffer, base, NEWEST)
        while at != NIL:
            record = self._record_at(base, at - 1)
            found, expires, _, older, _, length, _, _ = RECORD.unpack_from(buffer, record)
            length = min(length, self.value_size)
            if expires > now:
                live.append((found, bytes(buffer[record + RECORD_HEADER:record + RECORD_HEADER + length]), expires))
            at = older
        return live

    def __len__(self) -> int:
        """Records in use, expired ones not yet taken back included; read
        without locks, so only a moment's count while others write."""
        buffer = self._memory()
        size = self._layout.stripe_size
        return sum(STRIPE_FIELDS.unpack_from(buffer, HEADER_SIZE + stripe * size + LOCK_SLOT)[USED]
                   for stripe in range(self.stripes))

    # -- counters -----------------------------------------------------------

    @property
    def secret(self) -> bytes:
        """The 16 random bytes drawn when the zone was made, the same for
        every process attached to it."""
        return bytes(self._memory()[SECRET_AT:SECRET_AT + SECRET_SIZE])

    @property
    def recoveries(self) -> int:
        """Locks taken over from a dead owner, zone-wide."""
        return int(_U64.unpack_from(self._memory(), RECOVERIES_AT)[0])

    @property
    def evictions(self) -> int:
        """Unexpired records evicted to make room, zone-wide."""
        return int(_U64.unpack_from(self._memory(), EVICTIONS_AT)[0])

    @property
    def waits(self) -> int:
        """Locks that were busy when asked for, zone-wide: how often workers
        meet on a stripe (never here: this twin does not wait)."""
        return int(_U64.unpack_from(self._memory(), WAITS_AT)[0])

    def generation(self) -> int:
        """A number the store bumps when something every worker must reload changed."""
        return int(_U64.unpack_from(self._memory(), GENERATION_AT)[0])

    def ask(self, digest: bytes) -> None:
        """A hint that ``digest``'s record is read or written soon (the
        compiled zone asks for its memory ahead); this twin ignores it."""

    def ask_records(self, digest: bytes) -> None:
        """The hint after ``ask`` (the compiled zone asks for the records
        that reading or storing ``digest`` touches first); ignored here."""

    def ask_victim(self, digest: bytes) -> None:
        """The hint before a new ``digest`` is stored (the compiled zone
        asks for the memory an eviction touches); ignored here."""

    def bump_generation(self) -> int:
        """Add one to the generation; the new generation."""
        return self._add_counter(GENERATION_AT)

    def _add_counter(self, at: int) -> int:
        buffer = self._memory()
        value = (_U64.unpack_from(buffer, at)[0] + 1) & 0xFFFFFFFFFFFFFFFF
        _U64.pack_into(buffer, at, value)
        return int(value)

    # -- the stripe's structure ----------------------------------------------

    def _record_at(self, base: int, index: int) -> int:
        return base + self._layout.records_at + index * self.record_size

    def _bucket_at(self, base: int, digest: bytes) -> int:
        return base + self._layout.buckets_at + 4 * (int.from_bytes(digest[8:], sys.byteorder) & self._bucket_mask)

    @staticmethod
    def _field(buffer: bytearray | mmap.mmap, base: int, field: int) -> int:
        return int(_U32.unpack_from(buffer, base + LOCK_SLOT + 4 * field)[0])

    @staticmethod
    def _set_field(buffer: bytearray | mmap.mmap, base: int, field: int, value: int) -> None:
        _U32.pack_into(buffer, base + LOCK_SLOT + 4 * field, value)

    def _add_field(self, buffer: bytearray | mmap.mmap, base: int, field: int, change: int) -> None:
        self._set_field(buffer, base, field, self._field(buffer, base, field) + change)

    def _link(self, buffer: bytearray | mmap.mmap, base: int, index: int, at: int) -> int:
        return int(_U32.unpack_from(buffer, self._record_at(base, index - 1) + at)[0])

    def _set_link(self, buffer: bytearray | mmap.mmap, base: int, index: int, at: int, value: int) -> None:
        _U32.pack_into(buffer, self._record_at(base, index - 1) + at, value)

    def _find(self, buffer: bytearray | mmap.mmap, base: int, digest: bytes) -> int:
        """The index + 1 of the record of ``digest`` in the stripe, or NIL."""
        at = _U32.unpack_from(buffer, self._bucket_at(base, digest))[0]
        while at != NIL:
            record = self._record_at(base, at - 1)
            if buffer[record:record + DIGEST_SIZE] == digest:
                return int(at)
            at = _U32.unpack_from(buffer, record + CHAIN_AT)[0]
        return NIL

    def _write(self, buffer: bytearray | mmap.mmap, record: int, digest: bytes, value: bytes, expires: float) -> None:
        """A record's contents, between two changes of its state: a record
        found being written after its writer died is dropped."""
        buffer[record + STATE_AT] = WRITING
        buffer[record:record + DIGEST_SIZE] = digest
        _F64.pack_into(buffer, record + EXPIRES_AT, expires)
        struct.pack_into("=H", buffer, record + LENGTH_AT, len(value))
        buffer[record + RECORD_HEADER:record + RECORD_HEADER + len(value)] = value
        buffer[record + STATE_AT] = LIVE

    def _replace(self, buffer: bytearray | mmap.mmap, base: int, index: int, digest: bytes, value: bytes,
                 expires: float) -> None:
        """Write a live record anew, its old contents in the undo copy
        meanwhile: a rebuild after a death halfway puts them back."""
        record = self._record_at(base, index - 1)
        undo = base + STRIPE_HEADER
        buffer[undo:undo + self.record_size] = buffer[record:record + self.record_size]
        self._set_field(buffer, base, UNDO, index)
        self._write(buffer, record, digest, value, expires)
        self._set_field(buffer, base, UNDO, NIL)

    def _take(self, buffer: bytearray | mmap.mmap, base: int, now: float) -> int:
        """A record for a new digest: a free one, one never used, an expired
        one among the least recently used, or the least recently used."""
        free = self._field(buffer, base, FREE_HEAD)
        if free != NIL:
            self._set_field(buffer, base, FREE_HEAD, self._link(buffer, base, free, CHAIN_AT))
            return free
        fresh = self._field(buffer, base, FRESH)
        if fresh < self.per_stripe:
            self._set_field(buffer, base, FRESH, fresh + 1)
            return fresh + 1
        victim = self._expired_victim(buffer, base, now)
        if victim == NIL:
            victim = self._field(buffer, base, OLDEST)
            self._add_counter(EVICTIONS_AT)
        self._remove(buffer, base, victim)
        return victim

    def _expired_victim(self, buffer: bytearray | mmap.mmap, base: int, now: float) -> int:
        at = self._field(buffer, base, OLDEST)
        for _ in range(EXPIRED_SCAN):
            if at == NIL:
                break
            if _F64.unpack_from(buffer, self._record_at(base, at - 1) + EXPIRES_AT)[0] <= now:
                return at
            at = self._link(buffer, base, at, NEWER_AT)
        return NIL

    def _remove(self, buffer: bytearray | mmap.mmap, base: int, index: int) -> None:
        """Take a record out of its bucket's chain and the LRU list."""
        record = self._record_at(base, index - 1)
        bucket = self._bucket_at(base, bytes(buffer[record:record + DIGEST_SIZE]))
        after = _U32.unpack_from(buffer, record + CHAIN_AT)[0]
        at = _U32.unpack_from(buffer, bucket)[0]
        if at == index:
            _U32.pack_into(buffer, bucket, after)
        else:
            while at != NIL:
                following = self._link(buffer, base, at, CHAIN_AT)
                if following == index:
                    self._set_link(buffer, base, at, CHAIN_AT, after)
                    break
                at = following
        self._unlink_lru(buffer, base, index)
        self._add_field(buffer, base, USED, -1)

    def _push_free(self, buffer: bytearray | mmap.mmap, base: int, index: int) -> None:
        record = self._record_at(base, index - 1)
        buffer[record + STATE_AT] = FREE
        _U32.pack_into(buffer, record + CHAIN_AT, self._field(buffer, base, FREE_HEAD))
        self._set_field(buffer, base, FREE_HEAD, index)

    def _unlink_lru(self, buffer: bytearray | mmap.mmap, base: int, index: int) -> None:
        newer = self._link(buffer, base, index, NEWER_AT)
        older = self._link(buffer, base, index, OLDER_AT)
        if newer == NIL:
            self._set_field(buffer, base, NEWEST, older)
        else:
            self._set_link(buffer, base, newer, OLDER_AT, older)
        if older == NIL:
            self._set_field(buffer, base, OLDEST, newer)
        else:
            self._set_link(buffer, base, older, NEWER_AT, newer)

    def _link_front(self, buffer: bytearray | mmap.mmap, base: int, index: int) -> None:
        newest = self._field(buffer, base, NEWEST)
        self._set_link(buffer, base, index, NEWER_AT, NIL)
        self._set_link(buffer, base, index, OLDER_AT, newest)
        if newest == NIL:
            self._set_field(buffer, base, OLDEST, index)
        else:
            self._set_link(buffer, base, newest, NEWER_AT, index)
        self._set_field(buffer, base, NEWEST, index)

    def _to_front(self, buffer: bytearray | mmap.mmap, base: int, index: int) -> None:
        if self._field(buffer, base, NEWEST) != index:
            self._unlink_lru(buffer, base, index)
            self._link_front(buffer, base, index)

    # -- recovery -------------------------------------------------------------

    def _rebuild(self, stripe: int) -> None:
        """Make a stripe consistent from its live records alone, whatever its
        links say: what the compiled zone does when a lock's owner died.

        A record being replaced gets its undo copy back first. The LRU list
        is walked from the newest while it leads to live records not yet
        seen; live records it does not reach follow, oldest, in index order.
        Of two live records of one digest the first in that order stays.
        Buckets, chains, the LRU list, the free list (ascending) and the
        count are then written anew. A record being written, or whose length
        or expiry cannot be, is dropped. Uses no memory beyond the stripe:
        each record's mark, and its chain link as the order being built.
        """
        buffer = self._memory()
        base = self._stripe_base(stripe)
        fresh = min(self._field(buffer, base, FRESH), self.per_stripe)
        undone = self._field(buffer, base, UNDO)
        if 1 <= undone <= fresh:
            record, undo = self._record_at(base, undone - 1), base + STRIPE_HEADER
            buffer[record:record + self.record_size] = buffer[undo:undo + self.record_size]
        self._set_field(buffer, base, UNDO, NIL)
        head = tail = NIL

        def keep(index: int) -> None:
            nonlocal head, tail
            record = self._record_at(base, index - 1)
            buffer[record + MARK_AT] = 1
            _U32.pack_into(buffer, record + CHAIN_AT, NIL)
            if tail == NIL:
                head = index
            else:
                self._set_link(buffer, base, tail, CHAIN_AT, index)
            tail = index

        for index in range(1, fresh + 1):
            buffer[self._record_at(base, index - 1) + MARK_AT] = 0
        at = self._field(buffer, base, NEWEST)
        for _ in range(fresh):
            if not 1 <= at <= fresh or buffer[self._record_at(base, at - 1) + MARK_AT] or not self._intact(base, at):
                break
            following = self._link(buffer, base, at, OLDER_AT)
            keep(at)
            at = following
        for index in range(1, fresh + 1):
            if not buffer[self._record_at(base, index - 1) + MARK_AT] and self._intact(base, index):
                keep(index)
        self._relink(buffer, base, head)
        free = NIL
        for index in range(fresh, 0, -1):
            record = self._record_at(base, index - 1)
            if buffer[record + MARK_AT]:
                buffer[record + MARK_AT] = 0
            else:
                buffer[record + STATE_AT] = FREE
                _U32.pack_into(buffer, record + CHAIN_AT, free)
                free = index
        self._set_field(buffer, base, FREE_HEAD, free)
        self._set_field(buffer, base, FRESH, fresh)

    def _intact(self, base: int, index: int) -> bool:
        record = self._record_at(base, index - 1)
        _, expires, _, _, _, length, state, _ = RECORD.unpack_from(self._memory(), record)
        return state == LIVE and length <= self.value_size and not math.isnan(expires)

    def _relink(self, buffer: bytearray | mmap.mmap, base: int, head: int) -> None:
        """Buckets, chains and the LRU list anew from the order of records
        kept (linked through their chain links from ``head``); a digest seen
        already loses its mark, to be freed."""
        buckets_at, buckets_size = base + self._layout.buckets_at, 4 * (self._bucket_mask + 1)
        buffer[buckets_at:buckets_at + buckets_size] = bytes(buckets_size)
        newest = newer = NIL
        used = 0
        at = head
        while at != NIL:
            record = self._record_at(base, at - 1)
            following = _U32.unpack_from(buffer, record + CHAIN_AT)[0]
            digest = bytes(buffer[record:record + DIGEST_SIZE])
            if self._find(buffer, base, digest) != NIL:
                buffer[record + MARK_AT] = 0
            else:
                bucket = self._bucket_at(base, digest)
                _U32.pack_into(buffer, record + CHAIN_AT, _U32.unpack_from(buffer, bucket)[0])
                _U32.pack_into(buffer, bucket, at)
                _U32.pack_into(buffer, record + NEWER_AT, newer)
                _U32.pack_into(buffer, record + OLDER_AT, NIL)
                if newer == NIL:
                    newest = at
                else:
                    self._set_link(buffer, base, newer, OLDER_AT, at)
                newer = at
                used += 1
            at = following
        self._set_field(buffer, base, NEWEST, newest)
        self._set_field(buffer, base, OLDEST, newer)
        self._set_field(buffer, base, USED, used)

    def verify(self, stripe: int) -> list[str]:
        """What is inconsistent in a locked stripe, in words (empty when
        nothing): the LRU list both ways, the hash chains, the free list and
        the count. For tests, and for reading a zone a crash left behind."""
        buffer = self._memory()
        base = self._stripe_base(stripe)
        problems: list[str] = []
        fresh = self._field(buffer, base, FRESH)
        used = self._field(buffer, base, USED)
        if fresh > self.per_stripe:
            return [f"{fresh} records taken of {self.per_stripe}"]
        seen: list[int] = []
        at, newer = self._field(buffer, base, NEWEST), NIL
        while at != NIL and len(seen) <= fresh:
            if not 1 <= at <= fresh:
                return problems + [f"the LRU list leads to record {at - 1}"]
            if self._link(buffer, base, at, NEWER_AT) != newer:
                problems.append(f"record {at - 1}'s newer link is not {newer - 1}")
            seen.append(at)
            newer, at = at, self._link(buffer, base, at, OLDER_AT)
        if newer != self._field(buffer, base, OLDEST):
            problems.append("the oldest record is not the LRU list's end")
        if len(set(seen)) != len(seen) or len(seen) != used:
            problems.append(f"the LRU list holds {len(seen)} records ({len(set(seen))} distinct), the count {used}")
        for index in seen:
            record = self._record_at(base, index - 1)
            if buffer[record + STATE_AT] != LIVE:
                problems.append(f"record {index - 1} is listed but not live")
            elif self._find(buffer, base, bytes(buffer[record:record + DIGEST_SIZE])) != index:
                problems.append(f"record {index - 1} is not found by its digest")
        free, at = 0, self._field(buffer, base, FREE_HEAD)
        while at != NIL and free <= fresh:
            if not 1 <= at <= fresh or buffer[self._record_at(base, at - 1) + STATE_AT] != FREE:
                return problems + [f"the free list leads to record {at - 1}"]
            free, at = free + 1, self._link(buffer, base, at, CHAIN_AT)
        if free + used != fresh:
            problems.append(f"{free} free and {used} used records, {fresh} taken")
        return problems


def reserve(fd: int, size: int) -> None:
    """Size a new zone file and reserve its memory now where the file system
    can (tmpfs can), so that a full /dev/shm fails at start, not as SIGBUS on
    a later write."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno not in (95, 22):  # EOPNOTSUPP, EINVAL: not supported here
            raise OSError(error.errno, f"reserving {size} bytes for a zone: {error.strerror}") from None
        os.ftruncate(fd, size)
