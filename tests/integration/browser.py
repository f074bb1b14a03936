"""Headless Chromium for the integration tests, driven over the DevTools protocol.

The protocol is JSON over a WebSocket on a loopback port. The standard
library has no WebSocket client, so this module carries the little of
RFC 6455 the protocol needs: one handshake, masked text frames out,
unmasked frames in (text, continuations, ping and close).

Chromium is told to reach nothing but loopback: every host name resolves
to nothing, and any other address is sent to a proxy on a closed loopback
port (loopback addresses themselves never go through a proxy).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pytest

LOOPBACK = "127.0.0.1"
START_SECONDS = 20.0
CALL_SECONDS = 10.0
STOP_SECONDS = 5.0

# Quiet, and on loopback only: no first-run pages, no background services
# (updates, sync, safe browsing lists, metrics), no host name resolution,
# and a proxy that refuses everything not on loopback.
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-sync",
    "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication",
    "--metrics-recording-only",
    "--password-store=basic",
    "--use-mock-keychain",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--proxy-server=http://127.0.0.1:9",
)


def find_chromium() -> str:
    """The `chromium` command; the test fails (does not skip) without it."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("Chromium is not installed: the challenge-page browser tests need the `chromium` "
                "command (Debian package chromium; `make chromium` or `make test` installs it)")


class DevToolsError(RuntimeError):
    """Chromium answered a protocol call with an error, or went away."""


class WebSocket:
    """A client WebSocket on an open TCP connection: text messages only."""

    def __init__(self, host: str, port: int, path: str, timeout: float = CALL_SECONDS) -> None:
        self._socket = socket.create_connection((host, port), timeout=timeout)
        self._buffer = b""
        key = base64.b64encode(os.urandom(16)).decode()
        self._socket.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
        head = self._read_until(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status_line + b" ":
            raise DevToolsError(f"WebSocket handshake refused: {head.decode(errors='replace')}")

    def send(self, text: str) -> None:
        payload = text.encode()
        mask = os.urandom(4)
        length = len(payload)
        if length < 126:
            header = struct.pack("!BB", 0x81, 0x80 | length)
        elif length < 1 << 16:
            header = struct.pack("!BBH", 0x81, 0x80 | 126, length)
        else:
            header = struct.pack("!BBQ", 0x81, 0x80 | 127, length)
        masked = bytes(byte ^ mask[index % 4] for index, byte in enumerate(payload))
        self._socket.sendall(header + mask + masked)

    def receive(self, timeout: float) -> str:
        """The next text message, joined from its fragments; answers pings on the way."""
        self._socket.settimeout(timeout)
        parts: list[bytes] = []
        while True:
            first, second = self._read_exactly(2)
            opcode, length = first & 0x0F, second & 0x7F
            if length == 126:
                (length,) = struct.unpack("!H", self._read_exactly(2))
            elif length == 127:
                (length,) = struct.unpack("!Q", self._read_exactly(8))
            mask = self._read_exactly(4) if second & 0x80 else b""
            payload = self._read_exactly(length)
            if mask:
                payload = bytes(byte ^ mask[index % 4] for index, byte in enumerate(payload))
            if opcode == 0x8:
                raise DevToolsError("Chromium closed the DevTools connection")
            if opcode == 0x9:
                self._socket.sendall(struct.pack("!BB", 0x8A, 0x80 | len(payload)) + b"\0\0\0\0" + payload)
                continue
            if opcode in (0x0, 0x1):
                parts.append(payload)
                if first & 0x80:
                    return b"".join(parts).decode()

    def close(self) -> None:
        self._socket.close()

    def _read_exactly(self, count: int) -> bytes:
        while len(self._buffer) < count:
            self._fill()
        data, self._buffer = self._buffer[:count], self._buffer[count:]
        return data

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self._buffer:
            self._fill()
        data, _, self._buffer = self._buffer.partition(marker)
        return data

    def _fill(self) -> None:
        chunk = self._socket.recv(65536)
        if not chunk:
            raise DevToolsError("Chromium closed the DevTools connection")
        self._buffer += chunk


class Chromium:
    """One headless Chromium with a profile of its own, and its first tab.

    Use as a context manager. `javascript=False` starts a browser whose
    pages run no script at all, as one with JavaScript turned off in its
    settings. Every protocol event the tab sends is kept in `events`, in
    order, so a test can look at what the browser requested and received.
    """

    def __init__(self, profile: Path, javascript: bool = True) -> None:
        self.profile = profile
        self.javascript = javascript
        self.log_path = profile.parent / f"{profile.name}-chromium.log"
        self.events: list[dict[str, Any]] = []
        self._next_id = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: WebSocket | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Start Chromium and connect to its tab, with network events on."""
        self.profile.mkdir(parents=True, exist_ok=True)
        argv = [find_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}",
                "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]
        if not self.javascript:
            argv.append("--blink-settings=scriptEnabled=false")
        argv.append("about:blank")
        with open(self.log_path, "wb") as log:
            # Its own process group, so that stopping it takes its helper
            # processes (renderers, the GPU and network services) along.
            self._process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            port = self._wait_for_devtools_port()
            self._socket = WebSocket(LOOPBACK, port, self._page_socket_path(port))
            self.call("Network.enable")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Close the browser, politely first; kill its process group if it lingers."""
        process = self._process
        if process is None:
            return
        if self._socket is not None:
            try:
                self.send("Browser.close")
            except (OSError, DevToolsError):
                pass
            self._socket.close()
            self._socket = None
        # Helpers may outlive the browser process by a moment, so the group
        # is killed in any case: while its leader is not reaped (a zombie
        # at most), the group id is certainly this browser's.
        _wait_for_exit_unreaped(process.pid, STOP_SECONDS)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        self._process = None

    def send(self, method: str, **params: Any) -> int:
        """Send one protocol command; its message id."""
        if self._socket is None:
            raise DevToolsError("Chromium is not running")
        self._next_id += 1
        self._socket.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        return self._next_id

    def call(self, method: str, timeout: float = CALL_SECONDS, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its answer, keeping the events that come first."""
        assert self._socket is not None
        wanted = self.send(method, **params)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DevToolsError(f"no answer to {method} within {timeout} s")
            try:
                message = json.loads(self._socket.receive(left))
            except TimeoutError:
                # Not a DevToolsError: the connection may be cut inside a
                # frame, so no later call must be tried on it.
                raise TimeoutError(f"Chromium did not answer {method} within {timeout} s") from None
            if "method" in message:
                self.events.append(message)
            elif message.get("id") == wanted:
                if "error" in message:
                    raise DevToolsError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def navigate(self, url: str) -> None:
        """Load `url` in the tab, as typing it in the address bar would."""
        answer = self.call("Page.navigate", url=url)
        if "errorText" in answer:
            raise DevToolsError(f"navigation to {url} failed: {answer['errorText']}")

    def open(self, url: str) -> None:
        """Load `url` with console, exception and log events on, and wait
        until it is loaded and painted."""
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        self.navigate(url)
        self.wait_for_event("Page.loadEventFired")
        self.evaluate("new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))",
                      await_promise=True)

    def wait_for_event(self, method: str, timeout: float = CALL_SECONDS) -> None:
        """Read the tab's messages until an event `method` has come."""
        assert self._socket is not None
        deadline = time.monotonic() + timeout
        while not any(event["method"] == method for event in self.events):
            left = deadline - time.monotonic()
            if left <= 0:
                raise DevToolsError(f"no {method} within {timeout} s")
            message = json.loads(self._socket.receive(left))
            if "method" in message:
                self.events.append(message)

    def problems(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions and the browser's
        error and warning log entries (a blocked or failed load), in order."""
        found = []
        for event in self.events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "warning", "assert"):
                text = " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params["args"])
                found.append(f"console.{params['type']}: {text}")
            elif method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                found.append("uncaught: " + details.get("exception", {}).get("description", details["text"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
                found.append(f"{params['entry']['source']}: {params['entry']['text']}")
        return found

    def requested(self) -> list[str]:
        """Every URL the tab asked for, oldest first."""
        return [event["params"]["request"]["url"] for event in self.events
                if event["method"] == "Network.requestWillBeSent"]

    def evaluate(self, expression: str, await_promise: bool = False) -> Any:
        """The value of a JavaScript expression in the tab's current document
        (of the promise it makes, with `await_promise`).

        DevTools evaluates even where the page's own scripts are off; a
        document being replaced by a navigation answers with an error.
        """
        answer = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=await_promise)
        if "exceptionDetails" in answer:
            raise DevToolsError(f"{expression}: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    def wait_for(self, condition: Callable[[], bool], what: str, seconds: float = 15.0) -> None:
        """Check `condition` every 50 ms until it holds; fail after `seconds`.

        Errors while the tab moves between documents count as "not yet".
        """
        deadline = time.monotonic() + seconds
        while True:
            try:
                if condition():
                    return
            except DevToolsError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"not within {seconds} s: {what}; the tab is at {self.location()!r}")
            time.sleep(0.05)

    def location(self) -> str:
        try:
            return str(self.evaluate("location.href"))
        except DevToolsError as error:
            return f"unknown ({error})"

    def cookies(self) -> dict[str, dict[str, Any]]:
        """Every cookie in the profile's store, by name."""
        return {cookie["name"]: cookie for cookie in self.call("Network.getAllCookies")["cookies"]}

    def responses(self, url: str) -> list[dict[str, Any]]:
        """The responses the tab received for `url`, oldest first (Network.Response objects)."""
        return [event["params"]["response"] for event in self.events
                if event["method"] == "Network.responseReceived" and event["params"]["response"]["url"] == url]

    def requests(self, url: str) -> list[dict[str, Any]]:
        """The requests the tab sent to `url`, oldest first (Network.Request objects)."""
        return [event["params"]["request"] for event in self.events
                if event["method"] == "Network.requestWillBeSent" and event["params"]["request"]["url"] == url]

    def _wait_for_devtools_port(self) -> int:
        """Chromium writes the port it chose into the profile once it listens."""
        assert self._process is not None
        active_port = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_SECONDS
        while True:
            if self._process.poll() is not None:
                raise DevToolsError(f"Chromium exited with status {self._process.returncode} while starting; "
                                    f"see {self.log_path}")
            try:
                first_line = active_port.read_text().split("\n", 1)[0]
                if first_line.isdigit():
                    return int(first_line)
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise DevToolsError(f"Chromium opened no DevTools port within {START_SECONDS} s; "
                                    f"see {self.log_path}")
            time.sleep(0.05)

    def _page_socket_path(self, port: int) -> str:
        """The WebSocket path of the tab Chromium opened at start."""
        connection = http.client.HTTPConnection(LOOPBACK, port, timeout=CALL_SECONDS)
        try:
            connection.request("GET", "/json/list")
            targets = json.loads(connection.getresponse().read())
        finally:
            connection.close()
        for target in targets:
            if target.get("type") == "page":
                url: str = target["webSocketDebuggerUrl"]
                return "/" + url.split("/", 3)[3]
        raise DevToolsError(f"Chromium has no tab: {targets}")


def _wait_for_exit_unreaped(pid: int, seconds: float) -> None:
    """Wait up to `seconds` for the child `pid` to exit, leaving it unreaped."""
    deadline = time.monotonic() + seconds
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
