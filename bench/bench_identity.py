"""What does keying a rule on a JWT claim or an ASN cost, against the same rule keyed on the address?

Three engines in process, each with one window rule: one keyed on
``jwt:sub`` (tokens verified against an RS256 JWKS file, each token
verified once and then found in the cache), one on ``asn`` (a database
written with mmdb-writer, each address looked up once and then found in
the cache), one on ``ip``, and the same on ``ip`` with a span per check
(sidecar.tracing, batched to an in-memory exporter: what the SDK costs a
check, without a network). Each is asked for 1,000 clients, each
with its own address and its own token, every check carrying its
``Authorization`` field, two ways:

- the check: nginx's check request fed to Sluice's HTTP protocol in
  process (read, decided, answered; as bench_engine.py's front door),
  the figure the target is set on (at most 1.1x);
- the decision alone (``Engine.decide_now``), where the token's share is
  largest.

Passes are interleaved; each figure is the CPU time per check
(``time.process_time``) of the fastest pass.

Then the check as deployed: the shipped nginx template in front of a
``sluice serve`` keyed on ``jwt:sub`` and of one keyed on ``ip`` (the same
1,000 clients, each with its token, from its address in a trusted
X-Forwarded-For; wrk with bench/tokens.lua), interleaved passes, each
Sluice's CPU per request from /proc (as bench_check.py measures it). Skip
it with ``--in-process``.

Usage: ``.venv/bin/python bench/bench_identity.py [--passes 9] [--batch 20000] [--seconds 5] [--rounds 6]
[--in-process]``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import asyncio  # noqa: E402

import uvloop  # noqa: E402
from bench_engine import _Transport  # noqa: E402
from uvicorn.config import Config  # noqa: E402
from uvicorn.server import ServerState  # noqa: E402

from sidecar.app import create_app  # noqa: E402
from sidecar.config import parse_rules_text  # noqa: E402
from sidecar.engine import Engine  # noqa: E402
from sidecar.request import CheckRequest  # noqa: E402
from sidecar.rules import compile_rules  # noqa: E402
from sidecar.server import protocol_factory  # noqa: E402
from sidecar.tracing import Tracing  # noqa: E402
from tests.geodb import write_asn_database  # noqa: E402
from tests.jwks import Issuer  # noqa: E402

TOKENS_LUA = ROOT / "bench" / "tokens.lua"
RULE = """
client_ip: {{trusted_proxies: [127.0.0.0/8]}}
rules:
  - id: per-client
    key: [{key}]
    limit: {{requests: 1000000000, per: 1m}}
    action: block
"""
JWT = """
jwt:
  keys: {file: jwks.json}
  algorithms: [RS256]
"""
GEO = "geoip: {asn: asn.mmdb}\n"
CLIENTS = 1_000


def engine(text: str, directory: Path) -> Engine:
    return Engine(compile_rules(parse_rules_text(text, "bench.yaml", directory)))


def check(address: str, token: str, number: int) -> bytes:
    """nginx's check request for one client (the shipped template's fields)."""
    return (f"GET /v1/nginx/auth HTTP/1.1\r\nHost: sluice\r\nX-Sluice-Client-Addr: {address}\r\n"
            f"X-Original-Method: GET\r\nX-Original-URI: /items\r\nX-Original-Host: api.test\r\n"
            f"X-Request-Id: {number:032x}\r\nAuthorization: Bearer {token}\r\nUser-Agent: bench\r\n\r\n").encode()


def protocol_for(chosen: Engine):  # type: ignore[no-untyped-def]
    app = create_app(chosen)
    config = Config(app, access_log=False, server_header=False, date_header=False, proxy_headers=False,
                    lifespan="off", http=protocol_factory())
    config.load()
    protocol = protocol_factory()(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(_Transport())
    return protocol


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=9)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--seconds", type=int, default=5, help="each pass through nginx (default 5)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved passes through nginx (default 6)")
    parser.add_argument("--in-process", action="store_true", help="skip the checks through nginx")
    args = parser.parse_args()
    issuer = Issuer()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / "jwks.json").write_text(json.dumps(issuer.jwks(("RS256",))))
        write_asn_database(directory / "asn.mmdb", {"10.0.0.0/8": (64500, "Bench Net", "NL")})
        engines = {"jwt:sub": engine(JWT + RULE.format(key='"jwt:sub"'), directory),
                   "asn": engine(GEO + RULE.format(key="asn"), directory),
                   "ip": engine(RULE.format(key="ip"), directory),
                   "ip, traced": engine(RULE.format(key="ip"), directory)}
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = InMemorySpanExporter()
    traced = engines["ip, traced"]
    traced.tracing = Tracing("", traced.derived_key(b"sluice trace keys"), "bench", exporter=spans)
    tokens = [issuer.token({"sub": f"user-{n}"}, "RS256") for n in range(CLIENTS)]
    addresses = [f"10.0.{n >> 8}.{n & 255}" for n in range(CLIENTS)]
    best: dict[tuple[str, str], float] = {}

    async def checks() -> None:
        protocols = {name: protocol_for(chosen) for name, chosen in engines.items()}
        for number in range(args.passes * len(engines)):
            name = list(engines)[number % len(engines)]
            heads = [check(addresses[n % CLIENTS], tokens[n % CLIENTS], n) for n in range(args.batch)]
            received = protocols[name].data_received
            started = time.process_time()
            for head in heads:
                received(head)
            figure = (time.process_time() - started) / args.batch * 1e6
            best["check", name] = min(best.get(("check", name), figure), figure)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(checks())
    deciding = [name for name in engines if name != "ip, traced"]  # the decision has no span
    for number in range(args.passes * len(deciding)):
        name = deciding[number % len(deciding)]
        chosen = engines[name]
        requests = [CheckRequest("GET", "api.test", "/items", {"authorization": f"Bearer {tokens[n % CLIENTS]}"},
                                 chosen.resolve_client(addresses[n % CLIENTS], None), "r")
                    for n in range(args.batch)]
        decide = chosen.decide_now
        started = time.process_time()
        for request in requests:
            decide(request)
        figure = (time.process_time() - started) / args.batch * 1e6
        best["decision", name] = min(best.get(("decision", name), figure), figure)
    assert engines["jwt:sub"].metrics.jwt_tokens["valid"] == 2 * args.passes * args.batch, "a token was not valid"
    traced.close()
    assert len(spans.get_finished_spans()) == args.passes * args.batch, "a check was not traced"
    print(f"bench_identity: one window rule, {CLIENTS:,} clients each with its own token, fastest of "
          f"{args.passes} interleaved passes of {args.batch:,} (CPU time per check)")
    for what in ("check", "decision"):
        ip_figure = best[what, "ip"]
        print(f"  {what + ':':<10} keyed on ip {ip_figure:6.2f} µs")
        for name in ("jwt:sub", "asn", "ip, traced") if what == "check" else ("jwt:sub", "asn"):
            target = "   (target <= 1.1)" if what == "check" and name != "ip, traced" else ""
            print(f"  {'':<10} keyed on {name:<10} {best[what, name]:6.2f} µs: {best[what, name] / ip_figure:.2f}x "
                  f"the address's{target}")
    print("  (with tracing off, the check keyed on ip is the untraced one: the doors hold None and build nothing)")
    if not args.in_process:
        through_nginx(issuer, tokens, args.seconds, args.rounds)


def through_nginx(issuer: Issuer, tokens: list[str], seconds: int, rounds: int) -> None:
    """The check as deployed: nginx's template before a Sluice keyed on
    jwt:sub and one keyed on ip, each Sluice's CPU per request."""
    import bench_check

    bench_check.ensure_wrk()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-identity-") as tmp:
        run = Path(tmp)
        bench = bench_check.Bench(run)
        (run / "jwks.json").write_text(json.dumps(issuer.jwks(("RS256",))))
        (run / "tokens.txt").write_text("\n".join(tokens) + "\n")
        configs = {}
        try:
            upstream = [bench.start_upstream()]
            for name, key in (("ip", "ip"), ("jwt:sub", '"jwt:sub"')):
                rules = run / f"rules-{name.replace(':', '-')}.yaml"
                rules.write_text((JWT if name != "ip" else "") + RULE.format(key=key))
                sluice, port = bench.start_sluice(f"sluice-{name}", rules=rules)
                nginx, nginx_port = bench.start_nginx(f"nginx-{name.replace(':', '-')}", port)
                configs[name] = bench_check.Config(name, f"http://127.0.0.1:{nginx_port}",
                                                   {"sidecar": sluice, "nginx": nginx, "upstream": upstream})
            for config in configs.values():
                _wrk_pass(config, run / "tokens.txt", 1, keep=False)
            for number in range(rounds):
                for config in list(configs.values())[::1 if number % 2 == 0 else -1]:
                    _wrk_pass(config, run / "tokens.txt", seconds)
        except (OSError, subprocess.SubprocessError):
            for log in sorted((run / "logs").glob("*")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}", file=sys.stderr)
            raise
        finally:
            bench.procs.stop()
    ip_us, jwt_us = (configs[name].us_per_request("sidecar") for name in ("ip", "jwt:sub"))
    print(f"  through nginx ({rounds} interleaved passes of {seconds} s, Sluice's CPU per request from /proc):")
    print(f"             keyed on ip {ip_us:6.2f} µs")
    print(f"             keyed on jwt:sub  {jwt_us:6.2f} µs: {jwt_us / ip_us:.2f}x the address's   (target <= 1.1)")


def _wrk_pass(config, tokens_file: Path, seconds: int, keep: bool = True) -> None:  # type: ignore[no-untyped-def]
    """One wrk pass of bench/tokens.lua, the CPU of the config's processes charged to it."""
    import bench_check

    every = [pid for pids in config.pids.values() for pid in pids]
    before = {pid: bench_check.cpu_seconds(pid) for pid in every}
    out = subprocess.run([bench_check.ensure_wrk(), "-t2", "-c32", f"-d{seconds}s", "-s", str(TOKENS_LUA),
                          config.url, "--", str(tokens_file)], capture_output=True, text=True, check=True,
                         timeout=seconds + 30).stdout
    # nginx's cache loader ends a minute after nginx starts: what it used is what it had.
    after = {pid: bench_check.cpu_seconds(pid) if Path(f"/proc/{pid}").exists() else before[pid] for pid in every}
    done = re.search(r"(\d+) requests in ([\d.]+)(m?s)", out)
    if done is None or "Non-2xx" in out:
        raise SystemExit(f"wrk through {config.name}: no count, or refusals:\n{out}")
    if not keep:
        return
    took = float(done.group(2)) / (1000 if done.group(3) == "ms" else 1)
    config.passes.append(bench_check.Result(int(done.group(1)), took, 0, 0))
    for role, pids in config.pids.items():
        config.cpu[role] = config.cpu.get(role, 0.0) + sum(after[pid] - before[pid] for pid in pids)


if __name__ == "__main__":
    main()
