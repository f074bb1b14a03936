"""Keys a shared store said are over limit, known on this node until their
wait ends: a request for such a key is answered without a round trip (under
an attack, most requests are such requests), as envoyproxy/ratelimit's
local cache does for keys over limit.

Exact where it answers: a key over limit stays so, and counts nothing, until
its penalty (or a bucket's wait) ends, whatever other nodes do. A ban this
node's evaluation gave an address is seen: the store asks Redis for that
address's requests while the ban lasts. What it does not see until the entry
ends: a ban another node issued for the address (the request is refused by
the rule's page instead of by closing it), and a key
an administrator reset on the shared store by hand (redis-cli); what an
administrator does through Sluice empties every node's cache within a second
(``sidecar.store.redis_admin``). It never answers for a check that can ban
(a ban rule, a challenge counted towards an auto-ban or then_ban_after),
hold (a leaky bucket whose refusal may be this node's full wait queue) or
lease (a concurrency limit, whose slots are given back at any moment).
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.bounded import BoundedMap
from sidecar.keys import CountingKey
from sidecar.limiters import Hit
from sidecar.state import Check, Clock, Evaluation


def _cacheable(check: Check) -> bool:
    # A full concurrency key is not over limit until a given time: a
    # release may free a slot at any moment.
    return check.ban_duration is None and check.auto_ban is None and check.penalty_ban is None \
        and not check.limiter.holds and not check.limiter.leases


class PenaltyCache:
    """At most ``max_keys`` keys (the ruleset's ``state.max_keys``), each
    until its wait ends on this node's clock, and only for the limiter that
    found it over limit (a reload may give the key's rule another)."""

    def __init__(self, max_keys: int, clock: Clock) -> None:
        self._clock = clock
        self._until = self._empty(max_keys)
        self.answered = 0  # requests answered without a round trip

    def _empty(self, max_keys: int) -> BoundedMap:
        return BoundedMap(max_keys, lambda entry: entry[0], self._clock)

    def answer(self, now: float, checks: Sequence[Check]) -> Evaluation | None:
        """The evaluation when every check up to the first stopping one is
        known over limit (so none of them would count), else None."""
        known = self._until.data
        if not known:
            return None
        hits: list[Hit] = []
        for check in checks:
            entry = known.get(check.key)
            if entry is None:
                return None
            until, limiter = entry
            if until <= now or limiter is not check.limiter or not _cacheable(check):
                return None
            hits.append(Hit(True, until - now))
            if check.stops:
                self.answered += 1
                return Evaluation(hits=hits)
        return None

    def learn(self, now: float, checks: Sequence[Check], hits: Sequence[Hit]) -> None:
        """Remember the keys the store just found over limit."""
        for check, hit in zip(checks, hits):
            if hit.over_limit and hit.retry_after > 0 and _cacheable(check):
                self._until[check.key] = now + hit.retry_after, check.limiter

    def forget(self, key: CountingKey) -> None:
        """The key was reset on the shared store: ask the store again."""
        self._until.pop(key, None)

    def clear(self) -> None:
        """Forget every key: an administrator changed the shared store."""
        self._until = self._empty(self._until.max_keys)

    def configure(self, max_keys: int) -> None:
        self._until.max_keys = max_keys

    def __len__(self) -> int:
        return len(self._until)
