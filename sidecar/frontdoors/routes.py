"""A table of routes: a path, or a prefix and every path under it, to what
answers it. The application dispatches its bare ASGI routes through one
(sidecar.app), and the HTTP protocol finds the check doors it answers
itself through another (sidecar.server): a module of its own, so that a
check the protocol answers enters it once, for its lookup, and no other
module the check goes through."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

H = TypeVar("H")


class RouteTable(Generic[H]):
    """``(path, handler, prefix)`` routes, looked up by a request's path:
    its exact path first, then each prefix in order (``path`` itself, or
    ``path`` + ``/...``)."""

    def __init__(self, routes: Iterable[tuple[str, H, bool]]) -> None:
        self.exact: dict[str, H] = {}
        self.prefixes: list[tuple[str, H]] = []
        seen: set[str] = set()
        for path, handler, prefix in routes:
            if path in seen:
                raise ValueError(f"two front doors answer {path}")
            seen.add(path)
            if prefix:
                self.prefixes.append((path, handler))
            else:
                self.exact[path] = handler

    def find(self, path: str) -> H | None:
        handler = self.exact.get(path)
        if handler is not None:
            return handler
        for prefix, handler in self.prefixes:
            if path.startswith(prefix) and (len(path) == len(prefix) or path[len(prefix)] == "/"):
                return handler
        return None
