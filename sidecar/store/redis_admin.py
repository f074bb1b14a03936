"""What administrators change on the shared store, found and followed by
every node.

**Finding keys.** A counting key's Redis name is its tuple's JSON under a
hash tag (``sidecar.store.redis.counting_key``), so the keys an
administrator names are found by their names: the keys of one client
address share its tag (``sluice:{ADDRESS}:count:...``: on a Redis Cluster
they are the keys of one hash slot, which ``CLUSTER GETKEYSINSLOT`` lists
at once; on a single Redis they are scanned for), a ``session:`` rule's
fallback to the address is found by the value in the name, and the keys
of one rule by the rule's part of the name. ``SCAN`` walks the whole
keyspace, a thousand keys a step, between the decisions on the same
connection; each name found is read back into its key and kept only if
it is one.

**Following changes.** Network bans live in the admin slot (hash tag
``{admin}``): a record per network, like a client's ban record, and an
index of them. Every action an administrator takes on the store also
writes a new random admin version there. Each node asks for the version
every second (one ``GET``-sized script call) and, when it changed, reads
the network bans again and empties its cache of keys over limit (which
would otherwise answer for a reset key, or keep refusing a banned client
with a rule's page instead of closing). The node that acts reads them at
once; every other node within a second.

**Tier assignments** (``sidecar.tiers``) live in the admin slot too: one
hash, ``sluice:{admin}:tiers`` (identity to tier), and a version of their
own, ``sluice:{admin}:tiers:version``. A node assigns or removes one in one
script (tier.lua) that also writes a new version of both; it changes its
own copy at once, and every other node, finding the admin version moved,
reads the assignments again with the network bans when (and only when)
their version moved too: a network ban or a reset does not send every
node the whole hash. ``TierAssignments`` is each node's copy, read with
every request without a round trip; a node that cannot ask keeps its
last copy. The hash holds at most ``sidecar.tiers.MAX_ASSIGNMENTS``
identities (the script refuses one more), never expires, and is never
logged: an identity may be a secret (an API key).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from sidecar.keys import CountingKey
from sidecar.networkbans import NetworkBans
from sidecar.ratelog import RateLimitedLog
from sidecar.state import BanRecord, Clock
from sidecar.store import StoreUnavailable
from sidecar.store.penalties import PenaltyCache
from sidecar.store.redis_cluster import ClusterRedis
from sidecar.store.redis_pipeline import PipelinedRedis, RedisReplyError
from sidecar.tiers import TierAssignments

log = logging.getLogger("sluice")

ADMIN_VERSION = "sluice:{admin}:version"
NETWORK_INDEX = "sluice:{admin}:networks"
NETWORK_HEAD = "sluice:{admin}:network:"
# The tier assignments made at run time (a hash: identity -> tier), and
# their version, which changes with each of them (never expires, as they
# do not).
TIERS = "sluice:{admin}:tiers"
TIERS_VERSION = "sluice:{admin}:tiers:version"
# The version outlives every node's last look at it by far; when it expires
# the nodes read the network bans once more, and nothing else happens.
VERSION_KEPT_MS = 86_400_000
# How often each node asks for the admin version.
WATCH_INTERVAL = 1.0
SCAN_COUNT = 1000

COUNT_INFIX = "}:count:"


def network_record(network: str) -> str:
    return NETWORK_HEAD + network


def new_version() -> str:
    """A version no node has seen: random, so that one expired and written
    again never looks unchanged."""
    return os.urandom(8).hex()


def glob_escape(text: str) -> str:
    """``text`` matched literally by a ``SCAN MATCH`` pattern."""
    return "".join("\\" + char if char in "*?[]\\" else char for char in text)


def key_of_name(name: str) -> CountingKey | None:
    """The counting key a Redis key name holds, if it is one
    (``counting_key`` read backwards): the caller checks that the key makes
    the name again."""
    start = name.find("{")
    end = name.find(COUNT_INFIX, start + 1)
    if start < 0 or end < 0:
        return None
    try:
        body = json.loads(name[end + len(COUNT_INFIX):])
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, list) or not body or not _is_prefix(body[0]):
        return None
    values: list[Any] = []
    for value in body[1:]:
        if isinstance(value, str):
            values.append(value)
        elif isinstance(value, list) and len(value) == 2 and all(isinstance(part, str) for part in value):
            values.append((value[0], value[1]))  # a session value, tagged
        else:
            return None
    rule_id, names = body[0]
    return ((rule_id, tuple(names)), *values)


def _is_prefix(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) \
        and isinstance(value[1], list) and all(isinstance(name, str) for name in value[1])


async def scan(client: PipelinedRedis | ClusterRedis, pattern: str) -> AsyncIterator[list[str]]:
    """The names that match ``pattern``, a step of ``SCAN`` at a time, from
    every master of a cluster in turn."""
    servers = await client.masters() if isinstance(client, ClusterRedis) else [client]
    for server in servers:
        cursor = "0"
        while True:
            cursor, names = await server.execute("SCAN", cursor, "MATCH", pattern, "COUNT", SCAN_COUNT)
            yield names
            if cursor == "0":
                break


class AdminCopy:
    """This node's copy of the admin slot: the network bans, read again
    whenever the admin version changes, and the tier assignments, read
    again when their own version changed too; the cache of keys over limit
    is emptied then. ``read`` runs the admin state script (admin_state.lua)
    and ``ban`` makes a ban record of its fields; ``clock`` is the time of
    the asks that no caller makes."""

    def __init__(self, read: Callable[[float, str, str], Awaitable[list[Any]]],
                 ban: Callable[[str, float, Sequence[Any]], BanRecord], penalties: PenaltyCache,
                 clock: Clock, interval: float = WATCH_INTERVAL) -> None:
        self.network_bans = NetworkBans()
        self.tier_assignments = TierAssignments()  # replaced in place: the engine holds this one
        self._tiers_version: str | None = None  # None: never read
        self._read = read
        self._ban = ban
        self._penalties = penalties
        self._clock = clock
        self.interval = interval
        self._version: str | None = None  # None: never read
        self._watching: asyncio.Task[None] | None = None
        self._failure_log = RateLimitedLog(log, 60)

    async def refresh(self, now: float, force: bool = False) -> None:
        """Ask for the admin version; read the network bans when it changed
        (or with ``force``), and the tier assignments when their own
        version changed too (``force`` or not: theirs never expires)."""
        known = "*" if force or self._version is None else self._version
        known_tiers = "*" if self._tiers_version is None else self._tiers_version
        version, changed, *values = await self._read(now, known, known_tiers)
        if not int(changed):
            return
        tiers_version, tiers, *values = values
        if isinstance(tiers, list):  # else 0: the version known
            self.tier_assignments.replace(dict(zip(tiers[0::2], tiers[1::2])))
            self._tiers_version = tiers_version
        self.network_bans.replace(self._ban(values[i], now, values[i + 1:i + 8]) for i in range(0, len(values), 8))
        if version != self._version:
            self._penalties.clear()
            self._version = version

    def watch(self) -> None:
        """Ask every ``interval`` seconds from now on, in a task of this loop."""
        if self._watching is None:
            self._watching = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                await self.refresh(self._clock())
            except (StoreUnavailable, RedisReplyError) as exc:
                # The last copy stays in force until the store answers again.
                self._failure_log.warning("could not read the network bans, tier assignments and admin "
                                          "version from the shared store (%s); the last copy stays in force "
                                          "(reported once per minute)", exc)
            await asyncio.sleep(self.interval)

    @property
    def watching(self) -> bool:
        """Whether the asks every ``interval`` run (they outlast failures)."""
        return self._watching is not None and not self._watching.done()

    async def stop(self) -> None:
        watching, self._watching = self._watching, None
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
