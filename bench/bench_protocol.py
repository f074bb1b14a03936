"""What does Sluice's HTTP protocol cost per check? Against the floor, and against another revision's.

Sluice answers nginx's checks in its own protocol (sidecar/server.py). This
bench measures what that protocol costs, through the shipped nginx template
(rendered as the launcher renders it, one worker, in front of
sidecar.demo_upstream), with ``wrk -t2 -c32`` and bench/rotate.lua:

* Sluice with the ten rules of bench/bench_engine.py, and without a rule
  (what is left is the protocol and the front door);
* the HTTP floor of bench/bench_check.py: a bare httptools protocol on
  uvloop answering a fixed 200, the least any Python check costs;
* with ``--against REV`` (repeatable), the same Sluices serving the protocol
  of sidecar/server.py at git revision REV instead (its ``protocol_factory``,
  with this tree's everything else): the protocols compared on one engine.

Every figure is CPU time per request of the sidecar process (utime + stime
from /proc/<pid>/stat over the requests wrk completed), over passes
interleaved with their references (the order reverses every other round),
and ratios are taken between figures of the same run: throughput on a
shared machine moves too much between runs to compare across them.

Usage: ``.venv/bin/python bench/bench_protocol.py [--seconds 5] [--rounds 5] [--against REV ...]``.
Needs nginx and wrk (``make bench`` installs them). Loopback only; every pass
is bounded in time.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from bench_check import Bench, Config, ensure_wrk, free_port, http_ok  # noqa: E402  (bench/ is the script's directory)

# Starts ``sluice serve`` with the protocol_factory of another file in
# place of sidecar.server's: argv is that file, then serve's arguments.
SERVE_WITH_PROTOCOL = """
import importlib.util, sys
from sidecar import cli

spec = importlib.util.spec_from_file_location("protocol_under_test", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
cli._http_protocol = module.protocol_factory
sys.argv = ["sluice", *sys.argv[2:]]
cli.main()
"""


def protocol_at(revision: str, directory: Path) -> Path:
    """sidecar/server.py as it was at ``revision``, as a file of its own."""
    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:sidecar/server.py"],
                           capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"--against {revision}: {shown.stderr.strip()}")
    path = directory / f"server_at_{revision.replace('/', '_')}.py"
    path.write_text(shown.stdout)
    return path


def start_sluice(bench: Bench, name: str, rules: Path, protocol: Path | None) -> tuple[list[int], int]:
    """A Sluice on a port of its own, with this tree's protocol or ``protocol``'s."""
    port = free_port()
    serve = ["serve", "--config", str(rules), "--host", "127.0.0.1", "--port", str(port), "--hook-udp", "off",
             "--log-level", "warning"]
    if protocol is None:
        argv = [bench.python, "-m", "sidecar", *serve]
    else:
        argv = [bench.python, str(bench.run / "serve_with_protocol.py"), str(protocol), *serve]
    process = bench.procs.start(name, argv, lambda: http_ok(f"http://127.0.0.1:{port}/healthz"))
    return [process.pid], port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5, help="length of each pass (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved passes per configuration (default 5)")
    parser.add_argument("--against", action="append", default=[], metavar="REV",
                        help="also measure sidecar/server.py of this git revision (repeatable)")
    args = parser.parse_args()
    ensure_wrk()
    started = time.monotonic()
    print(f"bench_protocol: wrk -t2 -c32 through nginx, {args.rounds} rounds of {args.seconds:g} s passes", flush=True)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        bench = Bench(Path(tmp))
        (bench.run / "serve_with_protocol.py").write_text(SERVE_WITH_PROTOCOL)
        protocols: dict[str, Path | None] = {"": None}
        for revision in args.against:
            protocols[f"@{revision}"] = protocol_at(revision, bench.run)
        configs: list[Config] = []
        per_pass: dict[str, list[float]] = {}
        try:
            # Only the sidecar's CPU is read: nginx's workers may be replaced
            # meanwhile (a reload), and they are not what is compared.
            bench.start_upstream()
            floor_pid, floor_port = bench.start_floor()
            _, nginx_port = bench.start_nginx("nginx-floor", floor_port)
            configs.append(Config("floor", f"http://127.0.0.1:{nginx_port}", {"sidecar": [floor_pid]}))
            for suffix, protocol in protocols.items():
                for rules_name, rules in (("ten-rules", bench.rules), ("no-rules", bench.no_rules)):
                    name = f"sluice-{rules_name}{suffix}"
                    sidecar, sidecar_port = start_sluice(bench, name, rules, protocol)
                    _, nginx_port = bench.start_nginx(f"nginx-{name}", sidecar_port)
                    configs.append(Config(name, f"http://127.0.0.1:{nginx_port}", {"sidecar": sidecar}))
            interleaved(bench, configs, args.rounds, args.seconds, per_pass)
        finally:
            bench.procs.stop()
    report(configs, list(protocols), per_pass)
    print(f"\n(bench_protocol took {time.monotonic() - started:.0f} s)")


def interleaved(bench: Bench, configs: list[Config], rounds: int, seconds: float,
                per_pass: dict[str, list[float]],
                around: Callable[[Config], Callable[[], None]] | None = None) -> None:
    """A 1 s warm-up of each configuration, then ``rounds`` passes of each,
    the order reversed every other round; each pass's CPU per request in
    ``per_pass``. ``around``, called before a pass, gives what to call
    after it (a figure of the pass's own, read before and after)."""
    print("warm-up: 1 s per configuration", flush=True)
    for config in configs:
        config.measure(1, keep=False)
    for number in range(rounds):
        print(f"round {number + 1}/{rounds}", flush=True)
        for config in configs if number % 2 == 0 else reversed(configs):
            after = around(config) if around is not None else None
            measure(bench, config, seconds, per_pass)
            if after is not None:
                after()
            print(f"    {config.name:<30} {config.passes[-1].rate:8.0f} req/s", flush=True)


def measure(bench: Bench, config: Config, seconds: float, per_pass: dict[str, list[float]]) -> None:
    """One pass, its sidecar CPU per request added to ``per_pass``; a
    process that ended on the way is named, and the logs are kept."""
    try:
        before = config.cpu.get("sidecar", 0.0)
        config.measure(seconds)
        per_pass.setdefault(config.name, []).append(
            (config.cpu["sidecar"] - before) / max(1, config.passes[-1].requests) * 1e6)
    except FileNotFoundError:
        gone = [f"{role} {pid}" for role, pids in config.pids.items() for pid in pids
                if not Path(f"/proc/{pid}").exists()]
        kept = Path(tempfile.mkdtemp(prefix="sluice-bench-logs-"))
        shutil.copytree(bench.logs, kept, dirs_exist_ok=True)
        for run_dir in bench.run.glob("nginx-*/logs"):
            shutil.copytree(run_dir, kept / run_dir.parent.name, dirs_exist_ok=True)
        raise SystemExit(f"{config.name}: {', '.join(gone)} ended during the pass; logs kept in {kept}") from None


def report(configs: list[Config], suffixes: list[str], per_pass: dict[str, list[float]]) -> None:
    by_name = {config.name: config for config in configs}
    print("\nSidecar CPU per request (µs, over all passes; each pass's in brackets) and median req/s through nginx:")
    for config in configs:
        passes = " ".join(f"{figure:.1f}" for figure in per_pass[config.name])
        print(f"  {config.name:<28} {config.us_per_request('sidecar'):7.1f} µs [{passes}]   "
              f"{statistics.median(config.rates()):7.0f} req/s")

    def ratio(a: str, b: str) -> str:
        return ratio_text(by_name, per_pass, a, b)

    print("\nRatios of sidecar CPU per request (same run):")
    for suffix in suffixes:
        label = "this tree" if not suffix else suffix
        for rules_name in ("no-rules", "ten-rules"):
            print(f"  {label:<12} {rules_name:<9} / floor: {ratio(f'sluice-{rules_name}{suffix}', 'floor')}")
    for suffix in suffixes[1:]:
        for rules_name in ("no-rules", "ten-rules"):
            ours, theirs = f"sluice-{rules_name}", f"sluice-{rules_name}{suffix}"
            print(f"  {rules_name:<9} this tree / {suffix}: {ratio(ours, theirs)}")


def ratio_text(by_name: dict[str, Config], per_pass: dict[str, list[float]], a: str, b: str) -> str:
    """a / b of sidecar CPU per request over all passes, and the median and
    range of the ratios of the same round's passes."""
    rounds = sorted(x / y for x, y in zip(per_pass[a], per_pass[b]))
    overall = by_name[a].us_per_request("sidecar") / by_name[b].us_per_request("sidecar")
    return f"{overall:5.3f}x (rounds: median {statistics.median(rounds):5.3f}, {rounds[0]:5.3f}-{rounds[-1]:5.3f})"


if __name__ == "__main__":
    main()
