"""What the distribution says about itself: pyproject.toml's metadata, read
as the build backend reads it (no build here; tests/integration/test_dist.py
builds the sdist and the wheel)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
REPOSITORY = "https://github.com/sluice-ratelimit/sluice"


def test_the_license_is_an_spdx_expression_with_its_file_and_no_classifier() -> None:
    assert PROJECT["license"] == "MIT"
    assert [path for pattern in PROJECT["license-files"] for path in REPO.glob(pattern)] == [REPO / "LICENSE"]
    assert "MIT License" in (REPO / "LICENSE").read_text()
    # PEP 639: the expression replaces the classifier, which the backend refuses beside it.
    assert [classifier for classifier in PROJECT["classifiers"] if classifier.startswith("License ::")] == []


def test_the_build_backend_is_one_that_reads_the_spdx_license() -> None:
    [setuptools] = [Requirement(text) for text in PYPROJECT["build-system"]["requires"]
                    if Requirement(text).name == "setuptools"]

    assert "76.9" not in setuptools.specifier and "77.0" in setuptools.specifier


def test_the_python_classifiers_are_the_versions_requires_python_admits() -> None:
    versions = [classifier.rpartition(" :: ")[2] for classifier in PROJECT["classifiers"]
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", classifier)]
    requires = SpecifierSet(PROJECT["requires-python"])

    assert versions == ["3.11", "3.12", "3.13"]
    assert all(f"{version}.0" in requires for version in versions)
    assert "3.10.0" not in requires


def test_the_classifiers_are_sorted_and_say_what_sluice_is() -> None:
    classifiers = PROJECT["classifiers"]

    assert classifiers == sorted(classifiers) and len(set(classifiers)) == len(classifiers)
    assert {"Framework :: FastAPI", "Topic :: Internet :: WWW/HTTP :: HTTP Servers", "Typing :: Typed",
            "Operating System :: POSIX :: Linux"} <= set(classifiers)
    assert len([classifier for classifier in classifiers if classifier.startswith("Development Status :: ")]) == 1
    # Typing :: Typed promises the marker file, shipped as package data.
    assert (REPO / "sidecar" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["sidecar"]


def test_the_project_urls_point_into_the_repository() -> None:
    urls = PROJECT["urls"]

    assert set(urls) == {"Homepage", "Documentation", "Source", "Changelog", "Issues"}
    assert all(url == REPOSITORY or url.startswith(f"{REPOSITORY}/") for url in urls.values())
    assert urls["Changelog"].endswith("/CHANGELOG.md") and (REPO / "CHANGELOG.md").is_file()
    assert urls["Documentation"].endswith("/docs")
    assert urls["Issues"] == f"{REPOSITORY}/issues"


# -- the compiled core (setup.py) ---------------------------------------------


def test_the_build_requires_cython_beside_setuptools() -> None:
    requires = {Requirement(text).name.lower(): Requirement(text) for text in PYPROJECT["build-system"]["requires"]}

    assert set(requires) == {"setuptools", "cython"}
    assert "2.9.9" not in requires["cython"].specifier and "3.0.0" in requires["cython"].specifier


def test_the_wheel_carries_the_core_s_manifest_and_its_sources_and_no_c() -> None:
    setuptools = PYPROJECT["tool"]["setuptools"]
    data = setuptools["package-data"]["sidecar"]

    # sidecar.core checks every source the manifest names, .pxd and .pyx included.
    assert {"_core_manifest.json", "*.pxd", "*/*.pxd", "*.pyx", "*/*.pyx"} <= set(data)
    assert setuptools["exclude-package-data"] == {"*": ["*.c"]}
    pxd_files = list((REPO / "sidecar").rglob("*.pxd"))
    assert pxd_files and all(len(path.relative_to(REPO / "sidecar").parts) <= 2 for path in pxd_files)


def test_the_sdist_carries_setup_py_and_the_type_files_and_no_build_in_place() -> None:
    lines = (REPO / "MANIFEST.in").read_text().splitlines()

    assert "include setup.py" in lines
    assert "recursive-include sidecar *.pxd *.pyx" in lines
    assert "exclude sidecar/_core_manifest.json" in lines and "global-exclude *.so" in lines


def test_a_build_in_place_is_ignored_by_git_and_by_the_image() -> None:
    ignored = (REPO / ".gitignore").read_text().splitlines()
    docker = (REPO / ".dockerignore").read_text().splitlines()

    assert {"/sidecar/**/*.c", "/sidecar/**/*.so", "/sidecar/_core_manifest.json"} <= set(ignored)
    assert {"**/*.c", "**/*.so", "sidecar/_core_manifest.json", "!setup.py"} <= set(docker)
