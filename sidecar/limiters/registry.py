"""The kinds of limit Sluice knows, each declared once, by its own module.

A limiter's module declares here everything the rest of Sluice dispatches on:

- ``lua_kind``: the code its checks carry to the Redis scripts, and the Lua
  files that run it (each registers its functions under that code in the
  scripts' ``KINDS`` table; see ``sidecar/lua/window.lua``);
- ``limit``: its kind of ``limit:`` in a rules file: the pydantic model and
  its ``tag``, the field that tells the kind, how a rule's limit becomes its
  limiter, the field that holds its threshold and the smallest value that
  field takes;
- ``rls_algorithm``: the name a Rate Limit Service descriptor gives it
  (``sluice: {algorithm: NAME}``), and how a descriptor's rate becomes its
  limiter.

The rules file's schema (``sidecar.config``), replay's sweeps, the Rate
Limit Service's configurations and the Redis store read them here and name
no kind. Every module of ``sidecar.limiters`` is imported at the first
question, so a new limiter is its module, its Lua and its tests; a limiter
kept elsewhere registers itself when its module is imported.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, NewType, TypeVar

from sidecar.limiters import RuleLimit

if TYPE_CHECKING:
    from sidecar.config import LimitModel

# A check's kind in the Redis scripts: the first of its arguments, the key
# of its functions in the scripts' KINDS table.
LuaKind = NewType("LuaKind", str)
# inspect.lua's kind of a key no rule running now counts: read, never judged.
NO_LIMITER = LuaKind("X")

M = TypeVar("M", bound="LimitModel")


@dataclass(frozen=True, slots=True)
class LimitKind(Generic[M]):
    """A kind of ``limit:`` in a rules file."""

    model: type[M]  # its pydantic model, whose ``tag`` names the kind
    field: str  # the field that tells the kind: a limit with it is one of these
    needs: str  # the fields that go with it, as the error for a limit of no kind lists them
    build: Callable[[M, float | None], RuleLimit]  # a rule's limit and its penalty (None: unset)
    threshold: str  # the field that holds the threshold (what replay's --sweep changes)
    least: Callable[[M], int]  # the smallest value the rules file takes for it
    order: int  # its place where kinds are listed (errors, the schema)

    @property
    def usage(self) -> str:
        """``requests (with per)``: the kind as the error for a limit of no kind names it."""
        return f"{self.field} (with {self.needs})" if self.needs else self.field


@dataclass(frozen=True, slots=True)
class RlsAlgorithm:
    """An algorithm a Rate Limit Service descriptor may name."""

    name: str
    # requests per period, the period in seconds, the descriptor's burst
    # (None: unset) and penalty (None: unset).
    build: Callable[[int, float, int | None, float | None], RuleLimit]
    # Raises ValueError, in words for the file, for a rate it cannot count.
    check: Callable[[int, float], None]
    burst: bool  # takes a burst
    order: int


@dataclass(slots=True)
class _Registry:
    kinds: dict[str, LimitKind[Any]]  # by tag
    rls: dict[str, RlsAlgorithm]  # by name
    lua_kinds: dict[LuaKind, tuple[Traversable, ...]]  # each kind's files
    lua: list[Traversable]  # every kind's files, each once, in load order

    def copy(self) -> _Registry:
        return _Registry(dict(self.kinds), dict(self.rls), dict(self.lua_kinds), list(self.lua))


_registry = _Registry({}, {}, {}, [])
# The package's modules: not imported yet (False), being imported (None),
# imported (True).
_discovered: bool | None = False
_listeners: list[Callable[[], None]] = []


def _discover() -> None:
    """Import every module of this package: each registers its kinds."""
    global _discovered
    if _discovered is not False:
        return
    _discovered = None
    package = importlib.import_module("sidecar.limiters")
    for module in sorted(info.name for info in pkgutil.iter_modules(package.__path__)):
        importlib.import_module(f"sidecar.limiters.{module}")
    _discovered = True


def _register(add: Callable[[], None]) -> None:
    """Apply a registration. The package's own kinds are imported first,
    whoever registers first; a registration after them tells whoever built
    something from the registry (the rules file's schema) to build it again."""
    _discover()
    add()
    if _discovered:
        _changed()


def _changed() -> None:
    for listener in _listeners:
        listener()


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` after each registration that follows the package's own."""
    _listeners.append(listener)


# --------------------------------------------------------------------------
# Declaring
# --------------------------------------------------------------------------


def lua_file(name: str) -> Traversable:
    """One of Sluice's own scripts, ``sidecar/lua/NAME.lua``."""
    return resources.files("sidecar") / "lua" / f"{name}.lua"


def lua_kind(code: str, *files: str | Path | Traversable) -> LuaKind:
    """Declare a kind of check of the Redis scripts: ``code`` and the Lua
    files that run it, those it builds on first (a name is one of
    ``sidecar/lua``). Every script loads every kind's files in order, each
    once, so the order of registration is free."""
    if not code or code == NO_LIMITER or not code.isascii():
        raise ValueError(f"a Lua kind is a short ASCII code other than {NO_LIMITER!r}, got {code!r}")
    kind = LuaKind(code)
    paths = tuple(lua_file(item) if isinstance(item, str) else item for item in files)

    def add() -> None:
        known = _registry.lua_kinds.setdefault(kind, paths)
        if known != paths:
            raise ValueError(f"Lua kind {code!r} is registered already, with {', '.join(map(str, known))}")
        _registry.lua.extend(path for path in paths if path not in _registry.lua)

    _register(add)
    return kind


def limit(model: type[M], *, field: str, threshold: str, needs: str = "",
          least: Callable[[M], int] | None = None,
          order: int = 100) -> Callable[[Callable[[M, float | None], RuleLimit]],
                                        Callable[[M, float | None], RuleLimit]]:
    """Make the decorated function build the limiter of ``model``'s limits.

    ``field`` tells the kind in a rules file (and ``needs`` what goes with
    it, for the error that lists the kinds); ``threshold`` is the field that
    holds the threshold, whose smallest value is ``least`` of the limit, by
    default the bound the model's field sets (``ge``)."""

    def add(build: Callable[[M, float | None], RuleLimit]) -> Callable[[M, float | None], RuleLimit]:
        for name in (field, threshold):
            if name not in model.model_fields:
                raise ValueError(f"{model.__name__} has no field {name!r}")
        lower = least if least is not None else _least_of(model, threshold)
        kind = LimitKind(model, field, needs, build, threshold, lower, order)
        _register(lambda: _add(_registry.kinds, model.tag, kind, model.__qualname__,
                               lambda known: known.model.__qualname__))
        return build

    return add


def rls_algorithm(name: str, *, burst: bool, check: Callable[[int, float], None] | None = None,
                  order: int = 100) -> Callable[[Callable[[int, float, int | None, float | None], RuleLimit]],
                                                Callable[[int, float, int | None, float | None], RuleLimit]]:
    """Make the decorated function build the limiter of Rate Limit Service
    descriptors with ``algorithm: NAME``; ``burst``: they may set one."""

    def add(build: Callable[[int, float, int | None, float | None], RuleLimit]
            ) -> Callable[[int, float, int | None, float | None], RuleLimit]:
        algorithm = RlsAlgorithm(name, build, check or _any_rate, burst, order)
        _register(lambda: _add(_registry.rls, name, algorithm, build.__qualname__,
                               lambda known: known.build.__qualname__))
        return build

    return add


V = TypeVar("V")


def _add(table: dict[str, V], name: str, value: V, qualname: str, qualname_of: Callable[[V], str]) -> None:
    """Register ``value`` as ``name``; the same definition again (its module
    reloaded) replaces it, another one is an error."""
    known = table.get(name)
    if known is not None and qualname_of(known) != qualname:
        raise ValueError(f"{name!r} is registered already, by {qualname_of(known)}")
    table[name] = value


def _any_rate(requests: int, period: float) -> None:
    """A rate every algorithm counts."""


def _least_of(model: type[LimitModel], field: str) -> Callable[[Any], int]:
    bounds = [int(item.ge) for item in model.model_fields[field].metadata if hasattr(item, "ge")]
    least = bounds[0] if bounds else 0
    return lambda limit: least


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Registrations made within are withdrawn on leaving: a limiter loaded
    for a while (a test's)."""
    _discover()
    saved = _registry.copy()
    try:
        yield
    finally:
        _registry.kinds, _registry.rls = saved.kinds, saved.rls
        _registry.lua_kinds, _registry.lua = saved.lua_kinds, saved.lua
        _changed()


# --------------------------------------------------------------------------
# Asking
# --------------------------------------------------------------------------


def limit_kinds() -> tuple[LimitKind[Any], ...]:
    """Every kind of ``limit:``, in the order they are listed."""
    _discover()
    return tuple(sorted(_registry.kinds.values(), key=lambda kind: kind.order))


def limit_kind(tag: str) -> LimitKind[Any]:
    _discover()
    return _registry.kinds[tag]


def build_limiter(limit: LimitModel, penalty: float | None) -> RuleLimit:
    """A rule's limit as its limiter; ``penalty`` is the rule's, None when it sets none."""
    return limit_kind(limit.tag).build(limit, penalty)


def least_threshold(limit: LimitModel) -> int:
    """The smallest value the rules file takes for the limit's threshold."""
    return limit_kind(limit.tag).least(limit)


def rls_algorithms() -> tuple[RlsAlgorithm, ...]:
    """Every algorithm a descriptor may name, in the order they are listed."""
    _discover()
    return tuple(sorted(_registry.rls.values(), key=lambda algorithm: algorithm.order))


def rls_algorithm_named(name: str) -> RlsAlgorithm:
    _discover()
    return _registry.rls[name]


def lua_kinds() -> tuple[LuaKind, ...]:
    _discover()
    return tuple(_registry.lua_kinds)


def lua_sources() -> tuple[str, ...]:
    """The text of every kind's Lua files, in load order: what each Redis
    script starts with."""
    _discover()
    return tuple(path.read_text(encoding="utf-8") for path in _registry.lua)
