"""Which core runs: the compiled modules or their pure-Python twins, decided
once, when the package is imported.

The compiled core is Cython's build of some of the package's own ``.py``
files (those with a ``.pxd`` beside them) and of its ``.pyx`` files; the
build (``setup.py``) writes ``_core_manifest.json`` beside them: each
compiled module and the SHA-256 of the sources it was built from. The
compiled core runs only when all of this holds:

- ``SLUICE_PURE_PYTHON`` is not set to 1 (it forces the pure-Python core);
- the manifest is there, and so is each module's extension for this Python;
- every source still has the hash it was built from: a developer who edits
  a ``.py`` after an in-place build runs the pure-Python core, told once
  in a warning naming the file, never a stale compiled module.

It is all or nothing: one stale or missing module and every module runs
its ``.py``. CPython's own finder prefers an extension to a source of the
same name, which is the compiled core; for the pure-Python core,
``install()`` (called by ``sidecar/__init__.py``) puts a finder first that
loads the ``.py`` instead, and refuses a module that has no ``.py`` (a
``.pyx``'s, whose twin is a module of another name).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec
from importlib.util import spec_from_file_location
from types import FunctionType, ModuleType
from typing import NamedTuple

PURE_ENV = "SLUICE_PURE_PYTHON"
PACKAGE = __name__.rpartition(".")[0]
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
MANIFEST_NAME = "_core_manifest.json"

logger = logging.getLogger("sluice")


class Choice(NamedTuple):
    """The core a process runs, and why in words."""

    pure: bool
    which: str
    warning: str | None = None  # a compiled core that cannot run though it was built


def forced_pure(environ: Mapping[str, str]) -> bool:
    return environ.get(PURE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def read_manifest(package_dir: str) -> dict[str, object] | None:
    """The build's manifest, or None when there is none (or it is unreadable)."""
    try:
        with open(os.path.join(package_dir, MANIFEST_NAME), encoding="utf-8") as file:
            manifest = json.load(file)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("modules"), dict) else None


def file_hash(path: str) -> str | None:
    try:
        with open(path, "rb") as file:
            return hashlib.sha256(file.read()).hexdigest()
    except OSError:
        return None


def extension_of(package_dir: str, module: str) -> str | None:
    """The path of a module's extension for this Python, or None."""
    base = os.path.join(os.path.dirname(package_dir), *module.split("."))
    for suffix in EXTENSION_SUFFIXES:
        if os.path.isfile(base + suffix):
            return base + suffix
    return None


def choose(environ: Mapping[str, str], package_dir: str = PACKAGE_DIR) -> Choice:
    """The core for this environment and this package folder; see the module's docstring."""
    if forced_pure(environ):
        return Choice(True, f"pure-Python core ({PURE_ENV}=1)")
    manifest = read_manifest(package_dir)
    if manifest is None:
        return Choice(True, "pure-Python core (not built)")
    modules = manifest["modules"]
    assert isinstance(modules, dict)
    root = os.path.dirname(package_dir)
    for module, sources in sorted(modules.items()):
        if extension_of(package_dir, module) is None:
            version = f"{sys.version_info.major}.{sys.version_info.minor}"
            return Choice(True, f"pure-Python core (not built for Python {version}: {module})",
                          f"{module} has no compiled module for Python {version}")
        for source, digest in sorted(sources.items()):
            if file_hash(os.path.join(root, source)) != digest:
                return Choice(True, f"pure-Python core (stale: {source} changed since the build)",
                              f"{source} changed since the compiled core was built")
    return Choice(False, f"compiled core ({manifest.get('compiler', 'Cython')})")


class PureFinder:
    """The import finder of the pure-Python core: a module of the package
    with a compiled build beside its ``.py`` is loaded from the ``.py``; a
    module that is only compiled is refused."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if path is None or not fullname.startswith(PACKAGE + "."):
            return None
        name = fullname.rpartition(".")[2]
        for folder in path:
            base = os.path.join(folder, name)
            compiled = any(os.path.isfile(base + suffix) for suffix in EXTENSION_SUFFIXES)
            if not compiled:
                if os.path.isfile(base + ".py") or os.path.isdir(base):
                    return None  # not compiled: the usual import
                continue
            if os.path.isfile(base + ".py"):
                return spec_from_file_location(fullname, base + ".py")
            raise ModuleNotFoundError(f"{fullname} is compiled only, and the {self.reason} runs", name=fullname)
        return None


def install() -> None:
    """Make imports of the package load the chosen core (once)."""
    if PURE and not any(isinstance(finder, PureFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, PureFinder(_CHOICE.which))


def which() -> str:
    """The core this process runs, in words (``sluice --version``)."""
    return _CHOICE.which


def function_types() -> tuple[type, ...]:
    """The types of the package's functions and methods: Python's, and the
    compiled core's, which pydantic is told are methods, not fields."""
    if PURE:
        return (FunctionType,)
    from sidecar import keys  # a compiled module with no import of its own

    return (FunctionType, type(keys.key_rule_id))


_CHOICE = choose(os.environ)
PURE = _CHOICE.pure
if _CHOICE.warning is not None:
    logger.warning("%s: running the %s", _CHOICE.warning, _CHOICE.which)
