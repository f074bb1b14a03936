"""What an operator's tools see of a running stack: the container
healthchecks of the Dockerfile and compose.yaml, run against real Sluice,
upstream, nginx and Envoy; answers counted by front door under a burst;
HEAD on /metrics."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import yaml

from devstack.launcher import Stack
from tests.integration.burst import burst
from tests.integration.clients import LOOPBACK
from tests.integration.conftest import free_port, fresh_client_address, front_door_port, sluice_metric, unique_path
from tests.unit.deploy_files import REPO, dockerfile_instructions, exec_form

COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
# What compose.yaml's services listen on in their containers.
IN_CONTAINER = {"upstream": 9000, "nginx": 8080, "envoy": 9901}


def run_probe(argv: list[str], environment: dict[str, str] | None = None) -> int:
    """A healthcheck's command, run here; its exit status (0: healthy)."""
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    return subprocess.run(argv, env=environment, capture_output=True, timeout=30).returncode


def compose_probe(service: str, port: int) -> list[str]:
    """The service's compose healthcheck, pointed at ``port`` instead of its container's."""
    test: list[str] = COMPOSE[service]["healthcheck"]["test"]
    assert test[0] == "CMD"
    old = str(IN_CONTAINER[service])
    return [re.sub(rf"(?<=[:/]){old}(?=[/ ]|$)", str(port), word) for word in test[1:]]


def test_the_images_healthcheck_passes_against_sluice_and_fails_without_it(limits_stack: Stack) -> None:
    [arguments] = [arguments for keyword, arguments in dockerfile_instructions() if keyword == "HEALTHCHECK"]
    argv = exec_form(arguments.partition("CMD ")[2])

    assert run_probe(argv, {"SLUICE_PORT": str(limits_stack.ports.sluice)}) == 0
    assert run_probe(argv, {"SLUICE_PORT": str(free_port())}) != 0


def test_the_compose_healthchecks_pass_against_the_real_services_and_fail_without_them(limits_stack: Stack) -> None:
    ports = {"upstream": limits_stack.ports.upstream, "nginx": limits_stack.ports.nginx,
             "envoy": limits_stack.ports.envoy_admin}
    for service, port in ports.items():
        assert compose_probe(service, port) != COMPOSE[service]["healthcheck"]["test"][1:], service

        assert run_probe(compose_probe(service, port)) == 0, service
        assert run_probe(compose_probe(service, free_port())) != 0, service


def decisions(stack: Stack, front_door: str) -> dict[str, float]:
    label = front_door.replace("-", "_")  # the envoy-grpc door's answers are envoy_grpc's
    return {outcome: sluice_metric(stack, "sluice_decisions_total", f'front_door="{label}",outcome="{outcome}"')
            for outcome in ("allow", "deny", "close")}


def test_a_burst_through_a_front_door_is_counted_exactly_by_outcome(limits_stack: Stack, front_door: str) -> None:
    before = decisions(limits_stack, front_door)

    statuses = burst(front_door_port(limits_stack, front_door), 300, unique_path("/block/"),
                     source=fresh_client_address())

    after = decisions(limits_stack, front_door)
    assert statuses == {200: 3, 429: 297}
    assert {outcome: after[outcome] - before[outcome] for outcome in after} == {"allow": 3, "deny": 297, "close": 0}
    assert sluice_metric(limits_stack, "sluice_internal_errors_total") == 0


def test_head_on_metrics_sends_no_body_so_the_next_answer_on_the_connection_is_whole(limits_stack: Stack) -> None:
    with socket.create_connection((LOOPBACK, limits_stack.ports.sluice), timeout=5) as connection:
        connection.sendall(b"HEAD /metrics HTTP/1.1\r\nHost: sluice\r\n\r\n"
                           b"GET /healthz HTTP/1.1\r\nHost: sluice\r\nConnection: close\r\n\r\n")
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    get_head, _, get_body = rest.partition(b"\r\n\r\n")

    assert head.startswith(b"HTTP/1.1 200") and b"text/plain" in head
    assert get_head.startswith(b"HTTP/1.1 200") and get_body == b"ok\n"
