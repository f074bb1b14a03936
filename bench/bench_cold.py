"""The check through nginx, in process, with the CPU's caches cold: a
steadier stand-in for bench/bench_core.py's ratios on a shared machine.

Through nginx, Sluice shares the cores with nginx and wrk, which push its
code and data out of the CPU's nearer caches between checks: a check costs
there about twice what the same check costs fed in process in a loop,
where everything it touches stays cached, and the two kinds of load rank
differently (rotation costs more, relative to the trivial ASGI app, when
the caches are cold). This feeds nginx's check requests to each server's
HTTP protocol in one process, as bench/bench_instructions.py does, and
before each check writes one byte in every line of a buffer the size of
a core's L2 cache here (1 MiB; ``--pollute``), so each check starts with
what that buffer evicted. Only the checks are timed.

Every configuration is fed in the same process, in blocks taken in turn
(each block's ratio paired with the reference's block of the same round),
so the machine's load moves them together:

* the trivial raw ASGI app under uvicorn's httptools protocol (the
  reference), and the HTTP floor (a bare httptools protocol);
* Sluice with the ten rules of bench/bench_engine.py (max_keys 100,000):
  one client; 5,000 returning clients (every key held); every check a new
  client (100,000 rotating, the map full and evicting).

Usage: ``.venv/bin/python bench/bench_cold.py [--rounds 60] [--block 1000]
[--pollute 1024]`` (KiB; 0: warm caches). No network.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_engine import nginx_check  # noqa: E402
from bench_instructions import Transport, protocol_for  # noqa: E402

# (name, the configuration bench_instructions makes, clients in turn (0:
# every check a new one), checks of warm-up)
CONFIGURATIONS = (("asgi", "asgi", 1, 2_000),
                  ("floor", "floor", 1, 2_000),
                  ("one client", "sluice-one", 1, 2_000),
                  ("5,000 returning clients", "sluice-rotating", 5_000, 60_000),
                  ("new clients (100,000 rotating)", "sluice-rotating", 0, 150_000))
KEPT_ALIVE = 24 * 3600.0  # seconds an idle connection stays open
ROWS = (("ten rules, one client / trivial ASGI app", "one client", "asgi"),
        ("ten rules, 5,000 returning clients / trivial ASGI app", "5,000 returning clients", "asgi"),
        ("ten rules, new clients / trivial ASGI app", "new clients (100,000 rotating)", "asgi"),
        ("new clients / one client", "new clients (100,000 rotating)", "one client"),
        ("trivial ASGI app / HTTP floor (no system call here)", "asgi", "floor"))


class Fed:
    """One configuration's protocol, fed its checks in turn."""

    def __init__(self, configuration: str, clients: int) -> None:
        # Another configuration's blocks come between this one's: its
        # connection must outlive them (closed, it would answer no more).
        self.protocol = protocol_for(configuration, keep_alive=KEPT_ALIVE)
        self.transport = Transport()
        self.protocol.connection_made(self.transport)
        self.clients = clients
        self.number = 0

    async def feed(self, count: int, before: Callable[[], None] | None) -> float:
        """Seconds the next ``count`` checks took, ``before`` run ahead of
        each (untimed)."""
        protocol, transport = self.protocol, self.transport
        taken = 0.0
        for _ in range(count):
            request = nginx_check(self.number % self.clients if self.clients else self.number)
            self.number += 1
            if before is not None:
                before()
            started = time.perf_counter()
            expected = transport.answers + 1
            protocol.data_received(request)
            while transport.answers < expected:
                assert not transport.closing, "the connection was closed"
                await asyncio.sleep(0)
            taken += time.perf_counter() - started
        return taken


async def measure(rounds: int, block: int, pollute: int) -> dict[str, list[float]]:
    """µs per check of each configuration's block, round by round."""
    from sidecar.server import freeze_loaded_objects, tune_garbage_collector

    tune_garbage_collector()  # as a `sluice serve` process (the same for every configuration here)
    fed = {name: Fed(configuration, clients) for name, configuration, clients, _ in CONFIGURATIONS}
    freeze_loaded_objects()
    for name, _, _, warm in CONFIGURATIONS:
        await fed[name].feed(warm, None)
    buffer = bytearray(max(pollute, 1) * 1024)
    ones = b"\1" * len(buffer[::64])

    def evict() -> None:
        buffer[::64] = ones  # a write in each line: what was cached before goes

    before = evict if pollute else None
    figures: dict[str, list[float]] = {name: [] for name in fed}
    for _ in range(rounds):
        for name, one in fed.items():
            figures[name].append(await one.feed(block, before) / block * 1e6)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60, help="blocks of each configuration, taken in turn")
    parser.add_argument("--block", type=int, default=1000, help="checks a block")
    parser.add_argument("--pollute", type=int, default=1024, help="KiB written before each check (0: none)")
    arguments = parser.parse_args()
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        figures: dict[str, Any] = runner.run(measure(arguments.rounds, arguments.block, arguments.pollute))
    print(f"== checks fed in process, {arguments.pollute:,} KiB written before each; {arguments.rounds} rounds "
          f"of {arguments.block:,} checks a configuration")
    for name, values in figures.items():
        print(f"  {name + ':':34} {statistics.median(values):6.2f} µs a check (median of the rounds)")
    print("Ratios (each round's blocks paired):")
    for label, name, reference in ROWS:
        pairs = [a / b for a, b in zip(figures[name], figures[reference], strict=True)]
        print(f"  {label:60} {statistics.median(pairs):.3f}x (rounds {min(pairs):.3f}-{max(pairs):.3f})")


if __name__ == "__main__":
    main()
