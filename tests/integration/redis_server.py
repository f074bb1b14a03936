"""A throwaway redis-server for integration tests."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from tests.integration.clients import LOOPBACK
from tests.integration.conftest import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    """A throwaway redis-server: loopback only, nothing saved to disk."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.directory = directory
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def start(self, *options: str) -> None:
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", LOOPBACK, "--save", "",
             "--appendonly", "no", "--dir", str(self.directory), *options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def client(self) -> redis.Redis:
        return redis.Redis(host=LOOPBACK, port=self.port, decode_responses=True)


class RedisCluster:
    """A throwaway Redis Cluster of three masters on loopback, made the way
    an operator makes one: three ``redis-server --cluster-enabled yes``,
    then ``redis-cli --cluster create``."""

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.nodes = [RedisServer(directory / f"node-{i}") for i in range(masters)]
        self.bus_ports = [free_port() for _ in range(masters)]

    @property
    def addresses(self) -> list[str]:
        return [f"{LOOPBACK}:{node.port}" for node in self.nodes]

    def start(self) -> None:
        for node, bus in zip(self.nodes, self.bus_ports):
            node.directory.mkdir(parents=True, exist_ok=True)
            node.start("--cluster-enabled", "yes", "--cluster-port", str(bus),
                       "--cluster-config-file", str(node.directory / "nodes.conf"))
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
