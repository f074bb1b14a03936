"""Coroutines that never wait, run without an event loop.

The memory store's operations never wait, nor does the engine over it: replay
and the tests decide with them at the cost of a call (``run_at_once``). The
HTTP service answers a check at once with ``Engine.decide_now``, which needs
no coroutine at all.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar, cast

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
