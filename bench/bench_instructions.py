"""What does a check cost in instructions, against answering 200 through ASGI? Counted, not timed.

On a shared machine the CPU time of one configuration moves 10-20 % from
pass to pass, more than most changes to the check's code. The instructions
a check executes do not: this script counts them under valgrind's callgrind
(the same count on every run, to a few in a hundred thousand), so a change
of one per cent shows. Instructions are not time: a miss of the CPU's cache
costs many cycles and no instruction, so the rotating rows understate what
rotation costs (bench/bench_core.py times them through nginx).

Each configuration is fed nginx's check requests in process (the shipped
template's fields, bench/bench_engine.py's ``nginx_check``) through the
protocol that serves them, with the event loop turned after each one as a
server turns it, and answers into a transport that drops the bytes:

* ``floor``: a bare httptools protocol answering a fixed 200
  (bench/bench_check.py's HTTP floor);
* ``asgi``: uvicorn's httptools protocol with the trivial raw ASGI app that
  answers 200 (bench/bench_check.py's reference);
* ``sluice-no-rule``: Sluice's protocol and front door, without a rule;
* ``sluice-one``: the ten rules of bench/bench_engine.py, one client;
* ``sluice-rotating``: the same, a new one of 100,000 clients every check;
* ``sluice-pure-one``: the pure-Python core (SLUICE_PURE_PYTHON=1), one client;
* ``sluice-node-one``, ``sluice-node-rotating``: the ten rules over the
  node's table (``sluice serve --workers N``'s store, sidecar.store.node),
  its zones private to the process: what a worker executes for the
  table's transactions, beside ``sluice-one`` and ``sluice-rotating``.

A configuration's figure is the difference between a run that feeds
``--checks`` requests and one that feeds none (the same start, the same
warm-up), divided by ``--checks``. Ratios are taken between figures of the
same run. The warm-up is 2,000 checks, and 15,000 for the rotating
configurations: they store eight keys a client in a map of 100,000, full
after 12,500 clients, so every check counted stores its keys in a full
map, as under a sustained rotation, and none pays for the map's growth,
which happens once.

With ``--cache``, callgrind also simulates the CPU's caches and each
configuration's figure comes with the reads and writes a check makes that
miss a last-level cache of 4 MB (16 ways, lines of 64 bytes): what a
rotation of clients costs beyond its instructions, the same on every run.
The simulation ignores software prefetches. A rotating check makes room
in the map once in about 125 (a hundredth of the map at once), so
``--checks 20000`` averages the evictions over more of them than the
default does.

Usage: ``.venv/bin/python bench/bench_instructions.py [--checks 3000]
[--cache] [--configurations sluice-one,sluice-rotating]`` (about nine
minutes for every configuration; about twice that with ``--cache``).
Needs valgrind (``make bench`` installs it). No network: nothing is sent
anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

WARM = 2_000
ROTATING_WARM = 15_000  # past a full map of the rotating clients' keys (the docstring says why)
CONFIGURATIONS = ("floor", "asgi", "sluice-no-rule", "sluice-one", "sluice-rotating", "sluice-pure-one",
                  "sluice-node-one", "sluice-node-rotating")
COLLECTED = re.compile(r"Collected : ([\d ]+)")
# The simulated last-level cache of --cache: 4 MB, 16 ways, lines of 64 bytes.
LAST_LEVEL = "--LL=4194304,16,64"
# Callgrind's events with its cache simulation, in the order it counts them.
CACHE_EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")


class Transport(asyncio.Transport):
    """What the protocols ask of a transport; answers are counted and dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.closing = False
        self.answers = 0

    def write(self, data: Any) -> None:
        self.answers += bytes(data).count(b"HTTP/1.1 ")

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def protocol_for(configuration: str, keep_alive: float = 5.0) -> Any:
    """The protocol that serves ``configuration``, made as its server makes
    it; an idle connection is closed after ``keep_alive`` seconds (uvicorn's
    default: 5)."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    if configuration == "floor":
        from bench_check import FLOOR_PROTOCOL

        namespace: dict[str, Any] = {}
        exec(FLOOR_PROTOCOL, namespace)  # noqa: S102 - the bench's own source
        return namespace["Floor"]()
    if configuration == "asgi":
        from bench_check import BARE_APP
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        namespace = {}
        exec(BARE_APP, namespace)  # noqa: S102 - the bench's own source
        config = Config(namespace["app"], access_log=False, server_header=False, date_header=False,
                        proxy_headers=False, lifespan="off", http="httptools", timeout_keep_alive=keep_alive)
        config.load()
        return HttpToolsProtocol(config=config, server_state=ServerState(), app_state={})
    from bench_engine import NO_RULES, TEN_RULES, engine_for

    from sidecar.app import create_app
    from sidecar.server import protocol_factory

    engine = engine_for(NO_RULES if configuration == "sluice-no-rule" else TEN_RULES)
    if configuration.startswith("sluice-node"):
        from sidecar.engine import Engine
        from sidecar.store.node import NodeStore, NodeZones

        ruleset = engine.ruleset
        engine = Engine(ruleset, store=NodeStore(NodeZones.private(ruleset.max_keys), ruleset.node))
    app = create_app(engine)
    config = Config(app, access_log=False, server_header=False, date_header=False, proxy_headers=False,
                    lifespan="off", http=protocol_factory(), timeout_keep_alive=keep_alive)
    config.load()
    return protocol_factory()(config=config, server_state=ServerState(), app_state={})


async def feed(configuration: str, checks: int) -> None:
    """The warm-up, then ``checks`` more, each answered before the next."""
    from bench_engine import nginx_check

    from sidecar.server import freeze_loaded_objects, tune_garbage_collector

    if configuration.startswith("sluice"):
        tune_garbage_collector()  # as a `sluice serve` process
    protocol = protocol_for(configuration)
    transport = Transport()
    protocol.connection_made(transport)
    if configuration.startswith("sluice"):
        freeze_loaded_objects()
    rotating = configuration.endswith("rotating")
    warm = ROTATING_WARM if rotating else WARM
    requests = [nginx_check(number if rotating else 7) for number in range(warm + checks)]
    for request in requests:
        expected = transport.answers + 1
        protocol.data_received(request)
        while transport.answers < expected:
            await asyncio.sleep(0)  # the loop turns, as a server's does, until the answer is written
    assert not transport.closing, f"{configuration}: the connection was closed"


def child(configuration: str, checks: int) -> None:
    import uvloop

    if configuration.startswith("sluice"):
        from sidecar import core

        pure = configuration == "sluice-pure-one"
        assert core.PURE == pure, f"{configuration} runs the {'pure' if core.PURE else 'compiled'} core"
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(feed(configuration, checks))


def counted(configuration: str, checks: int, cache: bool = False) -> dict[str, int]:
    """Callgrind's totals of one run of ``configuration`` feeding ``checks``
    checks after the warm-up: its instructions (``Ir``), and with ``cache``
    every event of its cache simulation (``CACHE_EVENTS``)."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("SLUICE_PURE_PYTHON", None)
    if configuration == "sluice-pure-one":
        env["SLUICE_PURE_PYTHON"] = "1"
    simulation = ["--cache-sim=yes", LAST_LEVEL] if cache else []
    result = subprocess.run(["valgrind", "--tool=callgrind", *simulation, "--callgrind-out-file=/dev/null",
                             sys.executable, __file__, "--child", configuration, str(checks)],
                            capture_output=True, text=True, env=env, timeout=3600)
    found = COLLECTED.search(result.stderr)
    if result.returncode != 0 or found is None:
        raise SystemExit(f"{configuration}: valgrind failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return dict(zip(CACHE_EVENTS if cache else ("Ir",), map(int, found.group(1).split()), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=3_000, help="checks counted per configuration (default 3000)")
    parser.add_argument("--cache", action="store_true",
                        help="also count the checks' misses of a simulated 4 MB last-level cache")
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS),
                        help=f"the configurations measured, comma-separated (default: all: {','.join(CONFIGURATIONS)})")
    parser.add_argument("--child", nargs=2, metavar=("CONFIGURATION", "CHECKS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    measured = args.configurations.split(",")
    unknown = sorted(set(measured) - set(CONFIGURATIONS))
    if unknown:
        parser.error(f"unknown configurations: {', '.join(unknown)}")
    started = time.monotonic()
    print(f"bench_instructions: instructions per check under callgrind, {args.checks:,} checks after "
          f"{WARM:,} of warm-up ({ROTATING_WARM:,} for the rotating ones), fed in process"
          + ("; misses of a simulated last-level cache of 4 MB, 16 ways" if args.cache else ""))
    per_check: dict[str, float] = {}
    for configuration in measured:
        none, some = counted(configuration, 0, args.cache), counted(configuration, args.checks, args.cache)
        each = {event: (some[event] - none[event]) / args.checks for event in some}
        per_check[configuration] = each["Ir"]
        misses = f", {each['DLmr']:6.1f} + {each['DLmw']:6.1f} last-level misses (reads + writes)" \
            if args.cache else ""
        print(f"  {configuration:<20} {each['Ir']:>10,.0f} instructions per check{misses}")
    rows = (("ten rules, one client / trivial ASGI app", "sluice-one", "asgi", "(CPU target <= 0.9)"),
            ("ten rules, 100,000 clients / trivial ASGI app", "sluice-rotating", "asgi", "(CPU target <= 0.9)"),
            ("no rule / trivial ASGI app", "sluice-no-rule", "asgi", ""),
            ("ten rules, one client / no rule", "sluice-one", "sluice-no-rule", ""),
            ("100,000 clients / one client", "sluice-rotating", "sluice-one", "(CPU target <= 1.2)"),
            ("compiled core / pure-Python core, one client", "sluice-one", "sluice-pure-one", ""),
            ("node's table / memory store, one client", "sluice-node-one", "sluice-one", ""),
            ("node's table / memory store, 100,000 clients", "sluice-node-rotating", "sluice-rotating", ""),
            ("trivial ASGI app / HTTP floor", "asgi", "floor", ""))
    shown = [row for row in rows if row[1] in per_check and row[2] in per_check]
    if shown:
        print("\nRatios (same run):")
    for label, numerator, reference, target in shown:
        print(f"  {label:<46} {per_check[numerator] / per_check[reference]:6.3f}x   {target}")
    print(f"\n(bench_instructions took {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
