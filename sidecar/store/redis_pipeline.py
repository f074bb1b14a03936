"""One pipelined connection to Redis for every decision in flight.

Every caller's command is written to the same connection as soon as it is
made, and Redis answers in order, so a burst of a thousand concurrent
decisions is a thousand pipelined commands on one socket, not a thousand
connections. There is no pool to run out of: being busy never looks like
being down, and only a real failure makes the store unavailable:

* the connection is refused, reset or closed, or cannot be made within the
  timeout;
* Redis has answered nothing for ``timeout`` seconds while commands wait.
  The clock starts when the oldest unanswered command was written, or at
  the last reply if that came later: a long queue that Redis works through
  is progress, not a failure, and neither is a Sluice too busy to read (an
  answer waiting unread in the socket is Redis on time);
* Redis answers that it cannot take the command now: ``READONLY`` (a
  replica, such as a master a failover demoted), ``LOADING`` (a restarted
  server reading its data) or ``MASTERDOWN`` (a replica that lost its
  master).

Either way every waiting command fails at once with ``StoreUnavailable``
(the caller fails open or closed), and the next command connects again,
to the address its ``Locator`` names then.
Replies are parsed by hiredis's C reader and commands packed by its
``pack_command``.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import hashlib
import select
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any, Protocol, cast
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis

from sidecar.store import StoreUnavailable


class RedisReplyError(Exception):
    """Redis answered a command with an error (a script's bug, a wrong
    password): not an outage, so it is not hidden by failing open."""


class NoScriptError(RedisReplyError):
    """EVALSHA named a script this Redis does not have (yet)."""


# After a check found Redis silent past the timeout, the next one looks
# again this much later (one more turn of the loop, which reads replies).
_LOOK_AGAIN = 0.001

# Error replies that say the server cannot take commands now, not that a
# command is wrong: the store is unavailable, and the connection is dropped.
_UNAVAILABLE_REPLIES = ("READONLY ", "LOADING ", "MASTERDOWN ")


class RedisAddress:
    """Where and how to connect, from a ``redis://``, ``rediss://`` or
    ``unix://`` URL: host and port or socket path, database, credentials."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"expected a redis://, rediss:// or unix:// URL, got {url!r}")
        query = parse_qs(parts.query)
        self.tls = parts.scheme == "rediss"
        self.path: str | None = unquote(parts.path) if parts.scheme == "unix" else None
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 6379
        database = query.get("db", [""])[0] if parts.scheme == "unix" else parts.path.lstrip("/")
        self.db = int(database or 0)
        self.username = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password else None

    def elsewhere(self, host: str, port: int) -> RedisAddress:
        """The same credentials, database and TLS, on another server."""
        other = copy.copy(self)
        other.host, other.port, other.path = host, port, None
        return other

    def setup_commands(self) -> list[tuple[Any, ...]]:
        commands: list[tuple[Any, ...]] = []
        if self.password is not None:
            commands.append(("AUTH", self.username, self.password) if self.username
                            else ("AUTH", self.password))
        if self.db:
            commands.append(("SELECT", self.db))
        return commands


class _ReplyProtocol(asyncio.Protocol):
    """Hands replies, in order, to the futures of the commands sent."""

    def __init__(self, loop: asyncio.AbstractEventLoop, lost: Callable[[_ReplyProtocol], None]) -> None:
        self.loop = loop
        self.lost = lost
        self.reader = hiredis.Reader(encoding="utf-8", errors="replace")
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        # time.monotonic() of the last reply, or of a write when nothing
        # written was waiting for one: real time, not the loop's (uvloop's
        # is read once per turn, and a busy turn is long).
        self.progress = 0.0
        self._outgoing: list[bytes] = []
        self._watchdog: asyncio.TimerHandle | None = None
        self._silent = False  # the last check found the timeout passed
        self.timeout = 0.1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, command: bytes) -> asyncio.Future[Any]:
        future = self.loop.create_future()
        self.waiting.append(future)
        if not self._outgoing:
            # Commands made in one turn of the loop leave in one write.
            self.loop.call_soon(self._flush)
        self._outgoing.append(command)
        return future

    def _flush(self) -> None:
        if self.transport is not None and self._outgoing:
            if len(self.waiting) == len(self._outgoing):
                # Nothing written is waiting: Redis's time starts now.
                self.progress = time.monotonic()
            self.transport.write(b"".join(self._outgoing))
            if self._watchdog is None:
                self._watchdog = self.loop.call_later(self.timeout, self._check)
        self._outgoing.clear()

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiting = self.waiting
        try:
            while (reply := self.reader.gets()) is not False:
                future = waiting.popleft()
                if future.done():
                    continue  # its caller gave up
                if isinstance(reply, hiredis.ReplyError):
                    message = str(reply)
                    if message.startswith(_UNAVAILABLE_REPLIES):
                        unavailable = StoreUnavailable(f"Redis cannot take commands now ({message[:200]})")
                        future.set_exception(unavailable)
                        self.fail(unavailable)
                        return
                    error_class = NoScriptError if message.startswith("NOSCRIPT") else RedisReplyError
                    future.set_exception(error_class(message))
                else:
                    future.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:
            self.fail(StoreUnavailable(f"unreadable reply from Redis: {exc}"))
            return
        self.progress = time.monotonic()

    def _check(self) -> None:
        """Redis is unavailable when it answered nothing for ``timeout``
        while commands waited.

        A loop busy past the deadline (a burst of checks to parse) may not
        have read replies that are already in the socket, and uvloop runs
        timers before it reads: the verdict waits for one more look, after
        the loop has read what arrived.
        """
        self._watchdog = None
        if not self.waiting:
            self._silent = False
            return
        silent_for = time.monotonic() - self.progress
        if silent_for < self.timeout:
            self._silent = False
            self._watchdog = self.loop.call_later(self.timeout - silent_for, self._check)
        elif not self._silent or self._answer_unread():
            # Not silent yet, or Redis has answered and only this process
            # has not read it (a CPU shared with busy processes, a long
            # turn of the loop): the timeout measures Redis, not Sluice.
            self._silent = True
            self._watchdog = self.loop.call_later(_LOOK_AGAIN, self._check)
        else:
            self.fail(StoreUnavailable(f"Redis answered nothing for {self.timeout:g} s"))

    def _answer_unread(self) -> bool:
        """Whether the connection holds bytes from Redis that the loop has
        not read yet: a poll of the socket that does not wait."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return False
        try:
            readable, _, _ = select.select([sock.fileno()], [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(readable)

    def fail(self, error: StoreUnavailable) -> None:
        """Give up the connection: every waiting command fails now."""
        if self.transport is not None:
            self.transport.abort()
        self._fail_waiting(error)

    def _fail_waiting(self, error: StoreUnavailable) -> None:
        self.lost(self)
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._outgoing.clear()
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._fail_waiting(StoreUnavailable(f"connection to Redis lost ({exc or 'closed'})"))


class Locator(Protocol):
    """Where to connect, asked before every (re)connect: Redis Sentinel's
    master changes with a failover (sidecar.store.sentinel)."""

    async def locate(self) -> RedisAddress:
        """The address to connect to now, or StoreUnavailable."""
    async def close(self) -> None: ...


class FixedAddress:
    """The locator of one address that never moves (a URL's)."""

    def __init__(self, address: RedisAddress) -> None:
        self.address = address

    async def locate(self) -> RedisAddress:
        return self.address

    async def close(self) -> None:
        pass


class PipelinedRedis:
    """The commands of every caller on one connection, made on first use
    and again after a failure; ``timeout`` bounds connecting and silence.
    ``where`` is a URL, an address or a ``Locator``."""

    # One server holds every key: no command needs grouping by hash slot
    # (see sidecar.store.redis_cluster for the other case).
    clustered = False

    def __init__(self, where: str | RedisAddress | Locator, timeout: float) -> None:
        if isinstance(where, str):
            where = RedisAddress(where)
        self.locator = FixedAddress(where) if isinstance(where, RedisAddress) else where
        self.timeout = timeout
        self._protocol: _ReplyProtocol | None = None
        self._connecting: asyncio.Future[_ReplyProtocol] | None = None
        self._drops = 0  # calls of drop(), which also voids a connection being made
        self._scripts: dict[str, str] = {}  # digest -> source, loaded on each new connection

    @classmethod
    def at(cls, address: RedisAddress, node: tuple[str, int], timeout: float) -> PipelinedRedis:
        """A connection to another server with the same credentials and TLS."""
        return cls(address.elsewhere(*node), timeout)

    @staticmethod
    def digest(source: str) -> str:
        return hashlib.sha1(source.encode()).hexdigest()

    @staticmethod
    def slot(key: str) -> int:
        return 0

    def script(self, source: str) -> str:
        """Register a Lua script; its digest names it in ``evalsha``. It is
        loaded on every new connection, and at once on an open one: ahead
        of any command that calls it."""
        digest = self.digest(source)
        if digest not in self._scripts:
            self._scripts[digest] = source
            if self._protocol is not None:
                load: tuple[Any, ...] = ("SCRIPT", "LOAD", source)
                loading = self._protocol.send(hiredis.pack_command(load))
                # A failure is the connection's, seen by the commands behind it.
                loading.add_done_callback(lambda done: done.cancelled() or done.exception())
        return digest

    def forget(self, digest: str) -> None:
        """No longer load a script on new connections."""
        self._scripts.pop(digest, None)

    async def open(self) -> None:
        """Connect now (and load the scripts) rather than at the first command."""
        if self._protocol is None:
            await self._connected()

    async def execute(self, *command: Any) -> Any:
        protocol = self._protocol
        if protocol is None:
            protocol = await self._connected()
        return await protocol.send(hiredis.pack_command(command))

    async def evalsha(self, digest: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.execute("EVALSHA", digest, len(keys), *keys, *args)
        except NoScriptError:
            # SCRIPT FLUSH, or a failover to a replica without it: EVAL
            # runs it and caches it again.
            source = self._scripts.get(digest)
            if source is None:  # a version forgotten since (see redis._RuleTable)
                raise StoreUnavailable("Redis lost a script no longer registered") from None
            return await self.execute("EVAL", source, len(keys), *keys, *args)

    async def asking(self, *command: Any) -> Any:
        """A command for a slot this cluster node is importing: ASKING right
        before it, on the same connection."""
        protocol = self._protocol
        if protocol is None:
            protocol = await self._connected()
        asking = protocol.send(hiredis.pack_command(("ASKING",)))
        reply = protocol.send(hiredis.pack_command(command))
        try:
            return await reply
        finally:
            if asking.done() and not asking.cancelled():
                asking.exception()  # its failure is the command's, already raised

    async def asking_evalsha(self, digest: str, keys: list[str], args: list[Any]) -> Any:
        # EVALSHA, then EVAL if the node importing the slot lacks the script.
        try:
            return await self.asking("EVALSHA", digest, len(keys), *keys, *args)
        except NoScriptError:
            source = self._scripts.get(digest)
            if source is None:
                raise StoreUnavailable("Redis lost a script no longer registered") from None
            return await self.asking("EVAL", source, len(keys), *keys, *args)

    async def _connected(self) -> _ReplyProtocol:
        # Callers that arrive while a connection is being made share it.
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _connect(self) -> _ReplyProtocol:
        loop = asyncio.get_running_loop()
        drops = self._drops
        address = await self.locator.locate()
        protocol = _ReplyProtocol(loop, self._forget)
        protocol.timeout = self.timeout
        try:
            if address.path is not None:
                connecting = loop.create_unix_connection(lambda: protocol, address.path)
            else:
                connecting = loop.create_connection(
                    lambda: protocol, address.host, address.port,
                    ssl=ssl.create_default_context() if address.tls else None)
            await asyncio.wait_for(connecting, self.timeout)
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            raise StoreUnavailable(f"cannot connect to Redis ({exc or type(exc).__name__})") from exc
        commands = address.setup_commands() + [("SCRIPT", "LOAD", source) for source in self._scripts.values()]
        setup = [protocol.send(hiredis.pack_command(command)) for command in commands]
        try:
            await asyncio.gather(*setup)
        except RedisReplyError as exc:
            # A wrong password or database: the store is unusable, and the
            # reason is in the store-unavailable warning.
            protocol.fail(StoreUnavailable(f"Redis refused the connection's setup ({exc})"))
            raise StoreUnavailable(f"Redis refused the connection's setup ({exc})") from exc
        if self._drops != drops:
            # Located before the master moved: to the old one.
            protocol.fail(StoreUnavailable("the connection was given up while it was being made"))
            raise StoreUnavailable("the connection was given up while it was being made")
        self._protocol = protocol
        return protocol

    def _forget(self, protocol: _ReplyProtocol) -> None:
        if self._protocol is protocol:
            self._protocol = None

    def drop(self, reason: str) -> None:
        """Give up the connection now, or the one being made (a failover
        moved the master): the commands waiting on it fail, and the next
        one connects again."""
        self._drops += 1
        if self._protocol is not None:
            self._protocol.fail(StoreUnavailable(reason))

    async def close(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
        await self.locator.close()
