"""What does the zone (sidecar.shm) cost per operation, and what does sharing it cost? In one run.

Every pass runs in processes of its own (spawned, as uvicorn's workers are),
each doing one operation again and again for ``--seconds``: a stripe's lock,
a ``get`` and a ``put`` of an 88-byte value (a 128-byte record), the unlock,
with the zone sized for 100,000 keys in 64 stripes. The configurations:

* ``dict``: a Python dict's get and set in one process, the reference (what
  a store in one process does at its core, without lock, bound or expiry);
* ``compiled``: the compiled zone, one process, keys rotating over 100,000;
* ``pure``: the pure-Python twin, the same;
* ``compiled-1M``: the compiled zone, keys rotating over 1,000,000: every
  put evicts;
* ``compiled-2``: two processes on one zone, keys rotating over 100,000
  each (64 stripes: they rarely meet);
* ``compiled-hot``: one process, one key; ``compiled-hot-2``: two processes
  on that one key, always the same stripe (the lock's worst case).

Every figure is CPU time per operation (utime + stime of each process from
/proc/<pid>/stat, summed over the pass's processes, over the operations they
did), over passes interleaved with the others (the order reverses every
other round); ratios are taken between figures of the same run. Throughput
(operations a second, all processes together) is printed beside.

Usage: ``.venv/bin/python bench/bench_zone.py [--seconds 2] [--rounds 3]``.
No network; the zones are files in /dev/shm, removed afterwards.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.machinery
import importlib.util
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.shm import pure_zone  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
NOW, EXPIRES = 1000.0, 1e12
VALUE = bytes(range(88))
CAPACITY, STRIPES = 100_000, 64
SPAWN = multiprocessing.get_context("spawn")


def compiled_zone() -> tuple[Any, str]:
    """The compiled zone class and how it was found, or None and why not."""
    try:
        return importlib.import_module("sidecar.shm._zone").Zone, "the compiled core"
    except ImportError as error:
        why = str(error)
    shm = Path(pure_zone.__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        built = shm / f"_zone{suffix}"
        if built.is_file() and built.stat().st_mtime >= (shm / "_zone.pyx").stat().st_mtime:
            loader = importlib.machinery.ExtensionFileLoader("sidecar.shm._zone", str(built))
            spec = importlib.util.spec_from_file_location("sidecar.shm._zone", built, loader=loader)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            sys.modules["sidecar.shm._zone"] = module
            return module.Zone, "built in place (cythonize -i)"
    return None, why


def cpu_seconds(pid: int | str = "self") -> float:
    """utime + stime of a whole process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def digests(count: int) -> list[bytes]:
    return [hashlib.blake2b(number.to_bytes(8, "little"), digest_size=16).digest() for number in range(count)]


# -- what a pass's processes run ------------------------------------------------


def zone_loop(zone: Any, keys: list[bytes], seconds: float) -> int:
    """Lock, get, put, unlock, over rotating keys, for ``seconds``: the count."""
    count, at, operations = len(keys), 0, 0
    lock, unlock, get, put, stripe_of = zone.lock, zone.unlock, zone.get, zone.put, zone.stripe_of
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(500):
            key = keys[at]
            at = at + 1 if at + 1 < count else 0
            stripes = [stripe_of(key)]
            lock(stripes)
            get(key, NOW)
            put(key, VALUE, EXPIRES, NOW)
            unlock(stripes)
        operations += 500
    return operations


def dict_loop(keys: list[bytes], seconds: float) -> int:
    table: dict[bytes, bytes] = {}
    count, at, operations = len(keys), 0, 0
    get = table.get
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(500):
            key = keys[at]
            at = at + 1 if at + 1 < count else 0
            get(key)
            table[key] = VALUE
        operations += 500
    return operations


def worker(kind: str, path: str, keys: int, offset: int, seconds: float, start: Any, ready: Any,
           results: Any) -> None:
    """One process of a pass: attach, make its keys, say so, wait for the start, run."""
    rotation = digests(keys)
    rotation = rotation[offset:] + rotation[:offset]
    if kind == "dict":
        zone = None
    elif kind == "pure":
        zone = pure_zone.Zone.attach(path)
    else:
        zone = compiled_zone()[0].attach(path)
    ready.put(os.getpid())
    start.wait()
    cpu = cpu_seconds()
    operations = dict_loop(rotation, seconds) if zone is None else zone_loop(zone, rotation, seconds)
    results.put((operations, cpu_seconds() - cpu))
    if zone is not None:
        zone.close()


# -- the passes -------------------------------------------------------------------


@dataclass
class Config:
    name: str
    kind: str  # dict, pure or compiled: what the processes run
    processes: int
    keys: int
    cpu_per_op: list[float] = field(default_factory=list)  # µs, one a pass
    rate: list[float] = field(default_factory=list)  # operations a second, one a pass
    waits: list[float] = field(default_factory=list)  # locks found busy per operation, one a pass

    def run(self, seconds: float, folder: str) -> None:
        """One pass: a new zone, the processes, their figures."""
        path = os.path.join(folder, f"sluice-bench-zone-{os.getpid()}-{self.name}")
        maker = pure_zone.Zone if self.kind == "pure" else compiled_zone()[0]
        zone = None if self.kind == "dict" else maker.create(path, CAPACITY, len(VALUE), STRIPES)
        start, ready, results = SPAWN.Event(), SPAWN.Queue(), SPAWN.Queue()
        try:
            processes = [SPAWN.Process(target=worker, args=(self.kind, path, self.keys,
                                                            number * self.keys // 2, seconds, start, ready, results))
                         for number in range(self.processes)]
            for process in processes:
                process.start()
            for _ in processes:
                ready.get(timeout=120)
            start.set()
            figures = [results.get(timeout=seconds + 120) for _ in processes]
            for process in processes:
                process.join(30)
            waits = 0 if zone is None else zone.waits
        finally:
            if zone is not None:
                zone.close()
                zone.unlink()
        operations = sum(count for count, _ in figures)
        self.cpu_per_op.append(sum(cpu for _, cpu in figures) / operations * 1e6)
        self.rate.append(operations / seconds)
        self.waits.append(waits / operations)


def ratio(a: Config, b: Config) -> str:
    """a / b of CPU per operation: of the medians, and the range of the same round's ratios."""
    rounds = sorted(x / y for x, y in zip(a.cpu_per_op, b.cpu_per_op))
    overall = statistics.median(a.cpu_per_op) / statistics.median(b.cpu_per_op)
    return f"{overall:6.3f}x (rounds {rounds[0]:.3f}-{rounds[-1]:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each pass (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved passes per configuration (default 3)")
    args = parser.parse_args()
    compiled, how = compiled_zone()
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    layout = pure_zone.layout(CAPACITY, len(VALUE), STRIPES)
    print(f"bench_zone: {args.rounds} rounds of {args.seconds:g} s a pass; a zone of {layout.capacity:,} records "
          f"of {layout.record_size} bytes ({layout.bytes_per_key:.1f} bytes a key, everything counted) "
          f"in {STRIPES} stripes; compiled zone: {how if compiled else 'not run: ' + how}", flush=True)
    configs = [Config("dict", "dict", 1, CAPACITY), Config("pure", "pure", 1, CAPACITY)]
    if compiled is not None:
        configs += [Config("compiled", "compiled", 1, CAPACITY), Config("compiled-1M", "compiled", 1, 1_000_000),
                    Config("compiled-2", "compiled", 2, CAPACITY), Config("compiled-hot", "compiled", 1, 1),
                    Config("compiled-hot-2", "compiled", 2, 1)]
    started = time.monotonic()
    for number in range(args.rounds):
        print(f"round {number + 1}/{args.rounds}", flush=True)
        for config in configs if number % 2 == 0 else reversed(configs):
            config.run(args.seconds, folder)
            print(f"    {config.name:<16} {config.cpu_per_op[-1]:8.3f} µs CPU/op {config.rate[-1]:12,.0f} op/s",
                  flush=True)
    report({config.name: config for config in configs})
    print(f"\n(bench_zone took {time.monotonic() - started:.0f} s)")


def report(by_name: dict[str, Config]) -> None:
    print("\nCPU per operation (µs, median of the passes; each pass's in brackets), and operations a second:")
    for config in by_name.values():
        passes = " ".join(f"{figure:.3f}" for figure in config.cpu_per_op)
        print(f"  {config.name:<16} {statistics.median(config.cpu_per_op):8.3f} µs [{passes}]"
              f"  {statistics.median(config.rate):12,.0f} op/s ({config.processes} process"
              f"{'es' if config.processes > 1 else ''}), a lock found busy {statistics.median(config.waits):.2%}"
              " of the time")
    rows = [("compiled zone / pure-Python twin", "compiled", "pure"),
            ("compiled zone / a Python dict's get and set", "compiled", "dict"),
            ("1,000,000 keys, every put evicting / 100,000", "compiled-1M", "compiled"),
            ("two processes / one, keys spread over stripes", "compiled-2", "compiled"),
            ("two processes / one, one key (one lock)", "compiled-hot-2", "compiled-hot")]
    print("\nRatios of CPU per operation (same run):")
    for label, a, b in rows:
        if a in by_name and b in by_name:
            print(f"  {label:<48} {ratio(by_name[a], by_name[b])}")
    if "compiled-2" in by_name:
        for one, two in (("compiled", "compiled-2"), ("compiled-hot", "compiled-hot-2")):
            scale = statistics.median(by_name[two].rate) / statistics.median(by_name[one].rate)
            print(f"  throughput, {two} / {one}: {scale:5.2f}x")


if __name__ == "__main__":
    main()
