"""The X-Forwarded-For walk from a trusted loopback peer, through both front doors.

The rules (rules/trusted_walk.yaml) trust every loopback address, so the
peer each front door reports (the test's own 127.1.x.y) is a trusted proxy
and Sluice walks the client's X-Forwarded-For from the right, as nginx's
``real_ip_recursive on`` does. nginx passes the client's header to the check
as it came; Envoy must do the same. (Envoy's ``use_remote_address`` appends
an entry of its own, and for a loopback peer that entry is the node's
non-loopback address: unless the template skips the append, the walk stops
there and every client through Envoy is that address.)

A rule allows one request per client and path, and refuses the second with a
page naming the resolved client (``client=${{remote_addr}}``): `resolved`
reads the address, and two requests on one path show whether two headers
name the same counting key.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devstack.launcher import Stack
from tests.integration.clients import LOOPBACK, Client, Reply
from tests.integration.conftest import RULES, fresh_client_address, front_door_port, start_stack, unique_path


@pytest.fixture(scope="module")
def walk_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("walk-stack"), RULES / "trusted_walk.yaml")
    yield stack
    stack.stop()


def client_of(stack: Stack, front_door: str, source: str = LOOPBACK) -> Client:
    """A client of the front door; by default from 127.0.0.1, the peer Envoy
    treats as loopback (it takes 127.0.0.1 and ::1 for loopback, not 127/8)."""
    return Client(front_door_port(stack, front_door), source)


def forwarded(xff: str | None) -> dict[str, str]:
    return {} if xff is None else {"X-Forwarded-For": xff}


def refused_client(reply: Reply) -> str:
    assert reply.status == 429, (reply.status, reply.body[:200])
    body = reply.body.decode()
    assert body.startswith("client="), body[:200]
    return body.removeprefix("client=").strip()


def resolved(client: Client, xff: str | None, prefix: str = "/walk/") -> str:
    """The client address Sluice resolves for this connection's peer and `xff`."""
    path = unique_path(prefix)
    first = client.request(path, headers=forwarded(xff))
    assert first.status == 200, (first.status, first.body[:200])
    return refused_client(client.request(path, headers=forwarded(xff)))


def shares_counter(first: tuple[Client, str | None], second: tuple[Client, str | None]) -> bool:
    """Whether the second request counts against the first's key (same path)."""
    path = unique_path("/walk/")
    (client_a, xff_a), (client_b, xff_b) = first, second
    assert client_a.request(path, headers=forwarded(xff_a)).status == 200
    status = client_b.request(path, headers=forwarded(xff_b)).status
    assert status in (200, 429)
    return status == 429


def test_a_client_sent_address_behind_a_trusted_peer_is_the_client(walk_stack: Stack, front_door: str) -> None:
    # The reproduction of the Envoy defect: Envoy resolved 192.0.2.2 (its own
    # address), nginx 203.0.113.10.
    assert resolved(client_of(walk_stack, front_door), "203.0.113.10") == "203.0.113.10"


def test_without_x_forwarded_for_the_trusted_peer_is_the_client(walk_stack: Stack, front_door: str) -> None:
    client = client_of(walk_stack, front_door)

    assert resolved(client, None) == client.source


def test_the_walk_goes_right_to_left_past_trusted_entries(walk_stack: Stack, front_door: str) -> None:
    client = client_of(walk_stack, front_door)

    assert resolved(client, "198.51.100.1, 127.0.0.5") == "198.51.100.1"
    # The rightmost untrusted entry wins, not the leftmost.
    assert resolved(client, "192.0.2.77, 198.51.100.4, 127.0.0.5") == "198.51.100.4"


def test_when_every_entry_is_trusted_the_leftmost_is_the_client(walk_stack: Stack, front_door: str) -> None:
    assert resolved(client_of(walk_stack, front_door), "127.0.0.7, 127.0.0.5") == "127.0.0.7"


def test_a_malformed_entry_left_of_the_client_is_never_reached(walk_stack: Stack, front_door: str) -> None:
    assert resolved(client_of(walk_stack, front_door), "junk, 198.51.100.2") == "198.51.100.2"


def test_a_malformed_entry_stops_the_walk_at_the_last_good_address(walk_stack: Stack, front_door: str) -> None:
    client = client_of(walk_stack, front_door)

    # Nothing right of "junk" parsed: the last good address is the peer.
    assert resolved(client, "198.51.100.3, junk") == client.source
    # A trusted entry right of it is the last good address.
    assert resolved(client, "198.51.100.3, junk, 127.0.0.5") == "127.0.0.5"


def test_an_ipv4_mapped_address_counts_as_the_ipv4_address(walk_stack: Stack, front_door: str) -> None:
    assert resolved(client_of(walk_stack, front_door), "::ffff:203.0.113.7") == "203.0.113.7"
    assert shares_counter(
        (client_of(walk_stack, front_door), "::ffff:203.0.113.7"),
        (client_of(walk_stack, front_door), "203.0.113.7"),
    )


def test_ipv6_clients_in_one_slash_64_share_a_counter(walk_stack: Stack, front_door: str) -> None:
    assert resolved(client_of(walk_stack, front_door), "2001:db8:1:2::1") == "2001:db8:1:2::1"
    assert shares_counter(
        (client_of(walk_stack, front_door), "2001:db8:1:2::1"),
        (client_of(walk_stack, front_door), "2001:db8:1:2:ffff:ffff:ffff:ffff"),
    )
    assert not shares_counter(
        (client_of(walk_stack, front_door), "2001:db8:1:2::1"),
        (client_of(walk_stack, front_door), "2001:db8:1:3::1"),
    )


def test_a_session_key_without_its_cookie_falls_back_to_the_walked_address(
    walk_stack: Stack, front_door: str
) -> None:
    path = unique_path("/session/")
    one, other = client_of(walk_stack, front_door), client_of(walk_stack, front_door, fresh_client_address())

    assert one.request(path, headers=forwarded("198.51.100.20")).status == 200
    # Another peer, the same client behind it: the same counter.
    assert refused_client(other.request(path, headers=forwarded("198.51.100.20"))) == "198.51.100.20"
    # Another client behind the same peer: a counter of its own.
    assert one.request(path, headers=forwarded("198.51.100.21")).status == 200
    # A cookie is a key of its own, whatever the address.
    with_cookie = {"X-Forwarded-For": "198.51.100.20", "Cookie": "sid=walk-session"}
    assert one.request(path, headers=with_cookie).status == 200


@pytest.mark.parametrize(
    "xff",
    ["203.0.113.10", "198.51.100.1, 127.0.0.5", "junk, 198.51.100.2", "2001:db8:5:6::1", "::ffff:203.0.113.8"],
)
def test_nginx_and_envoy_resolve_the_same_header_to_one_counter(walk_stack: Stack, xff: str) -> None:
    # One Sluice behind both front doors: the same client-sent header through
    # nginx, then through Envoy, from two peers, is one client.
    assert shares_counter(
        (client_of(walk_stack, "nginx"), xff),
        (client_of(walk_stack, "envoy"), xff),
    )
    assert shares_counter(
        (client_of(walk_stack, "envoy", fresh_client_address()), xff),
        (client_of(walk_stack, "nginx", fresh_client_address()), xff),
    )


def test_the_application_gets_the_client_header_with_the_peer_appended(walk_stack: Stack, front_door: str) -> None:
    # Both doors send the application what nginx's $proxy_add_x_forwarded_for
    # makes: the client's header with the direct peer appended, never the
    # node's own address. (nginx joins with ", ", Envoy with a bare ",".)
    client = client_of(walk_stack, front_door)

    def entries(xff: str | None) -> list[str]:
        echo = client.request(unique_path("/app/"), headers=forwarded(xff)).echo()
        return [entry.strip() for entry in echo["headers"]["x-forwarded-for"].split(",")]

    assert entries(None) == [client.source]
    assert entries("203.0.113.10") == ["203.0.113.10", client.source]
    assert entries("junk, 198.51.100.2") == ["junk", "198.51.100.2", client.source]
