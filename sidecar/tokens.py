"""The node's signed tokens, all from one secret: pending response counts
(sidecar.pending) and challenges with their credentials (sidecar.challenge)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.challenge import Challenges
from sidecar.pending import PendingTokens


@dataclass(frozen=True, slots=True)
class Tokens:
    pending: PendingTokens
    challenges: Challenges

    @classmethod
    def from_secret(cls, secret: bytes | None, wall_clock: Callable[[], float] = time.time) -> Tokens:
        # Without a configured secret, a random one: tokens then do not
        # outlive this process, which costs at most the counts in flight,
        # and challenge credentials are asked for again after a restart.
        key = secret or os.urandom(32)
        return cls(PendingTokens(key, wall_clock=wall_clock), Challenges(key, wall_clock=wall_clock))
