"""Window counters and score budgets; in Redis, ``window.lua``.

Its kinds of limit: ``requests`` per period (``window-limit``), a ``score``
budget per period (``score-budget``); and the Rate Limit Service's
``fixed`` and ``sliding`` windows.
"""

from __future__ import annotations

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

import math
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from sidecar.config import Duration, LimitModel, format_duration
from sidecar.limiters import NO_PENALTY, Quota, RuleLimit, lua_number, registry
from sidecar.limiters.records import UNDER_LIMIT, Algorithm, Hit, place_in_lines, record_equal, record_repr, refused

WINDOW = registry.lua_kind("W", "window")


@cython.no_gc  # nothing a state holds leads back to it
@cython.cclass
class WindowState:
    """Two counters per key plus the end of the penalty period (a record:
    see ``sidecar.limiters.records.record_repr``)."""

    __match_args__ = ("window", "previous", "current", "penalty_until", "limiter")
    __slots__ = (*__match_args__, "used")

    def __init__(self, window: int, previous: int, current: int, penalty_until: float, limiter: Any = None) -> None:
        self.window = window  # index of the current window: floor(now / period)
        self.previous = previous
        self.current = current
        self.penalty_until = penalty_until
        # The limiter the state belongs to: a reload may give the key another.
        self.limiter = limiter
        self.used = False  # read since the table last passed it over (sidecar.bounded.StateMap)

    def __repr__(self) -> str:
        return record_repr(self)

    def __eq__(self, other: object) -> bool:
        return record_equal(self, other)

    __hash__ = None  # type: ignore[assignment]  # changed in place, as a dataclass's


place_in_lines(WindowState)  # each instance in one line of the cache, compiled


class WindowCounter(Algorithm):
    """Sliding window counter (default) or fixed window, with a penalty period.

    Requests 1..M are counted; the one that brings the estimate to M starts
    the penalty at once (not at a window boundary) and is itself allowed;
    every request in the penalty is over limit and not counted.
    Windows are aligned to multiples of the period for all keys.

    A score budget is the same counter fed with amounts (the
    upstream's score) instead of ones, entering the penalty when the total
    *exceeds* the budget rather than when it reaches it.

    With ``fit`` (the Rate Limit Service's descriptors), a request of
    ``amount`` is admitted only when the estimate with it stays within the
    threshold, and a refusal is not counted: the first ``threshold``
    requests of a window pass and the next are refused until the estimate
    falls, with no penalty unless one is set (then a refusal starts it).
    """

    __slots__ = ("threshold", "period", "penalty", "sliding", "exceed", "fit", "_lua_limit", "_lua_args",
                 "_window")
    deferred = False  # counts at once; buckets commit only admitted requests
    holds = False  # never asks to hold a request
    scalable = True  # the check's threshold is the limit: overrides may scale it
    leases = False  # takes no slot

    def __init__(self, threshold: int, period: float, penalty: float, sliding: bool = True,
                 exceed: bool = False, fit: bool = False) -> None:
        # Threshold 0 behaves as 1, as in the reference system; a fitting
        # counter's 0 refuses everything.
        self.threshold = threshold if fit else max(threshold, 1)
        self.period = period
        self.penalty = penalty
        self.sliding = sliding
        self.exceed = exceed
        self.fit = fit
        # window.lua's limit after the threshold, and the whole arguments for
        # the threshold of the rule itself: made once, not per request. The
        # last says when the threshold is crossed: reached (0), exceeded (1)
        # or the request would not fit (2).
        self._lua_limit = (lua_number(period), lua_number(penalty), "1" if sliding else "0",
                           "2" if fit else "1" if exceed else "0")
        self._lua_args = (WINDOW, lua_number(self.threshold)) + self._lua_limit
        # The current window's index, one int object that the states counted
        # in it share (a new int is 32 bytes of every key under rotation);
        # the pure core's only.
        self._window = -2

    def new_state(self) -> WindowState:
        # Made for every new key: compiled, its fields filled without the
        # call of the class (as sidecar.limiters.records.admitted makes a Hit).
        state = cython.cast(WindowState, WindowState.__new__(WindowState))  # compiled: no type test
        state.window = -2
        state.previous = 0
        state.current = 0
        state.penalty_until = NO_PENALTY
        state.limiter = self
        state.used = False
        return state

    def peek(self, state: Any, now: float) -> Hit:
        """Is the key in its penalty? Counts nothing (response-phase rules
        at request time)."""
        record: WindowState = state  # each method's state is read as its type (Algorithm)
        if now < record.penalty_until:
            return refused(record.penalty_until - now)
        return UNDER_LIMIT

    def hit(self, state: Any, now: float, threshold: float, amount: int = 1) -> Hit:
        record: WindowState = state
        if now < record.penalty_until:
            return refused(record.penalty_until - now)
        window = int(now // self.period)
        if window != record.window:
            if not cython.compiled:  # compiled, a state's window is a C integer: nothing to share
                if window == self._window:
                    window = self._window
                else:
                    self._window = window
            record.previous = record.current if window == record.window + 1 else 0
            record.current = 0
            record.window = window
        if self.fit:
            return self._fit(record, now, threshold, amount)
        added: int = amount  # compiled: a C integer, added to the count in C
        record.current += added
        estimate = float(record.current)
        if self.sliding and record.previous:
            elapsed = now - window * self.period
            estimate += record.previous * (self.period - elapsed) / self.period
        # Compared as a real number, never rounded.
        if estimate > threshold if self.exceed else estimate >= threshold:
            record.penalty_until = now + self.penalty
        return UNDER_LIMIT

    def _fit(self, state: WindowState, now: float, threshold: float, amount: int) -> Hit:
        """``hit`` of a fitting counter, in the key's current window."""
        elapsed = now - state.window * self.period
        previous = state.previous * (self.period - elapsed) / self.period if self.sliding else 0.0
        if state.current + amount + previous <= threshold:
            state.current += amount
            return UNDER_LIMIT
        if self.penalty > 0:
            state.penalty_until = now + self.penalty
            return refused(self.penalty)
        return refused(self._fits_in(state, elapsed, threshold, amount))

    def _fits_in(self, state: WindowState, elapsed: float, threshold: float, amount: int) -> float:
        """Seconds until ``amount`` would fit: this window's count weighs in
        whole until the window ends, then fades over the next one."""
        period = self.period
        if not self.sliding or amount > threshold:
            return period - elapsed
        room = threshold - amount - state.current
        if room >= 0 and state.previous:  # the previous window fades enough within this one
            return max(0.0, period - room * period / state.previous - elapsed)
        room = threshold - amount
        return period - elapsed + (period - room * period / state.current if state.current else 0.0)

    def quota(self, state: WindowState, now: float, threshold: float) -> Quota:
        """(requests still allowed, seconds until that resets, window) for
        the draft RateLimit header fields; the request that reaches the
        threshold is itself allowed."""
        if now < state.penalty_until:
            return Quota(0, state.penalty_until - now, self.period)
        window = int(now // self.period)
        elapsed = now - window * self.period
        if window == state.window:
            current, previous = state.current, state.previous
        else:
            current, previous = 0, state.current if window == state.window + 1 else 0
        estimate = current + (previous * (self.period - elapsed) / self.period if self.sliding else 0)
        if self.fit:  # requests that still fit whole
            return Quota(max(0, math.floor(threshold - estimate)), self.period - elapsed, self.period)
        return Quota(max(0, math.ceil(threshold - estimate)), self.period - elapsed, self.period)

    def expires_at(self, state: Any) -> float:
        """When the state stops mattering: its window no longer weighs in
        and its penalty is over."""
        record: WindowState = state
        horizon = (record.window + (2 if self.sliding else 1)) * self.period
        penalty_until = record.penalty_until
        return horizon if horizon > penalty_until else penalty_until

    def longest_hold(self) -> float:
        return 0.0

    def redis_args(self, threshold: float, lease: str = "") -> tuple[str, ...]:
        """WINDOW and window.lua's limit ``{threshold, period, penalty,
        sliding, exceed}``; only a threshold an override scaled is formatted
        here."""
        if threshold == self.threshold:
            return self._lua_args
        return (WINDOW, lua_number(threshold)) + self._lua_limit

    def peak_period(self) -> float:
        return self.period

    def sustained_rate(self) -> float:
        """The threshold per period."""
        return float(self.threshold) / self.period

    def describe(self) -> str:
        if self.exceed:
            text = f"score {self.threshold} per {format_duration(self.period)}"
        else:
            kind = "sliding" if self.sliding else "fixed"
            text = f"{self.threshold} per {format_duration(self.period)} ({kind} window)"
        if self.penalty != self.period:
            text += f", penalty {format_duration(self.penalty)}"
        return text


class WindowLimit(LimitModel):
    tag: ClassVar[str] = "window-limit"
    requests: int = Field(ge=0)
    per: Duration
    window: Literal["sliding", "fixed"] = "sliding"


class ScoreLimit(LimitModel):
    tag: ClassVar[str] = "score-budget"
    score: int = Field(ge=1)
    per: Duration
    header: str = Field(min_length=1)

    @field_validator("header")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.strip().lower()


@registry.limit(WindowLimit, field="requests", needs="per", threshold="requests", order=1)
def _requests(limit: WindowLimit, penalty: float | None) -> RuleLimit:
    """Without a penalty of its own, a counter is penalized for its period."""
    penalty = limit.per if penalty is None else penalty
    counter = WindowCounter(limit.requests, limit.per, penalty, sliding=limit.window == "sliding")
    return RuleLimit(counter, counter.threshold, penalty)


@registry.limit(ScoreLimit, field="score", needs="per, header", threshold="score", order=2)
def _score(limit: ScoreLimit, penalty: float | None) -> RuleLimit:
    """The same counter over the upstream's scores, penalized the same way."""
    penalty = limit.per if penalty is None else penalty
    return RuleLimit(WindowCounter(limit.score, limit.per, penalty, exceed=True), limit.score, penalty,
                     score_header=limit.header)


def _fitting(requests: int, period: float, penalty: float | None, sliding: bool) -> RuleLimit:
    """A descriptor's window admits what fits whole; no penalty unless it sets one."""
    counter = WindowCounter(requests, period, penalty or 0.0, sliding=sliding, fit=True)
    return RuleLimit(counter, requests, penalty)


@registry.rls_algorithm("fixed", burst=False, order=1)
def _fixed(requests: int, period: float, burst: int | None, penalty: float | None) -> RuleLimit:
    return _fitting(requests, period, penalty, sliding=False)


@registry.rls_algorithm("sliding", burst=False, order=2)
def _sliding(requests: int, period: float, burst: int | None, penalty: float | None) -> RuleLimit:
    return _fitting(requests, period, penalty, sliding=True)
