"""Redis Sentinel: the sentinels say where the master is (``state.sentinel``).

Before every (re)connect of the pipelined connection, the sentinels are
asked in turn, each within the store's timeout, ``SENTINEL
get-master-addr-by-name``; the first that names a master is asked first
next time. The master it names is then asked ``ROLE``: a master that a
failover has just demoted, or that the sentinels have not replaced yet
while it is down, must not be used, so a server that is not a master, or
cannot be reached, makes the store unavailable for this request.

A failover ends the connection to the old master:

* Sentinel announces it (``+switch-master``) to its subscribers, and one
  sentinel at a time is listened to: the connection is dropped as soon as
  the master moves. Without this, a master demoted by ``SENTINEL
  FAILOVER`` would take writes that the new master never sees until
  Sentinel turns it into a replica, seconds later;
* a master that died closes the connection, or goes silent past the
  timeout;
* a connection that outlives all that gets ``READONLY`` replies.

Each way the requests waiting fail open (or closed) and the next one asks
the sentinels again (sidecar.store.redis_pipeline). Nothing waits longer
than the timeout for one step, so a switch costs the requests of its own
duration, never a hang.

Valkey's sentinels speak the same protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import hiredis

from sidecar.config import SentinelConfig
from sidecar.store import StoreUnavailable
from sidecar.store.redis import DEFAULT_TIMEOUT
from sidecar.store.redis_pipeline import PipelinedRedis, RedisAddress, RedisReplyError

log = logging.getLogger("sluice")

# After every sentinel has refused to be listened to, the next round waits
# this long: the failover announcements are a shortcut, the connection's
# own failure still tells of a failover.
LISTEN_RETRY_SECONDS = 1.0
# A sentinel listened to that has said nothing for this long is sent a
# PING, and given up if it does not answer within the store's timeout.
LISTEN_PING_SECONDS = 5.0


def sentinel_client(config: SentinelConfig, timeout: float = DEFAULT_TIMEOUT) -> PipelinedRedis:
    """The pipelined connection to the master the sentinels name."""
    master = SentinelMaster(config, timeout)
    client = PipelinedRedis(master, timeout)
    master.on_failover = client.drop
    return client


class SentinelMaster:
    """The master of one group of sentinels: a ``Locator``."""

    def __init__(self, config: SentinelConfig, timeout: float) -> None:
        self.name = config.master
        self.timeout = timeout
        self.sentinels = [_address(host, port, 0, None, config.sentinel_password)
                          for host, port in config.nodes]
        self._config = config
        self.current: tuple[str, int] | None = None  # the master last located
        # Told when a sentinel announces that the master moved elsewhere.
        self.on_failover: Callable[[str], None] = lambda reason: None
        self._listener: asyncio.Task[None] | None = None

    async def locate(self) -> RedisAddress:
        """The master's address, checked to be a master."""
        if self._listener is None:
            self._listener = asyncio.ensure_future(self._listen_for_failovers())
        host, port = await self._ask_sentinels()
        config = self._config
        try:
            master = _address(host, port, config.db, config.username, config.password)
        except ValueError as exc:
            raise StoreUnavailable(f"the sentinels name {host!r} as the master, which is no address") from exc
        try:
            role = await _ask(master, self.timeout, "ROLE")
        except RedisReplyError as exc:
            raise StoreUnavailable(f"the master {_text(host, port)} did not say its role ({exc})") from exc
        if not role or role[0] != "master":
            raise StoreUnavailable(f"the sentinels name {_text(host, port)} as the master of {self.name!r}, "
                                   f"but it is a {role[0] if role else 'server without a role'}")
        if self.current != (host, port):
            # Said once per master: at the start, and after each failover.
            log.log(logging.INFO if self.current is None else logging.WARNING,
                    "Redis master of %r: %s", self.name, _text(host, port))
            self.current = (host, port)
        return master

    async def _ask_sentinels(self) -> tuple[str, int]:
        reasons = []
        for index, sentinel in enumerate(self.sentinels):
            where = _text(sentinel.host, sentinel.port)
            try:
                reply = await _ask(sentinel, self.timeout, "SENTINEL", "get-master-addr-by-name", self.name)
            except (StoreUnavailable, RedisReplyError) as exc:
                reasons.append(f"{where}: {exc}")
                continue
            if not reply:
                reasons.append(f"{where}: no master named {self.name!r}")
                continue
            if not (isinstance(reply, list) and len(reply) == 2 and str(reply[1]).isdigit()):
                reasons.append(f"{where}: unreadable answer {reply!r:.100}")
                continue
            if index:
                # The sentinel that answered is asked first from now on.
                self.sentinels.insert(0, self.sentinels.pop(index))
            return str(reply[0]), int(reply[1])
        raise StoreUnavailable(f"no sentinel named the master of {self.name!r} ({'; '.join(reasons)})")

    def _moved(self, master: tuple[str, int]) -> None:
        if self.current is not None and master != self.current:
            self.on_failover(f"failover: the master of {self.name!r} is now {_text(*master)}")

    async def _listen_for_failovers(self) -> None:
        while True:
            for sentinel in list(self.sentinels):
                try:
                    await self._listen(sentinel)
                except (TimeoutError, OSError, StoreUnavailable, hiredis.ProtocolError, ValueError):
                    pass  # the next one
            await asyncio.sleep(LISTEN_RETRY_SECONDS)

    async def _listen(self, sentinel: RedisAddress) -> None:
        """Subscribe to one sentinel's failover announcements, until its
        connection ends or it stops answering."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(sentinel.host, sentinel.port),
                                                self.timeout)
        try:
            commands = [*sentinel.setup_commands(), ("SUBSCRIBE", "+switch-master")]
            writer.write(b"".join(hiredis.pack_command(command) for command in commands))
            replies = hiredis.Reader(encoding="utf-8", errors="replace")
            answer_due = True  # within the timeout
            while True:
                try:
                    data = await asyncio.wait_for(reader.read(65536),
                                                  self.timeout if answer_due else LISTEN_PING_SECONDS)
                except TimeoutError:
                    if answer_due:
                        return  # a sentinel that does not answer is no one to listen to
                    writer.write(hiredis.pack_command(("PING",)))
                    answer_due = True
                    continue
                if not data:
                    return
                answer_due = False
                replies.feed(data)
                while (reply := replies.gets()) is not False:
                    await self._announced(reply)
        finally:
            writer.close()

    async def _announced(self, reply: Any) -> None:
        if isinstance(reply, hiredis.ReplyError):
            raise StoreUnavailable(str(reply))  # a wrong sentinel_password
        if not isinstance(reply, list) or len(reply) != 3:
            return  # AUTH's OK, PING's pong
        if reply[0] == "subscribe":
            # A failover may have happened while no sentinel was listened to.
            with contextlib.suppress(StoreUnavailable):
                self._moved(await self._ask_sentinels())
        elif reply[0] == "message":
            # "<name> <old host> <old port> <new host> <new port>"
            fields = str(reply[2]).split()
            if len(fields) == 5 and fields[0] == self.name and fields[4].isdigit():
                self._moved((fields[3], int(fields[4])))

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            self._listener = None


async def _ask(address: RedisAddress, timeout: float, *command: Any) -> Any:
    """One command on a connection of its own, closed afterwards."""
    client = PipelinedRedis(address, timeout)
    try:
        return await client.execute(*command)
    finally:
        await client.close()


def _address(host: str, port: int, db: int, username: str | None, password: str | None) -> RedisAddress:
    credentials = ""
    if password is not None:
        credentials = f"{quote(username or '', safe='')}:{quote(password, safe='')}@"
    return RedisAddress(f"redis://{credentials}{_text(host, port)}/{db}")


def _text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
