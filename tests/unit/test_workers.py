"""Each worker of ``serve --workers N`` listens on a socket of its own,
bound beside the parent's (sidecar.workers)."""

from __future__ import annotations

import collections
import select
import socket
from pathlib import Path

import pytest

from sidecar.workers import bind_shared, dead_workers_queues_migrate, own_listener

CONNECTIONS = 48


def listeners(host: str, count: int) -> tuple[socket.socket, list[socket.socket]]:
    """The parent's socket on a port the kernel picks, and ``count``
    workers' own sockets on it, listening."""
    shared = bind_shared(host, 0)
    own = []
    for _ in range(count):
        inherited = shared.dup()  # what a worker receives
        sock = own_listener(inherited)
        assert inherited.fileno() == -1  # closed: the worker keeps only its own
        sock.listen(64)
        own.append(sock)
    return shared, own


def accepted_by(own: list[socket.socket], connections: int, host: str) -> collections.Counter[int]:
    """How many of ``connections`` new connections each listener accepted."""
    port = own[0].getsockname()[1]
    clients = [socket.create_connection((host, port), timeout=5) for _ in range(connections)]
    counts: collections.Counter[int] = collections.Counter()
    try:
        while sum(counts.values()) < connections:
            ready, _, _ = select.select(own, [], [], 5)
            assert ready, counts
            for sock in ready:
                sock.accept()[0].close()
                counts[own.index(sock)] += 1
    finally:
        for client in clients:
            client.close()
    return counts


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_workers_sockets_share_the_parents_port_and_the_kernel_deals_connections_over_them(host: str) -> None:
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    shared, own = listeners(host, 2)
    try:
        port = shared.getsockname()[1]
        assert port != 0 and all(sock.getsockname()[1] == port for sock in own)
        assert own[0].fileno() != own[1].fileno()
        # The parent's socket is bound, never listening: no connection waits
        # for it.
        counts = accepted_by(own, CONNECTIONS, host)
        assert sum(counts.values()) == CONNECTIONS
        assert min(counts[0], counts[1]) >= CONNECTIONS // 8, counts
    finally:
        for sock in [shared, *own]:
            sock.close()


def test_a_worker_that_stops_leaves_new_connections_to_the_others() -> None:
    shared, own = listeners("127.0.0.1", 2)
    try:
        own[0].close()
        counts = accepted_by(own[1:], CONNECTIONS // 4, "127.0.0.1")
        assert counts[0] == CONNECTIONS // 4
    finally:
        for sock in [shared, *own]:
            sock.close()


def test_a_port_held_without_sharing_refuses_the_parents_socket() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        with pytest.raises(OSError):
            bind_shared("127.0.0.1", holder.getsockname()[1])
    finally:
        holder.close()


def test_a_unix_socket_stays_shared(tmp_path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(tmp_path / "sluice.sock"))
        assert own_listener(sock) is sock
        assert sock.fileno() != -1
    finally:
        sock.close()


@pytest.mark.parametrize(("text", "migrate"), [("0\n", False), ("1\n", True), (None, None)])
def test_the_kernels_setting_for_a_dead_listeners_queue_is_read(tmp_path: Path, text: str | None,
                                                                migrate: bool | None) -> None:
    setting = tmp_path / "tcp_migrate_req"
    if text is not None:
        setting.write_text(text)
    assert dead_workers_queues_migrate(str(setting)) is migrate
