"""What every counting algorithm answers: the ``Limiter`` protocol that the
algorithms of this package implement, and that rules, the stores, the policy
(``sidecar.policy``) and replay ask, never an algorithm's type."""

from __future__ import annotations

from typing import Any, Protocol, TypeGuard

from sidecar.limiters import Hit, Quota


class Limiter(Protocol):
    """What every algorithm answers. Window counters ``hit`` at once;
    buckets and concurrency slots are ``deferred`` (see ``DeferredLimiter``)."""

    deferred: bool
    holds: bool  # may ask to hold an admitted request (a leaky bucket's delay)
    scalable: bool  # the check's threshold is the limit, which overrides may scale
    # Takes a slot under the request's lease id, which the response report
    # gives back (a concurrency limit); its refusals can end at any moment.
    leases: bool

    def new_state(self) -> Any:
        """A state for a key never seen: a record the limiter changes in
        place, with its ``limiter`` (this one) and ``used``, False (the
        memory store's table marks a state it reads)."""
    def peek(self, state: Any, now: float) -> Hit: ...
    def hit(self, state: Any, now: float, threshold: float, amount: int = 1) -> Hit: ...
    def expires_at(self, state: Any) -> float: ...
    def quota(self, state: Any, now: float, threshold: float) -> Quota: ...

    def longest_hold(self) -> float:
        """Seconds the longest-held request may wait (0: never holds)."""

    def redis_args(self, threshold: float, lease: str = "") -> tuple[str, ...]:
        """The check's arguments for the Redis scripts: a kind ('W', 'L',
        'T', 'C') and five values, made at construction but for a threshold
        that differs from the limiter's own, and for the request's lease id
        (which only a concurrency limit reads)."""

    def peak_period(self) -> float:
        """The span over which replay measures a key's peak traffic."""

    def sustained_rate(self) -> float:
        """Requests a second a key is admitted in the long run (0: no rate,
        as a concurrency limit has none); the proxies' guard is sized from it."""

    def describe(self) -> str:
        """The limit in words, as replay reports it."""


class DeferredLimiter(Limiter, Protocol):
    """A bucket or a concurrency limit: ``assess`` a request, and ``commit``
    it only when the whole request is admitted (no bucket is
    charged when one refuses). ``lease`` is the request's lease id, under
    which a concurrency limit takes its slot."""

    def assess(self, state: Any, now: float, lease: str = "", amount: int = 1) -> Hit: ...
    def commit(self, state: Any, hit: Hit) -> None: ...


def is_deferred(limiter: Limiter) -> TypeGuard[DeferredLimiter]:
    return limiter.deferred
