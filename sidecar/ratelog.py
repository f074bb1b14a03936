"""Log lines that an attacker can trigger, at most once per interval.

A malformed address, a bad report datagram or a failing store can happen on
every request; logging each would let a client flood the log (and spend the
CPU it costs). The metric beside each such event counts them all; the log
says it once per interval, with how many were left unsaid since.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any


class RateLimitedLog:
    """One kind of warning, written at most every ``interval`` seconds."""

    __slots__ = ("logger", "interval", "clock", "_last", "_suppressed")

    def __init__(self, logger: logging.Logger, interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._last = -math.inf
        self._suppressed = 0

    def log(self, level: int, message: str, *args: Any, exc_info: BaseException | bool = False) -> bool:
        """Write the line if the interval has passed; True if it was written."""
        now = self.clock()
        if now - self._last < self.interval:
            self._suppressed += 1
            return False
        self._last = now
        if self._suppressed:
            message += " (%d more since the last report)"
            args = (*args, self._suppressed)
            self._suppressed = 0
        self.logger.log(level, message, *args, exc_info=exc_info)
        return True

    def warning(self, message: str, *args: Any) -> bool:
        return self.log(logging.WARNING, message, *args)

    def error(self, message: str, *args: Any, exc_info: BaseException | bool = False) -> bool:
        return self.log(logging.ERROR, message, *args, exc_info=exc_info)
