"""Could a C path for the common check meet the compiled core's rotation
target? A prototype measured against today's engine, in one run.

bench/proto/ctable.pyx (compiled here by Cython's pyximport) decides the ten
sliding-window rules of a check in C over a table of fixed records, with no
Python object per key: the keys hashed from the check's fields as they are
read, an open-addressing table of twice max_keys records, the least recently
used record of a key's probe taken when full. It leaves out what a real C
path must also do (matching rules, the other limiters, bans, the answer),
which the engine's figure includes: so it bounds what the table and the
counting cost, the part that grows with rotation.

For each of one client, 100,000 and 1,000,000 rotating clients (the rules'
max_keys 100,000: rotating clients evict), CPU time per decision (fastest
of interleaved passes) of:

* the prototype;
* the engine's ``decide_now`` over the memory store, the ten rules of
  bench/bench_engine.py (clients resolved beforehand, as the prototype's
  fields are read beforehand).

Usage: ``.venv/bin/python bench/bench_proto.py [--passes 5]``. No network.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pyximport

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
pyximport.install(language_level=3, build_dir=str(HERE / "proto" / "build"))

from bench_engine import TEN_RULES, address, engine_for, requests_for  # noqa: E402
from proto.ctable import Table  # noqa: E402

MAX_KEYS = 100_000
BATCH = 50_000
HIGH = 1_000_000_000


def fields(client: str) -> tuple[bytes, ...]:
    return (client.encode(), b"k", b"/api/items", b"example.com", b"shoes", b"s1")


def proto_pass(table: Table, checks: list[tuple[bytes, ...]], start: float) -> float:
    decide = table.decide
    began = time.process_time()
    now = start
    for check in checks:
        now += 0.0001
        decide(*check, now, 60.0, HIGH)
    return (time.process_time() - began) / len(checks) * 1e6


def engine_pass(engine: object, requests: list) -> float:
    decide = engine.decide_now  # type: ignore[attr-defined]
    began = time.process_time()
    for request in requests:
        decide(request)
    return (time.process_time() - began) / len(requests) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    loads = {"one client": 1, "100,000 clients": 100_000, "1,000,000 clients": 1_000_000}
    tables = {name: Table(MAX_KEYS) for name in loads}
    engines = {name: engine_for(TEN_RULES) for name in loads}
    figures: dict[tuple[str, str], list[float]] = {}
    for number in range(args.passes):
        for name, clients in loads.items():
            offset = number * BATCH
            addresses = [address((offset + i) % clients) for i in range(BATCH)]
            checks = [fields(a) for a in addresses]
            requests = requests_for(engines[name], addresses)
            kinds = ["prototype", "engine"] if number % 2 == 0 else ["engine", "prototype"]
            for kind in kinds:
                figure = (proto_pass(tables[name], checks, 1000.0 + number) if kind == "prototype"
                          else engine_pass(engines[name], requests))
                figures.setdefault((kind, name), []).append(figure)
    print(f"CPU per decision of ten rules, fastest of {args.passes} passes of {BATCH:,} (max_keys {MAX_KEYS:,}):\n")
    print("| load | prototype µs | engine µs | prototype / engine |\n|---|---:|---:|---:|")
    for name in loads:
        proto, engine = min(figures["prototype", name]), min(figures["engine", name])
        print(f"| {name} | {proto:.2f} | {engine:.2f} | {proto / engine:.2f}× |")
    one = min(figures["prototype", "one client"])
    for name in list(loads)[1:]:
        print(f"prototype, {name} / one client: {min(figures['prototype', name]) / one:.2f}×; "
              f"engine: {min(figures['engine', name]) / min(figures['engine', 'one client']):.2f}×")
    print("\nevictions in the prototype's tables: "
          + ", ".join(f"{name} {tables[name].evictions:,}" for name in loads))


if __name__ == "__main__":
    main()
