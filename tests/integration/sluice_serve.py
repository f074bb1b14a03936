"""``sluice serve`` in a process of its own, on a free loopback port: for
tests that need several processes, or workers, which the launcher's stack
does not start."""

from __future__ import annotations

import http.client
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.clients import LOOPBACK
from tests.integration.conftest import free_port


class SluiceServe:
    """``sluice serve --config RULES --workers N``, answering on ``port``
    once started; the report listener is off, the log beside the rules."""

    def __init__(self, rules: Path, workers: int = 1) -> None:
        self.rules = rules
        self.workers = workers
        self.port = free_port()
        self.log = rules.with_name(f"sluice-{self.port}.log")
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> SluiceServe:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "sidecar", "serve", "--config", str(self.rules), "--port", str(self.port),
                 "--workers", str(self.workers), "--hook-udp", "off", "--log-level", "warning"],
                stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.get("/healthz") == 200:
                    return self
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"sluice serve did not start: {self.log.read_text(errors='replace')}")
            time.sleep(0.05)

    def __exit__(self, *exc_info: object) -> None:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError("sluice serve did not stop within 20 s of SIGTERM; its log ends:\n"
                                     + self.log.read_text(errors="replace")[-4000:]) from None

    def get(self, path: str, headers: dict[str, str] | None = None) -> int:
        """The status of one GET on a fresh connection (workers take turns)."""
        connection = http.client.HTTPConnection(LOOPBACK, self.port, timeout=5)
        try:
            connection.request("GET", path, headers=headers or {})
            return connection.getresponse().status
        finally:
            connection.close()
