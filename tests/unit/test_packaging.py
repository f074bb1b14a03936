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
