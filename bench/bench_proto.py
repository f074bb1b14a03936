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
max_keys 100,000 by default: rotating clients evict), CPU time per decision
(fastest of interleaved passes) of:

* the prototype, reading its keys one after the other;
* the prototype, its ten keys hashed first and their records asked for
  together (``overlapped``: their misses overlap);
* ``lean``: overlapped, each key probing 4 records, not 16 (a new key
  reads every record of its probe, to find a free or the oldest one);
* the engine's ``decide_now`` over the memory store, the ten rules of
  bench/bench_engine.py (clients resolved beforehand, as the prototype's
  fields are read beforehand).

Each kind's rotating figure over its own one-client figure (and the µs
it adds) is what rotation costs it. ``--max-keys 2000`` makes every table
and the engine's map small enough for the CPU's caches: what rotation then
still costs is the work of taking in new keys and dropping old ones, not
the misses of a large table.

Usage: ``.venv/bin/python bench/bench_proto.py [--passes 5] [--max-keys 100000]``.
No network.
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
PROTOTYPES = ["prototype", "overlapped", "lean"]
LEAN_PROBES = 4


def fields(client: str) -> tuple[bytes, ...]:
    return (client.encode(), b"k", b"/api/items", b"example.com", b"shoes", b"s1")


def proto_pass(table: Table, checks: list[tuple[bytes, ...]], start: float, overlapped: bool) -> float:
    decide = table.decide_overlapped if overlapped else table.decide
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
    parser.add_argument("--max-keys", type=int, default=MAX_KEYS,
                        help="keys the tables and the engine's map hold (default 100,000; 2,000 fits the CPU's caches)")
    args = parser.parse_args()
    loads = {"one client": 1, "100,000 clients": 100_000, "1,000,000 clients": 1_000_000}
    tables = {(kind, name): Table(args.max_keys, LEAN_PROBES if kind == "lean" else 16)
              for kind in PROTOTYPES for name in loads}
    rules = TEN_RULES.replace(f"max_keys: {MAX_KEYS}", f"max_keys: {args.max_keys}")
    engines = {name: engine_for(rules) for name in loads}
    figures: dict[tuple[str, str], list[float]] = {}
    kinds = [*PROTOTYPES, "engine"]
    for number in range(args.passes):
        for name, clients in loads.items():
            offset = number * BATCH
            addresses = [address((offset + i) % clients) for i in range(BATCH)]
            checks = [fields(a) for a in addresses]
            requests = requests_for(engines[name], addresses)
            for kind in kinds if number % 2 == 0 else reversed(kinds):
                figure = (engine_pass(engines[name], requests) if kind == "engine"
                          else proto_pass(tables[kind, name], checks, 1000.0 + number, kind != "prototype"))
                figures.setdefault((kind, name), []).append(figure)
    print(f"CPU per decision of ten rules, fastest of {args.passes} passes of {BATCH:,}"
          f" (max_keys {args.max_keys:,}):\n")
    print("| load | " + " | ".join(f"{kind} µs" for kind in kinds) + " |\n|---|" + "---:|" * len(kinds))
    for name in loads:
        print(f"| {name} | " + " | ".join(f"{min(figures[kind, name]):.2f}" for kind in kinds) + " |")
    print("\nOver one client (ratio; µs more a decision):\n")
    print("| load | " + " | ".join(kinds) + " |\n|---|" + "---:|" * len(kinds))
    for name in list(loads)[1:]:
        cells = []
        for kind in kinds:
            one, many = min(figures[kind, "one client"]), min(figures[kind, name])
            cells.append(f"{many / one:.2f}×; +{many - one:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nevictions in the prototypes' tables: " + "; ".join(
        f"{kind}: " + ", ".join(f"{name} {tables[kind, name].evictions:,}" for name in loads) for kind in PROTOTYPES))


if __name__ == "__main__":
    main()
