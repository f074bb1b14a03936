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


@dataclass(slots=True)
class WindowState:
    """Two counters per key (SPEC §2) plus the end of the penalty period."""

    window: int  # index of the current window: floor(now / period)
    previous: int
    current: int
    penalty_until: float


@dataclass(frozen=True, slots=True)
class Hit:
    """The answer for one key: over limit or not, and the time to wait."""

    over_limit: bool
    retry_after: float = 0.0


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

    def __init__(self, threshold: int, period: float, penalty: float, sliding: bool = True,
                 exceed: bool = False) -> None:
        # Threshold 0 behaves as 1, as in the reference system.
        self.threshold = max(threshold, 1)
        self.period = period
        self.penalty = penalty
        self.sliding = sliding
        self.exceed = exceed

    def new_state(self) -> WindowState:
        return WindowState(window=-2, previous=0, current=0, penalty_until=-math.inf)

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

    def expires_at(self, state: WindowState) -> float:
        """When the state stops mattering: its window no longer weighs in
        and its penalty is over."""
        horizon = (state.window + (2 if self.sliding else 1)) * self.period
        return max(horizon, state.penalty_until)
