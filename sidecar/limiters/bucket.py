"""What the two buckets share; in Redis, ``buckets.lua``.

A bucket is deferred: ``assess`` says what a request would do and
``commit`` applies it only when the whole request is admitted. Its limit is
its parameters, never the check's threshold, so overrides cannot scale it,
and its Redis arguments are made whole at construction. It has no penalty
unless the rule sets one.
"""

from __future__ import annotations

from typing import Any

from sidecar.config import LimitModel, Rule, format_duration
from sidecar.limiters import lua_number
from sidecar.limiters.records import UNDER_LIMIT, Algorithm, Hit, refused
from sidecar.limiters.registry import LuaKind


class BucketLimit(LimitModel):
    """What the buckets' kinds of ``limit:`` share."""

    def check_rule(self, rule: Rule) -> None:
        if rule.count_on is not None:
            raise ValueError("count_on works with requests and score limits, not with buckets")


def in_penalty(penalty_until: float, now: float) -> Hit | None:
    """The refusal of a key whose explicit penalty (its state's
    ``penalty_until``) lasts past ``now``, else None. It takes the time,
    not the state: a bucket reads its own state's field, in C when
    compiled."""
    return refused(penalty_until - now) if now < penalty_until else None


class Bucket(Algorithm):
    """The parts of a bucket that are not its arithmetic."""

    __slots__ = ("penalty", "per_second", "_lua_args")
    deferred = True
    scalable = False
    leases = False

    def __init__(self, penalty: float | None, per_second: float, kind: LuaKind,
                 parameters: tuple[str, str, str]) -> None:
        self.penalty = penalty
        self.per_second = per_second  # requests (tokens) given back per second
        # buckets.lua's {kind, three parameters, penalty ('' for none)}, and
        # '' for the width of a window's arguments.
        self._lua_args = (kind, *parameters, "" if penalty is None else lua_number(penalty), "")

    def refuse(self, state: Any, now: float, wait: float) -> Hit:
        """A bucket's refusal changes nothing, unless the rule sets an
        explicit penalty, which then starts."""
        if self.penalty is None:
            return refused(wait)
        state.penalty_until = now + self.penalty
        return refused(self.penalty)

    def peek(self, state: Any, now: float) -> Hit:
        return in_penalty(state.penalty_until, now) or UNDER_LIMIT

    def hit(self, state: Any, now: float, threshold: float, amount: int = 1) -> Hit:
        """Charged at once: ``assess`` then ``commit``, as for a request of one rule."""
        hit = self.assess(state, now)
        if not hit.over_limit:
            self.commit(state, hit)
        return hit

    def longest_hold(self) -> float:
        return 0.0

    def redis_args(self, threshold: float, lease: str = "") -> tuple[str, ...]:
        return self._lua_args

    def peak_period(self) -> float:
        """A second, or a minute when the bucket gives back less than one per second."""
        return 1.0 if self.per_second >= 1 else 60.0

    def sustained_rate(self) -> float:
        """What the bucket gives back a second."""
        return self.per_second

    def with_penalty(self, text: str) -> str:
        """A description, and the penalty when the rule sets one."""
        return text if self.penalty is None else f"{text}, penalty {format_duration(self.penalty)}"
