"""Per-node state in this process, bounded by ``max_keys``.

Every operation answers at once: its coroutines never wait, so the engine
awaits them at the cost of a call (see ``run_at_once`` for callers with no
event loop, such as replay).
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Any, Callable, Coroutine, Hashable, Sequence, TypeVar, cast

from sidecar.counters import CounterState, KeySelection
from sidecar.keys import CountingKey
from sidecar.limiters import ALLOWED, Hit
from sidecar.networkbans import NetworkBans
from sidecar.state import (BanIncrement, BanRecord, Check, Clock, DeferredLimiter, Evaluation, Limiter,
                           PenaltyBan, ResponseCount, epoch_clock, is_deferred)
from sidecar.store import Described

T = TypeVar("T")


def run_at_once(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never waits (the memory store's, and
    the engine's over it), without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coroutine.close()
    raise RuntimeError("run_at_once: the coroutine waited; it needs an event loop")


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

    def __init__(self, max_keys: int, expires_at: Callable[[Any], float], clock: Clock) -> None:
        self.max_keys = max_keys
        self._expires_at = expires_at
        self._clock = clock
        # Read (and reordered, as get does) by MemoryStore's hot loop; keys
        # are added only through add and __setitem__, which file them.
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


class MemoryStore:
    """Per-node state in this process, bounded by ``max_keys``."""

    answers_at_once = True

    def __init__(self, max_keys: int, node: str, clock: Clock = epoch_clock,
                 wall_clock: Clock = time.time) -> None:
        self.node = node
        self._clock = clock
        self._wall_clock = wall_clock
        # Each state carries its limiter: a reload may change it.
        self._states = BoundedMap(max_keys, lambda state: state.limiter.expires_at(state), clock)
        self._bans = BoundedMap(max_keys, lambda ban: ban.expires, clock)
        self._shadow_bans = BoundedMap(max_keys, lambda ban: ban.expires, clock)
        # What bans react to: (address, rule) -> (step, length, forgotten
        # at) of its last escalating ban; (rule, address) -> the end of the
        # rule's last penalty counted towards then_ban_after.
        self._ban_steps = BoundedMap(max_keys, lambda last: last[2], clock)
        self._penalty_ends = BoundedMap(max_keys, lambda ends: ends, clock)
        self.network_bans = NetworkBans()

    async def evaluate(self, now: float, address: str, checks: Sequence[Check],
                       can_delay: bool = True, quotas: bool = False) -> Evaluation:
        evaluation = self._evaluate(now, address, checks, can_delay)
        if quotas and evaluation.ban is None:
            evaluation.quotas = [check.limiter.quota(self._state(check.key, check.limiter)[0], now,
                                                     check.threshold) if check.spec.count else None
                                 for check in checks]
        return evaluation

    def _evaluate(self, now: float, address: str, checks: Sequence[Check], can_delay: bool) -> Evaluation:
        if self._bans.data:
            ban = self._bans.get(address)
            if ban is not None and now < ban.expires:
                return Evaluation(ban=ban)
        hits: list[Hit] = []
        evaluation = Evaluation(None, False, hits)  # positional: made for every request
        buckets: list[tuple[Check, DeferredLimiter, Any, bool, Hit]] = []
        refused = False
        # BoundedMap.get and _state written out: this loop runs for every
        # rule of every request, and a method call per rule is a tenth of
        # its cost.
        data = self._states.data
        for check in checks:
            spec, key, lease = check
            limiter = spec.limiter
            if spec.count and not limiter.deferred:
                state = data.pop(key, None)
                if state is not None:
                    data[key] = state
                if state is not None and state.limiter is limiter:
                    hit = limiter.hit(state, now, spec.threshold, spec.amount)
                else:  # a new key, or one a reload gave another limiter
                    hit = self._count(key, state, limiter, now, spec.threshold, spec.amount)
            else:  # a look (a response-phase rule), or a bucket's
                state = data.pop(key, None)
                if state is not None:
                    data[key] = state
                    if state.limiter is not limiter:
                        state = self._reloaded(state, limiter)
                stored = state is not None
                if not spec.count:
                    hit = limiter.peek(state, now) if stored else ALLOWED
                elif is_deferred(limiter):
                    if not stored:
                        state = limiter.new_state()
                    hit = limiter.assess(state, now, lease, spec.amount)
                    if hit.delay and not can_delay:
                        hit = Hit(True, hit.delay)  # the wait queue is full: refuse
                    buckets.append((check, limiter, state, stored, hit))
            hits.append(hit)
            if hit.over_limit and spec.stops:
                refused = True
                ban_key, ban_duration = key, spec.ban_duration
                auto_ban = spec.auto_ban
                if auto_ban is not None and address:
                    # One more challenge for this address: past the auto-ban
                    # threshold, a ban instead.
                    ban_key = auto_ban.key(address)
                    if self._hit(ban_key, auto_ban.limiter, now, auto_ban.threshold, 1).over_limit:
                        ban_duration = auto_ban.duration
                penalty_ban = spec.penalty_ban
                if penalty_ban is not None and ban_duration is None and address and \
                        self._unsolved_penalty(now, address, spec.rule_id, hit, penalty_ban):
                    ban_key, ban_duration = penalty_ban.key(spec.rule_id, address), penalty_ban.duration
                if ban_duration is not None and address:
                    # Issuing a ban clears the triggering key.
                    self._states.pop(ban_key, None)
                    evaluation.ban = self._ban(now, address, spec.rule_id, ban_duration,
                                               spec.ban_increment if ban_duration == spec.ban_duration else None)
                    evaluation.new_ban = True
                break
        if buckets and not refused:
            # Like nginx with several limit_req zones: buckets (and
            # concurrency slots) are charged only when the request is
            # admitted by all of them. One over its limit that
            # did not refuse (observe mode) is not charged itself.
            for check, limiter, state, stored, hit in buckets:
                if not hit.over_limit:
                    limiter.commit(state, hit)
                    evaluation.delay = max(evaluation.delay, hit.delay)
                    if not stored:
                        self._states.add(check.key, state)
            # A refused request leaves no new key (a new key is never
            # refused by its own bucket, and a ban cleared its key).
        return evaluation

    async def record(self, now: float, counts: Sequence[ResponseCount]) -> list[Hit]:
        return [self._hit(c.key, c.limiter, now, c.threshold, c.amount) for c in counts]

    def count_now(self, key: Hashable, limiter: Limiter, now: float, threshold: float, amount: int) -> Hit:
        """Count one at once, whatever the limiter (a bucket is charged
        when it has room), without an event loop: the engine's own count of
        late checks over a shared store (Engine.late_counts)."""
        return self._hit(key, limiter, now, threshold, amount)

    async def release(self, lease: str, keys: Sequence[CountingKey]) -> int:
        released = 0
        for key in keys:
            state = self._states.data.get(key)
            # A reload may have made the key another kind's.
            if state is not None and state.limiter.leases and state.limiter.release(state, lease):
                released += 1
                if not state.held:
                    self._states.pop(key)
        return released

    def record_shadow_ban(self, record: BanRecord) -> None:
        self._shadow_bans[record.address] = record

    async def shadow_bans(self, now: float) -> list[BanRecord]:
        return [ban for ban in self._shadow_bans.values() if now < ban.expires]

    async def lift_shadow_ban(self, address: str) -> bool:
        return self._shadow_bans.pop(address) is not None

    async def forget_history(self, address: str) -> int:
        # (address, rule) and (rule, address) tuples.
        steps = [key for key in self._ban_steps.data if isinstance(key, tuple) and key[0] == address]
        ends = [key for key in self._penalty_ends.data if isinstance(key, tuple) and key[1] == address]
        for key in steps:
            self._ban_steps.pop(key)
        for key in ends:
            self._penalty_ends.pop(key)
        return len(steps) + len(ends)

    async def reset(self, keys: Sequence[CountingKey]) -> int:
        return sum(self._states.pop(key, None) is not None for key in keys)

    def _state(self, key: Hashable, limiter: Limiter) -> tuple[Any, bool]:
        """The key's state for this limiter, and whether it is stored yet."""
        state = self._states.get(key)
        if state is not None and state.limiter is not limiter:
            state = self._reloaded(state, limiter)
        if state is not None:
            return state, True
        return limiter.new_state(), False

    @staticmethod
    def _reloaded(state: Any, limiter: Limiter) -> Any:
        """A state counted by a limiter a reload replaced: its counts carry
        over to a limiter of the same algorithm, else it starts anew (None)."""
        if type(state.limiter) is not type(limiter):
            return None
        state.limiter = limiter
        return state

    def _hit(self, key: Hashable, limiter: Limiter, now: float, threshold: float, amount: int) -> Hit:
        return self._count(key, self._states.get(key), limiter, now, threshold, amount)

    def _count(self, key: Hashable, state: Any, limiter: Limiter, now: float, threshold: float,
               amount: int) -> Hit:
        """Count for the key whose stored state (or None) was just read."""
        if state is not None:
            if state.limiter is limiter or self._reloaded(state, limiter) is not None:
                return limiter.hit(state, now, threshold, amount)
            state = limiter.new_state()  # the rule was reloaded as another algorithm
            hit = limiter.hit(state, now, threshold, amount)
            self._states[key] = state
            return hit
        # A key never seen (or forgotten): under key rotation, most of them.
        state = limiter.new_state()
        hit = limiter.hit(state, now, threshold, amount)
        self._states.add(key, state, limiter.expires_at(state))
        return hit

    def _ban(self, now: float, address: str, rule_id: str, duration: float,
             increment: BanIncrement | None = None, reason: str = "") -> BanRecord:
        step = 0
        if increment is not None:
            step, duration = self._escalated(now, address, rule_id, duration, increment)
        record = BanRecord(address, rule_id, self.node, self._wall_clock(), now + duration, duration, step=step,
                           reason=reason)
        self._bans[address] = record
        return record

    def _escalated(self, now: float, address: str, rule_id: str, duration: float,
                   increment: BanIncrement) -> tuple[int, float]:
        """The step and length of an escalating ban, remembered until
        ``remember`` after it ends (a lifted ban is remembered all the same)."""
        last = self._ban_steps.get((address, rule_id))
        step, duration = increment.following(duration, last[:2] if last is not None and now < last[2] else None)
        self._ban_steps[(address, rule_id)] = (step, duration, now + duration + increment.remember)
        return step, duration

    def _unsolved_penalty(self, now: float, address: str, rule_id: str, hit: Hit,
                          penalty_ban: PenaltyBan) -> bool:
        """Count the penalty this challenged request is in, once (a new
        penalty can only start after the last counted one ended); True when
        it is one past ``then_ban_after`` within the day."""
        ends = self._penalty_ends.get((rule_id, address))
        if ends is not None and now < ends:
            return False
        self._penalty_ends[(rule_id, address)] = now + hit.retry_after
        return self._hit(penalty_ban.key(rule_id, address), penalty_ban.limiter, now, penalty_ban.threshold,
                         1).over_limit

    def may_be_banned(self) -> bool:
        return bool(self._bans)

    def configure(self, max_keys: int, node: str) -> None:
        """New settings from a reload; a smaller cap applies at the next insert."""
        self.node = node
        self._states.max_keys = self._bans.max_keys = self._shadow_bans.max_keys = max_keys
        self._ban_steps.max_keys = self._penalty_ends.max_keys = max_keys

    async def active_bans(self, now: float) -> list[BanRecord]:
        return self.bans_in_force(now)

    def bans_in_force(self, now: float) -> list[BanRecord]:
        return [ban for ban in self._bans.values() if now < ban.expires]

    async def lift_ban(self, address: str) -> bool:
        return self._bans.pop(address, None) is not None

    # -- what administrators do ---------------------------------------------

    async def ban_of(self, now: float, address: str) -> BanRecord | None:
        ban = self._bans.data.get(address)
        return ban if ban is not None and now < ban.expires else None

    async def ban(self, now: float, address: str, duration: float, reason: str) -> BanRecord:
        return self._ban(now, address, "", duration, reason=reason)

    async def ban_network(self, now: float, network: str, duration: float, reason: str) -> BanRecord:
        ban = BanRecord(network, "", self.node, self._wall_clock(), now + duration, duration, reason=reason)
        self.network_bans.add(ban)
        return ban

    async def lift_network_ban(self, now: float, network: str) -> bool:
        return self.network_bans.remove(network)

    async def active_network_bans(self, now: float) -> list[BanRecord]:
        return self.network_bans.in_force(now)

    async def find_keys(self, now: float, selection: KeySelection, limit: int | None = None) -> list[CountingKey]:
        # A look through every key: at most max_keys, for an administrator.
        found: list[CountingKey] = []
        candidates = [(selection.key, self._states.data.get(selection.key))] if selection.key is not None \
            else self._states.data.items()
        for key, state in candidates:
            if state is not None and selection.holds(cast(CountingKey, key)) \
                    and state.limiter.expires_at(state) > now:
                found.append(cast(CountingKey, key))
                if limit is not None and len(found) >= limit:
                    break
        return found

    async def describe_keys(self, now: float, keys: Sequence[Described]) -> list[CounterState | None]:
        return [self._describe(now, key, limiter, threshold) for key, limiter, threshold in keys]

    def _describe(self, now: float, key: CountingKey, limiter: Limiter | None,
                  threshold: float) -> CounterState | None:
        """As the Redis store's inspect.lua describes a key: read, never
        counted, and without refreshing its recency."""
        state = self._states.data.get(key)
        if state is None or state.limiter.expires_at(state) <= now:
            return None
        if limiter is None:
            own = state.limiter
            return CounterState(key, 0.0 if own.leases else own.peek(state, now).retry_after, None)
        if type(state.limiter) is not type(limiter):
            state = limiter.new_state()  # another algorithm's state: the rule's starts anew
        # A concurrency limit has no penalty: it refuses while full.
        penalty = 0.0 if limiter.leases else limiter.peek(state, now).retry_after
        return CounterState(key, penalty, limiter.quota(state, now, threshold))

    async def reset_keys(self, now: float, keys: Sequence[CountingKey]) -> int:
        return await self.reset(keys)  # one node: nobody else to tell

    def tracked_keys(self) -> int:
        return len(self._states)

    def gauges(self) -> dict[str, tuple[str, Callable[[], float]]]:
        # A shared store's bans and keys are Redis's to count, not a node's.
        return {"sluice_active_bans": ("IP bans in force on this node.",
                                       lambda: len(self.bans_in_force(self._clock()))),
                "sluice_tracked_keys": ("Counting keys held in memory.", self.tracked_keys)}

    async def open(self) -> None:
        """Nothing to open: the state is in the process."""

    async def close(self) -> None:
        """Nothing to close: the state goes with the process."""
