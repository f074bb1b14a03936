"""Counting algorithms: the arithmetic of one key, with time as a parameter.

A limiter owns no storage. It is handed the key's state (or None for a key
never seen), the current time and the effective threshold, and answers
whether the request is over limit. An over-limit request changes nothing
(the nginx discipline: a rejection has no side effects); a counted request
mutates the state in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sidecar.config import Rate

if TYPE_CHECKING:
    from sidecar.state import DeferredLimiter

# One shared float for every state never penalized: -math.inf would make one
# per state, 24 bytes of each tracked key.
NO_PENALTY = -math.inf


@dataclass(slots=True)
class WindowState:
    """Two counters per key (SPEC §2) plus the end of the penalty period."""

    window: int  # index of the current window: floor(now / period)
    previous: int
    current: int
    penalty_until: float
    # The limiter the state belongs to: a reload may give the key another.
    limiter: Any = None


@dataclass(slots=True)  # not frozen: made per bucket hit, and frozen __init__ is slow
class Hit:
    """The answer for one key: over limit or not, and the time to wait.

    ``delay`` is how long an admitted request must be held (leaky bucket);
    ``proposal`` is a bucket's new state, applied by ``commit`` only if the
    whole request is admitted.
    """

    over_limit: bool
    retry_after: float = 0.0
    delay: float = 0.0
    proposal: Any = None


ALLOWED = Hit(False)


class WindowCounter:
    """Sliding window counter (default) or fixed window, with a penalty period.

    Requests 1..M are counted; the one that brings the estimate to M starts
    the penalty at once (not at a window boundary) and is itself allowed;
    every request in the penalty is over limit and not counted (SPEC §2).
    Windows are aligned to multiples of the period for all keys.

    A score budget (SPEC §7) is the same counter fed with amounts (the
    upstream's score) instead of ones, entering the penalty when the total
    *exceeds* the budget rather than when it reaches it.
    """

    __slots__ = ("threshold", "period", "penalty", "sliding", "exceed")
    deferred = False  # counts at once; buckets commit only admitted requests
    holds = False  # never asks to hold a request

    def __init__(self, threshold: int, period: float, penalty: float, sliding: bool = True,
                 exceed: bool = False) -> None:
        # Threshold 0 behaves as 1, as in the reference system.
        self.threshold = max(threshold, 1)
        self.period = period
        self.penalty = penalty
        self.sliding = sliding
        self.exceed = exceed

    def new_state(self) -> WindowState:
        return WindowState(window=-2, previous=0, current=0, penalty_until=NO_PENALTY, limiter=self)

    def peek(self, state: WindowState, now: float) -> Hit:
        """Is the key in its penalty? Counts nothing (response-phase rules
        at request time, SPEC §8)."""
        if now < state.penalty_until:
            return Hit(True, state.penalty_until - now)
        return ALLOWED

    def hit(self, state: WindowState, now: float, threshold: float, amount: int = 1) -> Hit:
        if now < state.penalty_until:
            return Hit(True, state.penalty_until - now)
        window = int(now // self.period)
        if window != state.window:
            state.previous = state.current if window == state.window + 1 else 0
            state.current = 0
            state.window = window
        state.current += amount
        estimate = float(state.current)
        if self.sliding and state.previous:
            elapsed = now - window * self.period
            estimate += state.previous * (self.period - elapsed) / self.period
        # Compared as a real number, never rounded (SPEC §2).
        if estimate > threshold if self.exceed else estimate >= threshold:
            state.penalty_until = now + self.penalty
        return ALLOWED

    def quota(self, state: WindowState, now: float, threshold: float) -> tuple[int, float, float]:
        """(requests still allowed, seconds until that resets, window) for
        the draft RateLimit header fields; the request that reaches the
        threshold is itself allowed."""
        if now < state.penalty_until:
            return 0, state.penalty_until - now, self.period
        window = int(now // self.period)
        elapsed = now - window * self.period
        if window == state.window:
            current, previous = state.current, state.previous
        else:
            current, previous = 0, state.current if window == state.window + 1 else 0
        estimate = current + (previous * (self.period - elapsed) / self.period if self.sliding else 0)
        return max(0, math.ceil(threshold - estimate)), self.period - elapsed, self.period

    def expires_at(self, state: WindowState) -> float:
        """When the state stops mattering: its window no longer weighs in
        and its penalty is over."""
        horizon = (state.window + (2 if self.sliding else 1)) * self.period
        return max(horizon, state.penalty_until)


def _in_penalty(state: Any, now: float) -> Hit | None:
    return Hit(True, state.penalty_until - now) if now < state.penalty_until else None


def _refuse(state: Any, now: float, penalty: float | None, wait: float) -> Hit:
    """A bucket's refusal changes nothing, unless the rule sets an explicit
    penalty, which then starts (SPEC §2)."""
    if penalty is None:
        return Hit(True, wait)
    state.penalty_until = now + penalty
    return Hit(True, penalty)


class _Bucket:
    """What both buckets share: charged at once when asked to ``hit``
    (their ``assess`` then ``commit``, as for a request of one rule)."""

    __slots__ = ()

    def hit(self: DeferredLimiter, state: Any, now: float, threshold: float, amount: int = 1) -> Hit:
        hit = self.assess(state, now)
        if not hit.over_limit:
            self.commit(state, hit)
        return hit


@dataclass(slots=True)
class LeakyState:
    """nginx's two numbers per key: excess in thousandths of a request and
    the time of the last accounted request in milliseconds."""

    excess: int
    last: int | None  # None: a key never seen
    penalty_until: float
    # The limiter the state belongs to: a reload may give the key another.
    limiter: Any = None


class LeakyBucket(_Bucket):
    """nginx ``limit_req`` arithmetic, integer for integer (SPEC §7).

    The rate is kept as requests per second times 1000, truncated as nginx
    truncates (10r/m is 166); time is whole milliseconds of a monotonic clock.
    A request's excess is ``excess - rate * ms / 1000 + 1000`` (integer
    division, clamped at 0; a key's first request has excess 0); it is
    rejected when the excess exceeds the burst, and otherwise held for
    ``(excess - delay) * 1000 / rate`` ms when the excess is over ``delay``
    (``nodelay``: never held). A rejection changes nothing.
    """

    __slots__ = ("rate", "burst", "delay", "penalty", "holds")
    deferred = True

    def __init__(self, rate: Rate, burst: int, delay: int | None, penalty: float | None) -> None:
        self.rate = rate.count * 1000 // rate.period
        self.burst = burst * 1000
        # nodelay (delay None) admits the whole burst at once.
        self.delay = burst * 1000 if delay is None else delay * 1000
        self.penalty = penalty
        self.holds = self.longest_hold() > 0  # may ask to hold a request

    def longest_hold(self) -> float:
        """Seconds the longest-held request waits: the excess is at most
        the burst. The proxy's timeout for Sluice must be longer."""
        return max(0, self.burst - self.delay) * 1000 // self.rate / 1000

    def new_state(self) -> LeakyState:
        return LeakyState(0, None, NO_PENALTY, self)

    def peek(self, state: LeakyState, now: float) -> Hit:
        return _in_penalty(state, now) or ALLOWED

    def assess(self, state: LeakyState, now: float) -> Hit:
        held = _in_penalty(state, now)
        if held is not None:
            return held
        now_ms = int(now * 1000 + 1e-6)  # whole ms; the epsilon absorbs float error
        excess = 0 if state.last is None else self._excess(state, now_ms)
        if excess > self.burst:
            return _refuse(state, now, self.penalty, self._wait_ms(state, now_ms) / 1000)
        delay_ms = 0 if excess <= self.delay else (excess - self.delay) * 1000 // self.rate
        return Hit(False, delay=delay_ms / 1000, proposal=(excess, now_ms))

    def _excess(self, state: LeakyState, now_ms: int) -> int:
        assert state.last is not None
        elapsed = max(0, now_ms - state.last)
        return max(0, state.excess - self.rate * elapsed // 1000 + 1000)

    def _wait_ms(self, state: LeakyState, now_ms: int) -> int:
        """Milliseconds until a request would fit within the burst again."""
        assert state.last is not None
        needed = state.excess + 1000 - self.burst  # thousandths to drain
        # The smallest ms with rate * ms // 1000 >= needed.
        return max(0, state.last - (-needed * 1000 // self.rate) - now_ms)

    @staticmethod
    def commit(state: LeakyState, hit: Hit) -> None:
        state.excess, state.last = hit.proposal

    def quota(self, state: LeakyState, now: float, threshold: float) -> tuple[int, float, float]:
        """Requests that would still be admitted now, the time to drain, and
        the time the whole burst takes to drain."""
        full_drain = (self.burst + 1000) / self.rate
        if now < state.penalty_until:
            return 0, state.penalty_until - now, full_drain
        if state.last is None:
            return self.burst // 1000 + 1, 0.0, full_drain
        drained = max(0, state.excess - self.rate * max(0, int(now * 1000 + 1e-6) - state.last) // 1000)
        return max(0, (self.burst - drained) // 1000), drained / self.rate, full_drain

    def expires_at(self, state: LeakyState) -> float:
        if state.last is None:
            return state.penalty_until
        # Like nginx, keep a key at least 60 s after its last request, and
        # until its excess has drained: a forgotten key's next request would
        # start from excess 0 instead of 1000.
        drained = state.last + state.excess * 1000 // self.rate
        return max((max(drained, state.last + 60_000)) / 1000, state.penalty_until)


@dataclass(slots=True)
class TokenState:
    tokens: float
    last: float | None
    penalty_until: float
    # The limiter the state belongs to: a reload may give the key another.
    limiter: Any = None


class TokenBucket(_Bucket):
    """Token bucket (SPEC §7): starts full, refills on demand as
    ``min(B, tokens + r * elapsed)``, admits only when the cost fits, then
    deducts it. Rejected work consumes nothing."""

    __slots__ = ("capacity", "refill", "cost", "penalty")
    deferred = True
    holds = False

    def __init__(self, capacity: int, refill: float, cost: int, penalty: float | None) -> None:
        self.capacity = capacity
        self.refill = refill  # tokens per second
        self.cost = cost
        self.penalty = penalty

    def new_state(self) -> TokenState:
        return TokenState(float(self.capacity), None, NO_PENALTY, self)

    def peek(self, state: TokenState, now: float) -> Hit:
        return _in_penalty(state, now) or ALLOWED

    def tokens_at(self, state: TokenState, now: float) -> float:
        if state.last is None:
            return state.tokens
        return min(float(self.capacity), state.tokens + self.refill * max(0.0, now - state.last))

    def assess(self, state: TokenState, now: float) -> Hit:
        held = _in_penalty(state, now)
        if held is not None:
            return held
        tokens = self.tokens_at(state, now)
        if self.cost > tokens:
            return _refuse(state, now, self.penalty, (self.cost - tokens) / self.refill)
        return Hit(False, proposal=(tokens - self.cost, now))

    @staticmethod
    def commit(state: TokenState, hit: Hit) -> None:
        state.tokens, state.last = hit.proposal

    def quota(self, state: TokenState, now: float, threshold: float) -> tuple[int, float, float]:
        """Requests the tokens now cover, and the time until the bucket is full."""
        if now < state.penalty_until:
            return 0, state.penalty_until - now, self.capacity / self.refill
        tokens = self.tokens_at(state, now)
        return int(tokens // self.cost), (self.capacity - tokens) / self.refill, self.capacity / self.refill

    def expires_at(self, state: TokenState) -> float:
        if state.last is None:
            return state.penalty_until
        full_at = state.last + (self.capacity - state.tokens) / self.refill
        return max(full_at, state.penalty_until)
