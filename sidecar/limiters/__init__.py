"""Counting algorithms: the arithmetic of one key, with time as a parameter.

A limiter owns no storage. It is handed the key's state (or None for a key
never seen), the current time and the effective threshold, and answers
whether the request is over limit. An over-limit request changes nothing
(the nginx discipline: a rejection has no side effects); a counted request
mutates the state in place.

Each algorithm is a module of this package that declares, in the registry
(``sidecar.limiters.registry``), its kinds of ``limit:`` in the rules file,
its Rate Limit Service algorithms and the Redis scripts in ``sidecar/lua``
that run it. Rules, the stores and replay ask the limiter (the ``Limiter``
protocol of ``sidecar.limiters.base``) and never its type, so adding an
algorithm is its module, its Lua and its tests. Every limiter subclasses
``Algorithm``, the base through which the compiled policy calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from sidecar.limiters.records import UNDER_LIMIT, Algorithm, Hit, admitted, record_equal, record_repr, refused

if TYPE_CHECKING:
    from sidecar.limiters.base import Limiter

__all__ = ["NO_PENALTY", "UNDER_LIMIT", "Algorithm", "Hit", "Quota", "RuleLimit", "admitted", "lua_number",
           "record_equal", "record_repr", "refused"]

# One shared float for every state never penalized: -math.inf would make one
# per state, 24 bytes of each tracked key.
NO_PENALTY = -math.inf


class Quota(NamedTuple):
    """What a key has left: requests (or tokens) remaining before the
    limit, seconds until it resets, and the window it is counted over, as
    the RateLimit headers say them."""

    remaining: int
    reset: float
    window: float


def lua_number(value: float) -> str:
    """A number as the scripts read it: the float's repr, which ``tonumber``
    turns back into the same double."""
    return repr(float(value))


@dataclass(frozen=True, slots=True)
class RuleLimit:
    """What a rule's ``limit:`` compiles to."""

    limiter: Limiter
    # X-RateLimit-Limit, and the threshold that overrides scale: threshold 0
    # reports 1; a bucket's capacity, or its burst and the request itself.
    threshold: int
    penalty: float | None  # its length; None: a bucket that sets none
    score_header: str | None = None  # a score budget counts the score this response header carries

    def __post_init__(self) -> None:
        # The policy calls a limiter through its base (compiled, in C): one
        # made of anything else is refused when the rules load, never in a check.
        if not isinstance(self.limiter, Algorithm):
            raise TypeError(f"{type(self.limiter).__qualname__} is not a limiter: a limiter subclasses "
                            "sidecar.limiters.Algorithm")
