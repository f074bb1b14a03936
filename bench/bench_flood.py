"""Does the limit hold when a flood outruns Sluice? The flood matrix, and what a refusal costs.

1. The matrix. One address floods through the shipped configurations
   (``sluice config``) with wrk: nginx with 1 and 2 worker processes, the
   same with nginx's first tier (``--guard``), and Envoy with
   ``--concurrency 2``, without and with its own (``--guard``), at 1,000,
   4,000 and 8,000 connections, on the memory backend and on a
   redis-server the bench starts on loopback. An honest client at another
   address sends 5 requests a second meanwhile. One rule, ``key: [ip]``,
   10 requests per 60 s, ``action: block``. For each row: the requests wrk
   completed, those that reached the upstream (an nginx counting its access
   log lines), whether that stayed within the budget plus 1 % of the flood,
   the honest client's p99 latency, and the late checks Sluice refused
   without the shared store: from its memory of refusals, or by its own
   count of late checks.
2. Many addresses: 1,000 of them behind a trusted proxy, each far over its
   budget, from 2,000 connections through nginx (1 and 2 workers) and
   Envoy; the target is at most 1,000 budgets plus 1 % of the flood.
3. Sluice's CPU per check (utime + stime from /proc, over the requests wrk
   completed; interleaved passes, ``wrk -c32`` straight to nginx's check
   endpoint): a refusal of a client already over its limit against an
   admitted check, the same rule with a limit no client reaches, with that
   rule alone and before bench/bench_engine.py's ten rules; and the
   same through the shipped nginx (1 worker, ``wrk -c32`` from one address),
   whose cache answers the refusals that hold for the whole address, with
   nginx's own CPU per request beside Sluice's.

Usage: ``.venv/bin/python bench/bench_flood.py [--seconds 10] [--connections 1000,4000,8000]
[--backends memory,redis] [--rounds 3] [--doors nginx-1,nginx-2,envoy-2,...]
[--no-many-addresses]``
(``--rounds 0`` leaves out the CPU passes, ``--connections ''`` the matrix). Loopback only; every pass is
bounded in time.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_engine import HEADERS, PATH, TEN_RULES  # noqa: E402  (bench/ is on sys.path as the script's directory)

from tests.integration.clients import LOOPBACK  # noqa: E402
from tests.integration.conftest import free_port  # noqa: E402
from tests.integration.flood import WRK, FloodStack  # noqa: E402
from tests.integration.redis_server import RedisServer  # noqa: E402

BUDGET = 10
DOORS = (("nginx", 1, False), ("nginx", 2, False), ("nginx", 1, True), ("nginx", 2, True), ("envoy", 2, False),
         ("envoy", 2, True))


def rules(state: str, requests: int = BUDGET, rule_id: str = "flood") -> str:
    """One rule keyed by the address. Sluices that share a Redis and run at
    once take rules of their own ids: one rule's refusals must not be
    another's."""
    return f"""\
state: {state}
rules:
  - id: {rule_id}
    key: [ip]
    limit: {{requests: {requests}, per: 60s}}
    action: block
"""


def door_id(door: str, workers: int, guard: bool) -> str:
    """The door as ``--doors`` names it: nginx-2-guard, envoy-2."""
    return f"{door}-{workers}{'-guard' if guard else ''}"


def door_name(door: str, workers: int, guard: bool) -> str:
    guarded = ", --guard" if guard else ""
    if door == "envoy":
        return f"Envoy, --concurrency {workers}{guarded}"
    return f"nginx, {workers} worker{'s' if workers > 1 else ''}{guarded}"


def matrix(seconds: float, connections: list[int], state: str, backend: str,
           server: RedisServer | None = None, doors: tuple[tuple[str, int, bool], ...] = DOORS) -> None:
    print(f"\n{backend} backend:\n")
    print("| door | connections | requests | reached | budget + 1 % | honest p99 | late checks refused |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for door, workers, guard in doors:
        for count in connections:
            if server is not None:
                # Every row starts from nothing counted: the flood's address
                # is not over its limit yet.
                redis.Redis(host=LOOPBACK, port=server.port).flushall()
            with tempfile.TemporaryDirectory() as directory, \
                    FloodStack(Path(directory), rules(state), door, workers, guard) as stack:
                result = stack.flood(count, seconds)
                refused = sum(stack.metric("sluice_overload_decisions_total", f'outcome="{outcome}",rule="flood"')
                              for outcome in ("refused", "refused_locally"))
            honest_allowed = sum(1 for status, _ in result.honest if status == 200)
            over = result.reached - honest_allowed - BUDGET
            verdict = "held" if over <= result.requests // 100 else f"{over / max(result.requests, 1):.1%} over"
            print(f"| {door_name(door, workers, guard)} | {count:,} | {result.requests:,} | {result.reached:,} | "
                  f"{verdict} | {result.honest_p99() * 1000:.0f} ms | {refused:,.0f} |", flush=True)


ADDRESSES = 1000
ADDRESSES_SCRIPT = Path(__file__).resolve().parent / "addresses.lua"


def many_addresses(seconds: float, state: str, backend: str, server: RedisServer | None = None) -> None:
    """1,000 addresses behind a trusted proxy (X-Forwarded-For from
    loopback), each far over its budget, from 2,000 connections."""
    print(f"\n{backend} backend, {ADDRESSES:,} addresses behind a trusted proxy, 2,000 connections:\n")
    print("| door | requests | reached | budgets + 1 % |\n|---|---:|---:|---|")
    text = rules(state).replace("rules:\n", "client_ip: {trusted_proxies: [127.0.0.1/32]}\nrules:\n", 1)
    for door, workers, guard in (("nginx", 1, False), ("nginx", 2, False), ("envoy", 2, False)):
        if server is not None:
            redis.Redis(host=LOOPBACK, port=server.port).flushall()
        with tempfile.TemporaryDirectory() as directory, \
                FloodStack(Path(directory), text, door, workers, guard) as stack:
            result = stack.flood(2000, seconds, script=ADDRESSES_SCRIPT)
        honest_allowed = sum(1 for status, _ in result.honest if status == 200)
        over = result.reached - honest_allowed - ADDRESSES * BUDGET
        verdict = "held" if over <= result.requests // 100 else f"{over / max(result.requests, 1):.1%} over"
        print(f"| {door_name(door, workers, guard)} | {result.requests:,} | {result.reached:,} | {verdict} |",
              flush=True)


def _stat(path: Path) -> tuple[int, float]:
    """A process's parent and CPU seconds (utime + stime, in clock ticks
    of 1/100 s), from its /proc stat file."""
    fields = path.read_text().rpartition(")")[2].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / 100


def cpu_seconds(pid: int) -> float:
    return _stat(Path(f"/proc/{pid}/stat"))[1]


# As nginx's check of a request that the ten rules all look at (bench_engine's
# headers and path): the client's address and nginx's request id.
CHECK_HEADERS = ("X-Sluice-Client-Addr: 192.0.2.1", "X-Request-Id: 5f0c1a2b3d4e5f60718293a4b5c6d7e8",
                 "X-Original-Method: GET", f"X-Original-URI: {PATH}", "X-Original-Host: example.com",
                 *(f"{name}: {value}" for name, value in HEADERS.items()))


def ten_rules(state: str, requests: int, rule_id: str) -> str:
    """bench_engine's ten rules on ``state``, after the flood's rule of
    ``requests`` (refusals come from the first; an admitted check goes
    through all eleven)."""
    text = TEN_RULES.replace("state: {max_keys: 100000}", f"state: {state}")
    first = rules(state, requests, rule_id).partition("rules:\n")[2]
    return text.replace("rules:\n", "rules:\n" + first, 1)


def cpu_per_check(rounds: int, seconds: float, state: str, backend: str, server: RedisServer | None = None) -> None:
    """Sluice's CPU per refusal and per admitted check, interleaved, with
    the flood's one rule and with it before bench_engine's ten; over
    Redis, the server's own CPU is left out (it is Sluice's that the
    target is about)."""
    sets = {"one rule": rules, "ten rules": ten_rules}
    totals: dict[tuple[str, str], list[float]] = {}
    servers = {}
    with tempfile.TemporaryDirectory() as directory:
        for index, (label, make) in enumerate(sets.items()):
            for name, requests in (("refusal", BUDGET), ("admitted", 10**9)):
                path = Path(directory) / f"{name}-{index}.yaml"
                path.write_text(make(state, requests, f"{name}-{index}"))
                port = free_port()
                process = subprocess.Popen([sys.executable, "-m", "sidecar", "serve", "--config", str(path),
                                            "--port", str(port), "--hook-udp", "off", "--log-level", "warning"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                servers[label, name] = (process, port)
                totals[label, name] = []
        time.sleep(3)
        if server is not None:
            redis.Redis(host=LOOPBACK, port=server.port).flushall()
        headers = [argument for header in CHECK_HEADERS for argument in ("-H", header)]
        try:
            for round_ in range(rounds):
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                for key in order:
                    process, port = servers[key]
                    url = f"http://{LOOPBACK}:{port}/v1/nginx/auth"
                    before = cpu_seconds(process.pid)
                    run = subprocess.run([WRK, "-t1", "-c32", f"-d{seconds:g}s", *headers, url],
                                         capture_output=True, text=True, timeout=seconds + 30)
                    found = re.search(r"(\d+) requests in", run.stdout)
                    assert found is not None, run.stdout + run.stderr
                    totals[key].append((cpu_seconds(process.pid) - before) / int(found.group(1)))
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait()
    print(f"\n| Sluice's CPU per check, {backend} backend (fastest of the passes) | one rule µs | "
          "ten rules after it µs |\n|---|---:|---:|")
    refusal = [min(totals[label, "refusal"]) for label in sets]
    admitted = [min(totals[label, "admitted"]) for label in sets]
    print("| a refusal of a client over its limit | " + " | ".join(f"{v * 1e6:.1f}" for v in refusal) + " |")
    print("| an admitted check | " + " | ".join(f"{v * 1e6:.1f}" for v in admitted) + " |")
    print("| refusal / admitted (target ≤ 0.5×) | "
          + " | ".join(f"{r / a:.2f}×" for r, a in zip(refusal, admitted)) + " |", flush=True)


def family_cpu_seconds(pid: int) -> float:
    """The CPU of a process and of its living children (nginx's workers)."""
    total = cpu_seconds(pid)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent, seconds = _stat(stat)
        except OSError:
            continue  # ended meanwhile
        if parent == pid:
            total += seconds
    return total


def cpu_through_nginx(rounds: int, seconds: float, state: str, backend: str) -> None:
    """Sluice's CPU per refused request and per admitted one through the
    shipped nginx (1 worker), whose cache answers refusals that hold for
    the whole address: ``wrk -c32`` from one address, interleaved passes;
    nginx's own CPU (its workers') beside it."""
    totals: dict[str, list[tuple[float, float]]] = {"refusal": [], "admitted": []}
    with tempfile.TemporaryDirectory() as directory:
        stacks = {name: FloodStack(Path(directory) / name, rules(state, requests, name), "nginx", 1)
                  for name, requests in (("refusal", BUDGET), ("admitted", 10**9))}
        try:
            for stack in stacks.values():
                stack.start()
            for round_ in range(rounds):
                for name in (list(stacks) if round_ % 2 == 0 else list(reversed(stacks))):
                    stack = stacks[name]
                    assert stack.sluice is not None and stack.proxy is not None
                    sluice_before, nginx_before = cpu_seconds(stack.sluice.pid), family_cpu_seconds(stack.proxy.pid)
                    run = subprocess.run([WRK, "-t1", "-c32", f"-d{seconds:g}s",
                                          f"http://{LOOPBACK}:{stack.door_port}/flood"],
                                         capture_output=True, text=True, timeout=seconds + 30)
                    found = re.search(r"(\d+) requests in", run.stdout)
                    assert found is not None, run.stdout + run.stderr
                    requests = int(found.group(1))
                    totals[name].append(((cpu_seconds(stack.sluice.pid) - sluice_before) / requests,
                                         (family_cpu_seconds(stack.proxy.pid) - nginx_before) / requests))
        finally:
            for stack in stacks.values():
                stack.stop()
    refusal, admitted = min(totals["refusal"]), min(totals["admitted"])
    print(f"\n| CPU per request through nginx (1 worker), {backend} backend (fastest of the passes) "
          "| Sluice µs | nginx µs |\n|---|---:|---:|")
    print(f"| a refusal of a client over its limit | {refusal[0] * 1e6:.1f} | {refusal[1] * 1e6:.1f} |")
    print(f"| an admitted request | {admitted[0] * 1e6:.1f} | {admitted[1] * 1e6:.1f} |")
    print(f"| refusal / admitted, Sluice's | {refusal[0] / admitted[0]:.2f}× (target ≤ 0.5×) | |", flush=True)


def run(args: argparse.Namespace, state: str, backend: str, server: RedisServer | None = None) -> None:
    """Every part of the bench that ``args`` asks for, on one backend."""
    if args.rounds:
        cpu_per_check(args.rounds, 5.0, state, backend, server)
        cpu_through_nginx(args.rounds, 5.0, state, backend)
    connections = [int(n) for n in args.connections.split(",") if n]
    if connections:
        by_id = {door_id(*door): door for door in DOORS}
        doors = tuple(by_id[name] for name in args.doors.split(",") if name)
        matrix(args.seconds, connections, state, backend, server, doors)
        if args.many_addresses:
            many_addresses(args.seconds, state, backend, server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", default="1000,4000,8000")
    parser.add_argument("--backends", default="memory,redis")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--doors", default=",".join(door_id(*door) for door in DOORS),
                        help="the matrix's rows, of " + ", ".join(door_id(*door) for door in DOORS))
    parser.add_argument("--many-addresses", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    for backend in filter(None, args.backends.split(",")):
        if backend == "memory":
            run(args, "{backend: memory}", backend)
            continue
        with tempfile.TemporaryDirectory() as directory:
            server = RedisServer(Path(directory))
            server.start()
            try:
                run(args, f"{{backend: redis, url: '{server.url}'}}", backend, server)
            finally:
                server.stop()


if __name__ == "__main__":
    main()
