"""The container image: what the Dockerfile builds and the lock file it installs.

No container engine is needed: the Dockerfile is read instruction by
instruction, and the lock is compared with the dependency closure of
pyproject.toml's runtime dependencies, as the environment the tests run in
resolves it (their installed metadata).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.unit.deploy_files import REPO, dockerfile_instructions, dockerfile_user, exec_form, option

LOCK = REPO / "requirements.lock"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
INSTRUCTIONS = dockerfile_instructions()
# uvicorn[standard]'s reloader and websockets: nothing Sluice runs.
NOT_IN_THE_IMAGE = {"watchfiles", "websockets", "python-dotenv"}

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def locked() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of every requirement in the lock file."""
    entries: dict[str, tuple[str, list[str]]] = {}
    name = ""
    for line in LOCK.read_text().splitlines():
        pin = _PIN.match(line)
        if pin:
            name = canonicalize_name(pin.group(1))
            entries[name] = (pin.group(2), [])
        elif line.strip().startswith("--hash=sha256:"):
            entries[name][1].append(line.strip().removeprefix("--hash=sha256:").rstrip(" \\"))
        else:
            assert line.startswith(("#", "    #")) or not line.strip(), f"requirements.lock: {line!r}"
    return entries


def runtime_closure() -> set[str]:
    """pyproject's runtime dependencies and everything they need, without
    extras, for the image's platform (Linux, this Python)."""
    environment = {**default_environment(), "extra": "", "sys_platform": "linux",
                   "platform_system": "Linux", "os_name": "posix"}
    pending = [Requirement(text) for text in PROJECT["dependencies"]]
    closure: set[str] = set()
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in closure or (requirement.marker and not requirement.marker.evaluate(environment)):
            continue
        closure.add(name)
        pending += [Requirement(text) for text in importlib.metadata.requires(name) or []]
    return closure


def index_of(keyword: str, pattern: str) -> int:
    """The position of the first instruction ``keyword`` whose arguments match ``pattern``."""
    for position, (found, arguments) in enumerate(INSTRUCTIONS):
        if found == keyword and re.search(pattern, arguments):
            return position
    raise AssertionError(f"no {keyword} matching {pattern!r} in the Dockerfile")


# -- the Dockerfile -----------------------------------------------------------


def test_the_image_runs_as_a_numeric_user_that_is_not_root() -> None:
    uid, gid = dockerfile_user()

    assert uid > 0 and gid > 0
    # The user is the last one set: nothing after it runs as root.
    assert [keyword for keyword, _ in INSTRUCTIONS].count("USER") == 1
    assert index_of("USER", ".") > index_of("RUN", r"pip install --no-deps")


def test_the_dependencies_come_from_the_lock_in_a_layer_before_the_source() -> None:
    copy_lock = index_of("COPY", r"\brequirements\.lock\b")
    install_lock = index_of("RUN", r"pip install .*--require-hashes.*-r \S*requirements\.lock")
    first_source = min(index_of("COPY", r"\bsidecar\b"), index_of("COPY", r"\bpyproject\.toml\b"))
    install_source = index_of("RUN", r"pip install --no-deps")

    assert copy_lock < install_lock < first_source < install_source
    # Wheels only: the slim image has no compiler.
    assert "--only-binary=:all:" in INSTRUCTIONS[install_lock][1]


def context_rules() -> list[str]:
    return [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]


def test_the_build_context_lets_in_the_lock_and_what_the_package_is_built_from() -> None:
    rules = context_rules()

    assert rules[0] == "*"
    assert {"!requirements.lock", "!pyproject.toml", "!README.md", "!LICENSE", "!sidecar/"} <= set(rules)


def test_the_image_copies_what_the_package_s_links_point_to_where_they_point() -> None:
    # sidecar/templates/nginx -> ../../nginx: COPY keeps a link as a link, so
    # the folder it names must be in the context and copied beside /src/sidecar.
    copies = {}
    for keyword, arguments in INSTRUCTIONS:
        if keyword == "COPY":
            *sources, destination = arguments.split()
            copies.update({source: destination for source in sources})
    links = [Path(folder) / name for folder, names, _ in os.walk(REPO / "sidecar") for name in names
             if (Path(folder) / name).is_symlink()]

    assert links
    for link in links:
        target = (link.parent / os.readlink(link)).resolve().relative_to(REPO)
        assert f"!{target.parts[0]}/" in context_rules(), target
        assert copies.get(target.parts[0]) == f"/src/{target.parts[0]}", target
    assert copies["sidecar"] == "/src/sidecar"


def test_the_image_exposes_the_check_port_and_the_report_port_over_udp() -> None:
    exposed = {port for keyword, arguments in INSTRUCTIONS if keyword == "EXPOSE" for port in arguments.split()}
    environment = dict(pair.split("=", 1) for keyword, arguments in INSTRUCTIONS if keyword == "ENV"
                       for pair in arguments.split() if "=" in pair)
    command = exec_form(next(arguments for keyword, arguments in INSTRUCTIONS if keyword == "CMD"))

    assert command[:2] == ["sluice", "serve"]
    assert f"{environment['SLUICE_PORT']}" in exposed
    hook_host, _, hook_port = option(command, "--hook-udp").rpartition(":")
    assert (hook_host, f"{hook_port}/udp" in exposed) == ("0.0.0.0", True)
    assert environment["SLUICE_HOST"] == "0.0.0.0"


def test_the_healthcheck_asks_healthz_with_python_on_the_check_port() -> None:
    [healthcheck] = [arguments for keyword, arguments in INSTRUCTIONS if keyword == "HEALTHCHECK"]
    options, _, command = healthcheck.partition("CMD ")
    argv = exec_form(command)

    assert argv[:2] == ["python", "-c"]
    assert "urllib.request.urlopen(" in argv[2] and "/healthz" in argv[2]
    assert "SLUICE_PORT" in argv[2]
    assert re.search(r"--timeout=\d+s", options) and re.search(r"--interval=\d+s", options)


# -- the lock file ------------------------------------------------------------


def test_the_lock_pins_every_package_with_its_hashes() -> None:
    entries = locked()

    assert entries
    for name, (version, hashes) in entries.items():
        Version(version)  # a single exact version
        assert hashes and all(re.fullmatch(r"[0-9a-f]{64}", digest) for digest in hashes), name


def test_the_lock_is_exactly_the_closure_of_the_runtime_dependencies() -> None:
    entries = locked()

    assert set(entries) == runtime_closure(), \
        "requirements.lock differs from the runtime dependencies: regenerate it (see its header)"
    assert not NOT_IN_THE_IMAGE & set(entries)


def test_the_locked_versions_satisfy_pyproject() -> None:
    entries = locked()
    for text in PROJECT["dependencies"]:
        requirement = Requirement(text)
        assert not requirement.extras, text  # uvicorn, not uvicorn[standard]
        version, _ = entries[canonicalize_name(requirement.name)]
        assert requirement.specifier.contains(version), (text, version)


def test_the_lock_names_its_source_and_no_local_index() -> None:
    text = LOCK.read_text()

    assert "pip-compile" in text and "pyproject.toml" in text
    assert not re.search(r"^--(index-url|extra-index-url|find-links)", text, re.MULTILINE)
    assert "/tmp/" not in text and "file://" not in text
