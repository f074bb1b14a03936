"""The pipelined Redis connection against a scripted fake server: what is a
failure (refused, reset, silence) and what is only a queue (slow progress)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import hiredis
import pytest
import uvloop

from sidecar.store import StoreUnavailable
from sidecar.store.redis_pipeline import NoScriptError, PipelinedRedis, RedisAddress

TIMEOUT = 0.1
# For tests whose subject is not the timeout: a loaded machine may take
# longer than TIMEOUT to accept a loopback connection.
PATIENT = 5.0

Reply = Callable[[list[str]], Awaitable[bytes | None]]


class FakeRedis:
    """Answers each command with what ``reply`` returns (None: says nothing)."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.commands: list[list[str]] = []
        self.connections = 0
        self.writer: asyncio.StreamWriter | None = None  # the connection of the command being answered
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        parser = hiredis.Reader(encoding="utf-8")
        try:
            while data := await reader.read(65536):
                parser.feed(data)
                while (command := parser.gets()) is not False:
                    self.commands.append(command)
                    self.writer = writer
                    answer = await self.reply(command)
                    if answer is not None:
                        writer.write(answer)
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


def ok(value: str = "ok") -> bytes:
    return f"${len(value)}\r\n{value}\r\n".encode()


async def answer_at_once(command: list[str]) -> bytes:
    return ok(command[-1])


async def silent(command: list[str]) -> None:
    return None


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def test_many_callers_share_one_connection_and_get_their_own_replies() -> None:
    async def test() -> None:
        fake = FakeRedis(answer_at_once)
        client = PipelinedRedis(await fake.start(), PATIENT)
        replies = await asyncio.gather(*(client.execute("ECHO", str(n)) for n in range(1000)))
        assert replies == [str(n) for n in range(1000)]
        assert fake.connections == 1
        await client.close()
        await fake.stop()
    run(test)


def test_a_slow_redis_that_keeps_answering_is_a_queue_not_a_failure() -> None:
    async def slow(command: list[str]) -> bytes:
        await asyncio.sleep(TIMEOUT * 0.6)  # each answer well inside the timeout
        return ok(command[-1])

    async def test() -> None:
        fake = FakeRedis(slow)
        client = PipelinedRedis(await fake.start(), TIMEOUT)
        started = time.monotonic()
        # The last reply comes after 5 x 0.6 timeouts: more than the timeout
        # after it was sent, but Redis answered something all along.
        replies = await asyncio.gather(*(client.execute("ECHO", str(n)) for n in range(5)))
        assert replies == ["0", "1", "2", "3", "4"]
        assert time.monotonic() - started > 2 * TIMEOUT
        await client.close()
        await fake.stop()
    run(test)


def test_a_silent_redis_fails_every_waiting_command_after_the_timeout() -> None:
    async def test() -> None:
        fake = FakeRedis(silent)
        client = PipelinedRedis(await fake.start(), TIMEOUT)
        started = time.monotonic()
        results = await asyncio.gather(*(client.execute("ECHO", "x") for _ in range(50)),
                                       return_exceptions=True)
        took = time.monotonic() - started
        assert all(isinstance(result, StoreUnavailable) for result in results)
        assert TIMEOUT <= took < 3 * TIMEOUT
        await fake.stop()
    run(test)


def fake_in_a_thread(reply: Reply) -> str:
    """A FakeRedis on an event loop of its own thread: it answers while the
    test's loop is blocked. Its URL."""
    url: list[str] = []
    ready = threading.Event()

    async def serve() -> None:
        url.append(await FakeRedis(reply).start())
        ready.set()
        await asyncio.Event().wait()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    assert ready.wait(5)
    return url[0]


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_a_loop_too_busy_to_read_the_replies_is_not_a_silent_redis(
        new_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
    """Sluice's own load (a burst of checks to parse) must not pass for an
    outage: Redis answered in time, the replies wait in the socket."""
    url = fake_in_a_thread(answer_at_once)

    async def test() -> None:
        client = PipelinedRedis(url, TIMEOUT)
        await client.execute("PING")
        replies = [asyncio.ensure_future(client.execute("ECHO", str(n))) for n in range(10)]
        asyncio.get_running_loop().call_soon(time.sleep, 3 * TIMEOUT)  # the loop is busy
        assert await asyncio.gather(*replies) == [str(n) for n in range(10)]
        await client.close()

    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(test())


# How a first command fails: the fake server drops the connection (None),
# or answers that it cannot take commands now (a replica, such as a master
# a failover demoted; a server loading its data; a replica without master).
@pytest.mark.parametrize("failure", [
    None,
    b"-READONLY You can't write against a read only replica.\r\n",
    b"-LOADING Redis is loading the dataset in memory\r\n",
    b"-MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.\r\n",
], ids=["reset", "READONLY", "LOADING", "MASTERDOWN"])
def test_a_failure_is_unavailable_at_once_and_the_next_command_connects_again(failure: bytes | None) -> None:
    calls = 0

    async def fail_first(command: list[str]) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:
            if failure is None:
                raise ConnectionResetError
            return failure
        return ok(command[-1])

    async def test() -> None:
        fake = FakeRedis(fail_first)
        client = PipelinedRedis(await fake.start(), PATIENT)
        with pytest.raises(StoreUnavailable, match=failure.split()[0][1:].decode() if failure else "lost"):
            await client.execute("EVALSHA", "digest", 0)
        # After a failover, the new connection goes to the new master.
        assert await client.execute("ECHO", "again") == "again"
        assert fake.connections == 2
        await client.close()
        await fake.stop()
    run(test)


def test_a_refused_connection_is_unavailable_at_once() -> None:
    async def test() -> None:
        fake = FakeRedis(answer_at_once)
        url = await fake.start()
        await fake.stop()
        client = PipelinedRedis(url, TIMEOUT)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await client.execute("PING")
        assert time.monotonic() - started < TIMEOUT
    run(test)


def test_an_error_reply_is_an_error_not_an_outage() -> None:
    async def error(command: list[str]) -> bytes:
        return b"-ERR user_script:1: boom\r\n"

    async def test() -> None:
        fake = FakeRedis(error)
        client = PipelinedRedis(await fake.start(), PATIENT)
        with pytest.raises(Exception) as info:
            await client.execute("EVAL", "x", 0)
        assert not isinstance(info.value, StoreUnavailable) and "boom" in str(info.value)
        await client.close()
        await fake.stop()
    run(test)


def test_an_unknown_script_digest_runs_the_script_by_its_source() -> None:
    async def no_script_cache(command: list[str]) -> bytes:
        if command[0] == "EVALSHA":
            return b"-NOSCRIPT No matching script\r\n"
        return ok(command[0])

    async def test() -> None:
        fake = FakeRedis(no_script_cache)
        client = PipelinedRedis(await fake.start(), PATIENT)
        digest = client.script("return 1")
        assert await client.evalsha(digest, ["k"], ["a"]) == "EVAL"
        assert fake.commands[-1] == ["EVAL", "return 1", "1", "k", "a"]
        with pytest.raises(NoScriptError):
            await client.execute("EVALSHA", digest, 0)
        await client.close()
        await fake.stop()
    run(test)


def test_a_password_and_database_are_sent_when_connecting() -> None:
    async def test() -> None:
        fake = FakeRedis(lambda command: asyncio.sleep(0, ok()))
        port = (await fake.start()).rsplit(":", 1)[1].split("/")[0]
        client = PipelinedRedis(f"redis://app:s%40cret@127.0.0.1:{port}/3", PATIENT)
        client.script("return 2")
        await client.execute("PING")
        assert fake.commands[:3] == [["AUTH", "app", "s@cret"], ["SELECT", "3"], ["SCRIPT", "LOAD", "return 2"]]
        await client.close()
        await fake.stop()
    run(test)


@pytest.mark.parametrize("url, where", [
    ("redis://10.1.2.3:6380/2", ("10.1.2.3", 6380, None, 2)),
    ("redis://[::1]/0", ("::1", 6379, None, 0)),
    ("unix:///run/valkey.sock?db=4", ("127.0.0.1", 6379, "/run/valkey.sock", 4)),
])
def test_addresses_from_urls(url: str, where: tuple) -> None:
    address = RedisAddress(url)
    assert (address.host, address.port, address.path, address.db) == where


def test_an_unknown_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="redis://"):
        RedisAddress("http://127.0.0.1:6379")


def test_the_locator_is_asked_before_every_connection() -> None:
    async def test() -> None:
        servers = [FakeRedis(answer_at_once), FakeRedis(answer_at_once)]
        addresses = [RedisAddress(await server.start()) for server in servers]

        class Moving:
            """Names the first server, then the second."""
            asked = 0
            closed = False

            async def locate(self) -> RedisAddress:
                self.asked += 1
                return addresses[self.asked - 1]

            async def close(self) -> None:
                self.closed = True

        locator = Moving()
        client = PipelinedRedis(locator, PATIENT)
        assert await client.execute("ECHO", "first") == "first"
        assert await client.execute("ECHO", "same connection") == "same connection"
        client.drop("moved")
        assert await client.execute("ECHO", "second") == "second"
        await client.close()
        assert (locator.asked, locator.closed) == (2, True)
        assert [server.commands for server in servers] == [
            [["ECHO", "first"], ["ECHO", "same connection"]], [["ECHO", "second"]]]
        for server in servers:
            await server.stop()
    run(test)


def test_dropping_the_connection_fails_the_commands_waiting_on_it() -> None:
    async def test() -> None:
        fake = FakeRedis(silent)
        client = PipelinedRedis(await fake.start(), 10.0)
        waiting = asyncio.ensure_future(client.execute("ECHO", "x"))
        while not fake.commands:
            await asyncio.sleep(0.001)
        client.drop("failover: the master is now elsewhere")
        with pytest.raises(StoreUnavailable, match="failover"):
            await waiting
        await client.close()
        await fake.stop()
    run(test)


def test_dropping_while_a_connection_is_being_made_voids_that_connection() -> None:
    async def test() -> None:
        fake = FakeRedis(answer_at_once)
        address = RedisAddress(await fake.start())
        located = asyncio.Event()
        release = asyncio.Event()

        class Slow:
            async def locate(self) -> RedisAddress:
                located.set()
                await release.wait()
                return address

            async def close(self) -> None:
                pass

        client = PipelinedRedis(Slow(), TIMEOUT)
        first = asyncio.ensure_future(client.execute("ECHO", "to the old master"))
        await located.wait()
        client.drop("failover")  # the address being connected to is stale
        release.set()
        with pytest.raises(StoreUnavailable, match="given up"):
            await first
        assert await client.execute("ECHO", "again") == "again"
        assert ["ECHO", "to the old master"] not in fake.commands and fake.connections == 2
        await client.close()
        await fake.stop()
    run(test)
