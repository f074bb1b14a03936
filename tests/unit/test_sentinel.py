"""Finding the master through Redis Sentinel, against scripted fake
sentinels and servers: who is asked, in what order, within what time, and
what makes the store unavailable."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from sidecar.config import SentinelConfig
from sidecar.store import StoreUnavailable
from sidecar.store import sentinel as sentinel_module
from sidecar.store.redis_pipeline import PipelinedRedis
from sidecar.store.sentinel import sentinel_client
from tests.unit.test_redis_pipeline import PATIENT, TIMEOUT, FakeRedis, ok, run, silent

MASTER = "main"


def resp(value: Any) -> bytes:
    """``value`` in the Redis protocol: text, integers, lists, None."""
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, int):
        return f":{value}\r\n".encode()
    if isinstance(value, list):
        return f"*{len(value)}\r\n".encode() + b"".join(resp(item) for item in value)
    return ok(str(value))


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


class FakeSentinel(FakeRedis):
    """Names ``master`` (a port, or None: no such master) and keeps the
    connection of its subscriber, to announce a failover on."""

    def __init__(self, master: int | None) -> None:
        super().__init__(self._answer)
        self.master = master
        self.subscriber: asyncio.StreamWriter | None = None
        self.stuck = False  # it stops answering its subscriber's PING

    async def _answer(self, command: list[str]) -> bytes | None:
        if command[0] == "SENTINEL" and command[1:] == ["get-master-addr-by-name", MASTER]:
            return resp(None if self.master is None else ["127.0.0.1", str(self.master)])
        if command[0] == "PING":
            return None if self.stuck else resp(["pong", ""])
        if command[0] == "SUBSCRIBE":
            self.subscriber = self.writer
            return resp(["subscribe", "+switch-master", 1])
        return ok("OK")

    def fail_over(self, port: int) -> None:
        """Name the master on ``port`` from now on, and say so."""
        assert self.subscriber is not None
        self.subscriber.write(resp(["message", "+switch-master",
                                    f"{MASTER} 127.0.0.1 {self.master} 127.0.0.1 {port}"]))
        self.master = port


class FakeServer(FakeRedis):
    """Says it is a ``role`` and echoes every other command's last word."""

    def __init__(self, role: str = "master") -> None:
        super().__init__(self._answer)
        self.role = role

    async def _answer(self, command: list[str]) -> bytes:
        if command[0] == "ROLE":
            return resp([self.role, 0, []])
        return ok(command[-1])


async def reaches(client: PipelinedRedis, server: FakeRedis) -> bool:
    """Whether commands reach ``server`` within a second (one in flight
    when the connection is dropped fails)."""
    deadline = time.monotonic() + 1
    while ["ECHO", "here?"] not in server.commands and time.monotonic() < deadline:
        with contextlib.suppress(StoreUnavailable):
            await client.execute("ECHO", "here?")
    return ["ECHO", "here?"] in server.commands


def settings(*ports: int, **fields: Any) -> SentinelConfig:
    return SentinelConfig.model_validate({"master": MASTER, "nodes": [f"127.0.0.1:{port}" for port in ports],
                                          **fields})


async def started(*fakes: FakeRedis) -> list[int]:
    return [port_of(await fake.start()) for fake in fakes]


def test_commands_go_to_the_master_the_sentinels_name_once_it_says_it_is_one() -> None:
    async def test() -> None:
        master = FakeServer()
        sentinel = FakeSentinel(*await started(master))
        client = sentinel_client(settings(*await started(sentinel)), PATIENT)
        assert await client.execute("ECHO", "decided") == "decided"
        assert ["SENTINEL", "get-master-addr-by-name", MASTER] in sentinel.commands
        # ROLE on a connection of its own, then the commands on another.
        assert master.commands == [["ROLE"], ["ECHO", "decided"]] and master.connections == 2
        await client.close()
    run(test)


def test_sentinels_down_or_silent_are_passed_over_each_within_the_timeout() -> None:
    async def test() -> None:
        master = FakeServer()
        down, stuck, answering = FakeRedis(silent), FakeRedis(silent), FakeSentinel(*await started(master))
        ports = await started(down, stuck, answering)
        await down.stop()  # its port refuses connections
        client = sentinel_client(settings(*ports), TIMEOUT)
        began = time.monotonic()
        assert await client.execute("ECHO", "x") == "x"
        assert TIMEOUT <= time.monotonic() - began < 3 * TIMEOUT
        # The sentinel that answered is asked first from now on.
        client.drop("test")
        asked_before = len(stuck.commands)
        began = time.monotonic()
        assert await client.execute("ECHO", "y") == "y"
        assert time.monotonic() - began < TIMEOUT and len(stuck.commands) == asked_before
        await client.close()
    run(test)


def test_a_named_master_that_is_a_replica_is_not_used() -> None:
    async def test() -> None:
        demoted = FakeServer(role="slave")
        sentinel = FakeSentinel(*await started(demoted))
        client = sentinel_client(settings(*await started(sentinel)), PATIENT)
        with pytest.raises(StoreUnavailable, match="is a slave"):
            await client.execute("EVALSHA", "digest", 0)
        assert demoted.commands == [["ROLE"]]
        await client.close()
    run(test)


def test_without_a_sentinel_naming_the_master_the_store_is_unavailable_with_each_reason() -> None:
    async def test() -> None:
        unaware, down = FakeSentinel(None), FakeSentinel(None)
        ports = await started(unaware, down)
        await down.stop()
        client = sentinel_client(settings(*ports), PATIENT)
        with pytest.raises(StoreUnavailable) as info:
            await client.execute("PING")
        message = str(info.value)
        assert f"127.0.0.1:{ports[0]}: no master named {MASTER!r}" in message
        assert f"127.0.0.1:{ports[1]}: cannot connect" in message
        await client.close()
    run(test)


def test_an_announced_failover_drops_the_connection_and_the_next_command_goes_to_the_new_master() -> None:
    async def test() -> None:
        old, new = FakeServer(), FakeServer()
        old_port, new_port = await started(old, new)
        sentinel = FakeSentinel(old_port)
        client = sentinel_client(settings(*await started(sentinel)), PATIENT)
        assert await client.execute("ECHO", "before") == "before"
        while sentinel.subscriber is None:
            await asyncio.sleep(0.001)
        sentinel.fail_over(new_port)
        # The old master is still up and answering: only the announcement
        # can move the connection (and fail a command in flight then).
        assert await reaches(client, new)
        await client.close()
    run(test)


def test_passwords_and_the_database_are_sent_where_they_belong() -> None:
    async def test() -> None:
        master = FakeServer()
        sentinel = FakeSentinel(*await started(master))
        client = sentinel_client(settings(*await started(sentinel), db=3, username="app", password="s@cret",
                                          sentinel_password="watch"), PATIENT)
        await client.execute("PING")
        assert sentinel.commands[0] == ["AUTH", "watch"]
        assert master.commands[:3] == [["AUTH", "app", "s@cret"], ["SELECT", "3"], ["ROLE"]]
        assert master.commands[3:5] == [["AUTH", "app", "s@cret"], ["SELECT", "3"]]
        await client.close()
    run(test)


def test_a_sentinel_listened_to_that_stops_answering_is_replaced_by_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sentinel_module, "LISTEN_PING_SECONDS", 0.05)

    async def test() -> None:
        old, new = FakeServer(), FakeServer()
        old_port, new_port = await started(old, new)
        first, second = FakeSentinel(old_port), FakeSentinel(old_port)
        client = sentinel_client(settings(*await started(first, second)), TIMEOUT)
        await client.execute("PING")
        while first.subscriber is None:
            await asyncio.sleep(0.001)
        first.stuck = True
        while second.subscriber is None:
            await asyncio.sleep(0.001)
        assert first.commands.count(["PING"]) == 1  # its one chance
        second.fail_over(new_port)
        first.master = new_port
        assert await reaches(client, new)
        await client.close()
    run(test)
