"""``sluice serve --workers N``: uvicorn's supervisor of worker processes,
each worker listening on a socket of its own.

uvicorn's workers accept from the one socket their parent bound. The proxy
keeps a few dozen connections to Sluice open and sends every check on them,
so whoever accepted a connection decides its checks for as long as it lives;
and the worker that wakes first for a burst of new connections accepts them
all. Measured through nginx, one of two workers decided 60 to 80 % of the
checks. Here each worker binds its own socket to the address (SO_REUSEPORT,
as nginx's ``listen ... reuseport``), and the kernel deals new connections
over the workers' sockets by a hash of their addresses: evenly, whoever is
awake.

The parent binds the address first, with the same option, and never listens:
it holds the port while workers come and go (and fixes it when the port
given is 0). A worker that dies resets the connections still waiting in its
own socket's queue, which the proxy then answers as Sluice unreachable (fail
open, by the shipped configurations); Linux's ``net.ipv4.tcp_migrate_req =
1`` hands them to a sibling instead. A unix socket (``--uds``) is shared as
uvicorn shares it: the kernel does not deal those.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from uvicorn.supervisors import multiprocess

log = logging.getLogger("sluice")


def bind_shared(host: str, port: int) -> socket.socket:
    """The parent's socket on ``host:port``: bound, not listening, open to
    the workers' own sockets on the same address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        _share_address(sock)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def own_listener(shared: socket.socket) -> socket.socket:
    """A socket of the worker's own, bound to the address of ``shared``
    (which it closes); a unix socket is kept shared."""
    if shared.family == socket.AF_UNIX:
        return shared
    own = socket.socket(shared.family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        _share_address(own)
        own.bind(shared.getsockname())
    except OSError:
        own.close()
        raise
    shared.close()
    return own


MIGRATE_SETTING = "/proc/sys/net/ipv4/tcp_migrate_req"


def dead_workers_queues_migrate(setting: str = MIGRATE_SETTING) -> bool | None:
    """Whether the kernel hands the connections waiting for a closed
    listener to another on its port; None when it cannot tell."""
    try:
        with open(setting) as file:
            return file.read().strip() != "0"
    except (OSError, UnicodeDecodeError):
        return None


def _share_address(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)


class WorkerProcess(multiprocess.Process):
    """uvicorn's worker process, serving on its own socket."""

    def target(self, sockets: list[socket.socket] | None = None) -> None:  # in the worker
        super().target([own_listener(sock) for sock in sockets or ()])


def run_workers(config: Any) -> None:
    """Run ``config.workers`` workers of the uvicorn ``config`` until the
    supervisor stops (SIGINT or SIGTERM); dead workers are restarted."""
    if config.uds is not None:
        sock = config.bind_socket()
    else:
        sock = bind_shared(config.host, config.port)
        host, port = sock.getsockname()[:2]
        log.info("%d workers listening on %s, each on a socket of its own",
                 config.workers, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        if dead_workers_queues_migrate() is False:
            log.info("net.ipv4.tcp_migrate_req is 0: a worker that dies resets the connections waiting in its "
                     "socket's queue (the proxy lets their requests in unchecked); 1 hands them to the others")
    # uvicorn's supervisor makes (and remakes) its workers as
    # multiprocess.Process: they are this module's.
    uvicorns = multiprocess.Process
    multiprocess.Process = WorkerProcess  # type: ignore[misc]
    try:
        multiprocess.Multiprocess(config, sockets=[sock]).run()
    finally:
        multiprocess.Process = uvicorns  # type: ignore[misc]
        sock.close()
        if config.uds is not None and os.path.exists(config.uds):
            os.remove(config.uds)
