"""How does the in-process decision hold up under address rotation?

Like bench/bench_check.py, every number is printed beside a reference
measured in the same run, passes interleaved so that a noisy machine hurts
both sides alike, and the ratio is what to read:

1. ``Engine.decide`` with ten realistic rules for one client against the same
   under rotating IPv4 and IPv6 clients (``--clients``, 1M by default) with
   ``state.max_keys`` 100,000: eviction must not make an attack dearer. Each
   pass makes its 20,000 requests before deciding them; the same passes are
   also decided by two more engines with each request made just before its
   decision, 100 at a time, as the server makes one from the bytes it has
   just read (report only: a request made a pass ahead is out of the CPU's
   cache when decided, and a rotating one has more objects of its own),
2. one rule and the ten rules against one hit of the ``limits`` library's
   ``SlidingWindowCounterRateLimiter`` in memory (the Python reference),
3. ``resolve_client`` with a trusted X-Forwarded-For against the same hit:
   the same header every time (a walk remembered), and a new IPv4 or IPv6
   client every time, as under rotation,
4. memory per tracked key at 100,000 keys (tracemalloc), and the process's
   RSS while the rotation runs: flat once the cap is reached,
5. Sluice's HTTP protocol fed nginx's check requests from rotating clients
   in process, without a rule and with the ten rules: the front door's
   Python cost without sockets or the event loop (without a rule: at most
   8 µs), and with the compiled core the same with every head read by
   httptools, over interleaved passes (report only),
6. the compiled core against the pure-Python one (``sidecar.core``): the
   ten rules' decision, and the policy's own step for their checks, each
   beside the same ``limits`` hit, in processes of their own (a process
   runs one core), one with ``SLUICE_PURE_PYTHON=1``, run in turn.

Usage: ``.venv/bin/python bench/bench_engine.py [--clients 1000000]``
(``make bench`` installs ``limits`` into the virtualenv for it);
``--fastest`` prints only the fastest of 15 passes of one rule and of ten
rules, for comparing two checkouts run in turn; ``--core-pass`` is one
process's pass of (6), printed as JSON; ``--returning N`` (repeatable)
runs only N clients that return against one client, with ``max_keys``
large enough that nothing is evicted: what reading the keys a map holds
costs, without taking any in or dropping any.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar import core  # noqa: E402
from sidecar.config import parse_rules_text  # noqa: E402
from sidecar.engine import Engine  # noqa: E402
from sidecar.request import CheckRequest  # noqa: E402
from sidecar.rules import compile_rules  # noqa: E402
from sidecar.server import freeze_loaded_objects, tune_garbage_collector  # noqa: E402
from sidecar.state import Check  # noqa: E402

HIGH = 1_000_000_000  # far above the load: every rule evaluated, every request allowed

TEN_RULES = f"""
client_ip:
  trusted_proxies: [127.0.0.0/8]
state: {{max_keys: 100000}}
rules:
  - id: login
    match: {{all: [{{path: {{equals: /api/login}}}}, {{method: [POST]}}]}}
    key: [ip]
    limit: {{requests: {HIGH}, per: 15m}}
    count_on: {{status: [401, 403]}}
    action: block
  - id: api-key
    key: [ip, "header:x-api-key"]
    limit: {{requests: {HIGH}, per: 10s}}
    action: block
  - id: observe
    key: [ip]
    limit: {{requests: {HIGH}, per: 60s}}
    action: log
  - id: pages
    match: {{header: {{name: accept, prefix: text/html}}}}
    key: [ip]
    limit: {{requests: {HIGH}, per: 10s}}
    action: challenge
  - id: scrapers
    key: [ip]
    limit: {{requests: {HIGH}, per: 60s}}
    action: ban
    ban: {{duration: 1h}}
  - id: like-nginx
    key: [ip]
    limit: {{rate: 1000000r/s, burst: 1000000, nodelay: true}}
    action: block
  - id: tokens
    key: [ip, path]
    limit: {{tokens: {HIGH}, refill: 1000000/s}}
    action: block
  - id: fixed
    key: [host, ip]
    limit: {{requests: {HIGH}, per: 60s, window: fixed}}
    action: block
  - id: search
    match: {{path: {{regex: "^/api/(items|search)"}}}}
    key: [ip, "query:q"]
    limit: {{requests: {HIGH}, per: 60s}}
    action: block
  - id: sessions
    key: ["session:sid"]
    limit: {{requests: {HIGH}, per: 60s}}
    action: block
"""

# The same settings without a rule: what the front door costs by itself.
NO_RULES = TEN_RULES[:TEN_RULES.index("rules:")] + "rules: []\n"

ONE_RULE = f"""
rules:
  - id: per-ip
    key: [ip]
    limit: {{requests: {HIGH}, per: 60s}}
    action: block
"""

HEADERS = {"x-api-key": "k", "user-agent": "bench", "accept": "application/json",
           "cookie": "sid=s1"}
PATH = "/api/items?page=2&q=shoes"


def address(i: int) -> str:
    """The i-th rotating client: IPv4 and IPv6 (distinct /64s) in turn."""
    if i % 2:
        return f"2001:db8:{(i >> 16) & 0xffff:x}:{i & 0xffff:x}::1"
    return f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"


def engine_for(text: str) -> Engine:
    return Engine(compile_rules(parse_rules_text(text, "bench", ROOT)))


def requests_for(engine: Engine, addresses: list[str]) -> list[CheckRequest]:
    return [CheckRequest("GET", "example.com", PATH, dict(HEADERS), engine.resolve_client(a, None), "r")
            for a in addresses]


def time_decisions(engine: Engine, requests: list[CheckRequest]) -> float:
    """µs of this process's CPU per decision over the requests (CPU time,
    not elapsed: the passes of a machine shared with other work are not
    lengthened by the time it runs something else)."""
    decide = engine.decide_now
    started = time.process_time()
    for request in requests:
        decide(request)
    return (time.process_time() - started) / len(requests) * 1e6


def time_made_just_before(engine: Engine, addresses: list[str], chunk: int = 100) -> float:
    """µs of CPU per decision (as time_decisions), each request made just
    before its decision, ``chunk`` at a time (only the decisions timed)."""
    decide = engine.decide_now
    spent = 0.0
    for start in range(0, len(addresses), chunk):
        requests = requests_for(engine, addresses[start:start + chunk])
        started = time.process_time()
        for request in requests:
            decide(request)
        spent += time.process_time() - started
    return spent / len(addresses) * 1e6


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def limits_hit():
    """One in-memory sliding-window-counter hit of the ``limits`` library,
    or None when it is not installed."""
    try:
        from limits import parse, storage, strategies
    except ImportError:
        return None
    limiter = strategies.SlidingWindowCounterRateLimiter(storage.MemoryStorage())
    item = parse(f"{HIGH}/minute")
    return lambda: limiter.hit(item, "bench", "192.0.2.1")


def time_calls(call, rounds: int) -> float:
    """µs of this process's CPU per call (as time_decisions)."""
    started = time.process_time()
    for _ in range(rounds):
        call()
    return (time.process_time() - started) / rounds * 1e6


def rotation(clients: int, batch: int) -> tuple[float, float, float | None, float | None]:
    """The rotating/one-client ratio, the same with requests made just
    before their decisions, the RSS growth (MB) from the cap on, and the
    second half's peak RSS over the first half's."""
    print(f"== 10 rules: one client vs {clients:,} rotating IPv4+IPv6 clients, max_keys 100,000")
    single_engine, rotating_engine = engine_for(TEN_RULES), engine_for(TEN_RULES)
    single_near, rotating_near = engine_for(TEN_RULES), engine_for(TEN_RULES)
    single_us, rotating_us, rss = [], [], []
    single_near_us, rotating_near_us = [], []
    done = 0
    while done < clients:
        count = min(batch, clients - done)
        addresses = [address(i) for i in range(done, done + count)]
        rotating = requests_for(rotating_engine, addresses)
        done += count
        # New request objects for every pass, as for the rotating clients: a
        # request parses its cookies and query once, on first use.
        single = requests_for(single_engine, ["192.0.2.1"] * batch)
        single_us.append(time_decisions(single_engine, single))
        rotating_us.append(time_decisions(rotating_engine, rotating))
        del rotating, single
        single_near_us.append(time_made_just_before(single_near, ["192.0.2.1"] * batch))
        rotating_near_us.append(time_made_just_before(rotating_near, addresses))
        rss.append((done, rotating_engine.store.tracked_keys(), rss_mb()))
    # The first passes fill the map; steady state is what an attack costs.
    full = [i for i, (_, keys, _) in enumerate(rss) if keys >= 90_000]
    steady = full[1:] or list(range(len(rss)))
    one = statistics.median(single_us[i] for i in steady)
    many = statistics.median(rotating_us[i] for i in steady)
    print(f"one client:        {one:8.1f} µs per decision (median of {len(steady)} passes)")
    print(f"rotating clients:  {many:8.1f} µs per decision   ratio {many / one:.2f} of one client")
    one_near = statistics.median(single_near_us[i] for i in steady)
    many_near = statistics.median(rotating_near_us[i] for i in steady)
    print(f"each request made just before its decision: one client {one_near:.1f} µs, rotating clients"
          f" {many_near:.1f} µs, ratio {many_near / one_near:.2f}")
    print("RSS during the rotation (clients so far, tracked keys, MB):")
    step = max(1, len(rss) // 10)
    for done_so_far, keys, mb in rss[::step] + ([rss[-1]] if (len(rss) - 1) % step else []):
        print(f"    {done_so_far:>10,}  {keys:>8,}  {mb:8.1f}")
    growth = late = None
    if len(steady) > 1:
        first, last = rss[steady[0]][2], rss[steady[-1]][2]
        growth = last - first
        print(f"RSS from the cap on: {first:.1f} MB -> {last:.1f} MB ({growth:+.1f} MB)")
        # The expiry wheel's references to keys the cap evicted grow to
        # their own bound (twice the map) and are dropped again: RSS
        # saw-tooths. Bounded memory means the second half's peak is no
        # higher than the first half's.
        first_half, second_half = steady[:len(steady) // 2], steady[len(steady) // 2:]
        early_peak = max(rss[i][2] for i in first_half)
        late_peak = max(rss[i][2] for i in second_half)
        late = late_peak - early_peak
        print(f"peak RSS, first half of the rotation {early_peak:.1f} MB, second half ({rss[second_half[0]][0]:,}"
              f" -> {rss[second_half[-1]][0]:,} clients) {late_peak:.1f} MB ({late:+.1f} MB)")
    return many / one, many_near / one_near, growth, late


def returning(clients: int, batch: int, passes: int = 12) -> tuple[float, float]:
    """Clients that return instead of new ones: ``clients`` addresses, each
    decided once first, then passes of ``batch`` of them picked at random,
    against one client's passes in turn, with ``max_keys`` large enough
    that nothing is evicted. The ratios, requests made a pass ahead and
    made just before (what reading keys the map holds costs, without
    taking any in or dropping any)."""
    text = TEN_RULES.replace("max_keys: 100000", f"max_keys: {max(100_000, 8 * clients)}")
    single, many, single_near, many_near = (engine_for(text) for _ in range(4))
    addresses = [address(i) for i in range(clients)]
    for start in range(0, clients, batch):
        for engine in (many, many_near):
            for request in requests_for(engine, addresses[start:start + batch]):
                engine.decide_now(request)
    pick = random.Random(1)
    single_us, many_us, single_near_us, many_near_us = [], [], [], []
    for _ in range(passes):
        chosen = [addresses[pick.randrange(clients)] for _ in range(batch)]
        single_us.append(time_decisions(single, requests_for(single, ["192.0.2.1"] * batch)))
        many_us.append(time_decisions(many, requests_for(many, chosen)))
        single_near_us.append(time_made_just_before(single_near, ["192.0.2.1"] * batch))
        many_near_us.append(time_made_just_before(many_near, chosen))
    ahead = statistics.median(many_us) / statistics.median(single_us)
    near = statistics.median(many_near_us) / statistics.median(single_near_us)
    print(f"== 10 rules: {clients:,} returning clients ({many.store.tracked_keys():,} keys held) / one client: "
          f"{ahead:.2f}x, {near:.2f}x with each request made just before its decision")
    return ahead, near


def against_limits(rounds: int, passes: int) -> dict[str, float]:
    """Each figure's ratio to one limits hit (empty without limits)."""
    hit = limits_hit()
    if hit is None:
        print("== limits is not installed (pip install limits): no reference, absolute figures only")
    else:
        print("== against one limits SlidingWindowCounterRateLimiter hit (memory storage)")
    one, ten = engine_for(ONE_RULE), engine_for(TEN_RULES)
    one_requests, ten_requests = requests_for(one, ["192.0.2.1"] * rounds), requests_for(ten, ["192.0.2.1"] * rounds)
    resolve = ten.resolve_client
    figures: dict[str, list[float]] = {"limits": [], "1 rule": [], "10 rules": [], "resolve_client": [],
                                       "  a new IPv4 client": [], "  a new IPv6 client": []}
    for number in range(passes):
        if hit is not None:
            figures["limits"].append(time_calls(hit, rounds))
        figures["1 rule"].append(time_decisions(one, one_requests))
        figures["10 rules"].append(time_decisions(ten, ten_requests))
        figures["resolve_client"].append(
            time_calls(lambda: resolve("127.0.0.1", "198.51.100.7, 127.0.0.2"), rounds))
        # Under rotation every client is new: the same header, another
        # address each time (even i IPv4, odd i IPv6: see address()).
        for label, parity in (("  a new IPv4 client", 0), ("  a new IPv6 client", 1)):
            headers = iter([f"{address(i)}, 127.0.0.2" for i in range(number * 2 * rounds + parity,
                                                                      (number + 1) * 2 * rounds, 2)])
            figures[label].append(time_calls(lambda headers=headers: resolve("127.0.0.1", next(headers)), rounds))
    reference = statistics.median(figures["limits"]) if hit is not None else None
    ratios = {}
    for name, values in figures.items():
        if not values:
            continue
        median = statistics.median(values)
        ratio = f"   ratio {median / reference:.2f} of limits" if reference and name != "limits" else ""
        if reference and name != "limits":
            ratios[name] = median / reference
        print(f"{name + ':':18} {median:8.2f} µs{ratio}")
    return ratios


def memory_per_key(keys: int = 100_000) -> float:
    """Bytes per tracked key."""
    print(f"== memory per tracked key at {keys:,} keys (10 rules, tracemalloc)")
    engine = engine_for(TEN_RULES.replace("max_keys: 100000", f"max_keys: {keys}"))
    warm = requests_for(engine, [address(10_000_000)])
    engine.decide_now(warm[0])  # lazily made structures are not per key
    per_request = engine.store.tracked_keys()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    i = 0
    while engine.store.tracked_keys() + per_request <= keys:
        engine.decide_now(requests_for(engine, [address(i)])[0])
        i += 1
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    tracked = engine.store.tracked_keys()
    per_key = (after - before) / tracked
    print(f"{tracked:,} keys from {i:,} clients: {per_key:.0f} bytes per key"
          " (everything the store keeps: key tuples, addresses, entries, states, dict slots)")
    return per_key


class _Transport(asyncio.Transport):
    """What the HTTP protocol asks of its transport; the answers are dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.closing = False

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def nginx_check(i: int) -> bytes:
    """The i-th check request as the shipped nginx template sends it, from
    the i-th of 100,000 rotating clients (bench/rotate.lua's traffic)."""
    n = i % 100_000
    return (f"GET /v1/nginx/auth HTTP/1.1\r\nHost: sluice\r\nX-Sluice-Client-Addr: 127.0.0.1\r\n"
            f"X-Original-Method: GET\r\nX-Original-URI: /api/items?q={i % 5003}\r\n"
            f"X-Original-Host: bench.example\r\nX-Request-Id: {i:032x}\r\nX-Sluice-Tls-Fingerprint: \r\n"
            f"X-Forwarded-For: 10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}\r\nX-Api-Key: key-{i % 997}\r\n"
            f"User-Agent: wrk\r\n\r\n").encode()


def front_door(passes: int = 8, batch: int = 20_000) -> dict[str, float]:
    """µs per check of Sluice's HTTP protocol fed nginx's check requests in
    process (no socket, no event loop turn): what reading the check,
    deciding and writing the answer cost in Python, without a rule and with
    the ten rules under rotation (the fastest of ``passes``). With the
    compiled core, the passes alternate between the protocol as it runs
    (a check's head read by sidecar.httphead) and every head given to
    httptools, the reference: both are reported, and their ratio."""
    import uvloop
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from sidecar import server
    from sidecar.app import create_app
    from sidecar.server import protocol_factory

    print("== nginx check requests fed to Sluice's HTTP protocol in process (rotating clients)")
    results: dict[str, float] = {}
    as_served = server.READS_HEADS
    modes = (as_served, False) if as_served else (False,)

    async def measure(text: str) -> dict[bool, float]:
        app = create_app(engine_for(text))
        config = Config(app, access_log=False, server_header=False, date_header=False, proxy_headers=False,
                        lifespan="off", http=protocol_factory())
        config.load()
        protocol = protocol_factory()(config=config, server_state=ServerState(), app_state={})
        protocol.connection_made(_Transport())
        freeze_loaded_objects()  # as a `sluice serve` process does once started
        best = dict.fromkeys(modes, float("inf"))
        try:
            for number in range(passes * len(modes)):
                reads_heads = server.READS_HEADS = modes[number % len(modes)]
                checks = [nginx_check(number * batch + i) for i in range(batch)]
                started = time.perf_counter()
                for check in checks:
                    protocol.data_received(check)
                best[reads_heads] = min(best[reads_heads], (time.perf_counter() - started) / batch * 1e6)
        finally:
            server.READS_HEADS = as_served
        assert app.engine.metrics.errors.value == 0, "a check failed inside Sluice"
        protocol.connection_lost(None)
        gc.unfreeze()
        return best

    for name, text in (("no rule", NO_RULES), ("10 rules", TEN_RULES)):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # the loop `sluice serve` runs
            best = runner.run(measure(text))
        results[name] = best[as_served]
        print(f"{name + ':':10} {results[name]:7.2f} µs per check (fastest of {passes} passes of {batch:,})")
        if as_served:
            reference = results[f"{name}, heads read by httptools"] = best[False]
            print(f"{'':10} {reference:7.2f} µs with every head read by httptools, interleaved: "
                  f"{results[name] / reference:.2f}x")
    return results


def core_pass(rounds: int = 20_000, passes: int = 3) -> dict[str, object]:
    """One process's figures for (6): the median µs of one limits hit, of
    the ten rules' decision for one client, and of the policy's step for a
    check of each of the ten rules (``Policy.evaluate``), over interleaved passes."""
    hit = limits_hit()
    engine = engine_for(TEN_RULES)
    checks = [Check(rule.spec, ((rule.id, ("ip",)), "192.0.2.1"), "r") for rule in engine.ruleset.rules]
    policy = engine.store.policy
    now = engine.clock()
    figures: dict[str, list[float]] = {"limits": [], "10 rules": [], "policy": []}
    for _ in range(passes):
        if hit is not None:
            figures["limits"].append(time_calls(hit, rounds))
        figures["10 rules"].append(time_decisions(engine, requests_for(engine, ["192.0.2.1"] * rounds)))
        figures["policy"].append(time_calls(lambda: policy.evaluate(now, "192.0.2.1", checks), rounds))
    return {"core": core.which(), **{name: statistics.median(values) if values else None
                                     for name, values in figures.items()}}


def cores(rounds: int = 4) -> dict[str, float]:
    """(6): the compiled core's figures against the pure-Python core's,
    each process in turn so that a noisy machine hurts both alike."""
    print("== the compiled core against the pure-Python core (a process each, run in turn)")
    environ = {key: value for key, value in os.environ.items() if key != core.PURE_ENV}
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(rounds):
        for pure in (False, True):
            env = {**environ, core.PURE_ENV: "1"} if pure else environ
            output = subprocess.run([sys.executable, __file__, "--core-pass"], env=env, check=True,
                                    capture_output=True, text=True, timeout=600).stdout
            figures = json.loads(output.splitlines()[-1])
            print(f"    {figures['core']}: 10 rules {figures['10 rules']:.2f} µs, policy {figures['policy']:.2f} µs"
                  + (f", limits {figures['limits']:.2f} µs" if figures["limits"] else ""))
            runs[pure].append(figures)
    compiled, pure_core = runs[False][0]["core"], runs[True][0]["core"]
    if not str(compiled).startswith("compiled core"):
        print(f"no compiled core to compare: {compiled} (make core builds it)")
        return {}
    ratios: dict[str, float] = {}
    for name in ("10 rules", "policy"):
        compiled_us = statistics.median(run[name] for run in runs[False])
        pure_us = statistics.median(run[name] for run in runs[True])
        ratios[f"{name}, compiled / pure"] = compiled_us / pure_us
        print(f"{name + ':':10} {compiled_us:7.2f} µs compiled, {pure_us:7.2f} µs pure"
              f"   ratio {compiled_us / pure_us:.2f}")
        if runs[False][0]["limits"]:
            for label, side in (("compiled", False), ("pure", True)):
                ratio = statistics.median(run[name] / run["limits"] for run in runs[side])
                ratios[f"{name}, {label} / limits"] = ratio
                print(f"    {label:8} / one limits hit (same process): {ratio:.2f}")
    print(f"({compiled} against the {pure_core})")
    return ratios


def fastest(passes: int = 15, batch: int = 20_000) -> None:
    """The fastest of ``passes`` passes of one rule and of ten rules, one
    client: run it in two checkouts in turn, a few times, to compare them
    (the fastest pass is the one the machine disturbed least)."""
    for name, text in (("1 rule", ONE_RULE), ("10 rules", TEN_RULES)):
        engine = engine_for(text)
        requests = requests_for(engine, ["192.0.2.1"] * batch)
        best = min(time_decisions(engine, requests) for _ in range(passes))
        print(f"{name + ':':10} {best:7.2f} µs per decision (fastest of {passes} passes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1_000_000, help="rotating clients")
    parser.add_argument("--batch", type=int, default=20_000, help="decisions per timed pass")
    parser.add_argument("--fastest", action="store_true",
                        help="only the fastest pass of one rule and of ten rules, to compare two checkouts")
    parser.add_argument("--core-pass", action="store_true", help="one process's figures of the core comparison")
    parser.add_argument("--returning", type=int, metavar="CLIENTS", action="append",
                        help="only clients that return, this many (repeatable), against one client")
    args = parser.parse_args()
    tune_garbage_collector()  # as in a `sluice serve` process
    if args.returning:
        for clients in args.returning:
            returning(clients, args.batch)
        return
    if args.core_pass:
        print(json.dumps(core_pass()))
        return
    if args.fastest:
        fastest(batch=args.batch)
        return
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} cores, {core.which()}")
    rotating, rotating_near, growth, late = rotation(args.clients, args.batch)
    ratios = against_limits(rounds=20_000, passes=5)
    per_key = memory_per_key()
    door = front_door()
    core_ratios = cores()
    print()
    print("Summary (ratios from this run):")
    rows = [("10 rules under rotating clients / one client", f"{rotating:.2f}x", "<= 1.2x"),
            ("  the same, requests made just before", f"{rotating_near:.2f}x", "report only"),
            ("RSS growth once the cap is reached",
             "n/a (too few clients)" if growth is None else f"{growth:+.1f} MB", "flat"),
             ("peak RSS, second half of the rotation over first",
              "n/a (too few clients)" if late is None else f"{late:+.1f} MB", "flat")]
    rows += [(f"{name} / one limits hit", f"{ratios[name]:.2f}x", target)
             for name, target in (("10 rules", "<= 0.5x"), ("1 rule", "<= 0.3x"), ("resolve_client", "<= 0.1x"))
             if name in ratios]
    rows += [(f"resolve_client,{name[1:]} / one limits hit", f"{ratios[name]:.2f}x", "report only")
             for name in ("  a new IPv4 client", "  a new IPv6 client") if name in ratios]
    rows.append(("memory per tracked key at 100,000 keys", f"{per_key:.0f} bytes", "<= 250 bytes"))
    rows += [(f"nginx check in process, {name}", f"{us:.1f} µs", "<= 8 µs" if name == "no rule" else "report only")
             for name, us in door.items()]
    rows += [(f"{name.replace('policy', 'policy step, 10 checks')}", f"{ratio:.2f}x",
              "<= 0.5x" if name == "10 rules, compiled / limits" else "report only")
             for name, ratio in core_ratios.items()]
    for label, figure, target in rows:
        print(f"  {label:48} {figure:>22}   (target {target})")


if __name__ == "__main__":
    main()
