"""What the pure-Python core uses of Cython's pure-Python mode where Cython
is not installed (it is needed only to build the compiled core): the
class decorators of the limiters' states, the resolved client and the
objects made for every check (``freelist``: compiled, a few released
instances kept for the next ones), and the decorator that types a
function's locals, as no-ops; ``compiled``, False; and the C types a
module declares (``union`` of ``double`` and ``longlong``: the node's
records), as names only, used by compiled code alone. Compiled, the
states and the client are extension types the garbage collector does not
track: nothing they hold can lead back to them. ``cast`` returns its
value (compiled, a C cast: no type test)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

compiled = False  # what ``cython.compiled`` says to code that is not compiled


def cclass(cls: T) -> T:
    return cls


def no_gc(cls: T) -> T:
    return cls


def locals(**types: object) -> Callable[[F], F]:  # noqa: A001 - Cython's name
    return lambda function: function


def freelist(size: int) -> Callable[[T], T]:
    return lambda cls: cls


double = float  # C types, as names: what they type is run compiled only
longlong = int


def union(**members: object) -> object:
    return object


def declare(kind: object, value: Any = None) -> Any:
    return value


# Compiled, ``cast(kind, value)`` takes ``value`` as a ``kind`` without a
# type test. Here it returns ``value``: an empty dict's ``get`` (a class is
# never a key of it), a builtin, so that a check through the pure-Python
# core enters no frame of this module (tests/unit/test_check_trace.py).
cast: Any = {}.get

