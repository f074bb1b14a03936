"""What does the memory map's read-ahead buy? The policy tells its table
which keys a request reads next (``StateTable.expect``), and the compiled
core's matching program hints each key as it makes the key's check
(``StateMap.hint``); the compiled map then asks for their memory ahead,
every key's at once, so that the misses of many clients' keys overlap
instead of following one another.

One process, nginx's check requests fed to Sluice's HTTP protocol (as
bench/bench_instructions.py feeds them: the ten rules of
bench/bench_engine.py, max_keys 100,000), the map warmed up first. Then
blocks of checks, the hints on and off in turn (ABBA): off, the map's
``expect_from`` is set beyond its size, so that it takes neither hints
nor ``expect`` (as a map smaller than ``expect_from`` does). Each block's CPU time
per check is paired with its neighbour's; on one machine, in one process,
the two see the same load. Three traffics:

* returning clients: 5,000 clients in turn, every key held (40,000 keys);
* new clients: every check a new client, the map full, each new key
  evicting an old one (100,000 rotating clients);
* one client: the map small, the hint not given (under ``expect_from``).

Needs the compiled core (``make core``). Usage:
``.venv/bin/python bench/bench_hints.py [--blocks 40] [--size 2000]``.
No network.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_engine  # noqa: E402
from bench_instructions import Transport, protocol_for  # noqa: E402

from sidecar import core  # noqa: E402

# (label, clients in turn (0: every check a new one), checks of warm-up)
TRAFFICS = (("returning clients (5,000 in turn)", 5_000, 150_000),
            ("new clients (100,000 rotating, map full)", 0, 150_000),
            ("one client", 1, 20_000))


async def measure(clients: int, warm: int, blocks: int, size: int) -> tuple[list[float], list[float]]:
    """µs of CPU per check of each block with the hint on, and off."""
    from sidecar.server import freeze_loaded_objects, tune_garbage_collector

    made = []
    engine_for = bench_engine.engine_for
    bench_engine.engine_for = lambda text: made.append(engine_for(text)) or made[-1]
    try:
        tune_garbage_collector()
        protocol = protocol_for("sluice-rotating")
    finally:
        bench_engine.engine_for = engine_for
    states = made[-1].store.table.states
    hinted_from = states.expect_from
    transport = Transport()
    protocol.connection_made(transport)
    freeze_loaded_objects()
    requests = [bench_engine.nginx_check(number % clients if clients else number)
                for number in range(warm + blocks * size)]
    position = 0

    async def feed(count: int) -> None:
        nonlocal position
        for request in requests[position:position + count]:
            expected = transport.answers + 1
            protocol.data_received(request)
            while transport.answers < expected:
                await asyncio.sleep(0)
        position += count

    await feed(warm)
    on: list[float] = []
    off: list[float] = []
    for block in range(blocks):
        hinted = block % 4 in (0, 3)  # on, off, off, on, ...
        states.expect_from = hinted_from if hinted else 1 << 62
        started = time.process_time()
        await feed(size)
        (on if hinted else off).append((time.process_time() - started) / size * 1e6)
    states.expect_from = hinted_from
    return on, off


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=40, help="blocks of checks, half of them with the hint")
    parser.add_argument("--size", type=int, default=2000, help="checks a block")
    arguments = parser.parse_args()
    if core.PURE:
        raise SystemExit("bench_hints measures the compiled map: build the compiled core (make core)")
    import uvloop

    print(f"== the memory map's read-ahead, on / off: {arguments.blocks} blocks of {arguments.size:,} checks, ABBA")
    for label, clients, warm in TRAFFICS:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            on, off = runner.run(measure(clients, warm, arguments.blocks, arguments.size))
        pairs = [a / b for a, b in zip(on, off, strict=True)]
        print(f"{label + ':':44} on {statistics.median(on):6.2f} µs, off {statistics.median(off):6.2f} µs; "
              f"on / off {statistics.median(pairs):.3f} (pairs: faster in {sum(p < 1 for p in pairs)} "
              f"of {len(pairs)})")


if __name__ == "__main__":
    main()
