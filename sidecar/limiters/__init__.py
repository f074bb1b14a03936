"""Counting algorithms: the arithmetic of one key, with time as a parameter.

A limiter owns no storage. It is handed the key's state (or None for a key
never seen), the current time and the effective threshold, and answers
whether the request is over limit. An over-limit request changes nothing
(the nginx discipline: a rejection has no side effects); a counted request
mutates the state in place.

Each algorithm is a module of this package that registers, under the tag of
its kind of ``limit:`` in the rules file (``config.Limit``), how a rule's
limit becomes its limiter, and which of the Redis scripts in ``sidecar/lua``
run it. Rules, the stores and replay ask the limiter (the ``Limiter``
protocol of ``sidecar.state``) and never its type, so adding an algorithm
touches its module, its Lua and its tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:
    from sidecar import config
    from sidecar.limiters.base import Limiter

# One shared float for every state never penalized: -math.inf would make one
# per state, 24 bytes of each tracked key.
NO_PENALTY = -math.inf


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


class _Tagged(Protocol):
    tag: ClassVar[str]


Model = TypeVar("Model", bound=_Tagged)
Builder = Callable[[Model, float | None], RuleLimit]

_BUILDERS: dict[str, Callable[[Any, float | None], RuleLimit]] = {}
_LUA: list[str] = []


def register(model: type[Model], lua: tuple[str, ...]) -> Callable[[Builder[Model]], Builder[Model]]:
    """Make the decorated function build the limiter of ``model``'s limits.

    ``lua`` names the files of ``sidecar/lua`` that run its limiter, the
    shared ones it builds on first: the Redis store loads every algorithm's
    in that order, each file once, so the order of registration is free.
    """

    def add(build: Builder[Model]) -> Builder[Model]:
        _BUILDERS[model.tag] = build
        _LUA.extend(name for name in lua if name not in _LUA)
        return build

    return add


def build_limiter(limit: config.Limit, penalty: float | None) -> RuleLimit:
    """A rule's limit as its limiter; ``penalty`` is the rule's, None when it sets none."""
    return _BUILDERS[limit.tag](limit, penalty)


def lua_libraries() -> tuple[str, ...]:
    """The files of ``sidecar/lua`` that every registered algorithm needs, in load order."""
    return tuple(_LUA)


# Each algorithm registers itself when its module is imported; importing them
# here, once the names above exist, makes the registry whole for every caller.
from sidecar.limiters import concurrent, leaky, token, window  # noqa: E402,F401
