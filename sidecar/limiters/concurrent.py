"""Concurrency limits: at most N requests of a key in flight at once, like
nginx's ``limit_conn`` but shared through the store; in Redis,
``concurrent.lua``.

A key's state is its slots: the lease id of each request in flight and the
time its lease ends. A request is admitted while fewer than N leases are
live. It is deferred like a bucket: the slot is taken only when the whole
request is admitted, so a refusal by any rule holds none. The slot is given
back when the proxy reports the response (the store's ``release``, by the
request's lease id), or when its lease ends, so that a report that never
comes (a crashed proxy, a lost datagram) cannot keep it.
"""

from __future__ import annotations

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

import itertools
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field, field_validator

from sidecar.config import Duration, LimitModel, Rule, format_duration
from sidecar.limiters import NO_PENALTY, Quota, RuleLimit, lua_number, registry
from sidecar.limiters.records import (
    UNDER_LIMIT,
    Algorithm,
    Hit,
    admitted,
    place_in_lines,
    record_equal,
    record_repr,
    refused,
)

CONCURRENT = registry.lua_kind("C", "window", "concurrent")

_anonymous = itertools.count()


@cython.no_gc  # nothing a state holds leads back to it
@cython.cclass
class LeaseState:
    """The leases a key holds (a record: see ``sidecar.limiters.records.record_repr``)."""

    __match_args__ = ("held", "limiter")
    __slots__ = (*__match_args__, "used")

    def __init__(self, held: dict[str, float], limiter: Any = None) -> None:
        self.held = held  # lease id -> when its lease ends, in the order taken
        # The limiter the state belongs to: a reload may give the key another.
        self.limiter = limiter
        self.used = False  # read since the table last passed it over (sidecar.bounded.StateMap)

    def __repr__(self) -> str:
        return record_repr(self)

    def __eq__(self, other: object) -> bool:
        return record_equal(self, other)

    __hash__ = None  # type: ignore[assignment]  # changed in place, as a dataclass's


place_in_lines(LeaseState)  # each instance in one line of the cache, compiled


class ConcurrencyLimiter(Algorithm):
    """At most ``limit`` live leases per key. A state holds at most
    ``limit`` of them: the expired ones are dropped when the key is full,
    before it is judged, so a key below its limit costs no sweep."""

    __slots__ = ("limit", "lease", "_lua_limit")
    deferred = True  # the slot is taken only when the whole request is admitted
    holds = False
    scalable = False  # the limit is its own: overrides cannot scale it
    leases = True

    def __init__(self, limit: int, lease: float) -> None:
        self.limit = limit
        self.lease = lease  # seconds a slot lasts without its report
        self._lua_limit = (str(limit), lua_number(lease))

    def new_state(self) -> LeaseState:
        return LeaseState({}, self)

    def _refusal(self, state: LeaseState, now: float) -> Hit | None:
        """The refusal of a full key: Retry-After is its shortest remaining lease."""
        held = state.held
        if len(held) < self.limit:
            return None
        for lease in [lease for lease, ends in held.items() if ends <= now]:
            del held[lease]
        if len(held) < self.limit:
            return None
        return refused(min(held.values()) - now)

    def peek(self, state: Any, now: float) -> Hit:
        return self._refusal(state, now) or UNDER_LIMIT

    def assess(self, state: Any, now: float, lease: str = "", amount: int = 1) -> Hit:
        """One slot per request, whatever its ``amount``."""
        return self._refusal(state, now) or admitted(0.0, (lease, now + self.lease))

    def commit(self, state: Any, hit: Hit) -> None:
        record: LeaseState = state  # each method's state is read as its type (Algorithm)
        lease, ends = hit.proposal
        record.held[lease] = ends

    def hit(self, state: Any, now: float, threshold: float, amount: int = 1) -> Hit:
        """Taken at once, as for a request of one rule, under a lease id no
        report knows: such a slot ends with its lease."""
        hit = self.assess(state, now, f"anonymous-{next(_anonymous)}")
        if not hit.over_limit:
            self.commit(state, hit)
        return hit

    @staticmethod
    def release(state: LeaseState, lease: str) -> bool:
        """Give the slot of ``lease`` back; False when it was not held (its
        lease ended, or it was never taken)."""
        return state.held.pop(lease, None) is not None

    def quota(self, state: LeaseState, now: float, threshold: float) -> Quota:
        """Slots free, the time until the shortest lease ends (0 with none
        held), and the lease as the window of the draft RateLimit fields."""
        live = [ends for ends in state.held.values() if ends > now]
        return Quota(max(0, self.limit - len(live)), (min(live) - now if live else 0.0), self.lease)

    def expires_at(self, state: Any) -> float:
        record: LeaseState = state
        return max(record.held.values(), default=NO_PENALTY)

    def longest_hold(self) -> float:
        return 0.0

    def redis_args(self, threshold: float, lease: str = "") -> tuple[str, ...]:
        """CONCURRENT, concurrent.lua's {limit, lease}, the request's lease
        id, and '' for the width of a window's arguments."""
        return (CONCURRENT, *self._lua_limit, lease, "", "")

    def peak_period(self) -> float:
        """A request is in flight for its lease at most: after that it counts no more."""
        return self.lease

    def sustained_rate(self) -> float:
        """None: requests in flight at once, not a rate."""
        return 0.0

    def describe(self) -> str:
        return f"{self.limit} concurrent, lease {format_duration(self.lease)}"


# A slot's lease, unless the rule sets one: longer than a request normally
# runs behind the shipped proxies (nginx waits up to 60 s between two reads
# from the application, Envoy 15 s for a whole response), so a running
# request keeps its slot, while a slot whose report is lost comes back
# within a minute.
DEFAULT_LEASE = 60.0
# The longest lease: a response report comes with a token that is accepted
# for 10 minutes (sidecar.pending), so a longer lease could only keep a
# slot whose report is refused.
MAX_LEASE = 600.0


class ConcurrentLimit(LimitModel):
    tag: ClassVar[str] = "concurrent-requests"
    refused_settings: ClassVar[Mapping[str, str]] = {
        "count_on": "a concurrent limit counts requests in flight, which their responses end; "
                    "count_on needs a requests or score limit",
        "penalty": "a concurrent limit has no penalty: it refuses only while its limit is in flight",
    }
    refused_actions: ClassVar[Mapping[str, str]] = {
        "ban": "a concurrent limit refuses requests, it bans no one (parallel requests are as often "
               "a browser or a NAT as abuse); use block, or a requests rule with action: ban",
        "challenge": "a solved challenge would lift a concurrent limit for its client; use block or log",
    }
    concurrent: int = Field(ge=1)
    lease: Duration = DEFAULT_LEASE

    @field_validator("lease")
    @classmethod
    def _range(cls, value: float) -> float:
        if not 1 <= value <= MAX_LEASE:
            raise ValueError("a lease lasts from 1s to 10m (a response report is accepted for 10 minutes)")
        return value

    def check_rule(self, rule: Rule) -> None:
        if rule.reset_on is not None:
            raise ValueError("a concurrent limit is given back by each response already; reset_on "
                             "needs a requests, score or bucket limit")


@registry.limit(ConcurrentLimit, field="concurrent", threshold="concurrent", order=5)
def _concurrent(limit: ConcurrentLimit, penalty: float | None) -> RuleLimit:
    """Its header limit is N; it has no penalty (the rules file allows none)."""
    return RuleLimit(ConcurrencyLimiter(limit.concurrent, limit.lease), limit.concurrent, None)
