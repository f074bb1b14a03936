"""A dict bounded in size, whose expired entries go first when it is full,
then the least recently used: the memory store's tables, and every cache of
a node (keys known over limit, shadow bans written, late checks' counts).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from typing import Any


class BoundedMap:
    """A dict of at most ``max_keys`` entries: when full, expired entries go
    first, then the least recently used.

    Recency is the dict's order (an entry read is moved to the end). Expiry
    is found through a wheel of one-second slots: each key is filed under
    the slot of its expiry when it is stored. A value's expiry only moves
    later while it is counted, so the slot is a time before which the key
    cannot have expired, and only the keys of slots already past need a
    look: one whose expiry moved on is filed again under its new slot.

    When the map is full, the keys of past slots that have really expired
    go, then the oldest entries down to nine tenths. Each key costs one
    ``expires_at`` when stored and one per slot it outlives; entries
    dropped leave stale wheel references, which are skipped, and the wheel
    is rebuilt from the map whenever they outnumber its keys (full or not:
    a key popped and stored again on every request, as a concurrency
    limit's is, must not grow it). So an attack
    rotating through millions of addresses costs O(1) per request, with no
    sweep over the map, and never more memory than the cap.
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
        expires = self._expires_at(value)
        if expires < self._expires_at(stored):
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
        self._file(key, self._expires_at(value) if expires is None else expires)

    def pop(self, key: Hashable, default: Any = None) -> Any:
        return self.data.pop(key, default)

    def values(self) -> list[Any]:
        return list(self.data.values())

    def __len__(self) -> int:
        return len(self.data)

    @staticmethod
    def _slot(when: float) -> int:
        """The whole second of ``when``: slot 0 for times before the
        clock's first second (-inf, a state never counted, included)."""
        if when < 1.0:
            return 0
        return int(when) if when < 1e18 else 1 << 62

    def _file(self, key: Hashable, expires: float) -> None:
        slot = self._slot(expires)
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
        expires_at, wheel, slots = self._expires_at, self._wheel, self._slots
        current = self._slot(now)
        outlived: list[tuple[Hashable, float]] = []
        while slots and slots[0] < current:
            keys = wheel.pop(heapq.heappop(slots))
            self._filed -= len(keys)
            for key in keys:
                value = data.get(key)
                if value is None:
                    continue  # dropped or forgotten since it was filed
                expires = expires_at(value)
                if expires <= now:
                    del data[key]
                else:
                    outlived.append((key, expires))
        for key, expires in outlived:
            self._file(key, expires)
        target = max(0, min(self.max_keys - 1, self.max_keys * 9 // 10))
        if len(data) > target:
            for key in list(itertools.islice(data, len(data) - target)):
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
