"""A flood through the shipped proxy configurations: ``sluice serve``, nginx
or Envoy configured by ``sluice config``, an upstream that counts what
reaches it, wrk as the flood and an honest client beside it.

Used by the flood integration tests (a few seconds each) and by
bench/bench_flood.py (the full matrix). Loopback only; every process is
stopped when the stack is.
"""

from __future__ import annotations

import http.client
import re
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from devstack.launcher import find_envoy, find_nginx
from sidecar.rendering import nginx_main_config
from tests.integration.clients import LOOPBACK
from tests.integration.conftest import free_port, metric_at
from tests.processes import stop_process

# Where the honest client comes from: another address than the flood's;
# and the address of the probe that waits for the chain to answer.
HONEST_SOURCE = "127.0.0.2"
PROBE_SOURCE = "127.0.0.3"
OPEN_FILES = 65_536  # or the hard limit, when lower
WRK = shutil.which("wrk") or "/usr/bin/wrk"


def _open_files() -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return OPEN_FILES if hard == resource.RLIM_INFINITY else min(OPEN_FILES, hard)


def _more_open_files() -> None:
    """In a child: as many open files as a flood of thousands needs."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_open_files(), hard))


def _wait_for_port(port: int, process: subprocess.Popen, what: str, log: Path, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((LOOPBACK, port), timeout=0.2).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start: {log.read_text(errors='replace')[-3000:]}") from None
            time.sleep(0.05)


class CountingUpstream:
    """nginx answering 200 to everything, one access log line per request:
    the application the flood must not reach beyond the budget."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.log = directory / "upstream-access.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        site = self.directory / "upstream-site.conf"
        site.write_text(f"server {{\n    listen {LOOPBACK}:{self.port} reuseport;\n"
                        f"    access_log {self.log} counted;\n"
                        "    keepalive_requests 100000;\n"
                        "    location / { return 200 \"ok\\n\"; }\n}\n")
        main = nginx_main_config(self.directory / "upstream", site)
        main = main.replace("http {\n", "http {\n    log_format counted '$remote_addr';\n", 1)
        (self.directory / "upstream" / "logs").mkdir(parents=True, exist_ok=True)
        (self.directory / "upstream" / "tmp").mkdir(parents=True, exist_ok=True)
        config = self.directory / "upstream-nginx.conf"
        config.write_text(main)
        errors = self.directory / "upstream-nginx.err"
        self.process = subprocess.Popen([find_nginx(), "-p", str(self.directory / "upstream"), "-c", str(config),
                                         "-g", "daemon off;"], stderr=errors.open("wb"), preexec_fn=_more_open_files)
        _wait_for_port(self.port, self.process, "the upstream nginx", errors)

    def requests(self) -> int:
        """Requests that reached the application so far."""
        return len(self.log.read_bytes().splitlines()) if self.log.exists() else 0

    def settled_requests(self, seconds: float = 5.0) -> int:
        """``requests`` once the count stops moving: the upstream writes a
        line when a request ends, after the flood's client has its answer."""
        count, deadline = self.requests(), time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.2)
            count, previous = self.requests(), count
            if count == previous:
                break
        return count

    def stop(self) -> None:
        stop_process(self.process, 15)


@dataclass
class FloodResult:
    requests: int  # what wrk completed
    reached: int  # what reached the application
    honest: list[tuple[int, float]] = field(default_factory=list)  # status, seconds
    closed: int = 0  # requests whose connection closed without an answer (wrk's read errors)

    def honest_p99(self) -> float:
        latencies = sorted(seconds for _, seconds in self.honest)
        return latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else 0.0


class FloodStack:
    """``sluice serve`` with ``rules``, behind ``door`` (``nginx`` with
    ``workers`` worker processes, or ``envoy`` with ``--concurrency
    workers``; with the proxy's own first tier, ``sluice config --guard``,
    when ``guard``), in front of a ``CountingUpstream``."""

    def __init__(self, directory: Path, rules: str, door: str = "nginx", workers: int = 1,
                 guard: bool = False) -> None:
        self.directory = directory
        self.guard = guard
        self.rules_text = rules
        self.door = door
        self.workers = workers
        self.upstream = CountingUpstream(directory)
        self.sluice_port = free_port()
        self.door_port = free_port()
        self.admin_port = free_port()
        self.sluice: subprocess.Popen | None = None
        self.proxy: subprocess.Popen | None = None
        self.sluice_log = directory / "sluice.log"

    def __enter__(self) -> FloodStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        rules = self.directory / "rules.yaml"
        rules.write_text(self.rules_text)
        self.upstream.start()
        self.sluice = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", "--config", str(rules), "--port", str(self.sluice_port),
             "--hook-udp", "off", "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=self.sluice_log.open("wb"))
        _wait_for_port(self.sluice_port, self.sluice, "sluice serve", self.sluice_log)
        out = self.directory / ("conf.d" if self.door == "nginx" else "envoy")
        target = "nginx" if self.door == "nginx" else "envoy"
        subprocess.run([sys.executable, "-m", "sidecar", "config", target, "--listen", f"{LOOPBACK}:{self.door_port}",
                        "--sluice", f"{LOOPBACK}:{self.sluice_port}", "--upstream", f"{LOOPBACK}:{self.upstream.port}",
                        "--envoy-admin-port", str(self.admin_port), "--rules", str(rules), "--out", str(out),
                        *(["--guard"] if self.guard else [])],
                       check=True, capture_output=True)
        errors = self.directory / f"{self.door}.err"
        if self.door == "nginx":
            main = nginx_main_config(self.directory, out / "sluice.conf")
            main = main.replace("worker_processes 1;", f"worker_processes {self.workers};")
            main = main.replace("worker_rlimit_nofile 16384;", f"worker_rlimit_nofile {_open_files()};")
            main = main.replace("worker_connections 8192;", "worker_connections 30000;")
            for sub in ("logs", "tmp"):
                (self.directory / sub).mkdir(exist_ok=True)
            config = self.directory / "nginx.conf"
            config.write_text(main)
            argv = [find_nginx(), "-p", str(self.directory), "-c", str(config), "-g", "daemon off;"]
        else:
            argv = [find_envoy(), "-c", str(out / "envoy.yaml"), "--concurrency", str(self.workers),
                    "--log-level", "warning", "--base-id", str(self.admin_port)]
        self.proxy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors.open("wb"),
                                      preexec_fn=_more_open_files)
        _wait_for_port(self.door_port, self.proxy, self.door, errors, 60)
        # The first request through also proves the chain answers.
        deadline = time.monotonic() + 30
        while self.get("/healthz-probe", source=PROBE_SOURCE)[0] in (0, 503):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.door} never answered: {errors.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        stop_process(self.proxy, 15)
        stop_process(self.sluice, 15)
        self.upstream.stop()

    def get(self, path: str, source: str = HONEST_SOURCE, timeout: float = 10.0) -> tuple[int, float]:
        """One GET through the door from ``source``: its status (0 when it
        failed) and how long it took."""
        started = time.monotonic()
        connection = http.client.HTTPConnection(LOOPBACK, self.door_port, timeout=timeout,
                                                source_address=(source, 0))
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            return response.status, time.monotonic() - started
        except (OSError, http.client.HTTPException):
            return 0, time.monotonic() - started
        finally:
            connection.close()

    def metric(self, name: str, labels: str = "") -> float:
        return metric_at(self.sluice_port, name, labels)

    def flood(self, connections: int, seconds: float, path: str = "/flood", honest_rate: float = 5.0,
              script: Path | None = None) -> FloodResult:
        """wrk from 127.0.0.1 with ``connections`` connections for
        ``seconds``, and meanwhile an honest client from HONEST_SOURCE
        sending ``honest_rate`` requests a second."""
        before = self.upstream.requests()
        honest: list[tuple[int, float]] = []
        stop = threading.Event()

        def honest_client() -> None:
            period = 1.0 / honest_rate
            next_at = time.monotonic()
            while not stop.is_set():
                honest.append(self.get("/honest"))
                next_at += period
                stop.wait(max(0.0, next_at - time.monotonic()))

        thread = threading.Thread(target=honest_client, daemon=True)
        thread.start()
        argv = [WRK, "-t2", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "10s"]
        if script is not None:
            argv += ["-s", str(script)]
        argv.append(f"http://{LOOPBACK}:{self.door_port}{path}")
        try:
            run = subprocess.run(argv, capture_output=True, text=True, preexec_fn=_more_open_files,
                                 timeout=seconds + 60)
        finally:
            stop.set()
            thread.join()
        found = re.search(r"(\d+) requests in", run.stdout)
        if found is None:
            raise RuntimeError(f"wrk failed: {run.stdout}\n{run.stderr}")
        closed = re.search(r"Socket errors: connect \d+, read (\d+)", run.stdout)
        return FloodResult(int(found.group(1)), self.upstream.settled_requests() - before, honest,
                           int(closed.group(1)) if closed else 0)
