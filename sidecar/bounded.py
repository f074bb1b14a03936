"""A dict bounded in size, whose expired entries go first when it is full,
then the least recently used: the memory store's tables, and every cache of
a node (keys known over limit, shadow bans written, late checks' counts);
its variant for the counting keys' states, which finds the least recently
used when it makes room (``StateMap``); and the filter a cache of what
clients send puts before itself, so that a rotation of new values is not
stored (``SeenLately``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from sidecar.keystate import limiter_of
from sidecar.limiters.records import Algorithm

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

# The bits of a SeenLately by default: a text sets the one of its hash's
# lowest 16 bits.
SEEN_BITS = 1 << 16
# First sightings after which its bits are cleared: an eighth of them, so
# that they stay sparse (at most one in eight set).
SEEN_CLEARED_AFTER = SEEN_BITS // 8


def wheel_slot(when: float) -> int:
    """The whole second of ``when``, a slot of the expiry wheel: slot 0 for
    times before the clock's first second (-inf, a state never counted,
    included)."""
    if when < 1.0:
        return 0
    return int(when) if when < 1e18 else 1 << 62


class BoundedMap:
    """A dict of at most ``max_keys`` entries: when full, expired entries go
    first, then the least recently used.

    Recency is the dict's order (an entry read is moved to the end). Expiry
    is found through a wheel of one-second slots: each key is filed under
    the slot of its expiry when it is stored. A value's expiry only moves
    later while it is counted, so the slot is a time before which the key
    cannot have expired, and only the keys of slots already past need a
    look: one whose expiry moved on is filed again under its new slot.

    When the map is full, the keys of past slots that expired before the
    current second go, then the oldest entries, a hundredth of the map (at
    least one). Each key costs one ``expires_at`` when stored and one per
    slot it outlives;
    entries dropped leave stale wheel references, which are skipped, and
    the wheel is rebuilt from the map whenever they outnumber its keys
    (full or not: a key popped and stored again on every request, as a
    concurrency limit's is, must not grow it). So an attack rotating
    through millions of addresses costs O(1) per request, with no sweep
    over the map, and never more memory than the cap. A hundredth at a
    time, not more: the memory the dropped entries held is used again by
    the next ones stored while it is still in the CPU's cache (a tenth,
    which the map dropped until 7 December, was reused a thousand requests
    later under rotation, long out of it), and the map stays nearly full.
    """

    def __init__(self, max_keys: int, expires_at: Callable[[Any], float],
                 clock: Callable[[], float]) -> None:
        self.max_keys = max_keys
        self._expires_at = expires_at
        self._clock = clock
        # Read in place by the memory store's listings; keys are added
        # only through add and __setitem__, which file them.
        self.data: dict[Hashable, Any] = {}
        self._wheel: dict[int, list[Hashable]] = {}  # slot -> keys filed there
        self._slots: list[int] = []  # heap of the wheel's slots
        self._filed = 0  # references in the wheel, stale ones included

    def get(self, key: Hashable) -> Any:
        data = self.data
        value = data.pop(key, None)
        if value is not None:
            data[key] = value
        return value

    def __setitem__(self, key: Hashable, value: Any) -> None:
        data = self.data
        stored = data.get(key)
        if stored is value:
            return
        if stored is None:
            self.add(key, value)
            return
        expires = self._expiry(value)
        if expires < self._expiry(stored):
            # The key's reference may be filed after its new expiry; one
            # that expires later keeps it, which is still a time before
            # which it cannot have expired.
            self._file(key, expires)
        data[key] = value

    def add(self, key: Hashable, value: Any, expires: float | None = None) -> None:
        """Store a key that is not in the map, the common case under key
        rotation: one lookup fewer than ``__setitem__``, and no call for the
        expiry when the caller has it (``expires``)."""
        data = self.data
        if len(data) >= self.max_keys:
            self._make_room()
        data[key] = value
        self._file(key, self._expiry(value) if expires is None else expires)

    def _expiry(self, value: Any) -> float:
        """When ``value`` expires (the ``expires_at`` the map was made with)."""
        expires: float = self._expires_at(value)
        return expires

    def pop(self, key: Hashable, default: Any = None) -> Any:
        return self.data.pop(key, default)

    def values(self) -> list[Any]:
        return list(self.data.values())

    def __len__(self) -> int:
        return len(self.data)

    def _file(self, key: Hashable, expires: float) -> None:
        slot = wheel_slot(expires)
        keys = self._wheel.get(slot)
        if keys is None:
            self._wheel[slot] = [key]
            heapq.heappush(self._slots, slot)
        else:
            keys.append(key)
        self._filed += 1
        if self._filed > 2 * len(self.data) + 1024:
            self._rebuild_wheel()

    def _make_room(self) -> None:
        data = self.data
        now = self._clock()
        wheel, slots = self._wheel, self._slots
        current = wheel_slot(now)
        outlived: list[tuple[Hashable, float]] = []
        while slots and slots[0] < current:
            keys = wheel.pop(heapq.heappop(slots))
            self._filed -= len(keys)
            for key in keys:
                value = data.get(key)
                if value is None:
                    continue  # dropped or forgotten since it was filed
                expires = self._expiry(value)
                # Expired before this second: a key whose expiry falls
                # within it waits for the next second's look, whether a
                # reference of its own or a stale one led here.
                if expires < current:
                    del data[key]
                else:
                    outlived.append((key, expires))
        for key, expires in outlived:
            self._file(key, expires)
        target = max(0, min(self.max_keys - 1, self.max_keys - self.max_keys // 100))
        if len(data) > target:
            self._drop_oldest(len(data) - target)

    def _drop_oldest(self, count: int) -> None:
        """Drop the ``count`` least recently used entries: the first in the
        dict's order."""
        data = self.data
        for key in list(itertools.islice(data, count)):
            del data[key]

    def _rebuild_wheel(self) -> None:
        """Drop the wheel's stale references: keys dropped since they were
        filed (made room for, popped), which a map in use keeps making, full
        or not. Each key stays in its slot, which is still a time before
        which it cannot expire.

        Under key rotation nearly every reference is stale by now, so this
        is one membership test per reference; only when a key is filed
        twice (its expiry moved earlier) is the earliest reference kept.
        """
        data = self.data
        wheel: dict[int, list[Hashable]] = {}
        filed = 0
        for slot, keys in self._wheel.items():
            live = list(filter(data.__contains__, keys))  # no bytecode per reference
            if live:
                wheel[slot] = live
                filed += len(live)
        if filed > len(data):
            seen: set[Hashable] = set()
            for slot in sorted(wheel):
                live = [key for key in wheel[slot] if key not in seen]
                seen.update(live)
                if live:
                    wheel[slot] = live
                else:
                    del wheel[slot]
            filed = len(seen)
        self._wheel, self._slots = wheel, list(wheel)
        heapq.heapify(self._slots)
        self._filed = filed


class StateMap(BoundedMap):
    """The bounded map of the counting keys' states (the memory store's):
    a read does not move its entry, it marks the state ``used``, and the
    least recently used are found when room is made (the CLOCK algorithm's
    second chance). A read is then one lookup where moving the entry to
    the end is two lookups, a deletion and an insertion, for every check
    of every rule.

    Making room drops the oldest entries in the dict's order that were not
    read since they were stored or last passed over; a read one is moved
    to the end, unmarked, instead. A key read at least once between two
    evictions is never dropped before a key that was not. Each mark is
    cleared once for the read that set it, so making room stays O(1) per
    request, amortized.

    Its values are the limiters' states: each has a writable ``used``
    attribute, False when made, and its ``limiter``, which says when it
    expires (see ``sidecar.limiters.base.Limiter``).
    """

    def __init__(self, max_keys: int, clock: Callable[[], float]) -> None:
        super().__init__(max_keys, state_expiry, clock)

    def _expiry(self, value: Any) -> float:
        return state_expiry(value)

    def get(self, key: Hashable) -> Any:
        value = self.data.get(key)
        if value is not None:
            value.used = True
        return value

    def expect(self, checks: Sequence[Any]) -> None:
        """A hint that the checks' keys are read next (the compiled map asks
        for their memory ahead); this map ignores it."""

    def hint(self, key: Hashable, position: int) -> None:
        """A hint that ``key``, the ``position``-th of a request's checks,
        is read soon (the compiled map asks for its memory now); this map
        ignores it."""

    def peek(self, key: Hashable) -> Any:
        """The key's state, or None; not a use (an administrator's look)."""
        return self.data.get(key)

    def marked(self, key: Hashable) -> bool:
        """Whether the key was read since it was stored or last passed over
        when room was made (False when not held)."""
        value = self.data.get(key)
        return value is not None and bool(value.used)

    def items(self) -> list[tuple[Hashable, Any]]:
        """(key, state) of every key, oldest first."""
        return list(self.data.items())

    def _drop_oldest(self, count: int) -> None:
        data = self.data
        while count > 0 and data:
            for key in list(itertools.islice(data, count)):
                value = data.pop(key)
                if value.used:
                    value.used = False
                    data[key] = value  # its second chance: the newest entry
                else:
                    count -= 1


def state_expiry(state: Any) -> float:
    """When a key's state expires: its limiter says. Each state carries its
    limiter (a reload may change it); compiled, the limiter is read and
    asked in C (``sidecar.limiters.records.Algorithm``), once for every new
    key."""
    limiter: Algorithm = limiter_of(state)
    return limiter.expires_at(state)


@cython.no_gc  # it holds a bytearray only
@cython.cclass
class SeenLately:
    """Whether a value was seen lately: the filter a cache puts before
    itself, so that it stores a value only the second time it comes (a
    doorkeeper, as admission filters of caches call it).

    A cache of what clients send (the address resolver's of X-Forwarded-For
    fields) pays, under a rotation of new values, for storing every value
    once and dropping it again when the cache empties: by then the entry,
    its objects and their memory have left the CPU's caches, and each costs
    misses to free, as it cost the garbage collector a walk while it lived.
    Behind this filter a value seen once lately is not stored, and what was
    made for it goes at the end of its request, still in the CPU's cache.
    An honest client sends more than one request: it is remembered from its
    second.

    A value sets one bit of ``bits`` (a power of two; ``SEEN_BITS``, 2^16,
    by default), the one its hash's lowest bits pick; that bit already set
    says "seen" (another value with the same bits may have set it: the
    value is then stored on its first sighting, as it was without the
    filter). The bits are cleared after every ``bits / 8`` first sightings
    (``SEEN_CLEARED_AFTER``, 8,192, by default), so that at most one in
    eight is set: "lately" is within the last 8,192 to 16,384 new values,
    and under a rotation about one value in sixteen is stored; each clearing
    adds one to ``generation``, for a cache that forgets with it. Memory:
    ``bits / 8`` bytes (8 KiB), whatever comes. A caller that has a number
    of its own for a value (the node's table: a digest's bytes) asks
    ``again_at`` with it.
    """

    def __init__(self, bits: int = SEEN_BITS) -> None:
        if bits < 8 or bits & (bits - 1):
            raise ValueError(f"a SeenLately's bits are a power of two, at least 8, not {bits}")
        self._bits = bytearray(bits // 8)
        self._mask = bits - 1
        self._new = 0  # first sightings since the bits were cleared
        self.generation = 0  # times the bits were cleared
        self._started: dict[int, int] = {}  # id(cache) -> the generation ``remember`` last emptied it in

    def again(self, value: Hashable) -> bool:
        """Whether ``value`` was seen lately, before this call; the call is
        a sighting."""
        return self.again_at(hash(value))

    def again_at(self, number: int) -> bool:
        """``again`` for the value whose hash (or any number standing for
        it) is ``number``."""
        slot = number & self._mask
        mask = 1 << (slot & 7)
        bits = self._bits
        byte = bits[slot >> 3]
        if byte & mask:
            return True
        if self._new == len(bits):  # an eighth of the bits' first sightings
            bits = self._bits = bytearray(len(bits))
            self._new = 0
            self.generation += 1
            byte = 0
        self._new += 1
        bits[slot >> 3] = byte | mask
        return False

    def remember(self, cache: dict[Any, Any], value: Hashable, answer: Any, size: int) -> None:
        """Store ``answer`` for ``value`` in ``cache`` (at most ``size``
        entries) when ``value`` was seen lately: what a cache of what
        clients send (the address resolver's, the geo databases') does with
        what it worked out. The cache is emptied when full, and with the
        bits (the first store of a generation): under a rotation the values
        taken for seen (their bit set by another) would fill it, and a new
        value's look in it would miss a dict long out of the CPU's caches.
        The generation a cache was emptied in is kept by the cache's
        identity: a cache is one dict for as long as the filter lives
        (emptied in place, never replaced)."""
        if size > 0 and self.again(value):
            started = self._started.setdefault(id(cache), self.generation)
            if started != self.generation or len(cache) >= size:
                cache.clear()
                self._started[id(cache)] = self.generation
            cache[value] = answer
