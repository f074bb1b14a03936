"""A Redis Cluster: every key on the master that serves its hash slot.

Each master gets one pipelined connection (``PipelinedRedis``), so the
commands of every decision in flight that go to one master leave in one
write, and those that go to different masters travel in parallel. The slot
map comes from ``CLUSTER SLOTS``, asked of the configured nodes and then of
every master known, on first use and again whenever a master moved a slot
(``MOVED``), could not be reached, or the map had a hole. A slot being
migrated (``ASK``) is followed for that one command.

What a cluster gives up, and what a caller must group by slot, is the
store's business (``sidecar.store.redis``); this module only routes.
"""

from __future__ import annotations

import asyncio
import binascii
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from sidecar.store import StoreUnavailable
from sidecar.store.redis_pipeline import PipelinedRedis, RedisAddress, RedisReplyError

SLOTS = 16384

Node = tuple[str, int]


def key_slot(key: str) -> int:
    """The key's hash slot, as Redis computes it: CRC16 (XMODEM, which
    ``binascii.crc_hqx`` with 0 is) of the key, or of its hash tag, the
    text between the first ``{`` and the next ``}`` when that is not empty."""
    data = key.encode()
    start = data.find(b"{")
    if start != -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1:end]
    return binascii.crc_hqx(data, 0) & (SLOTS - 1)


def parse_node(text: str) -> Node:
    """``HOST:PORT`` (an IPv6 host in brackets, or bare before the last colon)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


class ClusterRedis:
    """Commands routed to the master of their key's slot."""

    clustered = True

    def __init__(self, nodes: Sequence[Node], address: RedisAddress, timeout: float) -> None:
        self.address = address  # credentials and TLS, for every node
        self.timeout = timeout
        self._seeds = list(nodes)
        self._clients: dict[Node, PipelinedRedis] = {}
        self._slots: list[Node | None] = []  # empty until the first map
        self._scripts: dict[str, str] = {}
        self._refreshing: asyncio.Future[None] | None = None

    # -- what PipelinedRedis offers, routed ----------------------------------

    def script(self, source: str) -> str:
        for client in self._clients.values():
            client.script(source)
        digest = PipelinedRedis.digest(source)
        self._scripts[digest] = source
        return digest

    def forget(self, digest: str) -> None:
        self._scripts.pop(digest, None)
        for client in self._clients.values():
            client.forget(digest)

    @staticmethod
    def slot(key: str) -> int:
        return key_slot(key)

    async def evalsha(self, digest: str, keys: list[str], args: list[Any]) -> Any:
        """The script on the master of its keys' slot (all of them in one)."""
        return await self._routed(key_slot(keys[0]),
                                  lambda client: client.evalsha(digest, keys, args),
                                  lambda client: client.asking_evalsha(digest, keys, args))

    async def execute(self, key: str, *command: Any) -> Any:
        """A one-key command on the master of the key's slot."""
        return await self._routed(key_slot(key), lambda client: client.execute(*command),
                                  lambda client: client.asking(*command))

    async def masters(self) -> list[PipelinedRedis]:
        """A connection to every master (for a command each must answer: SCAN)."""
        await self._mapped()
        return [self._client(node) for node in dict.fromkeys(self._slots) if node is not None]

    async def scan(self, pattern: str) -> list[str]:
        """The names of the keys that match, from every master (for listing)."""
        masters = await self.masters()
        try:
            found = await asyncio.gather(*(self._scan(master, pattern) for master in masters))
        except StoreUnavailable:
            self._refresh_soon()
            raise
        return [name for names in found for name in names]

    @staticmethod
    async def _scan(client: PipelinedRedis, pattern: str) -> list[str]:
        names: list[str] = []
        cursor = "0"
        while True:
            cursor, batch = await client.execute("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
            names.extend(batch)
            if cursor == "0":
                return names

    async def open(self) -> None:
        """Read the slot map and connect to every master now."""
        await self._mapped()
        await asyncio.gather(*(self._client(node).open() for node in {n for n in self._slots if n is not None}))

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()

    # -- routing -------------------------------------------------------------

    async def _routed(self, slot: int, call: Callable[[PipelinedRedis], Awaitable[Any]],
                      asking: Callable[[PipelinedRedis], Awaitable[Any]]) -> Any:
        node = await self._master(slot)
        for _ in range(3):
            try:
                return await call(self._client(node))
            except RedisReplyError as exc:
                kind, _, rest = str(exc).partition(" ")
                if kind == "MOVED":
                    # The slot has a new master for good: remember it now,
                    # and learn the rest of the new map in the background.
                    node = parse_node(rest.split()[1])
                    self._slots[slot] = node
                    self._refresh_soon()
                elif kind == "ASK":
                    # Being migrated: this one key may already be there.
                    return await asking(self._client(parse_node(rest.split()[1])))
                elif kind in ("CLUSTERDOWN", "TRYAGAIN"):
                    self._refresh_soon()
                    raise StoreUnavailable(f"Redis Cluster: {exc}") from exc
                else:
                    raise
            except StoreUnavailable:
                # The master may have failed over: its replica takes the
                # slots, and the next map says so.
                self._refresh_soon()
                raise
        raise StoreUnavailable(f"Redis Cluster kept moving slot {slot}")

    async def _master(self, slot: int) -> Node:
        await self._mapped()
        node = self._slots[slot]
        if node is None:
            self._refresh_soon()
            raise StoreUnavailable(f"no Redis Cluster master serves slot {slot}")
        return node

    def _client(self, node: Node) -> PipelinedRedis:
        client = self._clients.get(node)
        if client is None:
            client = self._clients[node] = PipelinedRedis.at(self.address, node, self.timeout)
            for source in self._scripts.values():
                client.script(source)
        return client

    async def _mapped(self) -> None:
        if not self._slots:
            await self._refresh()

    def _refresh_soon(self) -> None:
        if self._refreshing is None:
            task = asyncio.ensure_future(self._refresh())
            task.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def _refresh(self) -> None:
        # Callers that arrive while the map is being read share the reading.
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._read_map())
        refreshing = self._refreshing
        try:
            await asyncio.shield(refreshing)
        finally:
            if refreshing.done() and self._refreshing is refreshing:
                self._refreshing = None

    async def _read_map(self) -> None:
        known = [node for node in dict.fromkeys(self._slots) if node is not None]
        failures = []
        for node in dict.fromkeys([*known, *self._seeds]):
            try:
                reply = await self._client(node).execute("CLUSTER", "SLOTS")
            except (StoreUnavailable, RedisReplyError) as exc:
                failures.append(f"{node[0]}:{node[1]}: {exc}")
                continue
            slots: list[Node | None] = [None] * SLOTS
            for first, last, master, *_replicas in reply:
                # An empty host means the node that answered.
                where = (master[0] or node[0], int(master[1]))
                slots[int(first):int(last) + 1] = [where] * (int(last) - int(first) + 1)
            self._slots = slots
            return
        raise StoreUnavailable("no Redis Cluster node gave its slot map (" + "; ".join(failures) + ")")
