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
algorithm is its module, its Lua and its tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from sidecar.limiters.base import Limiter

# One shared float for every state never penalized: -math.inf would make one
# per state, 24 bytes of each tracked key.
NO_PENALTY = -math.inf


# The limiters' states are slotted classes written out rather than
# dataclasses: the compiled core makes extension types of them (each
# limiter's .pxd), which a slotted dataclass cannot become. They print and
# compare as the dataclasses they were, through these two.

def record_repr(record: Any) -> str:
    """``WindowState(window=3, previous=0, ...)``: a record's fields in order."""
    fields = ", ".join(f"{name}={getattr(record, name)!r}" for name in record.__match_args__)
    return f"{type(record).__qualname__}({fields})"


def record_equal(record: Any, other: Any) -> bool:
    """Records of the same class with equal fields, in order, are equal."""
    if other.__class__ is not record.__class__:
        unlike: bool = NotImplemented  # the other operand's __eq__ is asked
        return unlike
    names = record.__match_args__
    return tuple(getattr(record, name) for name in names) == tuple(getattr(other, name) for name in names)


class Quota(NamedTuple):
    """What a key has left: requests (or tokens) remaining before the
    limit, seconds until it resets, and the window it is counted over, as
    the RateLimit headers say them."""

    remaining: int
    reset: float
    window: float


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


UNDER_LIMIT = Hit(False)


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
