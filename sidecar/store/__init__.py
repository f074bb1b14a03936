"""Where counts and bans live: one seam, by role, and two backends.

A store plays four roles, each a protocol that its callers depend on:

- ``Deciding``: the request path, one call per request (``evaluate``), and
  what a reported response does (``record``, ``release``, ``reset``);
- ``BanAdmin``: bans by rule and by hand, shadow bans, network bans, and
  an administrator's reset of keys;
- ``Inspection``: finding and describing stored keys, for an administrator;
- ``TierAdmin``: the tiers an administrator assigns to identities at run
  time (``sidecar.tiers``), and this node's copy of them;
- ``Lifecycle``: settings from a reload, metrics, opening and closing.

``StateStore`` is all five: what the engine holds. It never learns which
backend it has. ``MemoryStore`` (``sidecar.store.memory``) keeps the state
of one process and answers at once: the policy (``sidecar.policy``) over a
table of a few primitives, which any in-process backend can implement
(``sidecar.store.local``). ``RedisStore`` (``sidecar.store.redis``) shares
the state between every worker and node through Redis or Valkey, one
round trip per request. ``NodeStore`` (``sidecar.store.node``) is the
memory backend for a node whose workers share one table in shared memory.
``open_store`` builds the one a ruleset asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from sidecar.config import Backend, SentinelConfig
from sidecar.keys import CountingKey
from sidecar.limiters import Hit
from sidecar.limiters.base import Limiter
from sidecar.policy import Policy
from sidecar.state import BanRecord, Check, Evaluation, ResponseCount

if TYPE_CHECKING:
    from sidecar.counters import CounterState, KeySelection
    from sidecar.networkbans import NetworkBans
    from sidecar.tiers import TierAssignments

# A key to describe, with the limiter and threshold of the rule that counts
# it now (None: no rule running now counts it).
Described = tuple[CountingKey, Limiter | None, float]


class StoreUnavailable(Exception):
    """The shared store did not answer; the caller fails open or closed."""


class Deciding(Protocol):
    """The request path: what the engine asks for every request, and for
    every reported response."""

    # True when no operation ever waits (the memory store): a caller may run
    # them with run_at_once instead of scheduling a task.
    answers_at_once: bool

    @property
    def network_bans(self) -> NetworkBans:
        """The network bans this node refuses (sidecar.networkbans): the
        store's own, or its copy of a shared store's."""

    async def evaluate(self, now: float, address: str, checks: Sequence[Check],
                       can_delay: bool = True, quotas: bool = False) -> Evaluation:
        """Ban check and every check in order, in one step (the policy of
        ``sidecar.policy``). With ``quotas``, also each counting check's
        (remaining, reset, window) after the decision (None for the
        others), for the draft RateLimit fields."""
    async def record(self, now: float, counts: Sequence[ResponseCount]) -> list[Hit]:
        """Count reported responses."""
    async def release(self, lease: str, keys: Sequence[CountingKey]) -> int:
        """Give back the concurrency slots a request took under ``lease``,
        one per key, when its response is reported; how many were held."""
    async def reset(self, keys: Sequence[CountingKey]) -> int:
        """Clear the keys' counters and penalties; how many were stored."""
    def may_be_banned(self) -> bool:
        """False only when no request can be banned now (nothing to ask)."""


class BanAdmin(Protocol):
    """Bans, listed, issued by hand and lifted (sidecar.admin and the
    engine's admin API), and an administrator's reset of keys."""

    def record_shadow_ban(self, record: BanRecord) -> None:
        """Keep a shadow rule's would-be ban for listing (it refuses nobody);
        a shared store writes it in the background, every node lists it."""
    async def shadow_bans(self, now: float) -> list[BanRecord]: ...
    async def lift_shadow_ban(self, address: str) -> bool: ...
    async def active_bans(self, now: float) -> list[BanRecord]: ...
    async def lift_ban(self, address: str) -> bool: ...
    async def forget_history(self, address: str) -> int:
        """Forget what bans react to for an address: the steps of its
        escalating bans and its unsolved challenge penalties; how many
        records there were."""
    async def ban_of(self, now: float, address: str) -> BanRecord | None:
        """The ban of one client key in force, if any."""
    async def ban(self, now: float, address: str, duration: float, reason: str) -> BanRecord:
        """Ban one client key by hand, replacing any ban it has."""
    async def ban_network(self, now: float, network: str, duration: float, reason: str) -> BanRecord:
        """Ban a network (a canonical CIDR) by hand, replacing its ban."""
    async def lift_network_ban(self, now: float, network: str) -> bool: ...
    async def active_network_bans(self, now: float) -> list[BanRecord]:
        """The network bans in force, as the store holds them."""
    async def reset_keys(self, now: float, keys: Sequence[CountingKey]) -> int:
        """``reset`` for an administrator: every node also forgets what it
        knew of the keys; how many were stored."""


class Inspection(Protocol):
    """Stored keys, found and described for an administrator (sidecar.admin)."""

    async def find_keys(self, now: float, selection: KeySelection, limit: int | None = None) -> list[CountingKey]:
        """The stored keys the selection names (at most ``limit``), ones
        whose counts and penalty are over excepted."""
    async def describe_keys(self, now: float, keys: Sequence[Described]) -> list[CounterState | None]:
        """Each key as its limiter describes it (None: no longer stored)."""


class TierAdmin(Protocol):
    """Tiers assigned to identities at run time (``sidecar.tiers``): kept by
    the store, so that with a shared store every node has them."""

    @property
    def tier_assignments(self) -> TierAssignments:
        """This node's copy, read with every request of a ruleset with
        tiers: the store's own, or its copy of a shared store's (read again
        within a second of another node's change)."""
    async def assign_tier(self, identity: str, tier: str) -> None:
        """Assign ``identity`` to ``tier``, replacing its assignment. The
        caller checked both, and that the store holds fewer than
        ``sidecar.tiers.MAX_ASSIGNMENTS`` others; a shared store may still
        refuse with ValueError (a 409), whose message never names the
        identity: Redis when another node added the last one since, the
        memory backend's shared table (``serve --workers``) when its own,
        smaller bound is reached or the identity is longer than its
        records (``sidecar.store.node.TIER_ASSIGNMENTS``)."""
    async def unassign_tier(self, identity: str) -> bool:
        """Remove the identity's run-time assignment; False when it had none."""
    async def assigned_tiers(self) -> dict[str, str]:
        """Every run-time assignment, as the store holds it now."""


class Lifecycle(Protocol):
    """Settings, metrics, and the connection of a shared store."""

    def configure(self, max_keys: int, node: str) -> None:
        """New settings from a reload."""
    def gauges(self) -> dict[str, tuple[str, Callable[[], float]]]:
        """Metrics only this store can tell, by name: (help, read); a name
        ending in ``_total`` is a running count, the others gauges."""
    async def open(self) -> None:
        """Connect ahead of the first request (a shared store), so that a
        burst at start does not wait for the connection and its scripts;
        StoreUnavailable if that fails (the first request tries again)."""
    async def close(self) -> None: ...


class StateStore(Deciding, BanAdmin, Inspection, TierAdmin, Lifecycle, Protocol):
    """A whole backend: every role."""


def open_store(backend: Backend, url: str, max_keys: int, node: str, clock: Callable[[], float],
               cluster: Sequence[tuple[str, int]] = (), sentinel: SentinelConfig | None = None,
               zones: str | None = None) -> StateStore:
    """The store a ruleset's ``state:`` asks for; ``cluster`` names some
    nodes of a Redis Cluster, ``sentinel`` the sentinels of a master.
    ``zones`` names the node's shared table that the workers of ``serve
    --workers N`` share (``sidecar.store.node``): the memory backend then
    keeps its state there."""
    if backend == "redis":
        from sidecar.store.redis import RedisStore

        if sentinel is not None:
            from sidecar.store.sentinel import sentinel_client

            return RedisStore(sentinel_client(sentinel), node, max_keys=max_keys, clock=clock)
        return RedisStore.from_url(url, node, max_keys=max_keys, clock=clock, cluster=cluster)
    if zones is not None:
        from sidecar.store.node import NodeStore, NodeZones

        return NodeStore(NodeZones.attach(zones), node, clock)
    from sidecar.store.memory import MemoryStore

    return MemoryStore(max_keys, node, clock)


def open_local_counts(max_keys: int, node: str, clock: Callable[[], float],
                      wall_clock: Callable[[], float]) -> Policy:
    """The policy over this process's memory, bounded like the memory store
    (``max_keys``) and with no store around it: for counts a node keeps of
    its own beside a shared store (``Policy.count``)."""
    from sidecar.store.memory import MemoryTable

    return Policy(MemoryTable(max_keys, clock), node, wall_clock)
