"""The limiter of a key's state: what the policy and the state map ask of
every state they read or store, whatever its kind.

Compiled, the state's ``limiter`` is read as a field of its C struct, its
type found among the four kinds of state, where reading it as an
attribute of any object goes through CPython's generic lookup (the four
share no base class: a base class's code would run at every state's
creation and release).
"""

from __future__ import annotations

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

from typing import Any

from sidecar.limiters.concurrent import LeaseState
from sidecar.limiters.leaky import LeakyState
from sidecar.limiters.token import TokenState
from sidecar.limiters.window import WindowState


def limiter_of(state: Any) -> Any:
    """``state.limiter``."""
    if cython.compiled:
        kind = type(state)
        if kind is WindowState:
            window: WindowState = state
            return window.limiter
        if kind is TokenState:
            token: TokenState = state
            return token.limiter
        if kind is LeakyState:
            leaky: LeakyState = state
            return leaky.limiter
        if kind is LeaseState:
            lease: LeaseState = state
            return lease.limiter
    return state.limiter
