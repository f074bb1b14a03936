"""Does the limit hold when a flood outruns Sluice? The flood matrix, in one run.

One address floods through the shipped configurations (``sluice config``)
with wrk: nginx with 1 and 2 worker processes and Envoy with
``--concurrency 2``, at 1,000, 4,000 and 8,000 connections, on the memory
backend; an honest client at another address sends 5 requests a second
meanwhile. One rule, ``key: [ip]``, 10 requests per 60 s, ``action: block``.
For each row: the requests wrk completed, those that reached the upstream
(an nginx counting its access log lines), their share over the budget, the
honest client's p99 latency, and Sluice's overload decisions. The target is
at most the budget plus 1 % of the flood.

Usage: ``.venv/bin/python bench/bench_flood.py [--seconds 10] [--connections 1000,4000,8000]``.
Loopback only; every pass is bounded in time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.integration.flood import FloodStack  # noqa: E402

BUDGET = 10
RULES = f"""\
state: {{backend: memory}}
rules:
  - id: flood
    key: [ip]
    limit: {{requests: {BUDGET}, per: 60s}}
    action: block
"""
DOORS = (("nginx", 1), ("nginx", 2), ("envoy", 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", default="1000,4000,8000")
    args = parser.parse_args()
    print("| door | connections | requests | reached | over the budget + 1 % | honest p99 | overload refused |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for door, workers in DOORS:
        for connections in (int(n) for n in args.connections.split(",")):
            with tempfile.TemporaryDirectory() as directory, \
                    FloodStack(Path(directory), RULES, door, workers) as stack:
                result = stack.flood(connections, args.seconds)
                refused = stack.metric("sluice_overload_decisions_total", 'outcome="refused",rule="flood"')
            honest_allowed = sum(1 for status, _ in result.honest if status == 200)
            over = result.reached - honest_allowed - BUDGET
            verdict = "held" if over <= result.requests // 100 else f"{over / max(result.requests, 1):.1%} over"
            name = f"nginx, {workers} worker{'s' if workers > 1 else ''}" if door == "nginx" else \
                f"Envoy, --concurrency {workers}"
            print(f"| {name} | {connections:,} | {result.requests:,} | {result.reached:,} | {verdict} | "
                  f"{result.honest_p99() * 1000:.0f} ms | {refused:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
