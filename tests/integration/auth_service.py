"""A small auth service on loopback, as oauth2-proxy answers nginx's auth_request:
for tests of ``sluice serve --then-auth``.

    python -m tests.integration.auth_service --port N

* ``/oauth2/auth``: 200 with ``X-Auth-Request-User: alice`` for the cookie
  ``session=ok``, 403 for ``session=forbidden``, else 401;
* ``/oauth2/sign_in``: 302 to the sign-in page (where nginx's
  ``error_page 401`` sends the client);
* ``/_asked``: how many times ``/oauth2/auth`` was asked, and the header
  fields of the last requests, as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SIGN_IN_PAGE = "https://auth.example/start"
USER = "alice"
KEPT = 50  # the header fields of this many requests


class AuthState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.asked = 0
        self.seen: collections.deque[dict[str, list[str]]] = collections.deque(maxlen=KEPT)


class AuthHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept alive, as Sluice's pool expects
    server: AuthServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.partition("?")[0]
        if path == "/oauth2/auth":
            self._auth()
        elif path == "/oauth2/sign_in":
            self._send(302, [("Location", SIGN_IN_PAGE)])
        elif path == "/_asked":
            state = self.server.state
            with state.lock:
                body = json.dumps({"asked": state.asked, "seen": list(state.seen)}).encode()
            self._send(200, [("Content-Type", "application/json")], body)
        else:
            self._send(404, [])

    def _auth(self) -> None:
        fields: dict[str, list[str]] = {}
        for name, value in self.headers.items():
            fields.setdefault(name.lower(), []).append(value)
        state = self.server.state
        with state.lock:
            state.asked += 1
            state.seen.append(fields)
        cookies = {part.strip() for part in self.headers.get("Cookie", "").split(";")}
        if "session=ok" in cookies:
            self._send(200, [("X-Auth-Request-User", USER), ("X-Auth-Request-Email", f"{USER}@example.com")])
        elif "session=forbidden" in cookies:
            self._send(403, [])
        else:
            self._send(401, [("WWW-Authenticate", 'Bearer realm="test"')])

    def _send(self, status: int, fields: list[tuple[str, str]], body: bytes = b"") -> None:
        self.send_response(status)
        for name, value in fields:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        pass


class AuthServer(ThreadingHTTPServer):
    daemon_threads = True
    # Room for a burst's connections arriving at once.
    request_queue_size = 1024

    def __init__(self, port: int) -> None:
        super().__init__(("127.0.0.1", port), AuthHandler)
        self.state = AuthState()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    AuthServer(parser.parse_args().port).serve_forever()


if __name__ == "__main__":
    main()
