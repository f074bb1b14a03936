"""Throwaway redis-servers for integration tests: a server, a replica of
one, and a group of sentinels watching them."""

from __future__ import annotations

import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from tests.integration.clients import LOOPBACK
from tests.integration.conftest import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    """A throwaway redis-server: loopback only, nothing saved to disk.
    ``arguments`` are added to its command line (``--replicaof H P``)."""

    def __init__(self, directory: Path, arguments: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.arguments = list(arguments)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def command(self) -> list[str]:
        return [REDIS_SERVER, "--port", str(self.port), "--bind", LOOPBACK, "--save", "",
                "--appendonly", "no", "--dir", str(self.directory), *self.arguments]

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, move: bool = False) -> None:
        """Start (or start again, on the same port) and wait until it
        answers. The server that answers must be this process: a port found
        free can be taken before this one binds it, and a test must never
        share another's server. With ``move`` (nothing knows the port yet)
        another free port is tried then; otherwise the reason is raised."""
        for _ in range(5):
            if self._started():
                return
            if not move:
                break
            self.port = free_port()
        raise RuntimeError(f"redis-server could not bind port {self.port}, taken by another process: "
                           f"{' '.join(self.command())}")

    def _started(self) -> bool:
        """Run the server; True once this process answers on the port, False
        when it exited (the port was taken)."""
        self.process = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    if client.info("server")["process_id"] == self.process.pid:
                        return True
                except redis.exceptions.RedisError:
                    pass  # not listening yet, or another server that is not this one
                if self.process.poll() is not None:
                    return False
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start: {' '.join(self.command())}")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL: no goodbye to its clients but what the kernel sends."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def client(self) -> redis.Redis:
        return redis.Redis(host=LOOPBACK, port=self.port, decode_responses=True)


class Sentinel(RedisServer):
    """``redis-server --sentinel`` with a configuration file of its own
    (sentinels rewrite theirs)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.config = directory / f"sentinel-{self.port}.conf"
        self.id = secrets.token_hex(20)

    def configure(self, master: str, master_port: int, replica_ports: Sequence[int],
                  others: Sequence[Sentinel], down_after_ms: int, failover_timeout_ms: int) -> None:
        """Watch ``master``; the replicas and the other sentinels are known
        from the start, so that no discovery delays the first failover."""
        lines = [f"port {self.port}", f"bind {LOOPBACK}", f"dir {self.directory}", f"sentinel myid {self.id}",
                 f"sentinel monitor {master} {LOOPBACK} {master_port} {len(others) // 2 + 1}",
                 f"sentinel down-after-milliseconds {master} {down_after_ms}",
                 f"sentinel failover-timeout {master} {failover_timeout_ms}",
                 f"sentinel parallel-syncs {master} 1"]
        lines += [f"sentinel known-replica {master} {LOOPBACK} {port}" for port in replica_ports]
        lines += [f"sentinel known-sentinel {master} {LOOPBACK} {other.port} {other.id}" for other in others]
        self.config.write_text("\n".join(lines) + "\n")

    def command(self) -> list[str]:
        return [REDIS_SERVER, str(self.config), "--sentinel"]


class SentinelGroup:
    """A master, one replica of it and three sentinels, on loopback, with
    short timers so that a failover takes about a second."""

    MASTER = "sluice-test"

    def __init__(self, directory: Path, down_after_ms: int = 400, failover_timeout_ms: int = 2000) -> None:
        while True:
            # A replica's first sync starts at once, not after the default 5 s.
            self.servers = [RedisServer(directory / name, ["--repl-diskless-sync-delay", "0"]) for name in "ab"]
            self.sentinels = [Sentinel(directory / f"s{number}") for number in range(3)]
            # Each port found free on its own: two may be the same one.
            if len({server.port for server in (*self.servers, *self.sentinels)}) == 5:
                break
        self.servers[1].arguments += ["--replicaof", LOOPBACK, str(self.servers[0].port)]
        for sentinel in self.sentinels:
            sentinel.configure(self.MASTER, self.servers[0].port, [self.servers[1].port],
                               [other for other in self.sentinels if other is not sentinel],
                               down_after_ms, failover_timeout_ms)

    def start(self) -> None:
        try:
            for server in (*self.servers, *self.sentinels):
                server.start()
            # The sentinels know the replica and each other before a
            # failover can be asked of them.
            deadline = time.monotonic() + 20
            while not all(self._ready(sentinel) for sentinel in self.sentinels):
                if time.monotonic() > deadline:
                    raise RuntimeError("the sentinels did not find the replica and each other")
                time.sleep(0.05)
            # After its first sync a replica is sent its master's writes
            # only once it has acknowledged the sync, up to a second later:
            # a master killed before then leaves a replica with nothing.
            master = self.servers[0].client()
            master.set("sluice-test:streaming", "1")
            if master.wait(1, 10_000) < 1:
                raise RuntimeError("the replica was not sent its master's writes within 10 s")
            master.delete("sluice-test:streaming")
        except BaseException:
            self.stop()  # nothing left running
            raise

    def _ready(self, sentinel: Sentinel) -> bool:
        master = sentinel.client().sentinel_master(self.MASTER)
        return bool(master["num-slaves"] == 1 and master["num-other-sentinels"] == 2
                    and self.servers[1].client().info("replication")["master_link_status"] == "up")

    def stop(self) -> None:
        for server in (*self.sentinels, *self.servers):
            server.stop()

    @property
    def nodes(self) -> list[str]:
        return [f"{LOOPBACK}:{sentinel.port}" for sentinel in self.sentinels]

    def master(self) -> RedisServer:
        """The server the sentinels name as master now."""
        host, port = self.sentinels[0].client().sentinel_get_master_addr_by_name(self.MASTER)
        return next(server for server in self.servers if server.port == int(port))


class RedisCluster:
    """A throwaway Redis Cluster of three masters on loopback, made the way
    an operator makes one: three ``redis-server --cluster-enabled yes``,
    then ``redis-cli --cluster create``."""

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.bus_ports = [free_port() for _ in range(masters)]
        self.nodes = [RedisServer(directory / f"node-{i}", [
            "--cluster-enabled", "yes", "--cluster-port", str(bus),
            "--cluster-config-file", str(directory / f"node-{i}" / "nodes.conf")])
            for i, bus in enumerate(self.bus_ports)]

    @property
    def addresses(self) -> list[str]:
        return [f"{LOOPBACK}:{node.port}" for node in self.nodes]

    def start(self) -> None:
        for node in self.nodes:
            node.directory.mkdir(parents=True, exist_ok=True)
            node.start(move=True)
        subprocess.run([shutil.which("redis-cli") or "/usr/bin/redis-cli", "--cluster", "create",
                        *self.addresses, "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        deadline = time.monotonic() + 20
        while not all(node.client().cluster("info")["cluster_state"] == "ok" for node in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not become ready")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def flush(self) -> None:
        for node in self.nodes:
            node.client().flushall()
