"""`sluice replay --html`: the report page, rendered by headless Chromium.

The page is loaded through the DevTools protocol (a small WebSocket client
of our own, standard library only), which reports every console message,
uncaught exception, browser log entry (a blocked or failed load) and
network request of the page. The test reads the rendered page back and
checks it against the text report the same command printed.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "examples" / "replay.yaml"
LOG = REPO / "examples" / "access.log.sample"
TIMEOUT = 30.0  # seconds for the browser to start, answer or load the page


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed: the replay report is tested in headless Chromium; "
                    "`make test` installs Debian's chromium package (as root: apt-get install chromium)")
    return path


# --------------------------------------------------------------------------
# A WebSocket client, just enough for the DevTools protocol
# --------------------------------------------------------------------------


class WebSocket:
    """Text frames over one connection (RFC 6455): masked from us, plain from the browser."""

    def __init__(self, url: str) -> None:
        match = re.fullmatch(r"ws://([^/:]+):(\d+)(/.*)", url)
        assert match is not None, url
        host, port, path = match.group(1), int(match.group(2)), match.group(3)
        self.sock = socket.create_connection((host, port), timeout=TIMEOUT)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            assert chunk, "the browser closed the connection during the handshake"
            head += chunk
        head, self.buffer = head.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head.decode(errors="replace")

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
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def receive(self) -> str:
        message = b""
        while True:
            first, second = self._read(2)
            length = second & 0x7F
            if length == 126:
                (length,) = struct.unpack("!H", self._read(2))
            elif length == 127:
                (length,) = struct.unpack("!Q", self._read(8))
            payload = self._read(length)
            opcode = first & 0x0F
            if opcode == 0x8:
                raise ConnectionError("the browser closed the DevTools connection")
            if opcode in (0x0, 0x1, 0x2):
                message += payload
                if first & 0x80:
                    return message.decode()

    def _read(self, count: int) -> bytes:
        while len(self.buffer) < count:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the browser closed the DevTools connection")
            self.buffer += chunk
        data, self.buffer = self.buffer[:count], self.buffer[count:]
        return data

    def close(self) -> None:
        self.sock.close()


@dataclass
class Page:
    """One browser tab over the DevTools protocol, and what it reported."""

    socket: WebSocket
    problems: list[str] = field(default_factory=list)  # console errors and warnings, exceptions, log entries
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    events: list[str] = field(default_factory=list)
    _ids: Iterator[int] = field(default_factory=lambda: iter(range(1, 1 << 30)))

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        number = next(self._ids)
        self.socket.send(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.receive())
            if message.get("id") == number:
                assert "error" not in message, message["error"]
                result: dict[str, Any] = message["result"]
                return result
            self._note(message)

    def wait_for(self, event: str) -> None:
        while event not in self.events:
            self._note(json.loads(self.socket.receive()))

    def _note(self, message: dict[str, Any]) -> None:
        method, params = message.get("method", ""), message.get("params", {})
        self.events.append(method)
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "warning", "assert"):
            text = " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params["args"])
            self.problems.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.problems.append("uncaught: " + details.get("exception", {}).get("description", details["text"]))
        elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
            self.problems.append(f"{params['entry']['source']}: {params['entry']['text']}")
        elif method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])

    def open(self, url: str) -> None:
        """Load the page and wait until it is loaded and painted."""
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")
        self.evaluate("new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")


@contextmanager
def browser_page(tmp_path: Path) -> Iterator[Page]:
    """A headless Chromium of its own (own profile, DevTools on a loopback
    port it picks), and its first tab."""
    profile = tmp_path / "chromium-profile"
    process = subprocess.Popen(
        [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--user-data-dir={profile}",
         "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    socket_ = None
    try:
        port = _devtools_port(profile, process)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=TIMEOUT) as answer:
            targets = json.load(answer)
        tab = next(target for target in targets if target["type"] == "page")
        socket_ = WebSocket(tab["webSocketDebuggerUrl"])
        yield Page(socket_)
    finally:
        if socket_ is not None:
            socket_.close()
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        assert process.stderr is not None
        process.stderr.close()


def _devtools_port(profile: Path, process: subprocess.Popen[bytes]) -> int:
    """Chromium writes the port it listens on to DevToolsActivePort in its profile."""
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            assert process.stderr is not None
            pytest.fail(f"chromium exited with {process.returncode}: {process.stderr.read().decode()[-2000:]}")
        text = marker.read_text() if marker.exists() else ""
        if text.strip():
            return int(text.split()[0])
        time.sleep(0.05)  # polling for the file, not a wait standing in for a result
    pytest.fail(f"chromium did not open its DevTools port within {TIMEOUT:g} s")


# --------------------------------------------------------------------------
# What the page shows
# --------------------------------------------------------------------------

READ_PAGE = """(() => {
  const text = element => element ? element.textContent.trim() : null;
  const table = element => [...element.rows].map(row => [...row.cells].map(cell => cell.textContent.trim()));
  return {
    summary: text(document.querySelector("p.summary")),
    answers: text(document.querySelector("p.answers")),
    rules: table(document.querySelector("table.rules")),
    notReached: [...document.querySelectorAll("ul.not-reached li")].map(text),
    scripts: document.scripts.length,
    sections: [...document.querySelectorAll("section.rule")].map(section => {
      const svg = section.querySelector("svg");
      return {
        id: section.dataset.rule,
        paragraphs: [...section.querySelectorAll("p")].map(text),
        svgs: section.querySelectorAll("svg").length,
        width: svg ? svg.getBoundingClientRect().width : 0,
        height: svg ? svg.getBoundingClientRect().height : 0,
        bars: [...section.querySelectorAll("svg rect.bar")].length,
        counts: [...section.querySelectorAll("svg text.count")].map(text),
        thresholds: [...section.querySelectorAll("svg text.label")].map(text),
        tables: [...section.querySelectorAll("table")].map(table),
      };
    }),
  };
})()"""


def cells(line: str) -> list[str]:
    """A row of a text-report table: columns are two spaces apart or more."""
    return re.split(r"\s{2,}", line.strip())


def text_blocks(text: str) -> dict[str, list[str]]:
    """The text report's per-rule blocks, by rule id: the lines after the
    rule's heading line up to the next blank line."""
    blocks: dict[str, list[str]] = {}
    for block in text.split("\n\n"):
        lines = block.splitlines()
        match = re.match(r"([A-Za-z0-9_.-]+): ", lines[0]) if lines else None
        if match and len(lines) > 1 and lines[1].startswith("  "):
            blocks[match.group(1)] = lines
    return blocks


def text_tables(block: list[str]) -> list[list[list[str]]]:
    """The tables of a rule's block: runs of lines indented by four spaces."""
    tables: list[list[list[str]]] = []
    previous = False
    for line in block:
        is_row = line.startswith("    ")
        if is_row and not previous:
            tables.append([])
        if is_row:
            tables[-1].append(cells(line))
        previous = is_row
    return tables


def replay_with_html(tmp_path: Path, *options: str) -> tuple[str, Path]:
    page = tmp_path / "report.html"
    result = subprocess.run([sys.executable, "-m", "sidecar", "replay", "--config", str(RULES), *options,
                             "--html", str(page), str(LOG)], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout, page


def test_the_report_page_loads_clean_and_shows_what_the_text_report_says(tmp_path):
    text, page_file = replay_with_html(tmp_path, "--sweep", "api=10,20,50", "--sweep", "scrapers=30,60,100",
                                       "--exclude-top", "1", "--top", "3")
    with browser_page(tmp_path) as page:
        url = page_file.as_uri()
        page.open(url)
        shown = page.evaluate(READ_PAGE)
    assert page.problems == []
    assert page.requests == [url]  # the page itself, nothing else
    assert shown["scripts"] == 0

    lines = text.splitlines()
    assert shown["summary"] == lines[0]
    assert shown["answers"] in lines
    rule_rows = [cells(line) for line in lines[lines.index("") + 1:] if line][:len(shown["rules"])]
    assert shown["rules"] == rule_rows
    assert shown["notReached"] == [line.replace("`", "") for line in lines if " was not reached for " in line]
    assert shown["notReached"]  # the sample log has an api refusal that hides scrapers

    blocks = text_blocks(text)
    assert [section["id"] for section in shown["sections"]] == [row[0] for row in rule_rows[1:]] == list(blocks)
    for section in shown["sections"]:
        block = blocks[section["id"]]
        assert section["paragraphs"] == [line.strip() for line in block if not line.startswith("    ")
                                         and not line.endswith(":")], section["id"]
        assert section["tables"] == text_tables(block), section["id"]
        # One chart, drawn at its size, with a bar and a count per bucket that has keys.
        assert section["svgs"] == 1 and section["width"] > 300 and section["height"] > 100
        keys = int(re.search(r"over ([\d,]+) keys?:", block[1]).group(1).replace(",", ""))
        assert sum(int(count.replace(",", "")) for count in section["counts"]) == keys
        assert section["bars"] == len(section["counts"]) > 0
    thresholds = {section["id"]: section["thresholds"] for section in shown["sections"]}
    assert thresholds == {"api": ["10", "20 now", "50"], "scrapers": ["30", "60", "100 now"], "per-ip": []}


def test_the_browser_check_sees_errors_failed_loads_and_requests(tmp_path):
    # The same checks on a page that has everything the report must not.
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><head><meta charset="utf-8"><title>bad</title></head><body>'
                   '<img src="missing.png"><script>console.error("logged"); throw new Error("thrown")</script>'
                   "</body></html>", encoding="utf-8")
    with browser_page(tmp_path) as page:
        page.open(bad.as_uri())
    assert "console.error: logged" in page.problems
    assert any(problem.startswith("uncaught: Error: thrown") for problem in page.problems)
    assert any("ERR_FILE_NOT_FOUND" in problem for problem in page.problems)
    assert (tmp_path / "missing.png").as_uri() in page.requests


def test_markup_from_the_log_stays_text_in_the_browser(tmp_path):
    # A key (the path) and a skipped line carrying markup: shown as text,
    # nothing runs, nothing is fetched.
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - id: paths\n    key: [path]\n    limit: {requests: 1, per: 10s}\n"
                     "    action: block\n", encoding="utf-8")
    attack = '/<script>console.error("ran")</script><img src=x onerror=console.error(1)>'
    log = tmp_path / "access.log"
    line = json.dumps({"remote_addr": "192.0.2.1", "msec": "1709287200", "request_method": "GET",
                       "request_uri": attack, "status": "200"})
    log.write_text("\n".join([line, line, "<svg onload=console.error(2)> not a log line"]) + "\n",
                   encoding="utf-8")
    page_file = tmp_path / "report.html"
    result = subprocess.run([sys.executable, "-m", "sidecar", "replay", "--config", str(rules), "--html",
                             str(page_file), str(log)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    with browser_page(tmp_path) as page:
        page.open(page_file.as_uri())
        shown = page.evaluate("""({
          scripts: document.scripts.length,
          images: document.images.length,
          handlers: [...document.querySelectorAll("*")].filter(e => [...e.attributes].some(a => a.name.startsWith("on"))).length,
          keys: [...document.querySelectorAll("table.keys td:first-child")].map(td => td.textContent),
          skipped: [...document.querySelectorAll("ul.skipped li")].map(li => li.textContent),
        })""")
    assert page.problems == [] and page.requests == [page_file.as_uri()]
    assert shown["scripts"] == shown["images"] == shown["handlers"] == 0
    assert f"path={attack}" in shown["keys"]
    assert any("<svg onload=console.error(2)>" in line for line in shown["skipped"])
