"""Sluice's build: the package, and its compiled core beside it.

pyproject.toml says what the distribution is; this file adds the compiled
core, which setuptools cannot declare there. The core is Cython's build of
the package's own modules, in pure-Python mode:

- a ``.py`` with a ``.pxd`` beside it is compiled from that very ``.py``,
  typed by the ``.pxd``: the ``.py`` stays the reference and the fallback
  (``sidecar.core`` picks one at import);
- every ``.pyx`` is compiled too (its pure twin is a module of another name).

The build writes ``sidecar/_core_manifest.json`` beside the modules: each
compiled module and the SHA-256 of the sources it was built from. At import,
``sidecar.core`` runs the compiled modules only when every source still
matches, so an edited ``.py`` never runs as a stale compiled module.

Installing never fails for want of the core: without a C compiler or the
Python headers, the build says so and the package installs with the
pure-Python core only. An sdist carries the C that Cython generated from
its sources, and builds it without Cython (``python -m build`` makes the
sdist, then the wheel from it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.sdist import sdist

PACKAGE = "sidecar"
MANIFEST = f"{PACKAGE}/_core_manifest.json"
ROOT = Path(__file__).resolve().parent
# Settings of every compiled module: Python 3 semantics; Python's own
# arithmetic (floor division and modulo, ZeroDivisionError) unless a module
# asks for C's with a cython.cdivision decorator; and C types from the .pxd
# files only, never from the .py's annotations (a ``float`` annotation
# would make a C double of an argument, refusing None and turning an int
# into a float: the compiled module must take what its .py takes).
DIRECTIVES = {"language_level": "3", "embedsignature": False, "always_allow_keywords": True,
              "annotation_typing": False}


def core_sources(root: Path) -> Iterator[tuple[str, Path, list[Path]]]:
    """Each module of the compiled core: its dotted name, the file Cython
    compiles and every source it is built from (the .py or .pyx, and the
    .pxd beside it), paths relative to ``root``, sorted by name."""
    found = []
    for pxd in (root / PACKAGE).rglob("*.pxd"):
        source = pxd.with_suffix(".py")
        if source.is_file():
            found.append((source, [source, pxd]))
    for pyx in (root / PACKAGE).rglob("*.pyx"):
        pxd = pyx.with_suffix(".pxd")
        found.append((pyx, [pyx, pxd] if pxd.is_file() else [pyx]))
    for source, files in sorted(found):
        relative = source.relative_to(root)
        parts = relative.with_suffix("").parts
        if parts[-1] == "__init__":
            raise SystemExit(f"{relative}: a package's __init__ is not compiled; move its hot code to a module")
        yield ".".join(parts), relative, [file.relative_to(root) for file in files]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest(root: Path, compiler: str) -> dict[str, object]:
    """What ``sidecar.core`` checks at import: the compiler, and each
    module's sources (paths relative to the package's parent) by hash."""
    return {"compiler": compiler,
            "modules": {name: {file.as_posix(): sha256(root / file) for file in files}
                        for name, _, files in core_sources(root)}}


def cython_version() -> str | None:
    """Cython's version, or None when it cannot be imported."""
    try:
        import Cython
    except ImportError:
        return None
    return str(Cython.__version__)


def generated_c(root: Path) -> Path:
    """Where an sdist keeps the C of each module, and which Cython made it."""
    return root / PACKAGE / "_core_generated.json"


def extensions(root: Path) -> tuple[list[Extension], str | None]:
    """The core's extensions and the Cython that makes or made their C:
    from the C an sdist carries (no Cython needed), else through Cython;
    none when neither is at hand (the pure-Python core)."""
    modules = list(core_sources(root))
    generated = generated_c(root)
    if generated.is_file() and all((root / source).with_suffix(".c").is_file() for _, source, _ in modules):
        made_by = json.loads(generated.read_text())["cython"]
        return [Extension(name, [str(source.with_suffix(".c"))]) for name, source, _ in modules], made_by
    version = cython_version()
    if version is None:
        print("sluice: Cython is not installed and these sources carry no generated C: "
              "installing the pure-Python core only", file=sys.stderr)
        return [], None
    from Cython.Build import cythonize

    built = cythonize([Extension(name, [str(source)]) for name, source, _ in modules],
                      compiler_directives=DIRECTIVES, quiet=True)
    return built, version


class BuildCore(build_ext):
    """build_ext that never fails the install: a module that does not
    compile leaves the whole core unbuilt (no manifest, so the pure-Python
    core runs), said in one line; when every module compiled, the manifest."""

    made_by: str | None = None

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:  # a dozen modules: one per core
            self.parallel = os.cpu_count() or 1

    def run(self) -> None:
        self.failures: list[str] = []
        try:
            super().run()
        except Exception as error:  # no compiler at all: distutils' errors, or an OSError
            self.failures.append(f"{type(error).__name__}: {error}")
        if not self.extensions:
            return
        target = Path(self.build_lib if not self.inplace else ROOT) / MANIFEST
        if self.failures:
            target.unlink(missing_ok=True)
            print(f"sluice: the compiled core was not built ({self.failures[0]}); the pure-Python core "
                  "runs. To build it: a C compiler and the Python headers (Debian: build-essential, python3-dev).",
                  file=sys.stderr)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(manifest(ROOT, f"Cython {self.made_by}"), indent=1, sort_keys=True) + "\n")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as error:  # a compiler error in one module
            self.failures.append(f"{ext.name}: {type(error).__name__}: {error}")

    def get_outputs(self) -> list[str]:
        """The extensions and the manifest, which an editable install links."""
        outputs = super().get_outputs()
        if self.extensions:
            outputs.append(os.path.join(self.build_lib, MANIFEST))
        return outputs


class SdistWithC(sdist):
    """An sdist that carries the C of every compiled module, generated from
    the very sources it carries, so that it builds without Cython."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        version = cython_version()
        if version is None:
            raise SystemExit("sluice: making the sdist needs Cython (it carries the C it generates)")
        from Cython.Build import cythonize

        release = Path(base_dir).resolve()
        sources = [str(release / source) for _, source, _ in core_sources(release)]
        cythonize(sources, compiler_directives=DIRECTIVES, force=True, quiet=True, nthreads=os.cpu_count() or 1)
        generated_c(release).write_text(json.dumps({"cython": version}) + "\n")


def main() -> None:
    # Only the commands that build need the extensions (and Cython's run).
    ext_modules, BuildCore.made_by = extensions(ROOT) if {"egg_info", "sdist"}.isdisjoint(sys.argv) else ([], None)
    setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildCore, "sdist": SdistWithC})


# The build backend runs this file as __main__; the tests import it for its functions.
if __name__ == "__main__":
    main()
