"""Per-node state in this process, bounded by ``max_keys``.

``MemoryTable`` is the primitives the policy (``sidecar.policy``) runs on,
each table a ``BoundedMap`` that evicts what expired first, then the least
recently used. ``MemoryStore`` is the policy over it (``LocalStore``), with
the roles of bans and admin, inspection and lifecycle: lists and searches
of its maps. Every operation answers at once.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, cast

from sidecar import core
from sidecar.bounded import BoundedMap, state_expiry
from sidecar.counters import CounterState, KeySelection
from sidecar.keys import CountingKey
from sidecar.keystate import limiter_of
from sidecar.limiters.base import Limiter
from sidecar.policy import BAN_STEP, COUNTED_PENALTY, Note
from sidecar.state import BanRecord, Clock, epoch_clock
from sidecar.store import Described
from sidecar.store.local import LocalStore
from sidecar.tiers import TierAssignments


def _state_map_class() -> type:
    """The map of the keys' states: the compiled one (``sidecar._statemap``,
    C records) with the compiled core, else its pure twin."""
    if core.PURE:
        from sidecar.bounded import StateMap as Pure

        return Pure
    compiled: type = importlib.import_module("sidecar._statemap").StateMap
    return compiled


if TYPE_CHECKING:
    from sidecar.bounded import StateMap
else:
    StateMap = _state_map_class()


class MemoryTable:
    """The policy's primitives over bounded maps of at most ``max_keys``
    entries each: the keys' states, the addresses' bans, and the notes that
    bans react to (a map per kind, so that one kind never evicts the other)."""

    def __init__(self, max_keys: int, clock: Clock) -> None:
        self.states = StateMap(max_keys, clock)
        self.bans = BoundedMap(max_keys, lambda ban: ban.expires, clock)
        self.notes = {kind: BoundedMap(max_keys, lambda note: note[1], clock) for kind in (BAN_STEP, COUNTED_PENALTY)}
        # The map's own operations, one call each on the request path.
        self.state: Callable[[Hashable], Any] = self.states.get
        self.keep: Callable[[Hashable, Any], None] = self.states.add
        self.expect: Callable[[Sequence[Any]], None] = self.states.expect

    def forget(self, key: Hashable) -> bool:
        return self.states.pop(key) is not None

    def ban(self, address: str) -> BanRecord | None:
        bans = self.bans
        return bans.get(address) if bans.data else None

    def keep_ban(self, record: BanRecord) -> None:
        self.bans[record.address] = record

    def note(self, name: Note, now: float) -> Any:
        note = self.notes[name[0]].get(name)
        return note[0] if note is not None and now < note[1] else None

    def keep_note(self, name: Note, value: Any, until: float) -> None:
        self.notes[name[0]][name] = (value, until)

    def forget_notes(self, address: str) -> int:
        """Drop the address's notes; how many there were."""
        dropped = 0
        for notes in self.notes.values():
            names = [name for name in notes.data if cast(Note, name)[1] == address]
            for name in names:
                notes.pop(name)
            dropped += len(names)
        return dropped

    def configure(self, max_keys: int) -> None:
        """A smaller cap applies at the next insert."""
        for table in (self.states, self.bans, *self.notes.values()):
            table.max_keys = max_keys


class MemoryStore(LocalStore):
    """Per-node state in this process, bounded by ``max_keys``."""

    def __init__(self, max_keys: int, node: str, clock: Clock = epoch_clock,
                 wall_clock: Clock = time.time) -> None:
        self.table = MemoryTable(max_keys, clock)
        super().__init__(self.table, node, wall_clock)
        self._clock = clock
        self._wall_clock = wall_clock
        self._shadow_bans = BoundedMap(max_keys, lambda ban: ban.expires, clock)
        self.tier_assignments = TierAssignments()

    @property
    def node(self) -> str:
        return self.policy.node

    def may_be_banned(self) -> bool:
        return bool(self.table.bans)

    def configure(self, max_keys: int, node: str) -> None:
        """New settings from a reload; a smaller cap applies at the next insert."""
        self.policy.node = node
        self.table.configure(max_keys)
        self._shadow_bans.max_keys = max_keys

    # -- bans -----------------------------------------------------------------

    def record_shadow_ban(self, record: BanRecord) -> None:
        self._shadow_bans[record.address] = record

    async def shadow_bans(self, now: float) -> list[BanRecord]:
        return [ban for ban in self._shadow_bans.values() if now < ban.expires]

    async def lift_shadow_ban(self, address: str) -> bool:
        return self._shadow_bans.pop(address) is not None

    async def forget_history(self, address: str) -> int:
        return self.table.forget_notes(address)

    async def active_bans(self, now: float) -> list[BanRecord]:
        return self.bans_in_force(now)

    def bans_in_force(self, now: float) -> list[BanRecord]:
        return [ban for ban in self.table.bans.values() if now < ban.expires]

    async def lift_ban(self, address: str) -> bool:
        return self.table.bans.pop(address, None) is not None

    async def ban_of(self, now: float, address: str) -> BanRecord | None:
        ban = self.table.bans.data.get(address)
        return ban if ban is not None and now < ban.expires else None

    async def ban(self, now: float, address: str, duration: float, reason: str) -> BanRecord:
        return self.policy.ban(now, address, "", duration, reason=reason)

    async def ban_network(self, now: float, network: str, duration: float, reason: str) -> BanRecord:
        ban = BanRecord(network, "", self.node, self._wall_clock(), now + duration, duration, reason=reason)
        self.network_bans.add(ban)
        return ban

    async def lift_network_ban(self, now: float, network: str) -> bool:
        return self.network_bans.remove(network)

    async def active_network_bans(self, now: float) -> list[BanRecord]:
        return self.network_bans.in_force(now)

    async def reset_keys(self, now: float, keys: Sequence[CountingKey]) -> int:
        return await self.reset(keys)  # one node: nobody else to tell

    # -- tiers ----------------------------------------------------------------

    async def assign_tier(self, identity: str, tier: str) -> None:
        self.tier_assignments.set(identity, tier)

    async def unassign_tier(self, identity: str) -> bool:
        return self.tier_assignments.remove(identity)

    async def assigned_tiers(self) -> dict[str, str]:
        return dict(self.tier_assignments.items())

    # -- inspection -----------------------------------------------------------

    async def find_keys(self, now: float, selection: KeySelection, limit: int | None = None) -> list[CountingKey]:
        # A look through every key: at most max_keys, for an administrator.
        found: list[CountingKey] = []
        states = self.table.states
        candidates = [(selection.key, states.peek(selection.key))] if selection.key is not None else states.items()
        for key, state in candidates:
            if state is not None and selection.holds(cast(CountingKey, key)) \
                    and state_expiry(state) > now:
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
        state = self.table.states.peek(key)
        if state is None or state_expiry(state) <= now:
            return None
        own = limiter_of(state)
        if limiter is None:
            return CounterState(key, 0.0 if own.leases else own.peek(state, now).retry_after, None)
        if type(own) is not type(limiter):
            state = limiter.new_state()  # another algorithm's state: the rule's starts anew
        # A concurrency limit has no penalty: it refuses while full.
        penalty = 0.0 if limiter.leases else limiter.peek(state, now).retry_after
        return CounterState(key, penalty, limiter.quota(state, now, threshold))

    # -- lifecycle ------------------------------------------------------------

    def tracked_keys(self) -> int:
        return len(self.table.states)

    def gauges(self) -> dict[str, tuple[str, Callable[[], float]]]:
        # A shared store's bans and keys are Redis's to count, not a node's.
        return {"sluice_active_bans": ("IP bans in force on this node.",
                                       lambda: len(self.bans_in_force(self._clock()))),
                "sluice_tracked_keys": ("Counting keys held in memory.", self.tracked_keys)}

    async def open(self) -> None:
        """Nothing to open: the state is in the process."""

    async def close(self) -> None:
        """Nothing to close: the state goes with the process."""
