"""How fast is a decision? Sluice against reference systems, in one run.

Machines here are noisy, so every number is printed beside a reference
measured in the same run, and the ratio is what to read:

1. Sluice's nginx check endpoint against a bare uvicorn ASGI app that answers
   200 with nothing else (the floor for any Python sidecar on this server),
2. nginx with Sluice against the same nginx without any check, and against
   nginx's own ``limit_req`` (the C reference),
3. Sluice's in-process decision (no HTTP) per rule evaluated.

Usage: ``.venv/bin/python bench/bench_check.py [--seconds 5]``. Needs
``wrk`` (Debian package ``wrk``; installed when missing and running as root).
Traffic goes to loopback only and each run is bounded in time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RULES = """
rules:
  - id: api
    match: {path: {prefix: /api/}}
    key: [ip, "header:x-api-key"]
    limit: {requests: 1000000000, per: 60s}
    action: block
  - id: per-ip
    key: [ip]
    limit: {requests: 1000000000, per: 60s}
    action: log
  - id: bucket
    key: [ip]
    limit: {tokens: 1000000000, refill: 1000000/s}
    action: block
"""

BARE_APP = """
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})
"""

NGINX_PLAIN = """
worker_processes 1;
pid {run}/plain.pid;
error_log {run}/plain-error.log;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {run}/tmp;
    proxy_temp_path {run}/tmp;
    limit_req_zone $binary_remote_addr zone=bench:10m rate=1000000r/s;
    upstream app {{ server 127.0.0.1:{upstream}; keepalive 16; }}
    server {{
        listen 127.0.0.1:{plain};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        location / {{ proxy_pass http://app; }}
    }}
    server {{
        listen 127.0.0.1:{limited};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        location / {{ limit_req zone=bench burst=1000 nodelay; proxy_pass http://app; }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, deadline: float = 15.0) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on 127.0.0.1:{port}")


def ensure_wrk() -> str:
    wrk = shutil.which("wrk")
    if wrk:
        return wrk
    if os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True,
                       stdout=subprocess.DEVNULL)
        return shutil.which("wrk") or "wrk"
    raise SystemExit("wrk is needed: apt-get install wrk")


def wrk(url: str, seconds: int, headers: dict[str, str]) -> float:
    argv = [ensure_wrk(), "-t2", "-c32", f"-d{seconds}s", "--latency"]
    for name, value in headers.items():
        argv += ["-H", f"{name}: {value}"]
    out = subprocess.run(argv + [url], capture_output=True, text=True, check=True).stdout
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if match is None:
        raise SystemExit(f"wrk printed no rate:\n{out}")
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if non2xx:
        print(f"    ({non2xx.group(1)} non-2xx answers from {url})")
    return float(match.group(1))


def start(stack: ExitStack, argv: list[str], port: int, log: Path) -> None:
    handle = log.open("w")
    process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)
    stack.callback(process.wait, 10)
    stack.callback(process.terminate)
    wait_for_port(port)


def in_process(rounds: int = 200_000) -> None:
    sys.path.insert(0, str(ROOT))
    from sidecar.config import parse_rules_text
    from sidecar.engine import Engine
    from sidecar.request import CheckRequest
    from sidecar.rules import compile_rules

    engine = Engine(compile_rules(parse_rules_text(RULES, "bench", ROOT)))
    client = engine.resolve_client("192.0.2.1", None)
    request = CheckRequest("GET", "example.com", "/api/items?page=2",
                           {"x-api-key": "k", "user-agent": "bench"}, client, "r")
    started = time.perf_counter()
    for _ in range(rounds):
        engine.decide(request)
    per_call = (time.perf_counter() - started) / rounds * 1e6
    print(f"in-process decision, 3 rules: {per_call:.2f} µs per request")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5)
    args = parser.parse_args()
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    python = sys.executable
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        (run / "tmp").mkdir()
        (run / "rules.yaml").write_text(RULES)
        (run / "bare.py").write_text(BARE_APP)
        ports = {name: free_port() for name in ("bare", "sluice", "hook", "upstream", "plain", "limited")}
        start(stack, [python, "-m", "uvicorn", "--app-dir", str(run), "bare:app", "--port",
                      str(ports["bare"]), "--no-access-log", "--log-level", "warning"],
              ports["bare"], run / "bare.log")
        start(stack, [python, "-m", "sidecar", "serve", "--config", str(run / "rules.yaml"),
                      "--port", str(ports["sluice"]), "--hook-udp", f"127.0.0.1:{ports['hook']}",
                      "--log-level", "warning"], ports["sluice"], run / "sluice.log")
        check_headers = {"X-Sluice-Client-Addr": "192.0.2.1", "X-Original-URI": "/api/items?page=2",
                         "X-Original-Method": "GET", "X-Original-Host": "example.com",
                         "X-Api-Key": "k"}
        bare = wrk(f"http://127.0.0.1:{ports['bare']}/", args.seconds, check_headers)
        sluice = wrk(f"http://127.0.0.1:{ports['sluice']}/v1/nginx/auth", args.seconds, check_headers)
        print(f"bare uvicorn app:           {bare:10.0f} req/s")
        print(f"Sluice check endpoint:      {sluice:10.0f} req/s   ratio {sluice / bare:.2f} of bare")

        # nginx: without a check, with limit_req, with Sluice (the launcher's stack).
        from sidecar.launcher import Stack, StackPorts  # noqa: E402  (needs ROOT on sys.path)

        start(stack, [python, "-m", "sidecar.demo_upstream", "--port", str(ports["upstream"])],
              ports["upstream"], run / "upstream.log")
        (run / "plain.conf").write_text(NGINX_PLAIN.format(run=run, **ports))
        start(stack, [nginx, "-p", str(run), "-c", str(run / "plain.conf"), "-g", "daemon off;"],
              ports["plain"], run / "plain-nginx.log")
        plain = wrk(f"http://127.0.0.1:{ports['plain']}/api/items", args.seconds, {})
        limited = wrk(f"http://127.0.0.1:{ports['limited']}/api/items", args.seconds, {})
        stack_ports = StackPorts(nginx=free_port(), sluice=free_port(), upstream=free_port(),
                                 envoy=free_port(), envoy_admin=free_port(), sluice_hook=free_port())
        with Stack(run / "stack", rules=run / "rules.yaml", ports=stack_ports) as sluice_stack:
            checked = wrk(f"{sluice_stack.nginx_url}/api/items", args.seconds, {"X-Api-Key": "k"})
        print(f"nginx, no check:            {plain:10.0f} req/s")
        print(f"nginx limit_req:            {limited:10.0f} req/s   ratio {limited / plain:.2f} of no check")
        print(f"nginx + Sluice:             {checked:10.0f} req/s   ratio {checked / plain:.2f} of no check,"
              f" {checked / limited:.2f} of limit_req")
    in_process()


if __name__ == "__main__":
    main()
