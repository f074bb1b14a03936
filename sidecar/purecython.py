"""The two class decorators of Cython's pure-Python mode that the limiters'
states use, as no-ops, for the pure-Python core where Cython is not
installed (it is needed only to build the compiled core). Compiled, the
states are extension types the garbage collector does not track: nothing
they hold can lead back to them."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def cclass(cls: T) -> T:
    return cls


def no_gc(cls: T) -> T:
    return cls
