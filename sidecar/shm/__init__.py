"""Memory that every worker of a node maps: the zone, a table of fixed-size
records in stripes, each with its own robust process-shared lock.

``Zone`` is the compiled zone (``_zone.pyx``) unless the pure-Python core
runs (``sidecar.core.PURE``) or the compiled zone is not built: then it is
the pure-Python twin (``pure_zone``), which has the same layout and API but
takes no lock between processes (one process only).
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING


def _pure_core() -> bool:
    """Whether the pure-Python core runs (sidecar.core decides; without it,
    SLUICE_PURE_PYTHON=1)."""
    try:
        from sidecar import core
    except ImportError:
        return os.environ.get("SLUICE_PURE_PYTHON") == "1"
    return bool(core.PURE)


def _zone_class() -> type:
    from sidecar.shm import pure_zone

    if _pure_core():
        return pure_zone.Zone
    try:
        compiled = importlib.import_module("sidecar.shm._zone")
    except ImportError:
        return pure_zone.Zone
    zone: type = compiled.Zone
    return zone


if TYPE_CHECKING:
    from sidecar.shm.pure_zone import Zone
else:
    Zone = _zone_class()

COMPILED = Zone.__module__ != "sidecar.shm.pure_zone"
"""Whether the zone is the compiled one (robust locks between processes)."""

__all__ = ["COMPILED", "Zone"]
