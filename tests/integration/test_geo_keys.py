"""Country and ASN keys through every front door, over databases the test
writes (tests/geodb.py): the loopback network is one autonomous system
(AS64510) in one country (AQ), so clients rotating through loopback
addresses share one count, as a scraper rotating through its hosting
provider's addresses does. The database is replaced while Sluice runs and
read again without a reload."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.launcher import Stack
from tests.geodb import NETWORKS, write_asn_database, write_country_database
from tests.integration.clients import Client
from tests.integration.conftest import fresh_client_address, front_door_port, stack_on, unique_path, wait_until

pytestmark = pytest.mark.integration

RULES = """
geoip: {asn: asn.mmdb, country: country.mmdb}
rules:
  - id: per-network
    match: {all: [{path: {prefix: /geo/}}, {country: {in: [AQ]}}]}
    key: [asn, path]
    limit: {requests: 3, per: 1h}
    action: block
"""


@pytest.fixture(scope="module")
def geo_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    directory = tmp_path_factory.mktemp("geo-stack")
    write_asn_database(directory / "asn.mmdb")
    write_country_database(directory / "country.mmdb")
    with stack_on(directory, RULES) as stack:
        yield stack, directory


def from_new_addresses(stack: Stack, front_door: str, path: str, times: int) -> list[int]:
    port = front_door_port(stack, front_door)
    return [Client(port, fresh_client_address()).request(path).status for _ in range(times)]


@pytest.mark.parametrize("front_door", ["nginx", "envoy", "envoy-grpc"])
def test_clients_rotating_through_one_network_share_its_count(geo_stack: tuple[Stack, Path],
                                                              front_door: str) -> None:
    stack, _ = geo_stack
    assert from_new_addresses(stack, front_door, unique_path("/geo/"), 4) == [200, 200, 200, 429]


def test_a_database_replaced_while_sluice_runs_is_read_again(geo_stack: tuple[Stack, Path]) -> None:
    stack, directory = geo_stack
    path = unique_path("/geo/")
    assert from_new_addresses(stack, "nginx", path, 4) == [200, 200, 200, 429]

    # Loopback moves to a country the rule does not match: its clients pass.
    moved = {**NETWORKS, "127.0.0.0/8": (64510, "Loopback Cloud", "NZ")}
    write_country_database(directory / "country.new", moved)
    (directory / "country.new").replace(directory / "country.mmdb")
    wait_until(lambda: from_new_addresses(stack, "nginx", path, 1) == [200], "the new database was read", 10)
    assert from_new_addresses(stack, "envoy", path, 3) == [200, 200, 200]
