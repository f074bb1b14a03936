"""What does a check cost with the compiled core, against answering 200 through ASGI? In one run.

Every Sluice runs the ten rules of bench/bench_engine.py behind its own nginx
(the shipped template, one worker) in front of devstack.demo_upstream, with
``wrk -t2 -c32`` and bench/rotate.lua. The configurations:

* the trivial raw ASGI app under uvicorn (answers 200), the reference;
* the HTTP floor (a bare httptools protocol on uvloop answering 200);
* Sluice, rotating 100,000 client addresses; the same with one client; the
  same with 1,000,000 (ten times the rules' ``max_keys``: every check evicts);
* Sluice with SLUICE_PURE_PYTHON=1 (the pure-Python core), 100,000 addresses;
* Sluice ``--workers 2`` over the node-wide table, 100,000 addresses (when
  this core can run it; else the row says why not).

Every figure is CPU time per request of the sidecar's processes (utime +
stime from /proc/<pid>/stat over the requests wrk completed), over passes
interleaved with the others (the order reverses every other round); ratios
are taken between figures of the same run.

Usage: ``.venv/bin/python bench/bench_core.py [--seconds 5] [--rounds 3]``.
Needs nginx and wrk (``make bench`` installs them). Loopback only; every
pass is bounded in time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from bench_check import Bench, Config, children_of, ensure_wrk, free_port, http_ok  # noqa: E402
from bench_protocol import interleaved, ratio_text  # noqa: E402
from bench_revisions import compiled_core_built  # noqa: E402

ONE_CLIENT, MANY, MOST = 1, 100_000, 1_000_000


def start_sluice(bench: Bench, name: str, pure: bool = False, workers: int = 1) -> list[int] | str:
    """A Sluice's pids (its workers' too) and port, or why it did not start."""
    port = free_port()
    env = {"SLUICE_PURE_PYTHON": "1"} if pure else {}
    argv = [bench.python, "-m", "sidecar", "serve", "--config", str(bench.rules), "--host", "127.0.0.1",
            "--port", str(port), "--hook-udp", "off", "--log-level", "warning", "--workers", str(workers)]
    try:
        process = bench.procs.start(name, argv, lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), env=env)
    except SystemExit as exc:
        return str(exc).splitlines()[-1] if str(exc) else "did not start"
    pids = [process.pid]
    if workers > 1:
        deadline = time.monotonic() + 10
        while len(children := children_of(process.pid)) < workers and time.monotonic() < deadline:
            time.sleep(0.05)
        pids += children
    return pids + [port]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5, help="length of each pass (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved passes per configuration (default 3)")
    args = parser.parse_args()
    ensure_wrk()
    started = time.monotonic()
    compiled = compiled_core_built()
    print(f"bench_core: wrk -t2 -c32 through nginx, ten rules, {args.rounds} rounds of {args.seconds:g} s; "
          f"this tree's core is {'compiled' if compiled else 'pure Python (not built)'}", flush=True)
    not_run: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        bench = Bench(Path(tmp))
        configs: list[Config] = []
        per_pass: dict[str, list[float]] = {}
        try:
            bench.start_upstream()

            def behind_nginx(name: str, pids: list[int], port: int, addresses: int | None = MANY) -> None:
                _, nginx_port = bench.start_nginx(f"nginx-{name}", port)
                configs.append(Config(name, f"http://127.0.0.1:{nginx_port}", {"sidecar": pids},
                                      addresses=addresses))

            bare_pid, bare_port = bench.start_bare()
            behind_nginx("asgi", [bare_pid], bare_port)
            floor_pid, floor_port = bench.start_floor()
            behind_nginx("floor", [floor_pid], floor_port)
            wanted: list[tuple[str, bool, int, int]] = [
                ("sluice", False, 1, MANY), ("sluice-one-client", False, 1, ONE_CLIENT),
                ("sluice-1M-clients", False, 1, MOST), ("sluice-workers-2", False, 2, MANY)]
            if compiled:
                wanted.append(("sluice-pure", True, 1, MANY))
            for name, pure, workers, addresses in wanted:
                started_as = start_sluice(bench, name, pure, workers)
                if isinstance(started_as, str):
                    not_run[name] = started_as
                    continue
                *pids, port = started_as
                behind_nginx(name, pids, port, addresses)
            interleaved(bench, configs, args.rounds, args.seconds, per_pass)
        finally:
            bench.procs.stop()
    report(configs, per_pass, not_run)
    print(f"\n(bench_core took {time.monotonic() - started:.0f} s)")


def report(configs: list[Config], per_pass: dict[str, list[float]], not_run: dict[str, str]) -> None:
    print("\nSidecar CPU per check (µs, over all passes; each pass's in brackets):")
    for config in configs:
        passes = " ".join(f"{figure:.1f}" for figure in per_pass[config.name])
        print(f"  {config.name:<20} {config.us_per_request('sidecar'):7.1f} µs [{passes}]")
    for name, why in not_run.items():
        print(f"  {name:<20} not run: {why}")
    by_name = {config.name: config for config in configs}
    rows = [("ten rules, 100,000 clients / trivial ASGI app", "sluice", "asgi", "<= 0.9"),
            ("ten rules, one client / trivial ASGI app", "sluice-one-client", "asgi", "<= 0.9"),
            ("ten rules, 1,000,000 clients / one client", "sluice-1M-clients", "sluice-one-client", "<= 1.2"),
            ("--workers 2 / --workers 1, same load", "sluice-workers-2", "sluice", "<= 1.1"),
            ("compiled core / pure-Python core", "sluice", "sluice-pure", ""),
            ("trivial ASGI app / HTTP floor", "asgi", "floor", "")]
    print("\nRatios of sidecar CPU per check (same run):")
    for label, a, b, target in rows:
        if a in by_name and b in by_name:
            goal = f"   (target {target})" if target else ""
            print(f"  {label:<48} {ratio_text(by_name, per_pass, a, b)}{goal}")


if __name__ == "__main__":
    main()
