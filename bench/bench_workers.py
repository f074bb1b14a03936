"""What does sharing one table cost? ``sluice serve --workers 2`` on the
memory backend (the node-wide table in shared memory, sidecar.store.node)
against ``--workers 1`` (the process's own memory store), in one run.

1. In process: the ten rules of bench/bench_engine.py decided by an engine
   over the memory store and by one over the node-wide store (the compiled
   zone, private to the process), for one client and for 100,000 rotating
   clients, passes interleaved: what a decision's transaction costs (the
   digests, the stripes' locks, reading and writing the states' bytes).
2. Through nginx (the shipped template, one nginx worker) with ``wrk -t2
   -c32`` and bench/rotate.lua, as bench/bench_core.py does: Sluice with one
   worker and with two, rotating 100,000 client addresses and with one
   client (whose checks all lock the same stripes: the contention figure).
   Beside them, made so by this bench's sitecustomize (which only it
   installs), two workers that each decide over zones of their own
   (``private``: the same transactions, nothing shared between the
   workers), and two workers that each keep a memory store of their own
   (``own-memory``: what serve refuses, each worker counting alone). So the
   cost of ``--workers 2`` splits into what two processes cost on this
   machine (own memory / one worker), what the zones' transactions cost
   (private / own memory) and what sharing costs (shared / private).
   Every figure is the CPU time per check of the sidecar's processes (the
   parent and its workers; utime + stime from /proc), over passes
   interleaved with the others; the ratios are of the same run. Beside
   each two-worker configuration's passes: the locks its workers found
   busy, and the busier worker's share of the two workers' CPU (the
   kernel deals nginx's connections; near 1.0, one worker decided nearly
   every check, and the pass says little about sharing).

With ``--pace MS`` each of wrk's connections waits MS milliseconds before
each request: a load the machine takes with room to spare, where each
check more often wakes a sleeping worker.

Usage: ``.venv/bin/python bench/bench_workers.py [--seconds 5] [--rounds 3]
[--pace MS]``.
Needs the compiled core (``--workers 2`` on the memory backend refuses to
run without it), nginx and wrk (``make bench`` installs them). Loopback
only; every pass is bounded in time.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from bench_check import Bench, Config, children_of, cpu_seconds, ensure_wrk, free_port, http_ok  # noqa: E402
from bench_engine import TEN_RULES, address, requests_for, time_decisions  # noqa: E402
from bench_protocol import interleaved, ratio_text  # noqa: E402

from sidecar import core  # noqa: E402
from sidecar.config import parse_rules_text  # noqa: E402
from sidecar.engine import Engine  # noqa: E402
from sidecar.rules import compile_rules  # noqa: E402
from sidecar.store.node import NodeStore, NodeZones, zones_directory  # noqa: E402

ONE_CLIENT, MANY = 1, 100_000


def in_process(passes: int, batch: int = 20_000) -> dict[str, list[float]]:
    """µs per decision of each pass: memory store and node-wide store, one
    client and rotating clients, interleaved."""
    ruleset = compile_rules(parse_rules_text(TEN_RULES, "bench", ROOT))
    largest = max((getattr(rule.limiter, "limit", 0) for rule in ruleset.rules if rule.limiter.leases), default=0)
    engines = {"memory": Engine(ruleset),
               "node": Engine(ruleset, store=NodeStore(NodeZones.private(ruleset.max_keys, largest),
                                                       ruleset.node))}
    rotating = [address(i) for i in range(MANY)]
    figures: dict[str, list[float]] = {}
    gc.collect()
    for number in range(passes):
        for clients in ("one", "rotating"):
            start = number * batch % MANY
            addresses = [rotating[0]] * batch if clients == "one" else rotating[start:start + batch]
            order = list(engines.items()) if number % 2 == 0 else list(reversed(engines.items()))
            for name, engine in order:
                requests = requests_for(engine, addresses)
                figures.setdefault(f"{name}-{clients}", []).append(time_decisions(engine, requests))
    return figures


def report_in_process(figures: dict[str, list[float]]) -> None:
    print("\nIn process, ten rules (µs per decision, median of passes; each pass's in brackets):")
    for name, values in figures.items():
        print(f"  {name:<18} {statistics.median(values):7.2f} [{' '.join(f'{v:.1f}' for v in values)}]")
    for clients in ("one", "rotating"):
        rounds = sorted(node / memory for node, memory in zip(figures[f"node-{clients}"],
                                                              figures[f"memory-{clients}"]))
        extra = statistics.median(figures[f"node-{clients}"]) - statistics.median(figures[f"memory-{clients}"])
        print(f"  node / memory, {clients:<8} client(s): median {statistics.median(rounds):5.2f}x "
              f"({rounds[0]:.2f}-{rounds[-1]:.2f}), {extra:+.1f} µs a decision")


# Installed on the bench's Sluice processes' path. With OWN_STATE set to
# "zones", a worker attaches to the node's zones as serve made them, then
# decides over zones of its own of the same sizes instead; set to "memory",
# it keeps a memory store of its own.
OWN_STATE = "SLUICE_BENCH_OWN_STATE"
SITECUSTOMIZE = f"""
import os

if os.environ.get("{OWN_STATE}") == "zones":
    from sidecar.store import node

    def private(prefix, zone_type=None, attach=node.NodeZones.attach):
        made = attach(prefix, zone_type)
        own = node.NodeZones.private(made.max_keys, made.lease_slots)
        made.close()
        return own

    node.NodeZones.attach = private
elif os.environ.get("{OWN_STATE}") == "memory":
    from sidecar import store
    from sidecar.store import memory

    def own_memory(backend, url, max_keys, name, clock, *arguments, **options):
        return memory.MemoryStore(max_keys, name, clock)

    store.open_store = own_memory
"""


def start_sluice(bench: Bench, name: str, workers: int, own: str = "") -> list[int] | str:
    """A Sluice's pids (its workers' too) and port, or why it did not start;
    ``own``: each worker's own state instead of the node's (see SITECUSTOMIZE)."""
    port = free_port()
    argv = [bench.python, "-m", "sidecar", "serve", "--config", str(bench.rules), "--host", "127.0.0.1",
            "--port", str(port), "--hook-udp", "off", "--log-level", "warning", "--workers", str(workers)]
    try:
        process = bench.procs.start(name, argv, lambda: http_ok(f"http://127.0.0.1:{port}/healthz"),
                                    env={OWN_STATE: own} if own else {})
    except SystemExit as exc:
        return str(exc).splitlines()[-1] if str(exc) else "did not start"
    pids = [process.pid]
    if workers > 1:
        deadline = time.monotonic() + 10
        while len(children := children_of(process.pid)) < workers and time.monotonic() < deadline:
            time.sleep(0.05)
        pids += children
    return pids + [port]


def shared_zones(parent: int) -> list[Any]:
    """The zones a Sluice's workers share, attached here (the compiled zone
    reads its counters without a lock)."""
    from sidecar.shm import Zone

    return [Zone.attach(str(path)) for path in sorted(Path(zones_directory()).glob(f"sluice-{parent}-*"))]


def waits(zones: list[Any]) -> int:
    """Locks the workers found busy when they asked, over the zones."""
    return sum(int(zone.waits) for zone in zones)


def through_nginx(seconds: int, rounds: int,
                  pace: int = 0) -> tuple[list[Config], dict[str, list[float]], dict[str, str]]:
    configs: list[Config] = []
    per_pass: dict[str, list[float]] = {}
    not_run: dict[str, str] = {}
    busy: dict[str, list[Any]] = {}  # each shared configuration's zones
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        bench = Bench(Path(tmp))
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(site)]))
        try:
            bench.start_upstream()
            for name, workers, addresses, own in (
                    ("workers-1", 1, MANY, ""), ("workers-2", 2, MANY, ""),
                    ("workers-2-private", 2, MANY, "zones"), ("workers-2-own-memory", 2, MANY, "memory"),
                    ("workers-1-one-client", 1, ONE_CLIENT, ""),
                    ("workers-2-one-client", 2, ONE_CLIENT, ""),
                    ("workers-2-private-one-client", 2, ONE_CLIENT, "zones")):
                started_as = start_sluice(bench, name, workers, own)
                if isinstance(started_as, str):
                    not_run[name] = started_as
                    continue
                *pids, port = started_as
                if workers > 1 and not own:
                    busy[name] = shared_zones(pids[0])
                _, nginx_port = bench.start_nginx(f"nginx-{name}", port)
                configs.append(Config(name, f"http://127.0.0.1:{nginx_port}", {"sidecar": pids},
                                      addresses=addresses, pace=pace))

            def contention(config: Config) -> Callable[[], None]:
                """The locks found busy per check in the pass about to run,
                and the share of the workers' CPU its busier worker took."""
                before = waits(busy.get(config.name, []))
                workers = config.pids["sidecar"][1:]
                spent = [cpu_seconds(pid) for pid in workers]

                def after() -> None:
                    if config.name in busy:
                        CONTENTION.setdefault(config.name, []).append(
                            (waits(busy[config.name]) - before) / max(1, config.passes[-1].requests))
                    if len(workers) > 1:
                        used = [cpu_seconds(pid) - start for pid, start in zip(workers, spent, strict=True)]
                        BUSIER.setdefault(config.name, []).append(max(used) / max(sum(used), 1e-9))
                return after

            interleaved(bench, configs, rounds, seconds, per_pass, contention)
        finally:
            for zones in busy.values():
                for zone in zones:
                    zone.close()
            bench.procs.stop()
    return configs, per_pass, not_run


# Locks found busy per check, each pass's, by shared configuration.
CONTENTION: dict[str, list[float]] = {}
# The busier worker's share of the workers' CPU, each pass's, by two-worker
# configuration: the kernel deals nginx's connections to the workers, and a
# pass where one worker took (nearly) all of them measures one process,
# not two sharing a table (0.5: an even split; 1.0: one worker alone).
BUSIER: dict[str, list[float]] = {}


def report_through_nginx(configs: list[Config], per_pass: dict[str, list[float]], not_run: dict[str, str]) -> None:
    print("\nThrough nginx, ten rules: sidecar CPU per check (µs, over all passes; each pass's in brackets):")
    for config in configs:
        passes = " ".join(f"{figure:.1f}" for figure in per_pass[config.name])
        print(f"  {config.name:<30} {config.us_per_request('sidecar'):7.1f} µs [{passes}]   "
              f"{statistics.median(config.rates()):7.0f} req/s")
    for name, why in not_run.items():
        print(f"  {name:<30} not run: {why}")
    for name, figures in CONTENTION.items():
        print(f"  {name:<30} locks found busy: {' '.join(f'{figure:.3f}' for figure in figures)} a check")
    for name, figures in BUSIER.items():
        print(f"  {name:<30} the busier worker's share of the workers' CPU: "
              f"{' '.join(f'{figure:.2f}' for figure in figures)}")
    by_name = {config.name: config for config in configs}
    print("\nRatios of sidecar CPU per check (same run):")
    for label, a, b, target in (
            ("--workers 2 / --workers 1, 100,000 clients", "workers-2", "workers-1", "<= 1.1"),
            ("--workers 2 / --workers 1, one client", "workers-2-one-client", "workers-1-one-client", ""),
            ("sharing: shared / private zones, 100,000", "workers-2", "workers-2-private", ""),
            ("sharing: shared / private zones, one client", "workers-2-one-client",
             "workers-2-private-one-client", ""),
            ("the zones' transactions: private / own memory", "workers-2-private", "workers-2-own-memory", ""),
            ("two processes: own memory / one worker", "workers-2-own-memory", "workers-1", "")):
        if a in by_name and b in by_name:
            goal = f"   (target {target})" if target else ""
            print(f"  {label:<46} {ratio_text(by_name, per_pass, a, b)}{goal}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5, help="length of each pass through nginx (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved passes per configuration (default 3)")
    parser.add_argument("--in-process-only", action="store_true", help="only the in-process part")
    parser.add_argument("--pace", type=int, default=0, metavar="MS",
                        help="a paced load: each of wrk's connections waits MS ms before each request "
                             "(8: about 3,500 checks a second here), not the most the stack can take")
    args = parser.parse_args()
    started = time.monotonic()
    print(f"bench_workers: {core.which()}", flush=True)
    report_in_process(in_process(max(3, args.rounds * 2)))
    if not args.in_process_only:
        ensure_wrk()
        report_through_nginx(*through_nginx(args.seconds, args.rounds, args.pace))
    print(f"\n(bench_workers took {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
