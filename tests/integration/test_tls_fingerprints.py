"""JA3 and JA4 as counting keys, through a real Envoy TLS listener.

The stack's Envoy bootstrap (the shipped one, rendered) is given a TLS
listener as `sluice config envoy --tls-cert/--tls-key` writes it
(sidecar.rendering.with_envoy_tls): a certificate the test makes, and the
tls_inspector computing JA3 and JA4. Two clients of different TLS
settings from one address are counted apart; a client that sends a
fingerprint header of its own, over plain HTTP through Envoy or through
nginx, is not believed.
"""

from __future__ import annotations

import http.client
import ssl
from collections.abc import Iterator

import pytest

from devstack.launcher import Stack
from sidecar.rendering import with_envoy_tls
from tests.certificates import write_certificate
from tests.integration.clients import LOOPBACK, Client
from tests.integration.conftest import (
    another_envoy,
    fresh_client_address,
    front_door_port,
    stack_on,
    unique_path,
)

pytestmark = pytest.mark.integration

RULES = """
rules:
  - id: per-fingerprint
    match: {path: {prefix: /fp/}}
    key: [ja4, path]
    limit: {requests: 2, per: 1h}
    action: block
"""


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, int]]:
    directory = tmp_path_factory.mktemp("tls-stack")
    with stack_on(directory, RULES) as stack:
        cert, key = write_certificate(directory)
        rendered = with_envoy_tls({"envoy.yaml": (stack.run_dir / "envoy.yaml").read_text()}, str(cert), str(key))
        with another_envoy(rendered["envoy.yaml"], directory, "envoy-tls") as port:
            yield stack, port


def tls_context(settings: str) -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if settings == "tls1.2":
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        context.set_ciphers("ECDHE-ECDSA-AES128-GCM-SHA256")
    return context


def over_tls(port: int, source: str, settings: str, path: str, headers: dict[str, str] | None = None) -> int:
    connection = http.client.HTTPSConnection(LOOPBACK, port, timeout=5, context=tls_context(settings),
                                             source_address=(source, 0))
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def test_two_tls_clients_of_one_address_are_counted_apart(tls_stack: tuple[Stack, int]) -> None:
    _, port = tls_stack
    source, path = fresh_client_address(), unique_path("/fp/")

    assert [over_tls(port, source, "default", path) for _ in range(3)] == [200, 200, 429]
    # Another TLS stack's handshake: another JA4, its own count.
    assert [over_tls(port, source, "tls1.2", path) for _ in range(3)] == [200, 200, 429]


def test_a_fingerprint_header_a_client_sends_is_replaced(tls_stack: tuple[Stack, int]) -> None:
    _, port = tls_stack
    source, path = fresh_client_address(), unique_path("/fp/")
    # Each request claims another fingerprint: the handshake's is counted.
    assert [over_tls(port, source, "default", path, {"X-Sluice-Ja4": f"fake-{n}"}) for n in range(3)] == \
        [200, 200, 429]


@pytest.mark.parametrize("front_door", ["nginx", "envoy"])
def test_without_tls_a_clients_own_fingerprint_is_not_believed(tls_stack: tuple[Stack, int],
                                                               front_door: str) -> None:
    stack, _ = tls_stack
    path = unique_path("/fp/")
    port = front_door_port(stack, front_door)
    # Plain HTTP has no fingerprint: every request counts under the empty one.
    statuses = [Client(port, fresh_client_address()).request(path, headers={"X-Sluice-Ja4": f"fake-{n}"}).status
                for n in range(3)]
    assert statuses == [200, 200, 429]
