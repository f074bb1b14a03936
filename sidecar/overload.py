"""What Sluice decides, on purpose, when a flood outruns it.

The shipped proxies give Sluice a deadline (1 s) and let a request in
unchecked when it passes: a rate limiter failure must not become an outage.
A flood that outruns Sluice's CPU would turn that rule into a bypass, so
Sluice answers a check that waited too long at once, before the proxy's
timeout would decide for it:

* a client known to be over a rule's limit (``RefusalMemory``: what this
  node refused, until the refusal ends) is refused as it was;
* otherwise a rule with ``overload: closed`` refuses (503, Retry-After 1),
  and with ``overload: open`` (the default) the request is let in,
  uncounted.

Each such answer is counted in ``sluice_overload_decisions_total`` by rule
and outcome.

A check is late when both hold:

* the proxy stamped it with the time it sent it (``X-Sluice-Sent``: nginx's
  ``$msec``, Envoy's ``%START_TIME%``), and it reached Sluice more than
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
import time
from typing import Callable, Hashable

# The proxy's stamp of when it sent the check (the shipped templates set it).
SENT_HEADER = "x-sluice-sent"
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


def parse_sent(value: str | None) -> float:
    """The proxy's send stamp (Unix seconds, as ``1700000000.123``); 0.0
    for none or anything else (never trusted blindly: see the module)."""
    if not value or len(value) > 24:
        return 0.0
    try:
        sent = float(value)
    except ValueError:
        return 0.0
    return sent if math.isfinite(sent) and sent > 0 else 0.0


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
