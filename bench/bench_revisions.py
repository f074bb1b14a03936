"""What does a check cost through nginx, this tree against earlier revisions? End to end, in one run.

The other benches compare Sluice with references; this one compares Sluice
with itself: the sidecar's CPU per check of this tree's whole package against
the package as it was at each ``--against REV`` (``git archive`` of its
sidecar/, nginx/ and envoy/ into a folder of the run, put first on the
Sluice's PYTHONPATH). Every Sluice runs the ten rules of
bench/bench_engine.py behind its own nginx (the shipped template, rendered by
this tree, one worker) in front of devstack.demo_upstream, with ``wrk -t2
-c32`` and bench/rotate.lua rotating 100,000 client addresses.

This tree runs twice when its compiled core is built: as built, and with
SLUICE_PURE_PYTHON=1, the pure-Python core that earlier revisions were.

Every figure is CPU time per request of the sidecar process (utime + stime
from /proc/<pid>/stat over the requests wrk completed), over passes
interleaved with the others (the order reverses every other round); ratios
are taken between figures of the same run.

Usage: ``.venv/bin/python bench/bench_revisions.py --against REV [--against REV ...]
[--seconds 5] [--rounds 5]``. Needs nginx and wrk (``make bench`` installs
them) and git. Loopback only; every pass is bounded in time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from bench_check import Bench, Config, ensure_wrk, free_port, http_ok  # noqa: E402  (bench/ is the script's directory)
from bench_protocol import interleaved, ratio_text  # noqa: E402

# What a revision's Sluice is made of: its package and the templates it links to.
TREES = ("sidecar", "nginx", "envoy")


def package_at(revision: str, directory: Path) -> Path:
    """The Sluice package as it was at ``revision``, unpacked into a folder of its own."""
    target = directory / f"at-{revision.replace('/', '_')}"
    target.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", revision, *TREES],
                             capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--against {revision}: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def compiled_core_built() -> bool:
    """Whether this tree's Sluice would run a compiled core."""
    shown = subprocess.run([sys.executable, "-c", "import sidecar.core as c; print(int(not c.PURE))"],
                           capture_output=True, text=True, cwd=ROOT)
    return shown.returncode == 0 and shown.stdout.strip() == "1"


def start_sluice(bench: Bench, name: str, package: Path | None, pure: bool) -> tuple[list[int], int]:
    """A Sluice on a port of its own, from this tree or from ``package``."""
    port = free_port()
    env = {"SLUICE_PURE_PYTHON": "1"} if pure else {}
    argv = [bench.python, "-m", "sidecar", "serve", "--config", str(bench.rules), "--host", "127.0.0.1",
            "--port", str(port), "--hook-udp", "off", "--log-level", "warning"]
    process = bench.procs.start(name, argv, lambda: http_ok(f"http://127.0.0.1:{port}/healthz"),
                                package=package or ROOT, env=env)
    return [process.pid], port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5, help="length of each pass (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved passes per configuration (default 5)")
    parser.add_argument("--against", action="append", default=[], metavar="REV", required=True,
                        help="also measure the package of this git revision (repeatable)")
    args = parser.parse_args()
    ensure_wrk()
    started = time.monotonic()
    print(f"bench_revisions: wrk -t2 -c32 through nginx, ten rules, {args.rounds} rounds of {args.seconds:g} s",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        bench = Bench(Path(tmp))
        sluices: dict[str, tuple[Path | None, bool]] = {"this tree": (None, False)}
        if compiled_core_built():
            sluices["this tree, pure"] = (None, True)
        for revision in args.against:
            sluices[f"@{revision}"] = (package_at(revision, bench.run), False)
        configs: list[Config] = []
        per_pass: dict[str, list[float]] = {}
        try:
            bench.start_upstream()
            for number, (name, (package, pure)) in enumerate(sluices.items()):
                sidecar, sidecar_port = start_sluice(bench, f"sluice-{number}", package, pure)
                _, nginx_port = bench.start_nginx(f"nginx-{number}", sidecar_port)
                configs.append(Config(name, f"http://127.0.0.1:{nginx_port}", {"sidecar": sidecar}))
            interleaved(bench, configs, args.rounds, args.seconds, per_pass)
        finally:
            bench.procs.stop()
    print("\nSidecar CPU per check (µs, over all passes; each pass's in brackets):")
    for config in configs:
        passes = " ".join(f"{figure:.1f}" for figure in per_pass[config.name])
        print(f"  {config.name:<24} {config.us_per_request('sidecar'):7.1f} µs [{passes}]")
    print("\nRatios of sidecar CPU per check (same run):")
    by_name = {config.name: config for config in configs}
    for name in list(sluices)[1:]:
        print(f"  this tree / {name:<20} {ratio_text(by_name, per_pass, 'this tree', name)}")
    if "this tree, pure" in sluices:
        for revision in args.against:
            print(f"  this tree, pure / @{revision:<14} "
                  f"{ratio_text(by_name, per_pass, 'this tree, pure', f'@{revision}')}")
    print(f"\n(bench_revisions took {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
