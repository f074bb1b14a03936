"""Coroutines that never wait, run without an event loop.

The memory store's operations never wait, nor does the engine over it: replay
and the tests decide with them at the cost of a call (``run_at_once``), and
the HTTP service answers a check at once instead of scheduling a task, with
the engine's decision as a plain function (``waitless``).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

A = TypeVar("A")
T = TypeVar("T")


def run_at_once(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never waits (the memory store's, and
    the engine's over it), without an event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coroutine.close()
    raise RuntimeError("run_at_once: the coroutine waited; it needs an event loop")


def waitless(function: Callable[[A], Coroutine[Any, Any, T]]) -> Callable[[A], T]:
    """``function``, whose coroutines never wait, as a plain function of
    one argument: each call runs its coroutine as ``run_at_once`` does,
    written out (this runs for every check the HTTP protocol answers at
    once)."""

    def call(argument: A) -> T:
        coroutine = function(argument)
        try:
            coroutine.send(None)
        except StopIteration as done:
            result: T = done.value  # without cast(): a call less
            return result
        coroutine.close()
        raise RuntimeError("waitless: the coroutine waited; it needs an event loop")

    return call
