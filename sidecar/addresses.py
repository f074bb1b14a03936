"""The addresses of the command line: ``HOST:PORT`` option values, and
whether ``sluice serve`` can listen on them before it starts."""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

# A HOST:PORT without a host: the loopback address, as before.
DEFAULT_HOST = "127.0.0.1"
# A bare PORT, where an option takes one: every address (nginx's `listen 80`).
EVERY_ADDRESS = "0.0.0.0"
# A host name, an IPv4 address or an IPv6 one (its brackets removed): what
# the proxies' configurations can carry as it is, nothing they would read
# as syntax.
_HOST = re.compile(r"[A-Za-z0-9._:-]{1,253}")


if TYPE_CHECKING:  # click 8.5 types it (value, input); older ones do not subscript
    _AddressParam = click.ParamType[tuple[str, int] | None, Any]
else:
    _AddressParam = click.ParamType


class Address(_AddressParam):
    """A ``HOST:PORT`` option, as ``(host, port)``. ``off``: the word off
    too, as None; ``bare_port``: a PORT alone too, on every address. Its
    error says exactly what the option accepts."""

    name = "address"

    def __init__(self, off: bool = False, bare_port: bool = False) -> None:
        self.off = off
        self.bare_port = bare_port
        forms = ["HOST:PORT"] + (["PORT"] if bare_port else []) + (["'off'"] if off else [])
        self.accepts = " or ".join([", ".join(forms[:-1]), forms[-1]] if len(forms) > 2 else forms)

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "HOST:PORT" + ("|PORT" if self.bare_port else "") + ("|off" if self.off else "")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> tuple[str, int] | None:
        if value is None or isinstance(value, tuple):
            return value
        text = str(value).strip()
        if self.off and text == "off":
            return None
        host, sep, port = (EVERY_ADDRESS, ":", text) if self.bare_port and text.isdigit() else text.rpartition(":")
        host = host.removeprefix("[").removesuffix("]") if host.startswith("[") else host
        if not sep or not port.isascii() or not port.isdigit() or not _HOST.fullmatch(host or DEFAULT_HOST):
            self.fail(f"expected {self.accepts}, got {value!r}", param, ctx)
        if not 1 <= int(port) <= 65535:
            self.fail(f"the port of {value!r} is not from 1 to 65535", param, ctx)
        return host or DEFAULT_HOST, int(port)


def shown(address: tuple[str, int]) -> str:
    """``127.0.0.1:8182``, ``[::1]:8182``."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Listener:
    """An address ``sluice serve`` listens on, and the option that gave it."""

    option: str
    address: tuple[str, int]
    udp: bool = False
    remedy: str = "give a free HOST:PORT"


class AddressBusy(Exception):
    """A listener's address that cannot be listened on: the one line to print."""


def check_listeners(listeners: Sequence[Listener]) -> None:
    """Listen on every address at once, and let them go: AddressBusy for
    the first that is taken (by another process, or by another of these:
    the same TCP port twice), before the server starts and would fail
    with a traceback from inside its startup."""
    with contextlib.ExitStack() as held:
        for listener in listeners:
            try:
                held.enter_context(_listen(listener))
            except OSError as exc:
                reason = (exc.strerror or str(exc)).lower() if not isinstance(exc, socket.gaierror) \
                    else f"unknown host ({exc.strerror})"
                kind = " (UDP)" if listener.udp else ""
                raise AddressBusy(f"{listener.option}: cannot listen on {shown(listener.address)}{kind}: "
                                  f"{reason}; {listener.remedy}") from None


def _listen(listener: Listener) -> socket.socket:
    host, port = listener.address
    kind = socket.SOCK_DGRAM if listener.udp else socket.SOCK_STREAM
    family, _, _, _, where = socket.getaddrinfo(host, port, type=kind, flags=socket.AI_PASSIVE)[0]
    probe = socket.socket(family, kind)
    try:
        if not listener.udp:
            # As the servers will: connections in TIME_WAIT do not block the port.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(where)
        if not listener.udp:
            probe.listen()  # SO_REUSEADDR lets two sockets bind a port; only one listens
    except BaseException:
        probe.close()
        raise
    return probe
