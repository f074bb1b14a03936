"""The memory backend's state for a whole node: every worker of ``sluice
serve --workers N`` decides over one table in shared memory, as nginx's
``limit_req`` workers do over one zone.

The table is a few zones (``sidecar.shm``): fixed-size records named by a
16-byte digest (SipHash keyed by a secret drawn when the zones are made:
``sidecar.store.records.Namer``), sized once at start from the rules
file's ``max_keys``, split into stripes that each have a lock, and bounded
by expiry then LRU eviction. ``NodeZones`` makes them (the parent process
of ``serve``), attaches to them (each worker) and removes them (the
parent, at exit):

- ``states``: each counting key's limiter state and the key's text
  (``sidecar.store.records``), at most 128 bytes a key;
- ``leases``: the states of concurrency limits, whose records hold a number
  of leases fixed at start (the rules' largest concurrency limit);
- ``bans``, ``notes``: the addresses' ban records and what bans react to;
- ``labels``: the text of keys too long for their state's record;
- ``shadow``, ``networks``: shadow rules' would-be bans, and network bans;
- ``prefixes``: the key prefixes (a rule id and its dimensions' names) that
  keys' texts name by an 8-byte code, for the admin API's listings.
- ``tiers``: the tier assignments made at run time (``sidecar.tiers``), a
  record per identity (its text and its tier), at most ``TIER_ASSIGNMENTS``
  of them, in one stripe; none is ever evicted: a new one that finds the
  zone full is refused.

A decision is one transaction (``NodeTable``): the store works out every
record the policy may touch for the request (the checks' keys, the
address's ban, and the auto-ban and penalty keys and notes its rules
derive from the address), locks their stripes in one order (zone by zone,
each zone's stripes in increasing order, so two workers never wait on each
other in a cycle), runs ``sidecar.policy`` over the records it reads,
writes back every state that changed, and unlocks. Nothing is written when
the policy fails. A worker killed while it holds a lock does not wedge the
others: the zone's robust mutexes hand the lock to the next worker, which
repairs the stripe (a record torn halfway is dropped).

A state stays readable ``STALE_KEPT`` after the time its limiter says it
stops mattering, as the per-process memory store keeps a state until it
needs the room: the two decide alike (a drained leaky bucket's excess, a
lease given back after it ended), and a full stripe still takes records
that long expired first, then the least recently used.

Every worker sees what administrators change at its next request: the bans
zone's generation is bumped by every change (a ban by hand, a lift, a
network ban, a reset, a reload through the admin API), and a worker that
finds it moved reads the network bans again and tells its listeners (the
engine forgets the refusals it keeps; a reload asked of another worker
reloads this one's rules too). A tier assignment or its removal bumps the
tiers zone's generation too, and a worker that finds that one moved reads
the assignments again into its copy (``tier_assignments``, which requests
read without touching the zones).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

from sidecar.bounded import SeenLately
from sidecar.counters import CounterState, KeySelection
from sidecar.keys import CountingKey
from sidecar.keystate import limiter_of
from sidecar.limiters import Hit
from sidecar.limiters.base import Limiter
from sidecar.limiters.concurrent import ConcurrencyLimiter
from sidecar.networkbans import NetworkBans
from sidecar.policy import BAN_STEP, COUNTED_PENALTY, Note, Policy, TableInC
from sidecar.state import BanRecord, Check, CheckSpec, Clock, Evaluation, ResponseCount, epoch_clock
from sidecar.store import records
from sidecar.store.records import ELSEWHERE, SPENT, Namer, encode_state, key_text
from sidecar.tiers import MAX_IDENTITY_CHARS, TierAssignments

if TYPE_CHECKING:
    from sidecar.store import Described

log = logging.getLogger("sluice")

# The table's figures as the node's metrics report them, summed over its
# zones: (metric, NodeZones.statistics's figure, what it says).
TABLE_FIGURES = (
    ("sluice_node_table_lock_recoveries", "recoveries", "Locks of the node's table taken over from a worker "
     "that died holding them (the stripe repaired), since serve started."),
    ("sluice_node_table_evictions", "evictions", "Records of the node's table evicted before they expired, "
     "to make room, since serve started."),
    ("sluice_node_table_lock_waits", "waits", "Locks of the node's table found busy (a worker waited for "
     "another), since serve started."),
    ("sluice_node_table_records", "records", "Records in use in the node's table."),
    ("sluice_node_table_capacity", "capacity", "Records the node's table holds."),
)

# Seconds a state stays readable after it stops mattering (see the module's docstring).
STALE_KEPT = 3600.0
NEVER = -math.inf  # what a state that matters at no time says its expiry is
# Bytes of value per record. A state's record: its state (33 bytes at most,
# a window's) and its key's text when it fits in the 47 bytes left (a rule
# keyed by the address: "(('login', ('ip',)), '2001:db8:85a3:8d3::/64')"),
# 120 bytes a record in all with the zone's 40 bytes of header, and under
# 128 a key with the zone's hash buckets and stripe headers.
STATE_VALUE = 80
TEXT_ROOM = STATE_VALUE - 33
# A ban record: any client key or network (43 characters at most) and a
# rule id of 64 fit whole, beside 12 bytes of the node's name and reason,
# which a shorter rule id leaves more room for (192 bytes a record).
BAN_VALUE = 152
LABEL_VALUE = 256  # a key's text longer than this is not listed
# The leases zone: as many keys as the states zone, within these bytes.
LEASE_ZONE_BYTES = 8 << 20
LEASE_TEXT = 64  # room for the key's text in a lease state's record
# Fewest leases a lease state holds, whatever the rules at start.
LEAST_LEASE_SLOTS = 16
# A zone's stripes: each its own lock; at least this many records each.
MOST_STRIPES = 64
LEAST_PER_STRIPE = 64
NETWORK_BANS = 4096  # network bans by hand a node holds
# Tier assignments made at run time a node holds: fewer than the
# ``sidecar.tiers.MAX_ASSIGNMENTS`` a shared store takes, because the zone
# is reserved in /dev/shm at start whether or not tiers are used, at 336
# bytes a record: 100,000 would add 32 MiB to the 57 MiB of the default
# table, past a container's default 64 MB; 10,000 add 3.2 MiB (60.2 MiB in all).
TIER_ASSIGNMENTS = 10_000
# A tier record: the tier's length (a byte), the tier (32 bytes at most:
# sidecar.tiers.TIER_NAME_RE), then the identity in UTF-8, at most
# MAX_IDENTITY_CHARS bytes (an identity of that many characters beyond
# ASCII is refused here).
TIER_NAME_BYTES = 32
TIER_VALUE = 1 + TIER_NAME_BYTES + MAX_IDENTITY_CHARS
# The lock order: zones in this order, each zone's stripes in increasing order.
ZONE_ORDER = ("bans", "notes", "states", "leases", "labels", "shadow", "networks", "prefixes", "tiers")
# The zones a decision's transaction locks, in the lock order (an
# administrator's operations lock the others), and the most stripes each may
# have: a transaction plans each zone's stripes as a mask, stripe n bit n.
LOCKED = ("bans", "notes", "states", "leases", "labels", "prefixes")
MASK_STRIPES = 64
# Key prefixes (a rule id and its dimensions' names) a node holds: a
# ruleset's rules, their challenge and penalty counters, and the Rate Limit
# Service's descriptors.
PREFIXES = 4096
PREFIX_VALUE = 256  # a longer prefix's keys are not listed


class Zone(Protocol):
    """What the store asks of a zone (``sidecar.shm.Zone``)."""

    capacity: int
    value_size: int
    stripes: int
    record_size: int

    def stripe_of(self, digest: bytes) -> int: ...
    def lock(self, stripes: Sequence[int]) -> None: ...
    def unlock(self, stripes: Sequence[int]) -> None: ...
    def lock_mask(self, mask: int) -> None: ...
    def unlock_mask(self, mask: int) -> None: ...
    def get(self, digest: bytes, now: float) -> bytes | None: ...
    def peek(self, digest: bytes, now: float) -> bytes | None: ...
    def put(self, digest: bytes, value: bytes, expires: float, now: float) -> None: ...
    def delete(self, digest: bytes) -> bool: ...
    def scan(self, stripe: int, now: float) -> list[tuple[bytes, bytes, float]]: ...
    def __len__(self) -> int: ...
    def generation(self) -> int: ...
    def bump_generation(self) -> int: ...
    def close(self) -> None: ...
    def unlink(self) -> None: ...

    @property
    def secret(self) -> bytes: ...

    @property
    def recoveries(self) -> int: ...

    @property
    def evictions(self) -> int: ...

    @property
    def waits(self) -> int: ...


class ZoneSize(NamedTuple):
    capacity: int
    value_size: int
    stripes: int


def zone_size(capacity: int, value_size: int) -> ZoneSize:
    """At least ``capacity`` records (a whole number in each stripe)."""
    stripes = max(1, min(MOST_STRIPES, capacity // LEAST_PER_STRIPE))
    return ZoneSize(-(-capacity // stripes) * stripes, value_size, stripes)


def lease_slots_for(largest_limit: int) -> int:
    """Leases a lease state holds: the rules' largest concurrency limit at
    start, and at least ``LEAST_LEASE_SLOTS``."""
    return max(largest_limit, LEAST_LEASE_SLOTS)


def zone_sizes(max_keys: int, lease_slots: int, tiers: int = TIER_ASSIGNMENTS) -> dict[str, ZoneSize]:
    """Each zone's records and bytes of value, for ``max_keys`` keys (the
    rules file's ``state.max_keys``), leases of ``lease_slots`` and
    ``tiers`` tier assignments.

    The tiers zone is one stripe: an administrator writes it, never a
    request, so its one lock costs nothing, and one stripe holds exactly
    its capacity (records spread over many stripes would fill one, and be
    refused, before the zone is full)."""
    lease_value = records.lease_value_bytes(lease_slots) + LEASE_TEXT
    lease_keys = max(LEAST_PER_STRIPE, min(max_keys, LEASE_ZONE_BYTES // (lease_value + 48)))
    some = max(1024, max_keys // 8)
    labelled = max(1024, max_keys // 4)  # keys whose text is longer than TEXT_ROOM
    return {"bans": zone_size(max_keys, BAN_VALUE), "notes": zone_size(max_keys, records.note_bytes()),
            "states": zone_size(max_keys, STATE_VALUE), "leases": zone_size(lease_keys, lease_value),
            "labels": zone_size(labelled, LABEL_VALUE), "shadow": zone_size(some, BAN_VALUE),
            "networks": zone_size(NETWORK_BANS, BAN_VALUE), "prefixes": zone_size(PREFIXES, PREFIX_VALUE),
            "tiers": ZoneSize(tiers, TIER_VALUE, 1)}


class NodeZones:
    """The zones of one node, by name (``ZONE_ORDER``), whose files are
    ``PREFIX-NAME``."""

    def __init__(self, prefix: str, zones: dict[str, Zone]) -> None:
        self.prefix = prefix
        self.zones = zones
        self.bans = zones["bans"]
        self.notes = zones["notes"]
        self.states = zones["states"]
        self.leases = zones["leases"]
        self.labels = zones["labels"]
        self.shadow = zones["shadow"]
        self.networks = zones["networks"]
        self.prefixes = zones["prefixes"]
        self.tiers = zones["tiers"]
        # A lease state's slots, from the size of the leases zone's values.
        self.lease_slots = (self.leases.value_size - LEASE_TEXT - records.lease_value_bytes(0)) \
            // records.LEASE_BYTES
        self.max_keys = self.states.capacity
        # The digests that name every record, keyed by the states zone's secret.
        self.names = _namer_type()(self.states.secret)

    def sized_for(self, max_keys: int) -> bool:
        """Whether the zones were made for ``max_keys`` keys."""
        return zone_size(max_keys, STATE_VALUE).capacity == self.states.capacity

    @classmethod
    def create(cls, prefix: str, max_keys: int, largest_concurrency: int = 0,
               zone_type: Any = None, tiers: int = TIER_ASSIGNMENTS) -> NodeZones:
        """New zones for the node (each file made 0600, never one already
        there): ``max_keys`` keys, leases for the largest concurrency limit,
        ``tiers`` tier assignments. OSError or ValueError says what failed;
        the zones made before it are removed."""
        zone_type = zone_type if zone_type is not None else _zone_type()
        made: dict[str, Zone] = {}
        try:
            for name, (capacity, value_size, stripes) in zone_sizes(max_keys, lease_slots_for(largest_concurrency),
                                                                    tiers).items():
                made[name] = zone_type.create(f"{prefix}-{name}", capacity, value_size, stripes)
        except BaseException:
            for zone in made.values():
                zone.unlink()
                zone.close()
            raise
        return cls(prefix, made)

    @classmethod
    def attach(cls, prefix: str, zone_type: Any = None) -> NodeZones:
        """The node's zones, made by ``create`` in another process."""
        zone_type = zone_type if zone_type is not None else _zone_type()
        attached: dict[str, Zone] = {}
        try:
            for name in ZONE_ORDER:
                attached[name] = zone_type.attach(f"{prefix}-{name}")
        except BaseException:
            for zone in attached.values():
                zone.close()
            raise
        return cls(prefix, attached)

    @classmethod
    def private(cls, max_keys: int, largest_concurrency: int = 0, zone_type: Any = None,
                tiers: int = TIER_ASSIGNMENTS) -> NodeZones:
        """Zones in this process's memory only (tests, one worker)."""
        zone_type = zone_type if zone_type is not None else _zone_type()
        return cls("", {name: zone_type.private(*size)
                        for name, size in zone_sizes(max_keys, lease_slots_for(largest_concurrency),
                                                     tiers).items()})

    def close(self) -> None:
        for zone in self.zones.values():
            zone.close()

    def unlink(self) -> None:
        """Remove the files (the processes attached keep their mappings)."""
        for zone in self.zones.values():
            zone.unlink()

    def memory(self) -> int:
        """Bytes of the zones' records, headers included."""
        return sum(zone.capacity * zone.record_size for zone in self.zones.values())

    def statistics(self) -> dict[str, dict[str, int]]:
        """Each zone's counters, by zone name (``ZONE_ORDER``), the same from
        every worker (they live in the zone's header): ``recoveries``, locks
        taken over from a worker that died holding them (its stripe
        repaired); ``evictions``, records evicted unexpired to make room;
        ``waits``, locks found busy when asked for (a worker then waited for
        another); ``records`` in use and ``capacity``. Read without locks:
        each figure is a moment's."""
        return {name: {"recoveries": zone.recoveries, "evictions": zone.evictions, "waits": zone.waits,
                       "records": len(zone), "capacity": zone.capacity}
                for name, zone in self.zones.items()}


def tier_name(names: Namer, identity: str) -> bytes:
    """The digest of an identity's record in the tiers zone."""
    return names.digest(identity.encode("utf-8", "surrogatepass"))


def encode_tier(identity: str, tier: str) -> bytes:
    """An identity's tier record (see ``TIER_VALUE``); ValueError when
    either does not fit (it never names the identity: it may be a secret)."""
    try:
        name = tier.encode("ascii")
    except UnicodeEncodeError:
        raise ValueError("a tier's name is ASCII (letters, digits, _ . -)") from None
    if not 0 < len(name) <= TIER_NAME_BYTES:
        raise ValueError(f"a tier's name is 1 to {TIER_NAME_BYTES} characters")
    try:
        text = identity.encode()
    except UnicodeEncodeError:
        raise ValueError("an identity is printable text") from None
    if not text:
        raise ValueError("expected an identity")
    if len(text) > MAX_IDENTITY_CHARS:
        raise ValueError(f"the memory backend's shared table (serve --workers) holds identities of at most "
                         f"{MAX_IDENTITY_CHARS} bytes in UTF-8; this one takes {len(text)}")
    return bytes((len(name),)) + name + text


def decode_tier(value: bytes) -> tuple[str, str] | None:
    """(identity, tier) of a tier record; None for bytes that are none."""
    length = value[0] if value else 0
    if not 0 < length <= TIER_NAME_BYTES or len(value) <= 1 + length:
        return None
    try:
        return value[1 + length:].decode(), value[1:1 + length].decode("ascii")
    except UnicodeDecodeError:
        return None


def _namer_type() -> type[Namer]:
    """What names the records: the compiled namer (``sidecar.store._naming``,
    the same names made in C) with the compiled core, else ``Namer``, its
    pure twin."""
    from sidecar import core

    if core.PURE:
        return Namer
    compiled: type[Namer] = importlib.import_module("sidecar.store._naming").FastNamer
    return compiled


def _zone_type() -> Any:
    from sidecar.shm import Zone as CompiledOrPure

    return CompiledOrPure


def zones_directory(directory: str = "/dev/shm") -> str:
    """Where a node's zones go: /dev/shm, or the temporary directory where
    there is none."""
    if os.path.isdir(directory):
        return directory
    import tempfile

    return tempfile.gettempdir()


def zones_prefix(directory: str) -> str:
    """The name of a new node's zones: ``DIRECTORY/sluice-PID-RANDOM``."""
    return os.path.join(directory, f"sluice-{os.getpid()}-{os.urandom(6).hex()}")


_ZONE_FILE = re.compile(r"sluice-(\d+)-[0-9a-f]{12}-(?:" + "|".join(ZONE_ORDER) + ")")


def remove_orphans(directory: str) -> list[str]:
    """Remove the zone files of this user in ``directory`` whose serve is
    gone without removing them (killed outright); the files removed. A file
    whose process id is in use again is left alone."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        found = _ZONE_FILE.fullmatch(name)
        if found is None or _running(int(found.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's: running
    return True


def in_force(value: bytes, expires: float, now: float) -> bool:
    """Whether a state's record, kept until ``expires``, holds a state in
    force at ``now``: not only kept ``STALE_KEPT`` after it stopped
    mattering, nor one that matters at no time (``SPENT``)."""
    return expires - STALE_KEPT > now and not value[0] & SPENT


def over_slots(checks: Sequence[Check], slots: int) -> bool:
    """Whether a check's concurrency limit is above ``slots`` leases (the
    store then caps it: ``NodeStore._within_slots``)."""
    for check in checks:  # a loop, not a generator: this runs for every decision
        spec = check.spec
        if spec.leases and cast(ConcurrencyLimiter, spec.limiter).limit > slots:
            return True
    return False


def stripe_bit(stripe: int) -> int:
    """A stripe's bit in a mask of stripes."""
    bit = 1
    return bit << stripe


def same_key(planned: Hashable, key: Hashable) -> bool:
    """Whether the key ``planned`` is certainly ``key``: two tuples whose
    items are the same objects or equal texts (a rule's prefix is one
    object for all its keys). Compiled, compared in C; False when unsure
    (other items), and the worker's names are asked instead."""
    if type(planned) is not tuple or type(key) is not tuple:
        return False
    old: tuple[Any, ...] = planned  # tuples: read in C
    new: tuple[Any, ...] = key
    if len(old) != len(new):
        return False
    for index in range(len(old)):
        first, second = old[index], new[index]
        if first is second:
            continue
        if type(first) is not str or type(second) is not str:
            return False
        text: str = first  # compiled: two str compared in C
        other: str = second
        if text != other:
            return False
    return True


class NotPlanned(RuntimeError):
    """The policy asked for a record the store did not lock for it: a bug."""


class _Name:
    """What a worker works out once about a key and keeps from one
    transaction to the next (``NAMES_KEPT`` keys): its digest and text,
    which zone and stripes hold its record, and whether the transaction
    running planned it already (``planned``, the transaction's number, and
    ``slot``, its slot's place then). Only bytes and numbers: the garbage
    collector has nothing to visit in the thousands kept."""

    __slots__ = ("digest", "text", "prefix_text", "leases", "room", "labelled", "stripe", "label_stripe", "planned",
                 "slot", "kept")

    digest: bytes
    text: bytes
    prefix_text: bytes  # its prefix's text: one object for all its prefix's keys
    leases: bool  # whether its record is in the leases zone (else the states zone)
    room: int  # bytes of its record the key's text may take
    labelled: bool  # its text is in the labels zone
    stripe: int  # its record's stripe
    label_stripe: int  # its text's stripe in the labels zone (labelled only)
    planned: int
    slot: int
    kept: bool  # put among the worker's names (NodeTable._names), which may have been cleared since


def new_name(digest: bytes, text: bytes, prefix_text: bytes, leases: bool, room: int, stripe: int,
             label_stripe: int) -> _Name:
    """A key's ``_Name``, its fields set in C (without a call of the class:
    under rotation, every key a check reads is named anew)."""
    name = _Name.__new__(_Name)
    name.digest = digest
    name.text = text
    name.prefix_text = prefix_text
    name.leases = leases
    name.room = room
    name.labelled = len(text) > room
    name.stripe = stripe
    name.label_stripe = label_stripe
    name.planned = -1
    name.slot = -1
    name.kept = False
    return name


class _Slot:
    """A key's record within one transaction. A table reuses its slots from
    one transaction to the next (``plan`` makes one a key's), and a slot
    keeps the last state it wrote or read beside that record's bytes
    (``kept_*``): a request like the last one plans its keys in the same
    slots, and a busy key's record read back unchanged is not decoded again."""

    __slots__ = ("key", "digest", "zone", "compiled", "value_size", "limiter", "text", "room", "labelled", "prefix",
                 "state", "raw", "read", "changed", "forgotten", "kept_digest", "kept_value", "kept_state", "last_key",
                 "last_name")

    def __init__(self) -> None:
        self.key: Hashable = None
        self.digest = b""
        self.zone: Any = None
        self.compiled: Any = None  # the zone when it is the compiled one (compiled_zone), called in C
        self.value_size = 0  # bytes of value its zone's records hold
        self.limiter: Limiter | None = None  # the limiter the caller counts the key with (None: any)
        self.text = b""
        self.room = 0
        self.labelled = False
        self.prefix: bytes | None = None  # its prefix's text, when this worker has not written it yet
        self.state: Any = None
        self.raw: bytes | None = None  # the record as read
        self.read = False
        self.changed = False
        self.forgotten = False
        self.kept_digest: bytes | None = None  # the digest of the record kept
        self.kept_value: bytes | None = None  # its bytes
        self.kept_state: Any = None  # the state they hold (None: nothing kept)
        # The key it was planned for last, and its name: the same key
        # planned in the same place again (a request like the last one) is
        # known without a lookup of the worker's names.
        self.last_key: Hashable = None
        self.last_name: _Name | None = None

    def plan(self, key: Hashable, name: _Name, zone: Zone, value_size: int, limiter: Limiter | None,
             prefix: bytes | None, compiled: Any) -> None:
        """Make the slot ``key``'s in a new transaction: nothing read yet
        (``compiled``: ``compiled_zone(zone)``)."""
        self.key = key
        self.digest = name.digest
        self.zone = zone
        self.compiled = compiled
        self.value_size = value_size
        self.limiter = limiter
        self.text = name.text
        self.room = name.room
        self.labelled = name.labelled
        self.prefix = prefix
        self.state = None
        self.raw = None
        self.read = False
        self.changed = False
        self.forgotten = False
        self.last_key = key
        self.last_name = name

    def keep_decoded(self, value: bytes, state: Any) -> None:
        """Keep ``state`` as the one ``value``, now the record's, holds."""
        self.kept_digest = self.digest
        self.kept_value = value
        self.kept_state = state

    def decoded(self, value: bytes) -> Any:
        """The state kept for ``value`` read from the slot's record, as
        decoding the bytes would make it; None when none is kept."""
        kept = self.kept_state
        if kept is not None and self.kept_digest is self.digest and limiter_of(kept) is self.limiter \
                and self.kept_value == value:
            return kept
        return None

    def clear(self) -> None:
        """Keep no key, limiter nor state alive past the transaction."""
        self.key = None
        self.limiter = None
        self.state = None
        self.raw = None


def compiled_zone(zone: Any) -> Any:
    """``zone`` when it is the compiled zone, which the compiled node store
    calls in C; else None (the pure zone, which the tests give it too)."""
    compiled = sys.modules.get("sidecar.shm._zone")  # never imported: no zone is the compiled one
    return zone if compiled is not None and type(zone) is compiled.Zone else None


# Keys whose digest and text a worker remembers (a key's repr and digest
# cost more than the rest of its read): forgotten all at once when full.
NAMES_KEPT = 16_384
# A key's name is kept from the second time the worker names it: a bit of
# SEEN_BITS, picked by its digest, says a key was named before, and all
# are cleared after NAMES_KEPT namings. Under rotation no key is named
# twice, and keeping every name (objects made and dropped by the
# thousand, in memory long cold) cost a quarter of a decision's time.
# (bounded.SeenLately: its bits are cleared after SEEN_BITS / 8 namings.)
# The names kept are forgotten with the bits (their generation): under
# rotation the few kept (keys whose bit an earlier one had set) would
# otherwise fill the dicts to NAMES_KEPT, each new key's look a miss of
# a dict long out of the CPU's caches.
SEEN_BITS = NAMES_KEPT * 8


class NodeTable(TableInC):
    """The policy's primitives (``sidecar.policy.StateTable``) over
    the zones, inside one transaction at a time: ``plan_*`` names the
    records the transaction may touch, ``run`` locks their stripes, runs
    the action, writes back and unlocks. Records are read when the policy
    first asks, and written when the action returns."""

    def __init__(self, zones: NodeZones) -> None:
        self.zones = zones
        self.now = 0.0
        self._transaction = 0  # the number of the transaction planned or running
        self._slots: list[_Slot] = []  # the keys' slots, reused: the first ``_used`` are the transaction's
        self._used = 0
        self._found = 0  # the slot the policy's last read or write found (_slot)
        self._bans: dict[str, list[Any]] = {}  # address -> [digest, record, read, changed]
        self._notes: dict[Note, list[Any]] = {}  # name -> [digest, (value, until), read, changed]
        self._names: dict[Hashable, _Name] = {}  # key -> what the worker worked out about it
        self._seen = SeenLately(SEEN_BITS)  # which keys were named (_named_before)
        self._names_generation = 0  # the filter's generation of the names kept
        self._known_prefixes: set[bytes] = set()  # the texts of prefixes this worker wrote
        self._ban_names: dict[str, tuple[bytes, int]] = {}  # address -> (digest, its stripe's bit)
        # The stripes to lock in each zone a transaction locks (LOCKED), as
        # masks of stripes: stripe n is bit n.
        self._ban_mask = self._note_mask = self._state_mask = self._lease_mask = 0
        self._label_mask = self._prefix_mask = 0
        self._locking: list[Zone] = [zones.zones[name] for name in LOCKED]
        self._compiled_locking: list[Any] = [compiled_zone(zone) for zone in self._locking]
        for name, zone in zip(LOCKED, self._locking):
            if zone.stripes > MASK_STRIPES:
                raise ValueError(f"the {name} zone has {zone.stripes} stripes; a transaction locks zones of "
                                 f"at most {MASK_STRIPES}")
        self._locked_masks: list[int] = []  # the masks the running transaction locked, zone by zone
        self._held = 0  # the zones it locked (the first ones of LOCKED)
        self._states = zones.states
        self._leases = zones.leases
        self._labels = zones.labels
        self._state_value_size = zones.states.value_size
        self._lease_value_size = zones.leases.value_size
        self.lease_slots = zones.lease_slots  # leases a record holds
        self._namer = zones.names
        self._compiled_states = compiled_zone(zones.states)
        self._compiled_leases = compiled_zone(zones.leases)
        self._compiled_bans = compiled_zone(zones.bans)
        # The bans zone's generation when the store last caught up, and
        # how it catches up (catch_up).
        self.bans_seen = -1
        self.catching_up: Callable[[], object] | None = None
        self._capped: dict[int, tuple[CheckSpec, CheckSpec]] = {}  # id(spec) -> (spec, capped spec)

    def bans_generation(self) -> int:
        """The bans zone's generation: bumped by any worker that changed
        what every worker must catch up with (``NodeStore.refresh``)."""
        compiled = self._compiled_bans
        if compiled is not None:
            generation: int = compiled.generation()  # in C
            return generation
        return self.zones.bans.generation()

    # -- planning ------------------------------------------------------------------

    def begin(self, now: float) -> None:
        self.now = now
        self._transaction += 1
        self._used = 0
        self._found = 0
        self._bans.clear()
        self._notes.clear()
        self._ban_mask = self._note_mask = self._state_mask = self._lease_mask = 0
        self._label_mask = self._prefix_mask = 0
        seen: SeenLately = self._seen  # compiled: its generation read in C
        if len(self._names) >= NAMES_KEPT or seen.generation != self._names_generation:
            # Between transactions: no key planned is forgotten. A name
            # forgotten is no longer kept, though a slot may still hold it
            # (``plan_key`` keeps it again when planned there again).
            self._names_generation = seen.generation
            for name in self._names.values():
                cython.cast(_Name, name).kept = False
            self._names.clear()
            self._ban_names.clear()

    def _name(self, key: Hashable, leases: bool) -> _Name:
        """What the worker keeps about a key, worked out anew (its text's
        ``repr`` and digest cost more than the rest of its read)."""
        text, digest, prefix_text = self._namer.key_name(key)
        compiled, zone, room = (self._compiled_leases, self._leases, LEASE_TEXT) if leases \
            else (self._compiled_states, self._states, TEXT_ROOM)
        stripe = compiled.stripe_of(digest) if compiled is not None else zone.stripe_of(digest)  # in C
        label_stripe = self._labels.stripe_of(digest) if len(text) > room else -1
        name = new_name(digest, text, prefix_text, leases, room, stripe, label_stripe)
        if self._named_before(digest):
            self._names[key] = name
            name.kept = True
        return name

    def _named_before(self, digest: bytes) -> bool:
        """Whether a key of this digest (or one sharing its bit) was named
        lately; a naming now. The digest's first bytes pick the bit."""
        seen: SeenLately = self._seen  # compiled: called in C
        return seen.again_at(digest[0] | digest[1] << 8 | digest[2] << 16)

    def plan_key(self, key: Hashable, limiter: Limiter | None, leases: bool | None = None) -> _Slot:
        """A key the transaction may read or write: in the leases zone when
        it counts leases (``leases``; by default, when ``limiter`` does)."""
        name = None
        slots = self._slots
        if self._used < len(slots):
            slot = cython.cast(_Slot, slots[self._used])  # compiled: no type test (the table's slots)
            last = slot.last_name
            if last is not None and same_key(slot.last_key, key):
                name = last
                if not name.kept:
                    # Planned again, as a name the worker did not keep
                    # yet: kept from now on, unless it keeps another.
                    name = self._names.setdefault(key, last)
                    name.kept = True
        if name is None:
            name = self._names.get(key)
        if name is not None and name.planned == self._transaction:
            return cython.cast(_Slot, slots[name.slot])
        # Compiled, a C truth: compared with the name's in C.
        counts_leases = (limiter is not None and limiter.leases) if leases is None else bool(leases)
        if name is None or name.leases != counts_leases:
            name = self._name(key, counts_leases)
        if counts_leases:
            zone, value_size, compiled = self._leases, self._lease_value_size, self._compiled_leases
        else:
            zone, value_size, compiled = self._states, self._state_value_size, self._compiled_states
        # An equal key (not the same object) may be planned already under
        # another of its names (one the worker did not keep, or forgot).
        digest = name.digest
        for index in range(self._used):
            slot = cython.cast(_Slot, slots[index])
            if slot.digest == digest and slot.zone is zone:
                return slot
        if counts_leases:
            self._lease_mask |= stripe_bit(name.stripe)
        else:
            self._state_mask |= stripe_bit(name.stripe)
        if name.labelled:
            self._label_mask |= stripe_bit(name.label_stripe)
        prefix = None
        if name.prefix_text not in self._known_prefixes:
            prefix = name.prefix_text
            self._prefix_mask |= stripe_bit(self.zones.prefixes.stripe_of(self._namer.digest(prefix)))
        if self._used == len(slots):
            slots.append(_Slot())
        slot = cython.cast(_Slot, slots[self._used])
        name.planned = self._transaction
        name.slot = self._used
        self._used += 1
        slot.plan(key, name, zone, value_size, limiter, prefix, compiled)
        if compiled is not None:
            compiled.ask(digest)  # in C: its memory asked for while the other keys are planned
        return slot

    def plan_ban(self, address: str) -> None:
        if address not in self._bans:
            named = self._ban_names.get(address)
            if named is None:
                if len(self._ban_names) >= NAMES_KEPT:
                    self._ban_names.clear()
                digest = self._namer.ban_name(address)
                compiled = self._compiled_bans
                stripe = compiled.stripe_of(digest) if compiled is not None else self.zones.bans.stripe_of(digest)
                named = (digest, stripe_bit(stripe))  # in C
                if self._named_before(digest):  # kept from its second time, as keys' names
                    self._ban_names[address] = named
            self._bans[address] = [named[0], None, False, False]
            self._ban_mask |= named[1]
            if self._compiled_bans is not None:
                self._compiled_bans.ask(named[0])  # in C

    def plan_note(self, name: Note) -> None:
        if name not in self._notes:
            digest = self._namer.note_name(name)
            self._notes[name] = [digest, None, False, False]
            self._note_mask |= stripe_bit(self.zones.notes.stripe_of(digest))

    def plan_checks(self, address: str, checks: Sequence[Check]) -> None:
        """Everything ``Policy.evaluate`` may touch for these checks (see
        ``_refused``, ``_unsolved_penalty`` and ``_escalated`` there)."""
        self.plan_ban(address)
        for check in checks:
            spec = check.spec
            self.plan_key(check.key, spec.limiter, spec.leases)
            if not address:
                continue
            if spec.auto_ban is not None:
                self.plan_key(spec.auto_ban.key(address), spec.auto_ban.limiter)
            if spec.penalty_ban is not None:
                self.plan_key(spec.penalty_ban.key(spec.rule_id, address), spec.penalty_ban.limiter)
                self.plan_note((COUNTED_PENALTY, address, spec.rule_id))
            if spec.ban_increment is not None:
                self.plan_note((BAN_STEP, address, spec.rule_id))

    # -- the transaction ------------------------------------------------------------

    def run(self, action: Callable[..., Any], *args: Any) -> Any:
        """``action(*args)`` with the planned stripes locked, then every
        change written; nothing is written when it raises."""
        return self._transact(None, action, args)

    def catch_up(self) -> bool:
        """``catching_up()`` (the node store's ``refresh``) when the bans
        zone's generation moved since it last caught up (``bans_seen``):
        one read of a counter, in C, for every check; whether it moved."""
        if self.bans_generation() == self.bans_seen or self.catching_up is None:
            return False
        self.catching_up()
        return True

    def decide(self, policy: Policy, now: float, address: str, checks: Sequence[Check], can_delay: bool,
               quotas: bool) -> Evaluation:
        """A decision's transaction: the records its checks may touch
        planned, then run as ``run(policy.evaluate, ...)``, the policy
        called in C. A concurrency limit above the leases a record holds
        is capped first (``_within_slots``)."""
        if over_slots(checks, self.lease_slots):
            checks = self._within_slots(checks)
        self.begin(now)
        self.plan_checks(address, checks)
        self._ask_records()
        evaluation: Evaluation = self._transact(policy, None, (now, address, checks, can_delay, quotas))
        return evaluation

    def _within_slots(self, checks: Sequence[Check]) -> list[Check]:
        """The checks, with a concurrency limit above the leases a record
        holds (a reload raised it past the largest at start) run at that
        many: the zones keep their size until a restart."""
        slots = self.lease_slots
        return [Check(self._capped_spec(check.spec), check.key, check.lease)
                if check.spec.leases and cast(ConcurrencyLimiter, check.spec.limiter).limit > slots
                else check for check in checks]

    def _capped_spec(self, spec: CheckSpec) -> CheckSpec:
        known = self._capped.get(id(spec))
        if known is not None and known[0] is spec:
            return known[1]
        limiter = cast(ConcurrencyLimiter, spec.limiter)
        slots = self.lease_slots
        log.warning("rule %s: a concurrent limit of %d runs as %d until Sluice restarts: the shared table's "
                    "records were sized at start for %d leases", spec.rule_id, limiter.limit, slots, slots)
        capped = dataclasses.replace(spec, limiter=ConcurrencyLimiter(slots, limiter.lease))
        self._capped[id(spec)] = (spec, capped)
        return capped

    def _ask_records(self) -> None:
        """Ask for the memory of the records the planned keys and bans
        read first (``Zone.ask_records``), their buckets' memory asked for
        as each was planned: under a rotation of keys the misses of a
        transaction's records overlap instead of following one another."""
        slots = self._slots
        for index in range(self._used):
            slot = cython.cast(_Slot, slots[index])
            compiled = slot.compiled
            if compiled is not None:
                compiled.ask_records(slot.digest)  # in C
        bans = self._compiled_bans
        if bans is not None:
            for entry in self._bans.values():
                bans.ask_records(entry[0])  # in C

    def _transact(self, policy: Policy | None, action: Callable[..., Any] | None, args: tuple[Any, ...]) -> Any:
        """``run``'s transaction, of ``action(*args)`` or, given the policy,
        of its evaluation of ``args``."""
        try:
            self._lock()
            if policy is not None:
                now, address, checks, can_delay, quotas = args
                result: Any = policy.evaluate(now, address, checks, can_delay, quotas)  # in C
            else:
                result = cast(Callable[..., Any], action)(*args)
            self._commit()
            return result
        except BaseException:
            self._drop_decoded()  # the action may have changed states it did not write
            raise
        finally:
            self._unlock()
            self._end()

    def _lock(self) -> None:
        """Lock the planned stripes, zone by zone in the lock order. A zone
        that fails to lock its stripes has unlocked those it took, and
        ``_unlock`` unlocks the zones locked before it."""
        masks = self._locked_masks = [self._ban_mask, self._note_mask, self._state_mask, self._lease_mask,
                                      self._label_mask, self._prefix_mask]
        self._held = 0
        for index in range(len(masks)):
            if masks[index]:
                self._lock_zone(index, masks[index], True)
            self._held = index + 1

    def _unlock(self) -> None:
        """Unlock what ``_lock`` locked, in the reverse order."""
        masks = self._locked_masks
        for index in range(self._held - 1, -1, -1):
            if masks[index]:
                self._lock_zone(index, masks[index], False)
        self._held = 0

    def _lock_zone(self, index: int, mask: int, lock: bool) -> None:
        """Lock (or unlock) the stripes of ``mask`` in the zone ``LOCKED[index]``:
        the compiled zone in C."""
        compiled = self._compiled_locking[index]
        if compiled is not None:
            if lock:
                compiled.lock_mask(mask)
            else:
                compiled.unlock_mask(mask)
        elif lock:
            self._locking[index].lock_mask(mask)
        else:
            self._locking[index].unlock_mask(mask)

    def _drop_decoded(self) -> None:
        """Forget the decoded states of the transaction's keys."""
        slots = self._slots
        for index in range(self._used):
            slot = cython.cast(_Slot, slots[index])
            slot.kept_state = None

    def _end(self) -> None:
        """No key is planned any more, and no state is kept alive past its transaction."""
        self._transaction += 1
        slots = self._slots
        for index in range(self._used):
            slot = cython.cast(_Slot, slots[index])
            slot.clear()
        self._used = 0
        self._bans.clear()
        self._notes.clear()

    def _commit(self) -> None:
        now = self.now
        never, stale_kept = NEVER, STALE_KEPT  # compiled: C doubles, read once
        zones = self.zones
        notes = self._notes
        # What can fail to encode (a plug-in's note) fails before any write.
        encoded_notes = {name: records.encode_note(name, note[0])
                         for name, (_, note, _, changed) in notes.items() if changed} if notes else None
        lease_slots = zones.lease_slots
        slots = self._slots
        for index in range(self._used):
            slot = cython.cast(_Slot, slots[index])
            compiled = slot.compiled
            if compiled is not None and slot.raw is None and slot.state is not None:
                compiled.ask_victim(slot.digest)  # in C: a new key's, evicting when its stripe is full
        for index in range(self._used):
            slot = cython.cast(_Slot, slots[index])
            state = slot.state
            if state is None:
                slot.kept_state = None
                if slot.forgotten:
                    compiled = slot.compiled
                    if compiled is not None:
                        compiled.delete(slot.digest)
                    else:
                        slot.zone.delete(slot.digest)
                    if slot.labelled:
                        self._labels.delete(slot.digest)
                continue
            limiter = limiter_of(state)
            expires = limiter.expires_at(state)  # in C
            text = slot.text
            labelled = slot.labelled
            # The key's text in the record when it fits the room planned
            # for it, else in the labels zone (whose stripe was locked
            # then). A plug-in's state too long to leave the room keeps no
            # text: its key is not listed. A state that matters at no time
            # (a lease state without a lease) is kept readable, never
            # listed as in force.
            value = encode_state(state, lease_slots, None if labelled else text, slot.value_size,
                                 0 if expires > never else SPENT)
            if not (slot.changed or slot.forgotten) and value == slot.raw:
                slot.keep_decoded(value, state)
                continue  # read, not changed
            kept = expires + stale_kept if expires > never else now + stale_kept
            compiled = slot.compiled
            if compiled is not None:
                compiled.put(slot.digest, value, kept, now)  # in C
            else:
                slot.zone.put(slot.digest, value, kept, now)
            slot.keep_decoded(value, state)
            if labelled and len(text) <= LABEL_VALUE:
                self._labels.put(slot.digest, text, kept, now)  # as long as the state
            if slot.prefix is not None:
                self._write_prefix(slot.prefix, now)
        for digest, record, _, changed in self._bans.values():
            if changed:
                zones.bans.put(digest, records.encode_ban(record, zones.bans.value_size), record.expires, now)
        if encoded_notes:
            for name, (digest, note, _, changed) in notes.items():
                if changed:
                    zones.notes.put(digest, encoded_notes[name], note[1], now)

    def _write_prefix(self, prefix: bytes, now: float) -> None:
        """Keep a key prefix's text for the admin API's listings (once per
        worker)."""
        if len(prefix) <= PREFIX_VALUE:
            self.zones.prefixes.put(self._namer.digest(prefix), prefix, math.inf, now)
        self._known_prefixes.add(prefix)

    # -- the primitives ----------------------------------------------------------------

    def _slot(self, key: Hashable) -> _Slot:
        slots = self._slots
        used = self._used
        # The key planned, most often (no hash to work out), looked for from
        # the last one found: the policy reads a key, may keep it, then
        # reads the next, in the order they were planned.
        index = self._found
        for _step in range(used):
            if index >= used:
                index = 0
            slot = cython.cast(_Slot, slots[index])
            if slot.key is key:
                break
            index += 1
        else:
            for index in range(used):  # an equal key, not the same object
                slot = cython.cast(_Slot, slots[index])
                if slot.key == key:
                    break
            else:
                raise NotPlanned(f"the policy asked for a key the store did not lock: {key!r:.200}")
        self._found = index
        if not slot.read:
            slot.read = True
            compiled = slot.compiled
            if compiled is not None:
                value = compiled.get(slot.digest, self.now)  # in C
            else:
                value = slot.zone.get(slot.digest, self.now)
            if value is not None:
                state = slot.decoded(value)
                slot.state = state if state is not None else records.decode_state(value, slot.limiter)
                slot.raw = value
        return slot

    def state(self, key: Hashable) -> Any:
        return self._slot(key).state

    def keep(self, key: Hashable, state: Any) -> None:
        slot = self._slot(key)
        slot.state = state
        slot.changed = True

    def expect(self, checks: Sequence[Check]) -> None:
        """A hint this table does not take: the transaction planned every
        record before it locked them, and reads each when the policy first
        asks."""

    def forget(self, key: Hashable) -> bool:
        slot = self._slot(key)
        had = slot.state is not None
        slot.state = None
        slot.changed = False
        slot.forgotten = True
        return had

    def ban(self, address: str) -> BanRecord | None:
        entry = self._bans.get(address)
        if entry is None:
            raise NotPlanned(f"the policy asked for a ban the store did not lock: {address!r:.200}")
        if not entry[2]:
            entry[2] = True
            compiled = self._compiled_bans
            digest, now = entry[0], self.now
            value = compiled.get(digest, now) if compiled is not None else self.zones.bans.get(digest, now)  # in C
            entry[1] = None if value is None else records.decode_ban(value)
        record: BanRecord | None = entry[1]  # not cast: a call in the compiled core
        return record

    def keep_ban(self, record: BanRecord) -> None:
        entry = self._bans.get(record.address)
        if entry is None:
            raise NotPlanned(f"the policy kept a ban the store did not lock: {record.address!r:.200}")
        entry[1:] = [record, True, True]

    def note(self, name: Note, now: float) -> Any:
        entry = self._notes.get(name)
        if entry is None:
            raise NotPlanned(f"the policy asked for a note the store did not lock: {name!r:.200}")
        if not entry[2]:
            entry[2] = True
            value = self.zones.notes.get(entry[0], self.now)
            entry[1] = None if value is None else (records.decode_note(value), math.inf)
        note = entry[1]
        return note[0] if note is not None and now < note[1] else None

    def keep_note(self, name: Note, value: Any, until: float) -> None:
        entry = self._notes.get(name)
        if entry is None:
            raise NotPlanned(f"the policy kept a note the store did not lock: {name!r:.200}")
        entry[1:] = [(value, until), True, True]


def _all_stripes(zone: Zone) -> Iterator[int]:
    return iter(range(zone.stripes))


class NodeStore:
    """The memory backend over a node's zones: every role of
    ``sidecar.store.StateStore``, the same from every worker. Every
    operation answers at once (locks are held for a few microseconds)."""

    answers_at_once = True

    def __init__(self, zones: NodeZones, node: str, clock: Clock = epoch_clock,
                 wall_clock: Clock = time.time) -> None:
        self.zones = zones
        self.table = NodeTable(zones)
        self.policy = Policy(self.table, node, wall_clock)
        self.table.catching_up = self.refresh
        self._clock = clock
        self._wall_clock = wall_clock
        self._network_bans = NetworkBans()
        self._tier_assignments = TierAssignments()  # replaced in place: the engine holds this one
        self._seen_tiers = -1
        self._seen_reload = zones.states.generation()
        self._on_change: list[Callable[[], None]] = []
        self._on_reload: list[Callable[[], None]] = []
        self._max_keys_told = zones.max_keys
        self.refresh()

    @property
    def node(self) -> str:
        return self.policy.node

    # -- following other workers ----------------------------------------------------

    def follow(self, on_change: Callable[[], None] | None = None,
               on_reload: Callable[[], None] | None = None) -> None:
        """Call ``on_change`` when an administrator changed the state through
        any worker, and ``on_reload`` when another worker was asked to reload."""
        if on_change is not None:
            self._on_change.append(on_change)
        if on_reload is not None:
            self._on_reload.append(on_reload)

    def refresh(self) -> bool:
        """Catch up with what other workers changed (one read of a counter
        when nothing did); whether something had."""
        generation = self.zones.bans.generation()
        if generation == self.table.bans_seen:
            return False
        self.table.bans_seen = generation
        self._network_bans.replace(self._read_bans(self.zones.networks, self._clock()))
        tiers = self.zones.tiers.generation()  # bumped before the bans zone's: read after it
        if tiers != self._seen_tiers:
            self._seen_tiers = tiers
            self._tier_assignments.replace(self._read_tiers())
        for listener in self._on_change:
            listener()
        reload = self.zones.states.generation()
        if reload != self._seen_reload:
            self._seen_reload = reload
            for listener in self._on_reload:
                listener()
        return True

    def changed(self) -> None:
        """Tell every worker (this one included) that an administrator changed the state."""
        self.zones.bans.bump_generation()
        self.refresh()

    def announce_reload(self) -> None:
        """Tell the other workers to reload their rules, as this one just did."""
        self._seen_reload = self.zones.states.bump_generation()
        self.zones.bans.bump_generation()

    @property
    def network_bans(self) -> NetworkBans:
        table: NodeTable = self.table  # compiled: the bans zone's generation read in C
        table.catch_up()
        return self._network_bans

    @property
    def tier_assignments(self) -> TierAssignments:
        self.refresh()
        return self._tier_assignments

    # -- deciding ---------------------------------------------------------------

    async def evaluate(self, now: float, address: str, checks: Sequence[Check],
                       can_delay: bool = True, quotas: bool = False) -> Evaluation:
        return self.decide(now, address, checks, can_delay, quotas)

    def decide(self, now: float, address: str, checks: Sequence[Check], can_delay: bool = True,
               quotas: bool = False) -> Evaluation:
        """``evaluate`` without an event loop."""
        table: NodeTable = self.table  # compiled: its methods called in C
        return table.decide(self.policy, now, address, checks, can_delay, quotas)

    async def record(self, now: float, counts: Sequence[ResponseCount]) -> list[Hit]:
        table = self.table
        table.begin(now)
        for count in counts:
            table.plan_key(count.key, count.limiter)
        count_now = self.policy.count
        hits: list[Hit] = table.run(lambda: [count_now(c.key, c.limiter, now, c.threshold, c.amount) for c in counts])
        return hits

    def count_now(self, key: Hashable, limiter: Limiter, now: float, threshold: float, amount: int) -> Hit:
        """Count one at once, whatever the limiter, without an event loop."""
        table = self.table
        table.begin(now)
        table.plan_key(key, limiter)
        hit: Hit = table.run(self.policy.count, key, limiter, now, threshold, amount)
        return hit

    async def release(self, lease: str, keys: Sequence[CountingKey]) -> int:
        table = self.table
        table.begin(self._clock())
        for key in keys:
            table.plan_key(key, None, leases=True)
        released: int = table.run(self.policy.release, lease, keys)
        return released

    async def reset(self, keys: Sequence[CountingKey]) -> int:
        """Forget the keys' states, counting or leasing."""
        return self._forget_keys(keys)

    def _forget_keys(self, keys: Sequence[Hashable]) -> int:
        zones = self.zones
        now = self._clock()
        forgotten = 0
        for key in keys:
            text = key_text(key)
            digest = zones.names.digest(text)
            found = False
            for zone in (zones.states, zones.leases):
                stripes = [zone.stripe_of(digest)]
                zone.lock(stripes)
                try:
                    value = zone.peek(digest, now)
                    found = zone.delete(digest) and value is not None or found
                finally:
                    zone.unlock(stripes)
            self._unlabel(digest, now)
            forgotten += found
        return forgotten

    def _unlabel(self, digest: bytes, now: float) -> None:
        labels = self.zones.labels
        stripes = [labels.stripe_of(digest)]
        labels.lock(stripes)
        try:
            labels.delete(digest)
        finally:
            labels.unlock(stripes)

    def may_be_banned(self) -> bool:
        return len(self.zones.bans) > 0

    def configure(self, max_keys: int, node: str) -> None:
        """New settings from a reload. The zones keep the size they were
        made with: a new ``max_keys`` applies at the next start."""
        self.policy.node = node
        if max_keys != self._max_keys_told and not self.zones.sized_for(max_keys):
            self._max_keys_told = max_keys
            log.warning("state.max_keys is now %d, but the node's shared table keeps the %d keys it was "
                        "sized for at start until Sluice restarts", max_keys, self.zones.max_keys)

    # -- bans -------------------------------------------------------------------------

    def _read_bans(self, zone: Zone, now: float) -> list[BanRecord]:
        """Every ban record of a zone unexpired at ``now``, a stripe at a time."""
        found: list[BanRecord] = []
        for stripe in _all_stripes(zone):
            zone.lock([stripe])
            try:
                found.extend(records.decode_ban(value) for _, value, _ in zone.scan(stripe, now))
            finally:
                zone.unlock([stripe])
        return found

    def _one(self, zone: Zone, digest: bytes, action: Callable[[], Any]) -> Any:
        stripes = [zone.stripe_of(digest)]
        zone.lock(stripes)
        try:
            return action()
        finally:
            zone.unlock(stripes)

    def _peek(self, zone: Zone, digest: bytes, now: float) -> bytes | None:
        return cast(bytes | None, self._one(zone, digest, lambda: zone.peek(digest, now)))

    def record_shadow_ban(self, record: BanRecord) -> None:
        shadow = self.zones.shadow
        digest = self.zones.names.ban_name(record.address)
        value = records.encode_ban(record, shadow.value_size)
        self._one(shadow, digest, lambda: shadow.put(digest, value, record.expires, self._clock()))

    async def shadow_bans(self, now: float) -> list[BanRecord]:
        return sorted(self._read_bans(self.zones.shadow, now), key=lambda ban: ban.address)

    async def lift_shadow_ban(self, address: str) -> bool:
        shadow = self.zones.shadow
        digest = self.zones.names.ban_name(address)
        lifted = bool(self._one(shadow, digest, lambda: shadow.delete(digest)))
        if lifted:
            self.changed()
        return lifted

    async def forget_history(self, address: str) -> int:
        notes = self.zones.notes
        hashed = records.address_hash(address)
        now = self._clock()
        dropped = 0
        for stripe in _all_stripes(notes):
            notes.lock([stripe])
            try:
                for digest, value, _ in notes.scan(stripe, now):
                    if records.note_of_address(value, hashed):
                        dropped += notes.delete(digest)
            finally:
                notes.unlock([stripe])
        if dropped:
            self.changed()
        return dropped

    async def active_bans(self, now: float) -> list[BanRecord]:
        return self.bans_in_force(now)

    def bans_in_force(self, now: float) -> list[BanRecord]:
        return sorted(self._read_bans(self.zones.bans, now), key=lambda ban: ban.address)

    async def lift_ban(self, address: str) -> bool:
        bans = self.zones.bans
        digest = self.zones.names.ban_name(address)
        lifted = bool(self._one(bans, digest, lambda: bans.delete(digest)))
        if lifted:
            self.changed()
        return lifted

    async def ban_of(self, now: float, address: str) -> BanRecord | None:
        bans = self.zones.bans
        digest = self.zones.names.ban_name(address)
        value = self._one(bans, digest, lambda: bans.peek(digest, now))
        return None if value is None else records.decode_ban(value)

    async def ban(self, now: float, address: str, duration: float, reason: str) -> BanRecord:
        table = self.table
        table.begin(now)
        table.plan_ban(address)
        record = cast(BanRecord, table.run(self.policy.ban, now, address, "", duration, None, reason))
        self.changed()
        return record

    async def ban_network(self, now: float, network: str, duration: float, reason: str) -> BanRecord:
        ban = BanRecord(network, "", self.node, self._wall_clock(), now + duration, duration, reason=reason)
        networks = self.zones.networks
        digest = self.zones.names.ban_name(network)
        value = records.encode_ban(ban, networks.value_size)
        self._one(networks, digest, lambda: networks.put(digest, value, ban.expires, now))
        self.changed()
        return ban

    async def lift_network_ban(self, now: float, network: str) -> bool:
        networks = self.zones.networks
        digest = self.zones.names.ban_name(network)
        lifted = bool(self._one(networks, digest, lambda: networks.delete(digest)))
        if lifted:
            self.changed()
        return lifted

    async def active_network_bans(self, now: float) -> list[BanRecord]:
        self.refresh()
        return self._network_bans.in_force(now)

    async def reset_keys(self, now: float, keys: Sequence[CountingKey]) -> int:
        reset = self._forget_keys(keys)
        self.changed()
        return reset

    # -- tiers ----------------------------------------------------------------------

    async def assign_tier(self, identity: str, tier: str) -> None:
        """A record of the tiers zone, never evicting another: ValueError
        when the zone holds ``TIER_ASSIGNMENTS`` others already, or when the
        identity or tier does not fit a record. Every worker reads the
        assignments again at its next request."""
        tiers = self.zones.tiers
        value = encode_tier(identity, tier)
        digest = tier_name(self.zones.names, identity)
        now = self._clock()

        def put() -> None:
            # One stripe (zone_sizes), locked: its records are the zone's.
            if tiers.peek(digest, now) is None and len(tiers) >= tiers.capacity:
                raise ValueError(f"the memory backend's shared table (serve --workers) holds {tiers.capacity:,} "
                                 "tier assignments made at run time, the most it takes: remove one first")
            tiers.put(digest, value, math.inf, now)

        self._one(tiers, digest, put)
        self._tier_assignments.set(identity, tier)
        self._tiers_changed()

    async def unassign_tier(self, identity: str) -> bool:
        tiers = self.zones.tiers
        digest = tier_name(self.zones.names, identity)
        removed = bool(self._one(tiers, digest, lambda: tiers.delete(digest)))
        self._tier_assignments.remove(identity)
        if removed:
            self._tiers_changed()
        return removed

    async def assigned_tiers(self) -> dict[str, str]:
        return self._read_tiers()

    def _tiers_changed(self) -> None:
        self.zones.tiers.bump_generation()
        self.changed()

    def _read_tiers(self) -> dict[str, str]:
        """Every assignment in the tiers zone, a stripe at a time."""
        tiers = self.zones.tiers
        now = self._clock()
        found: dict[str, str] = {}
        for stripe in _all_stripes(tiers):
            tiers.lock([stripe])
            try:
                values = [value for _, value, _ in tiers.scan(stripe, now)]
            finally:
                tiers.unlock([stripe])
            for value in values:
                assignment = decode_tier(value)
                if assignment is not None:
                    found[assignment[0]] = assignment[1]
        return found

    # -- inspection ----------------------------------------------------------------

    async def find_keys(self, now: float, selection: KeySelection, limit: int | None = None) -> list[CountingKey]:
        # A look through every key: at most the zones' records, for an administrator.
        if selection.key is not None:
            key = selection.key
            return [key] if self._stored(now, key) else []
        found: list[CountingKey] = []
        seen: set[bytes] = set()
        prefixes = self._prefixes(now)
        codes = None if selection.rule is None else \
            {code for code, prefix in prefixes.items() if prefix[0] == selection.rule}
        hint = None if selection.address is None else repr(selection.address).encode()
        for key in self._keys(now, prefixes, codes, hint, seen):
            if selection.holds(key):
                found.append(key)
                if limit is not None and len(found) >= limit:
                    break
        return found

    def _stored(self, now: float, key: CountingKey) -> bool:
        """Whether the key has a state in force at ``now`` (not only kept)."""
        digest = [self.zones.names.digest(key_text(key))]
        return any(self._in_force_of(zone, digest, now) for zone in (self.zones.states, self.zones.leases))

    def _prefixes(self, now: float) -> dict[bytes, Any]:
        """Every key prefix the workers wrote, by code."""
        zone = self.zones.prefixes
        found: dict[bytes, Any] = {}
        for stripe in _all_stripes(zone):
            zone.lock([stripe])
            try:
                texts = [value for _, value, _ in zone.scan(stripe, now)]
            finally:
                zone.unlock([stripe])
            for text in texts:
                prefix = records.parse_prefix(text)
                if prefix is not None:
                    found[records.prefix_of((prefix,))[0]] = prefix
        return found

    def _keys(self, now: float, prefixes: dict[bytes, Any], codes: set[bytes] | None, hint: bytes | None,
              seen: set[bytes]) -> Iterator[CountingKey]:
        """The keys of every state in force: of a prefix of ``codes`` (None:
        any), whose values' text holds ``hint``."""
        zones = self.zones
        for zone in (zones.states, zones.leases):
            for stripe in _all_stripes(zone):
                zone.lock([stripe])
                try:
                    live = [(digest, value) for digest, value, expires in zone.scan(stripe, now)
                            if in_force(value, expires, now)]
                finally:
                    zone.unlock([stripe])
                for digest, value in live:
                    if digest in seen:
                        continue
                    seen.add(digest)
                    text = self._text_of(digest, value, now)
                    if text is None or codes is not None and text[:records.PREFIX_CODE_BYTES] not in codes \
                            or hint is not None and hint not in text[records.PREFIX_CODE_BYTES:]:
                        continue
                    key = records.parse_key(text, prefixes)
                    if key is not None:
                        yield key

    def _text_of(self, digest: bytes, value: bytes, now: float) -> bytes | None:
        if not value[0] & ELSEWHERE:
            return value[records.state_length(value):]
        labels = self.zones.labels
        return cast(bytes | None, self._one(labels, digest, lambda: labels.peek(digest, now)))

    async def describe_keys(self, now: float, keys: Sequence[Described]) -> list[CounterState | None]:
        zones = self.zones
        digests = [self.zones.names.digest(key_text(key)) for key, _, _ in keys]
        # The records in force: a state's own limiter says when it stops
        # mattering, which a record read back knows only as its expiry.
        found = {**self._in_force_of(zones.states, digests, now), **self._in_force_of(zones.leases, digests, now)}
        return [self._describe(now, key, limiter, threshold, found.get(digest))
                for (key, limiter, threshold), digest in zip(keys, digests)]

    def _in_force_of(self, zone: Zone, digests: Sequence[bytes], now: float) -> dict[bytes, bytes]:
        """The values of those of ``digests`` whose state is in force at
        ``now`` (not only kept), a stripe scanned at a time."""
        wanted = set(digests)
        found: dict[bytes, bytes] = {}
        for stripe in sorted({zone.stripe_of(digest) for digest in wanted}):
            zone.lock([stripe])
            try:
                found.update((digest, value) for digest, value, expires in zone.scan(stripe, now)
                             if digest in wanted and in_force(value, expires, now))
            finally:
                zone.unlock([stripe])
        return found

    @staticmethod
    def _describe(now: float, key: CountingKey, limiter: Limiter | None, threshold: float,
                  value: bytes | None) -> CounterState | None:
        """As the memory store describes a key: read, never counted, and
        without refreshing its recency."""
        state = None if value is None else records.decode_state(value, limiter)
        if state is None:
            return None
        if limiter is None:
            own = state.limiter
            return CounterState(key, 0.0 if own.leases else own.peek(state, now).retry_after, None)
        if type(state.limiter) is not type(limiter):
            state = limiter.new_state()  # another algorithm's state: the rule's starts anew
        # A concurrency limit has no penalty: it refuses while full.
        penalty = 0.0 if limiter.leases else limiter.peek(state, now).retry_after
        return CounterState(key, penalty, limiter.quota(state, now, threshold))

    # -- lifecycle -------------------------------------------------------------------

    def tracked_keys(self) -> int:
        return len(self.zones.states) + len(self.zones.leases)

    def zone_statistics(self) -> dict[str, dict[str, int]]:
        """The node's table's counters, zone by zone (``NodeZones.statistics``):
        lock recoveries, evictions, lock waits, records in use and capacity."""
        return self.zones.statistics()

    def gauges(self) -> dict[str, tuple[str, Callable[[], float]]]:
        # The node's figures, the same from every worker: the table's
        # counters are the zones', kept since serve made them, and only grow.
        figures: dict[str, tuple[str, Callable[[], float]]] = {
            "sluice_active_bans": ("IP bans in force on this node.", lambda: len(self.bans_in_force(self._clock()))),
            "sluice_tracked_keys": ("Counting keys held in memory.", self.tracked_keys)}
        for name, figure, documentation in TABLE_FIGURES:
            figures[name] = (documentation, self._table_figure(figure))
        return figures

    def _table_figure(self, figure: str) -> Callable[[], float]:
        return lambda: sum(zone[figure] for zone in self.zones.statistics().values())

    async def open(self) -> None:
        """Nothing to open: the zones are attached."""

    async def close(self) -> None:
        """Nothing to close: the zones stay attached until the process ends
        (the parent removes their files)."""
