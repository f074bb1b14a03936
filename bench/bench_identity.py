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

Usage: ``.venv/bin/python bench/bench_identity.py [--passes 9] [--batch 20000]``.
"""

from __future__ import annotations

import argparse
import json
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

RULE = """
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


if __name__ == "__main__":
    main()
