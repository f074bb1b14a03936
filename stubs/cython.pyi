# What mypy knows of Cython's pure-Python mode: the names the package uses,
# typed as sidecar/purecython.py defines them for the pure-Python core, so
# that a function decorated with @cython.locals keeps its signature.
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])

compiled: bool

def cclass(cls: _T) -> _T: ...
def no_gc(cls: _T) -> _T: ...
def locals(**types: object) -> Callable[[_F], _F]: ...  # noqa: A001 - Cython's name
