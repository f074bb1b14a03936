"""Which core runs (sidecar.core): the compiled modules only when the build's
manifest matches every source and SLUICE_PURE_PYTHON is not 1; otherwise
the .py files, even with compiled modules beside them.

Most tests need no compiler: a copy of the package with a manifest that
setup.py's own functions write, and files named like extensions that are
not extensions at all (importing one would fail, so a test passes only if
the .py was loaded). The last tests look at the real build when it is there."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from types import FunctionType, ModuleType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar import core

REPO = Path(__file__).resolve().parents[2]
SUFFIX = EXTENSION_SUFFIXES[0]  # this Python's first extension suffix, e.g. .cpython-311-x86_64-linux-gnu.so


def load_setup() -> ModuleType:
    """setup.py's functions, without running a build."""
    spec = importlib.util.spec_from_file_location("sluice_setup", REPO / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SETUP = load_setup()


def copy_package(root: Path) -> Path:
    """A copy of the package's sources under ``root`` (no build of its own)."""
    shutil.copytree(REPO / "sidecar", root / "sidecar", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c", core.MANIFEST_NAME))
    return root / "sidecar"


def fake_build(root: Path) -> dict[str, object]:
    """The manifest setup.py writes for the sources under ``root``, and a
    file in each extension's place that is no extension (it cannot load)."""
    manifest = SETUP.manifest(root, "Cython 0.0-test")
    (root / "sidecar" / core.MANIFEST_NAME).write_text(json.dumps(manifest))
    for module in manifest["modules"]:
        Path(root, *module.split(".")).with_name(module.rpartition(".")[2] + SUFFIX).write_text("not an extension")
    return manifest


def run_python(root: Path, code: str, **environ: str) -> subprocess.CompletedProcess[str]:
    """``python -c code`` with the copy under ``root`` first on the path."""
    env = {key: value for key, value in os.environ.items() if key != core.PURE_ENV}
    env.update(environ, PYTHONPATH=str(root))
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


LOADED = "import sidecar.core as c, sidecar.policy as p, sidecar.limiters.window as w; " \
         "print(c.which()); print(c.PURE); print(p.__file__); print(w.__file__)"


def test_the_build_compiles_each_py_with_a_pxd_beside_it_and_every_pyx(tmp_path: Path) -> None:
    package = tmp_path / "sidecar"
    (package / "sub").mkdir(parents=True)
    for name in ("typed.py", "typed.pxd", "plain.py", "sub/fast.pyx", "sub/fast_pure.py", "sub/fast.pxd"):
        (package / name).write_text("")

    modules = {name: [file.as_posix() for file in files] for name, _, files in SETUP.core_sources(tmp_path)}

    assert modules == {"sidecar.typed": ["sidecar/typed.py", "sidecar/typed.pxd"],
                       "sidecar.sub.fast": ["sidecar/sub/fast.pyx", "sidecar/sub/fast.pxd"]}


def test_the_repository_compiles_the_policy_the_limiters_and_the_memory_table() -> None:
    modules = {name for name, _, _ in SETUP.core_sources(REPO)}

    assert {"sidecar.policy", "sidecar.state", "sidecar.keys", "sidecar.bounded", "sidecar.store.local",
            "sidecar.store.memory", "sidecar.limiters.window", "sidecar.limiters.token", "sidecar.limiters.leaky",
            "sidecar.limiters.concurrent", "sidecar.limiters.bucket"} <= modules


def test_no_manifest_is_the_pure_core_not_built(tmp_path: Path) -> None:
    package = copy_package(tmp_path)

    assert core.choose({}, str(package)) == core.Choice(True, "pure-Python core (not built)")


def test_a_fresh_build_is_the_compiled_core_named_with_its_compiler(tmp_path: Path) -> None:
    package = copy_package(tmp_path)
    fake_build(tmp_path)

    assert core.choose({}, str(package)) == core.Choice(False, "compiled core (Cython 0.0-test)")


@given(value=st.sampled_from(["1", "true", "yes", "on", " 1 ", "TRUE"]))
def test_the_environment_forces_the_pure_core_over_a_fresh_build(value: str) -> None:
    # The repository's own folder: whatever is built there, the variable wins.
    choice = core.choose({core.PURE_ENV: value})

    assert choice == core.Choice(True, "pure-Python core (SLUICE_PURE_PYTHON=1)")


@given(value=st.sampled_from(["", "0", "false", "no"]))
def test_other_values_of_the_variable_leave_the_choice_to_the_build(value: str) -> None:
    assert core.choose({core.PURE_ENV: value}) == core.choose({})


def test_a_changed_source_falls_back_whole_and_names_the_file(tmp_path: Path) -> None:
    package = copy_package(tmp_path)
    fake_build(tmp_path)
    with open(package / "limiters" / "token.py", "a") as source:
        source.write("# edited after the build\n")

    choice = core.choose({}, str(package))

    assert choice.pure
    assert choice.which == "pure-Python core (stale: sidecar/limiters/token.py changed since the build)"
    assert choice.warning == "sidecar/limiters/token.py changed since the compiled core was built"


def test_a_changed_type_file_falls_back_too(tmp_path: Path) -> None:
    package = copy_package(tmp_path)
    fake_build(tmp_path)
    (package / "policy.pxd").write_text((package / "policy.pxd").read_text() + "\n")

    assert core.choose({}, str(package)).which == "pure-Python core (stale: sidecar/policy.pxd changed since the build)"


def test_a_missing_extension_falls_back(tmp_path: Path) -> None:
    package = copy_package(tmp_path)
    fake_build(tmp_path)
    (package / f"bounded{SUFFIX}").unlink()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"

    choice = core.choose({}, str(package))

    assert choice.pure and choice.which == f"pure-Python core (not built for Python {version}: sidecar.bounded)"


def test_an_unreadable_manifest_is_no_build(tmp_path: Path) -> None:
    package = copy_package(tmp_path)
    fake_build(tmp_path)
    (package / core.MANIFEST_NAME).write_text("{not json")

    assert core.choose({}, str(package)).which == "pure-Python core (not built)"


def test_the_pure_core_loads_the_py_files_beside_compiled_ones(tmp_path: Path) -> None:
    copy_package(tmp_path)
    fake_build(tmp_path)

    result = run_python(tmp_path, LOADED, SLUICE_PURE_PYTHON="1")

    assert result.returncode == 0, result.stderr
    which, pure, policy, window = result.stdout.splitlines()
    assert which == "pure-Python core (SLUICE_PURE_PYTHON=1)" and pure == "True"
    assert policy == str(tmp_path / "sidecar" / "policy.py")
    assert window == str(tmp_path / "sidecar" / "limiters" / "window.py")
    assert result.stderr == ""


def test_a_stale_build_runs_the_py_files_and_warns_once_naming_the_file(tmp_path: Path) -> None:
    package = copy_package(tmp_path)
    fake_build(tmp_path)
    os.utime(package / "bounded.py")  # touched: the same content is no change
    with open(package / "keys.py", "a") as source:
        source.write("# edited after the build\n")

    result = run_python(tmp_path, LOADED + "; import sidecar.store.memory")

    assert result.returncode == 0, result.stderr
    which, pure, policy, window = result.stdout.splitlines()
    assert which == "pure-Python core (stale: sidecar/keys.py changed since the build)" and pure == "True"
    assert policy.endswith("policy.py") and window.endswith("window.py")
    assert result.stderr.splitlines() == [
        "sidecar/keys.py changed since the compiled core was built: running the pure-Python core "
        "(stale: sidecar/keys.py changed since the build)"]


def test_the_pure_core_refuses_a_module_that_is_only_compiled(tmp_path: Path) -> None:
    """A .pyx module's pure twin has another name: under the pure core, the
    compiled one must not load behind its back."""
    package = copy_package(tmp_path)
    fake_build(tmp_path)
    (package / f"only_compiled{SUFFIX}").write_text("not an extension")

    result = run_python(tmp_path, "import sidecar.only_compiled", SLUICE_PURE_PYTHON="1")

    assert result.returncode == 1
    assert result.stderr.rstrip().endswith(
        "ModuleNotFoundError: sidecar.only_compiled is compiled only, and the pure-Python core "
        "(SLUICE_PURE_PYTHON=1) runs")


def test_modules_that_are_not_compiled_import_as_usual_under_the_pure_core(tmp_path: Path) -> None:
    copy_package(tmp_path)
    fake_build(tmp_path)

    result = run_python(tmp_path, "import sidecar.rules, sidecar.config as c; print(c.__file__)",
                        SLUICE_PURE_PYTHON="1")

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "sidecar" / "config" / "__init__.py")


def test_which_names_the_core_this_process_runs() -> None:
    assert core.which() == core.choose(os.environ).which
    assert core.PURE == core.choose(os.environ).pure
    assert core.which().startswith("pure-Python core (" if core.PURE else "compiled core (Cython ")


def test_the_modules_this_process_loaded_are_the_chosen_core_s() -> None:
    import sidecar.policy

    manifest = core.read_manifest(core.PACKAGE_DIR)
    if manifest is None:
        pytest.skip("the compiled core is not built here")
    modules = manifest["modules"]
    assert isinstance(modules, dict) and "sidecar.policy" in modules
    compiled = sidecar.policy.__file__ is not None and sidecar.policy.__file__.endswith(tuple(EXTENSION_SUFFIXES))
    assert compiled is not core.PURE


def test_compiled_methods_are_functions_to_pydantic() -> None:
    from sidecar.limiters.bucket import BucketLimit  # a model with a method of its own, in a compiled module

    types = core.function_types()

    assert FunctionType in types and type(BucketLimit.check_rule) in types
    assert "check_rule" not in BucketLimit.model_fields


def test_the_pure_core_runs_without_cython_installed(tmp_path: Path) -> None:
    copy_package(tmp_path)
    # None in sys.modules: importing cython fails as where it is not installed.
    result = run_python(tmp_path, "import sys; sys.modules['cython'] = None; " + LOADED + "; "
                        "from sidecar.limiters.window import WindowState; print(WindowState(1, 0, 2, 0.0)); "
                        "from sidecar.store.records import encode_state; "
                        "print(encode_state(WindowState(1, 0, 2, 0.5), 1).hex())")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == ["True", str(tmp_path / "sidecar" / "policy.py"),
                                              str(tmp_path / "sidecar" / "limiters" / "window.py"),
                                              "WindowState(window=1, previous=0, current=2, penalty_until=0.0, "
                                              "limiter=None)",
                                              struct.pack("<Bqqqd", 1, 1, 0, 2, 0.5).hex()]


def test_the_compiled_limiters_states_are_not_tracked_by_the_garbage_collector() -> None:
    from sidecar.limiters.concurrent import LeaseState
    from sidecar.limiters.leaky import LeakyState
    from sidecar.limiters.token import TokenState
    from sidecar.limiters.window import WindowState

    limiter = object()
    states = [WindowState(1, 0, 0, 0.0, limiter), TokenState(1.0, None, 0.0, limiter),
              LeakyState(0, None, 0.0, limiter), LeaseState({"lease": 1.0}, limiter)]
    # Compiled, nothing a state holds leads back to it; pure, every object is tracked.
    assert [gc.is_tracked(state) for state in states] == [core.PURE] * 4
