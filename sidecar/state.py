"""Where counts and bans live, behind one interface (SPEC §9).

The engine hands the store every check of a request at once, in rule order;
the store answers in one call (one round trip for a remote store), applying
the stop rules of SPEC §1 as it goes so that rules after a stopping one are
neither evaluated nor counted.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol, Sequence

from sidecar.config import AutoBan as AutoBanConfig
from sidecar.limiters import ALLOWED, Hit, WindowCounter

Clock = Callable[[], float]


class Limiter(Protocol):
    """Window counters ``hit`` at once; buckets (``deferred``) ``assess``
    and are ``commit``ted only when the whole request is admitted."""

    deferred: bool
    holds: bool  # may ask to hold an admitted request (a leaky bucket's delay)

    def new_state(self) -> Any: ...
    def peek(self, state: Any, now: float) -> Hit: ...
    def hit(self, state: Any, now: float, threshold: float, amount: int = 1) -> Hit: ...
    def assess(self, state: Any, now: float) -> Hit: ...
    def commit(self, state: Any, hit: Hit) -> None: ...
    def expires_at(self, state: Any) -> float: ...
    def quota(self, state: Any, now: float, threshold: float) -> tuple[int, float, float]: ...


@dataclass(frozen=True, slots=True)
class AutoBan:
    """Challenges per address before the address is banned (SPEC §6):
    ``threshold`` challenges within the counter's period are issued, the
    next one is a ban of ``duration`` instead."""

    limiter: WindowCounter
    threshold: int
    duration: float

    @classmethod
    def from_config(cls, auto_ban: AutoBanConfig) -> "AutoBan":
        return cls(WindowCounter(auto_ban.challenges, auto_ban.per, auto_ban.per),
                   auto_ban.challenges, auto_ban.ban)

    @staticmethod
    def key(address: str) -> Hashable:
        # Shaped like a rule's counting key, so logs can describe it; no rule
        # id has a space, so it is nobody else's key.
        return (("challenge auto-ban", ("ip",)), address)


@dataclass(slots=True)  # not frozen: made per rule per request, and frozen __init__ is slow
class Check:
    """One matching rule of one request, ready for the store."""

    rule_id: str
    key: Hashable
    limiter: Limiter
    threshold: float
    stops: bool  # over limit ends evaluation (block, ban, challenge)
    ban_duration: float | None = None  # over limit bans the client address
    count: bool = True  # False: a response-phase rule, only its penalty is checked
    auto_ban: AutoBan | None = None  # over limit issues a challenge, counted per address


@dataclass(frozen=True, slots=True)
class ResponseCount:
    """One response that a response-phase rule counts (SPEC §8)."""

    key: Hashable
    limiter: Limiter
    threshold: float
    amount: int = 1


@dataclass(frozen=True, slots=True)
class BanRecord:
    address: str
    rule_id: str
    node: str
    started_wall: float  # wall-clock start, for people reading ban records
    expires: float  # monotonic
    duration: float


@dataclass(slots=True)
class Evaluation:
    """What the store decided: an active ban, or per-check hits in order.

    ``hits`` has one entry per check that was evaluated; it stops after the
    first over-limit check with ``stops`` set. ``ban`` is set when the
    client was already banned (nothing evaluated) or became banned now.
    """

    ban: BanRecord | None = None
    new_ban: bool = False
    hits: list[Hit] = field(default_factory=list)
    delay: float = 0.0  # how long to hold the admitted request (leaky buckets)
    # A shared store's answer to ``quotas`` for every check (None for one
    # that does not count), when asked for with the evaluation.
    quotas: list[tuple[int, float, float] | None] | None = None


class StateStore(Protocol):
    def evaluate(self, now: float, address: str, checks: Sequence[Check],
                 can_delay: bool = True) -> Evaluation: ...
    def record(self, now: float, counts: Sequence[ResponseCount]) -> list[Hit]: ...
    def quotas(self, now: float, checks: Sequence[Check]) -> list[tuple[int, float, float]]: ...
    def may_be_banned(self) -> bool: ...
    def configure(self, max_keys: int, node: str) -> None: ...
    def lift_ban(self, address: str) -> bool: ...
    def active_bans(self, now: float) -> list[BanRecord]: ...
    def tracked_keys(self) -> int: ...


class BoundedMap:
    """A dict of at most ``max_keys`` entries: when full, expired entries go
    first, then the least recently used (SPEC §9).

    Recency is the dict's order (an entry read is moved to the end). Expiry
    is found through a wheel of one-second slots: each key is filed under
    the slot of its expiry when it is stored. A value's expiry only moves
    later while it is counted, so the slot is a time before which the key
    cannot have expired, and only the keys of slots already past need a
    look: one whose expiry moved on is filed again under its new slot.

    When the map is full, the keys of past slots that have really expired
    go, then the oldest entries down to nine tenths. Each key costs one
    ``expires_at`` when stored and one per slot it outlives; entries read or
    dropped leave stale wheel references, which are skipped, and the wheel
    is rebuilt from the map when they outnumber its keys. So an attack
    rotating through millions of addresses costs O(1) per request, with no
    sweep over the map, and never more memory than the cap.
    """

    SLOT_SECONDS = 1.0

    def __init__(self, max_keys: int, expires_at: Callable[[Any], float], clock: Clock) -> None:
        self.max_keys = max_keys
        self._expires_at = expires_at
        self._clock = clock
        self._data: dict[Hashable, Any] = {}
        self._wheel: dict[int, list[Hashable]] = {}  # slot -> keys filed there
        self._slots: list[int] = []  # heap of the wheel's slots
        self._filed = 0  # references in the wheel, stale ones included

    def get(self, key: Hashable) -> Any:
        data = self._data
        value = data.pop(key, None)
        if value is not None:
            data[key] = value
        return value

    def __setitem__(self, key: Hashable, value: Any) -> None:
        data = self._data
        stored = data.get(key)
        if stored is value:
            return
        if stored is None and len(data) >= self.max_keys:
            self._make_room()
        self._file(key, self._expires_at(value))
        data[key] = value

    def pop(self, key: Hashable, default: Any = None) -> Any:
        return self._data.pop(key, default)

    def values(self) -> list[Any]:
        return list(self._data.values())

    def __len__(self) -> int:
        return len(self._data)

    def _slot(self, when: float) -> int:
        try:
            return int(when // self.SLOT_SECONDS)
        except OverflowError:  # -inf: a state never counted, expired since ever
            return -1 if when < 0 else 1 << 62

    def _file(self, key: Hashable, expires: float) -> None:
        slot = self._slot(expires)
        keys = self._wheel.get(slot)
        if keys is None:
            self._wheel[slot] = [key]
            heapq.heappush(self._slots, slot)
        else:
            keys.append(key)
        self._filed += 1

    def _make_room(self) -> None:
        data = self._data
        now = self._clock()
        if self._filed > 2 * len(data) + 1024:
            self._rebuild_wheel()
        expires_at, wheel, slots = self._expires_at, self._wheel, self._slots
        current = self._slot(now)
        outlived: list[tuple[Hashable, float]] = []
        while slots and slots[0] <= current:
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
        self._wheel, self._slots, self._filed = {}, [], 0
        expires_at = self._expires_at
        for key, value in self._data.items():
            self._file(key, expires_at(value))


class MemoryStore:
    """Per-node state in this process, bounded by ``max_keys``."""

    def __init__(self, max_keys: int, node: str, clock: Clock = time.monotonic,
                 wall_clock: Clock = time.time) -> None:
        self.node = node
        self._wall_clock = wall_clock
        # Each state carries its limiter: a reload may change it.
        self._states = BoundedMap(max_keys, lambda state: state.limiter.expires_at(state), clock)
        self._bans = BoundedMap(max_keys, lambda ban: ban.expires, clock)

    def evaluate(self, now: float, address: str, checks: Sequence[Check],
                 can_delay: bool = True) -> Evaluation:
        if self._bans:
            ban = self._bans.get(address)
            if ban is not None and now < ban.expires:
                return Evaluation(ban=ban)
        evaluation = Evaluation()
        buckets: list[tuple[Check, Any, bool, Hit]] = []
        refused = False
        for check in checks:
            if not check.count:
                state = self._states.get(check.key)
                hit = check.limiter.peek(state, now) if state is not None else ALLOWED
            elif check.limiter.deferred:
                state, stored = self._state(check.key, check.limiter)
                hit = check.limiter.assess(state, now)
                if hit.delay and not can_delay:
                    hit = Hit(True, hit.delay)  # the wait queue is full: refuse
                buckets.append((check, state, stored, hit))
            else:
                hit = self._hit(check.key, check.limiter, now, check.threshold, 1)
            evaluation.hits.append(hit)
            if hit.over_limit and check.stops:
                refused = True
                ban_key, ban_duration = check.key, check.ban_duration
                auto_ban = check.auto_ban
                if auto_ban is not None and address:
                    # One more challenge for this address: past the auto-ban
                    # threshold, a ban instead.
                    ban_key = auto_ban.key(address)
                    if self._hit(ban_key, auto_ban.limiter, now, auto_ban.threshold, 1).over_limit:
                        ban_duration = auto_ban.duration
                if ban_duration is not None and address:
                    # Issuing a ban clears the triggering key (SPEC §6).
                    self._states.pop(ban_key, None)
                    evaluation.ban = self._ban(now, address, check.rule_id, ban_duration)
                    evaluation.new_ban = True
                break
        if buckets:
            # Like nginx with several limit_req zones: buckets are charged
            # only when the request is admitted by all of them (SPEC §7).
            admitted = not refused and not any(bucket[3].over_limit for bucket in buckets)
            for check, state, stored, hit in buckets:
                if admitted:
                    check.limiter.commit(state, hit)
                    evaluation.delay = max(evaluation.delay, hit.delay)
                    if not stored:
                        self._states[check.key] = state
                # A refused request leaves no new key (a new key is never
                # refused by its own bucket, and a ban cleared its key).
        return evaluation

    def record(self, now: float, counts: Sequence[ResponseCount]) -> list[Hit]:
        return [self._hit(c.key, c.limiter, now, c.threshold, c.amount) for c in counts]

    def quotas(self, now: float, checks: Sequence[Check]) -> list[tuple[int, float, float]]:
        """What is left of each check's budget (remaining, reset, window)."""
        # The state a decision would use: carried over a reload like in _state.
        return [check.limiter.quota(self._state(check.key, check.limiter)[0], now, check.threshold)
                for check in checks]

    def _state(self, key: Hashable, limiter: Limiter) -> tuple[Any, bool]:
        """The key's state for this limiter, and whether it is stored yet."""
        state = self._states.get(key)
        if state is not None:
            if state.limiter is not limiter:
                if type(state.limiter) is not type(limiter):
                    state = None  # the rule was reloaded as another algorithm
                else:
                    # Reloaded with other settings: the counts carry over.
                    state.limiter = limiter
            if state is not None:
                return state, True
        return limiter.new_state(), False

    def _hit(self, key: Hashable, limiter: Limiter, now: float, threshold: float, amount: int) -> Hit:
        state = self._states.get(key)
        if state is not None and state.limiter is limiter:  # the common case, first
            return limiter.hit(state, now, threshold, amount)
        state, stored = self._state(key, limiter)
        hit = limiter.hit(state, now, threshold, amount)
        if not stored:
            self._states[key] = state
        return hit

    def _ban(self, now: float, address: str, rule_id: str, duration: float) -> BanRecord:
        record = BanRecord(address, rule_id, self.node, self._wall_clock(), now + duration, duration)
        self._bans[address] = record
        return record

    def may_be_banned(self) -> bool:
        return bool(self._bans)

    def configure(self, max_keys: int, node: str) -> None:
        """New settings from a reload; a smaller cap applies at the next insert."""
        self.node = node
        self._states.max_keys = self._bans.max_keys = max_keys

    def active_bans(self, now: float) -> list[BanRecord]:
        return [ban for ban in self._bans.values() if now < ban.expires]

    def lift_ban(self, address: str) -> bool:
        return self._bans.pop(address, None) is not None

    def tracked_keys(self) -> int:
        return len(self._states)
