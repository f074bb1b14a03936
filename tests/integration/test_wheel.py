"""The distributions `make dist` builds (python -m build: the sdist, then the
wheel from that sdist) carry the repository's nginx/ and envoy/ templates,
and the wheel works on its own: installed into a fresh virtualenv, and run
from a folder outside the checkout with nothing of the repository on the
path — `sluice serve`, `check`, `replay` and `config` (whose nginx and Envoy
output the real nginx and Envoy accept).

The wheel's C is compiled without optimisation (``BUILD_CFLAGS``): the same
build, modules and files as `make dist`'s, in a third of its time; what the
optimiser makes of them is the benchmarks' subject, not this packaging's."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.launcher import find_envoy, find_nginx
from sidecar.rendering import nginx_main_config
from tests.integration.clients import LOOPBACK
from tests.integration.conftest import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

RULES = """\
rules:
  - id: per-ip
    key: [ip]
    limit: {requests: 2, per: 60s}
    action: block
"""

LOG = "\n".join(f'198.51.100.7 - - [01/Mar/2024:10:00:0{i} +0000] "GET /items HTTP/1.1" 200 12 "-" "curl/8"'
                for i in range(5)) + "\n"


# The compiler's flags for the wheel's C: Python's own, but -O0 for its
# -O3 and no debugging information.
BUILD_CFLAGS = "-DNDEBUG -fwrapv -O0 -Wall"


class Dist:
    """The sdist and the wheel, built as `make dist` builds them (the C
    without optimisation: see the module)."""

    def __init__(self, out: Path) -> None:
        result = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
                                capture_output=True, text=True, timeout=600,
                                env={**os.environ, "CFLAGS": BUILD_CFLAGS})
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        self.log = result.stdout + result.stderr
        [self.sdist] = out.glob("sluice_ratelimit-*.tar.gz")
        [self.wheel] = out.glob("sluice_ratelimit-*.whl")


def repository_templates() -> dict[str, bytes]:
    """Every file of the repository's nginx/ and envoy/ folders, by its path there."""
    return {path.relative_to(REPO).as_posix(): path.read_bytes()
            for proxy in ("nginx", "envoy") for path in sorted((REPO / proxy).rglob("*")) if path.is_file()}


class Installed:
    """A fresh virtualenv with the wheel installed, and a working folder
    outside the checkout."""

    def __init__(self, root: Path, wheel: Path) -> None:
        self.root = root
        self.work = root / "work"
        self.work.mkdir()
        self.venv = root / "venv"
        # Nothing of the checkout or the test run leaks in (a PYTHONPATH to
        # the checkout would make pip find Sluice installed already).
        self.env = {key: value for key, value in os.environ.items()
                    if key not in ("PYTHONPATH", "VIRTUAL_ENV") and not key.startswith("SLUICE_")}
        subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True, timeout=120, env=self.env)
        subprocess.run([str(self.venv / "bin" / "pip"), "install", "--quiet", str(wheel)],
                       check=True, capture_output=True, timeout=600, env=self.env)
        self.env["PATH"] = f"{self.venv / 'bin'}:{os.environ.get('PATH', '')}"

    def sluice(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([str(self.venv / "bin" / "sluice"), *args], cwd=self.work, env=self.env,
                                capture_output=True, text=True, timeout=60)
        if check:
            assert result.returncode == 0, result.stderr
        return result


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    return Dist(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, dist: Dist) -> Installed:
    return Installed(tmp_path_factory.mktemp("wheel"), dist.wheel)


def test_the_sdist_carries_the_nginx_and_envoy_folders_and_the_package_s_copy_of_them(dist: Dist) -> None:
    templates = repository_templates()
    with tarfile.open(dist.sdist) as sdist:
        top = sdist.getnames()[0].split("/")[0]
        members = {member.name.removeprefix(f"{top}/"): member for member in sdist.getmembers()}
        # The package's links to them become files: the sdist builds a wheel without the checkout.
        for prefix in ("", "sidecar/templates/"):
            carried = {name.removeprefix(prefix): member for name, member in members.items()
                       if member.isfile() and name.removeprefix(prefix).startswith(("nginx/", "envoy/"))
                       and name.startswith(prefix)}
            assert sorted(carried) == sorted(templates), prefix
            for name, member in carried.items():
                extracted = sdist.extractfile(member)
                assert extracted is not None and extracted.read() == templates[name], f"{prefix}{name}"
    assert len(templates) >= 18


def test_the_wheel_built_from_the_sdist_carries_the_templates_and_the_license(dist: Dist) -> None:
    templates = repository_templates()
    with zipfile.ZipFile(dist.wheel) as wheel:
        carried = {name.removeprefix("sidecar/templates/"): wheel.read(name) for name in wheel.namelist()
                   if name.startswith("sidecar/templates/")}
        [metadata] = [name for name in wheel.namelist() if name.endswith(".dist-info/METADATA")]
        headers = wheel.read(metadata).decode().partition("\n\n")[0].splitlines()
        licenses = [name for name in wheel.namelist() if ".dist-info/licenses/" in name]

    assert carried == templates
    assert "License-Expression: MIT" in headers and "License-File: LICENSE" in headers
    assert [name.rpartition("/")[2] for name in licenses] == ["LICENSE"]
    # pyproject.toml as the backend reads it: no deprecated license table or classifier.
    assert "deprecated" not in dist.log.lower()


def test_the_wheel_carries_a_compiled_extension_for_every_module_of_its_core(dist: Dist) -> None:
    with zipfile.ZipFile(dist.wheel) as wheel:
        names = wheel.namelist()
        manifest = json.loads(wheel.read("sidecar/_core_manifest.json"))
    extensions = {name.split(".")[0].replace("/", ".") for name in names if name.endswith(".so")}
    # Every module the manifest names, from the limiters to the shared-memory zone.
    assert set(manifest["modules"]) == extensions
    assert {"sidecar.policy", "sidecar.store.node", "sidecar.shm._zone"} <= extensions
    for module, sources in manifest["modules"].items():
        # ...each beside its sources, whose hashes the package checks at import.
        assert all(source in names for source in sources), module


def test_the_installed_wheel_runs_its_compiled_core(installed: Installed) -> None:
    assert "compiled core" in installed.sluice("--version").stdout


def test_the_installed_package_is_the_wheel_s_not_the_checkout_s(installed: Installed) -> None:
    result = subprocess.run([str(installed.venv / "bin" / "python"), "-c", "import sidecar; print(sidecar.__file__)"],
                            cwd=installed.work, env=installed.env, capture_output=True, text=True, timeout=60)
    assert result.stdout.startswith(str(installed.venv)), result.stdout
    assert installed.sluice("--version").stdout.startswith("sluice ")
    assert installed.sluice("-h").stdout.startswith("Usage: ")


def test_check_and_replay_work_from_outside_the_checkout(installed: Installed) -> None:
    (installed.work / "rules.yaml").write_text(RULES)
    (installed.work / "bad.yaml").write_text(RULES.replace("per: 60s", "per: soon"))
    (installed.work / "access.log").write_text(LOG)
    assert installed.sluice("check", "rules.yaml").stdout == "rules.yaml: OK, 1 rule\n"
    bad = installed.sluice("check", "bad.yaml", check=False)
    assert bad.returncode == 1 and bad.stderr.startswith("bad.yaml:4: rules[0](per-ip).limit.per: ")
    report = installed.sluice("replay", "--config", "rules.yaml", "access.log").stdout
    assert "replayed 5 requests" in report and "2 allowed" in report and "3 denied" in report


def test_the_wheel_carries_the_runtime_package_and_not_the_development_stack(dist: Dist) -> None:
    with zipfile.ZipFile(dist.wheel) as wheel:
        names = wheel.namelist()
    top_level = {name.partition("/")[0] for name in names if ".dist-info/" not in name}

    assert top_level == {"sidecar"}
    # make run's launcher and the demo upstream live in devstack/, beside the package.
    assert [name for name in names if name.rpartition("/")[2] in ("launcher.py", "demo_upstream.py")] == []
    assert "sidecar/rendering.py" in names


def test_the_shipped_renderer_writes_the_envoy_bootstraps_without_the_checkout(installed: Installed) -> None:
    # What compose.yaml's envoy-config service runs in Sluice's image, the
    # values from the environment.
    result = subprocess.run([str(installed.venv / "bin" / "python"), "-m", "sidecar.rendering", "--render", "envoy",
                             "rendered"], cwd=installed.work, env={**installed.env, "SLUICE_HOST": "sluice"},
                            capture_output=True, text=True, timeout=60)

    assert result.returncode == 0, result.stderr
    rendered = installed.work / "rendered"
    assert sorted(path.name for path in rendered.iterdir()) == ["envoy-grpc.yaml", "envoy-rls.yaml", "envoy.yaml"]
    bootstrap = (rendered / "envoy.yaml").read_text()
    assert "${" not in bootstrap and 'address: "sluice"' in bootstrap


def test_config_renders_an_nginx_site_nginx_accepts(installed: Installed) -> None:
    conf_d = installed.work / "conf.d"
    installed.sluice("config", "nginx", "--listen", f"{LOOPBACK}:{free_port()}", "--sluice", "10.0.0.5:8181",
                     "--upstream", "10.0.0.6:8000", "--out", str(conf_d))
    assert sorted(path.relative_to(conf_d).as_posix() for path in conf_d.rglob("*.conf")) == [
        "sluice.conf", "snippets/sluice-http.conf", "snippets/sluice-location.conf", "snippets/sluice-server.conf"]
    site = (conf_d / "sluice.conf").read_text()
    assert "${" not in site and "10.0.0.5:8181" in (conf_d / "snippets" / "sluice-http.conf").read_text()
    # The site includes conf.d/snippets/...: nginx's prefix is the folder holding conf.d.
    for folder in ("logs", "tmp"):
        (installed.work / folder).mkdir(exist_ok=True)
    main = installed.work / "nginx.conf"
    main.write_text(nginx_main_config(installed.work, conf_d / "sluice.conf"))
    result = subprocess.run([find_nginx(), "-t", "-q", "-e", "stderr", "-p", str(installed.work), "-c", str(main)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_config_prints_an_envoy_bootstrap_envoy_accepts(installed: Installed) -> None:
    bootstrap = installed.sluice("config", "envoy", "--listen", f"{LOOPBACK}:{free_port()}",
                                 "--sluice", f"{LOOPBACK}:8181", "--upstream", f"{LOOPBACK}:9000",
                                 "--envoy-admin-port", str(free_port())).stdout
    path = installed.work / "envoy.yaml"
    path.write_text(bootstrap)
    assert "${" not in bootstrap and not any(line.lstrip().startswith("@include") for line in bootstrap.splitlines())
    result = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def served(installed: Installed) -> Iterator[int]:
    (installed.work / "rules.yaml").write_text(RULES)
    port = free_port()
    process = subprocess.Popen([str(installed.venv / "bin" / "sluice"), "serve", "--port", str(port),
                                "--hook-udp", "off"], cwd=installed.work,
                               env={**installed.env, "SLUICE_CONFIG": "rules.yaml"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while status(port, "/healthz") != 200:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr and process.stderr.read()
            time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def status(port: int, path: str, headers: dict[str, str] | None = None) -> int | None:
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=5)
    try:
        connection.request("GET", path, headers=headers or {})
        return connection.getresponse().status
    except OSError:
        return None
    finally:
        connection.close()


def test_serve_decides_with_the_rules_the_environment_names(served: int) -> None:
    check = {"X-Sluice-Client-Addr": "192.0.2.44", "X-Original-URI": "/items"}
    assert [status(served, "/v1/nginx/auth", check) for _ in range(3)] == [200, 200, 403]
