"""The limiters' records: how they print and compare, the answer a limiter
gives for one key (``Hit``), made for every request a bucket admits, and
the limiters' common base (``Algorithm``).

The records are slotted classes written out rather than dataclasses: the
compiled core makes extension types of them (their .pxd files), which a
slotted dataclass cannot become. They print and compare as the dataclasses
they were, through ``record_repr`` and ``record_equal``.
"""

from __future__ import annotations

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

import importlib
from typing import Any


def place_in_lines(kind: type) -> None:
    """Compiled, a state's type: each instance in one line of the CPU's
    cache, from blocks kept for the next instances (``sidecar._slab``);
    called by each limiter module right after the class, before any
    instance exists. As Python: nothing (Python's allocator)."""
    if cython.compiled:
        importlib.import_module("sidecar._slab").place_in_lines(kind)


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


@cython.freelist(16)
@cython.no_gc  # its proposal is a tuple of numbers or of a lease and a time
@cython.cclass
class Hit:
    """The answer for one key: over limit or not, and the time to wait (a
    record: see ``record_repr``).

    ``delay`` is how long an admitted request must be held (leaky bucket);
    ``proposal`` is a bucket's new state, applied by ``commit`` only if the
    whole request is admitted.
    """

    __slots__ = __match_args__ = ("over_limit", "retry_after", "delay", "proposal")

    def __init__(self, over_limit: bool, retry_after: float = 0.0, delay: float = 0.0,
                 proposal: Any = None) -> None:
        self.over_limit = over_limit
        self.retry_after = retry_after
        self.delay = delay
        self.proposal = proposal

    def __repr__(self) -> str:
        return record_repr(self)

    def __eq__(self, other: object) -> bool:
        return record_equal(self, other)

    __hash__ = None  # type: ignore[assignment]  # as a dataclass's that is not frozen


def admitted(delay: float, proposal: Any) -> Hit:
    """A bucket's ``Hit`` for a request it admits: what it proposes, and
    the delay (made for every admitted request; compiled, without the
    call of the class)."""
    hit = cython.cast(Hit, Hit.__new__(Hit))  # compiled: no type test
    hit.over_limit = False
    hit.retry_after = 0.0
    hit.delay = delay
    hit.proposal = proposal
    return hit


def refused(retry_after: float) -> Hit:
    """The ``Hit`` of a request over limit, to retry after ``retry_after``
    seconds (compiled, without the call of the class)."""
    hit = cython.cast(Hit, Hit.__new__(Hit))  # compiled: no type test
    hit.over_limit = True
    hit.retry_after = retry_after
    hit.delay = 0.0
    hit.proposal = None
    return hit


UNDER_LIMIT = Hit(False)


@cython.cclass
class Algorithm:
    """What every limiter is made from: the methods of the ``Limiter``
    protocol (``sidecar.limiters.base``) that a check calls. Compiled, the
    policy and the state map call them in C through this type, where a
    method looked up by name is a call of a Python object with its
    arguments boxed. A limiter overrides those it answers (a window counter
    no ``assess``); each takes its state as any object, as declared here,
    and reads it as its own type. ``RuleLimit`` takes no other limiter."""

    __slots__ = ()

    def new_state(self) -> Any:
        """A state for a key never seen (see ``Limiter.new_state``)."""
        raise NotImplementedError

    def peek(self, state: Any, now: float) -> Hit:
        raise NotImplementedError

    def hit(self, state: Any, now: float, threshold: float, amount: int = 1) -> Hit:
        raise NotImplementedError

    def assess(self, state: Any, now: float, lease: str = "", amount: int = 1) -> Hit:
        """A deferred limiter's (see ``DeferredLimiter``)."""
        raise NotImplementedError

    def commit(self, state: Any, hit: Hit) -> None:
        """A deferred limiter's (see ``DeferredLimiter``)."""
        raise NotImplementedError

    def expires_at(self, state: Any) -> float:
        raise NotImplementedError
