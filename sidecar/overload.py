"""What Sluice decides, on purpose, when a flood outruns it.

The shipped proxies give Sluice a deadline (1 s) and let a request in
unchecked when it passes: a rate limiter failure must not become an outage.
A flood that outruns Sluice's CPU would turn that rule into a bypass, so
Sluice answers a check that waited too long at once, before the proxy's
timeout would decide for it:

* a client known to be over a rule's limit (``RefusalMemory``: what this
  node refused, until the refusal ends) is refused as it was;
* otherwise a rule with ``overload: closed`` refuses (503, Retry-After 1),
  and with ``overload: open`` (the default) the check is counted on this
  node alone (``Engine.late_counts``, this node's memory, which also counts
  every request the shared store admitted through this node): let in while
  within the rule's limit there, refused past it. A flood's late checks,
  before any refusal of its client came back from the shared store, get
  what is left of the budget on this node, not the whole flood.

Each such answer is counted in ``sluice_overload_decisions_total`` by rule
and outcome.

A check is late when both hold:

* the proxy stamped it with the time it sent it (``X-Sluice-Sent``: nginx's
  ``$msec``, Envoy's ``%START_TIME%``; read by ``sidecar.request.parse_sent``
  when the request is described), and it reached Sluice more than
  ``overload.after`` later (the rules file; 250 ms by default);
* Sluice's own event loop is behind (``LoopWatch``) by at least a quarter
  of that. A client cannot make its own checks late by sending an old
  stamp (a proxy that does not set the header passes the client's on):
  only a loop that is really behind trusts a stamp.
"""

from __future__ import annotations

import asyncio
import collections
import math
import re
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

# How often the loop watch's timer should run.
TICK_SECONDS = 0.02
# A stamp is trusted when the loop is behind by this share of overload.after.
BEHIND_SHARE = 0.25


class LoopWatch:
    """How far the event loop is behind right now: a timer that should run
    every TICK_SECONDS. While the loop works through a long turn (thousands
    of checks read at once), ``behind`` grows with it, read per check."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = clock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start on ``loop`` (once: a second call is a no-op)."""
        if self._loop is None:
            self._loop = loop
            self._last = self._clock()
            loop.call_later(TICK_SECONDS, self._tick)

    def _tick(self) -> None:
        self._last = self._clock()
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_later(TICK_SECONDS, self._tick)

    def behind(self) -> float:
        """Seconds the loop is late for its timer (0 when unwatched or on time)."""
        if self._loop is None:
            return 0.0
        return max(0.0, self._clock() - self._last - TICK_SECONDS)


class RefusalMemory:
    """The refusals this node made that still hold: (rule id, counting key)
    → until when (on the engine's clock) and the decision, at most
    ``capacity`` of them, the oldest forgotten first.

    Written by every full decision that refuses, read only for late checks:
    a client already over its limit stays refused while Sluice is overloaded.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: collections.OrderedDict[Hashable, tuple[float, object]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, key: Hashable, until: float, decision: object) -> None:
        entries = self._entries
        entries[key] = (until, decision)
        entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def recall(self, key: Hashable, now: float) -> tuple[float, object] | None:
        """The refusal still in force for ``key`` at ``now``, if any."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] <= now:
            del self._entries[key]
            return None
        return entry


# A request id that a stored answer can take in place of its own: what
# nginx's $request_id (32 hex digits) and Envoy's (a UUID) look like, which
# neither a page's HTML escaping nor a header field's changes.
_SPLICEABLE_ID = re.compile(r"[A-Za-z0-9-]{16,64}")
# A stored answer is sent again for at most this long: the decision log's
# fold (a key's line a second) is late by no more. Over a shared store, a
# quarter of that: what an administrator does on another node reaches this
# node's cache of keys over limit within a second (sidecar.store.redis_admin),
# and a stored refusal adds no more than this to it.
STORED_SECONDS = 1.0
SHARED_STORED_SECONDS = 0.25
# nginx may answer such a refusal itself, from its cache (X-Accel-Expires on
# the check's answer; sluice-server.conf's proxy_cache), for at most this
# long: an unban, a reset or a reload reaches a client whose refusal nginx
# holds within that. nginx counts in whole seconds of its clock and caches
# an answer only until a later second than the current one, so a refusal
# that holds less than that (to the end of the next second) is not cached.
PROXY_SECONDS = 2.0


def proxy_expires(until: float, now: float) -> int:
    """The Unix second to give nginx as ``X-Accel-Expires: @N`` for a
    refusal that holds from ``now`` to ``until`` (Unix seconds), or 0 when
    none fits: nginx serves a cached answer through the end of the second
    it is given, which must end by ``until``, and caches nothing given
    the current second."""
    last = math.floor(until) - 1
    return last if last > math.floor(now) else 0


# What a stored refusal is found by: the front door, the check's method, and
# the header fields that name the client and shape the answer (the peer, its
# X-Forwarded-For, the host the page names, and the Accept header that
# chooses between an HTML and a JSON page), as received.
StoredKey = tuple[str, str, str | None, str | None, str | None, str | None, str | None]
STORED_KEY_FIELDS = ("x-sluice-client-addr", "x-forwarded-for", "x-original-host", "host", "accept")
# The front doors whose client and page come from those fields alone
# (forward-auth's client is the connection's peer).
STORED_FRONT_DOORS = frozenset({"nginx", "envoy"})


def stored_key(front_door: str, method: str, headers: dict[str, str]) -> StoredKey:
    """The ``StoredKey`` of a check, from its header map (STORED_KEY_FIELDS,
    written out: this runs for every check while refusals are stored)."""
    get = headers.get
    return (front_door, method, get("x-sluice-client-addr"), get("x-forwarded-for"), get("x-original-host"),
            get("host"), get("accept"))


@dataclass(frozen=True, slots=True)
class StoredRefusal:
    """An answer the HTTP protocol sends again without a decision: its
    bytes split where the request id goes, until when it holds, and what
    the metrics count for it."""

    until: float
    id_length: int
    parts: tuple[bytes, ...]
    rule_id: str  # "" for a ban
    action: str
    outcome: str
    log_key: Hashable | None  # the decision log's fold, for a rule's refusal

    def bytes_for(self, request_id: bytes) -> bytes:
        return request_id.join(self.parts)


class AddressRefusals:
    """Refusals that hold for every request of one client for a while, as
    the bytes of their answers (see ``Engine.address_wide``): a ban, or the
    first rule of the file when it matches every request, is keyed by the
    address alone and over its limit. Looked up by the fields of the check
    that name the client and shape the answer (``StoredKey``), at most
    ``capacity`` of them, the oldest forgotten first.

    ``entries`` is public so that a check door tells an empty store from
    its truth value without a call into this module (a check enters each
    module at most once: tests/unit/test_check_trace.py)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: collections.OrderedDict[Hashable, StoredRefusal] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()

    def remember(self, key: Hashable, request_id: str, answer: bytes, until: float, rule_id: str,
                 action: str, outcome: str, log_key: Hashable | None) -> None:
        if not _SPLICEABLE_ID.fullmatch(request_id):
            return
        parts = tuple(answer.split(request_id.encode("ascii")))
        entries = self.entries
        entries[key] = StoredRefusal(until, len(request_id), parts, rule_id, action, outcome, log_key)
        entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def recall(self, key: Hashable, request_id: str, now: float) -> StoredRefusal | None:
        """The stored refusal for ``key`` if it still holds and takes this
        request id."""
        stored = self.entries.get(key)
        if stored is None:
            return None
        if now >= stored.until:
            del self.entries[key]
            return None
        if len(request_id) != stored.id_length or not _SPLICEABLE_ID.fullmatch(request_id):
            return None
        return stored

    def answer_again(self, front_door: str, method: str, headers: dict[str, str], request_id: str,
                     now: float) -> tuple[StoredRefusal, bytes] | None:
        """The stored refusal for a check (``stored_key`` of its header
        map; as ``recall``) with the bytes of its answer for this request
        id, in one call."""
        stored = self.recall(stored_key(front_door, method, headers), request_id, now)
        return None if stored is None else (stored, stored.bytes_for(request_id.encode("ascii")))
