"""A burst of simultaneous requests on one key, with the Redis backend (and
a thousand with the memory store), admits exactly the budget: straight to
Sluice, through nginx and through Envoy, whatever the concurrency, and no
store or internal error is counted.

The stack fails closed, so a request that the store could not decide would
show as a 503 besides being counted as a store error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from devstack.launcher import FRONT_DOORS, Stack
from tests.integration.burst import burst, burst_over
from tests.integration.conftest import (
    fresh_client_address,
    front_door_port,
    metric_at,
    sluice_metric,
    start_stack,
    wait_until,
)
from tests.integration.redis_server import RedisServer
from tests.integration.sluice_serve import SluiceServe

pytestmark = pytest.mark.integration

BUDGET = 50
# The bursts' windows are the clock's hours, so that a burst seldom has to
# wait for one with room left before a boundary (see the waits below).
WINDOW = "1h"
WINDOW_SECONDS = 3600



def burst_stack(directory: Path, state: str) -> Stack:
    rules = directory / "rules.yaml"
    rules.write_text(f"""\
state: {state}
rules:
  - id: per-key
    match: {{header: {{name: x-k, present: true}}}}
    key: ["header:x-k"]
    limit: {{requests: {BUDGET}, per: {WINDOW}}}
    action: block
""")
    # The proxies' own timeouts for Sluice (1 s in the templates) let a
    # check through unchecked when it takes longer, as documented: a
    # thousand decisions on a loaded 2-core machine can. What is tested
    # here is that Sluice itself admits exactly the budget, so the proxies
    # wait long enough for every answer.
    return start_stack(directory / "stack", Path(rules),
                       {"SLUICE_READ_TIMEOUT": "20s", "SLUICE_CHECK_TIMEOUT": "20s"})


@pytest.fixture(scope="module")
def redis_stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    stack = burst_stack(tmp_path_factory.mktemp("redis-burst"),
                        f'{{backend: redis, url: "{redis_server.url}", fail: closed}}')
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def memory_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = burst_stack(tmp_path_factory.mktemp("memory-burst"), "{backend: memory}")
    yield stack
    stack.stop()


def door_port(stack: Stack, door: str) -> tuple[int, str, dict[str, str]]:
    """Where a burst goes in, the path, and the headers that door needs."""
    if door == "sluice":
        # As nginx's check subrequest asks.
        return stack.ports.sluice, "/v1/nginx/auth", {"X-Sluice-Client-Addr": "10.70.0.1"}
    return front_door_port(stack, door), "/burst", {}


@pytest.mark.parametrize("door", ["sluice", *FRONT_DOORS])
@pytest.mark.parametrize("concurrency", [100, 400, 1000])
def test_a_burst_on_one_key_admits_exactly_the_budget(redis_stack: Stack, door: str, concurrency: int) -> None:
    assert_burst_admits_the_budget(redis_stack, door, concurrency)


@contextmanager
def busy_cores(redis: RedisServer, count: int = 2) -> Iterator[None]:
    """``count`` processes spinning on the CPU for as long as the block runs:
    Sluice and the proxies then share the cores with them.

    Redis is what a store timeout measures, and these tests ask whether
    Sluice tells a late Redis from its own late loop: Redis is spared the
    spinners (a higher priority while they run, as root), so that a Redis
    descheduled for 100 ms on a shared 2-core machine does not stand for a
    Redis that stopped answering. Without the right to raise it (not root),
    it shares the cores as everything else does."""
    process = redis.process
    assert process is not None
    spared = False
    if count:
        try:
            os.setpriority(os.PRIO_PROCESS, process.pid, -10)
            spared = True
        except PermissionError:
            pass
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        if spared:
            os.setpriority(os.PRIO_PROCESS, process.pid, 0)


@pytest.mark.parametrize("door", ["sluice", *FRONT_DOORS])
def test_a_burst_beside_two_busy_processes_admits_exactly_the_budget_with_no_store_error(
        redis_stack: Stack, redis_server: RedisServer, door: str) -> None:
    """A store timeout measures Redis, not a Sluice whose loop is late to
    read an answer already in its socket."""
    with busy_cores(redis_server):
        assert_burst_admits_the_budget(redis_stack, door, 1000)


@pytest.mark.parametrize("door", ["sluice", *FRONT_DOORS])
def test_a_burst_of_a_thousand_on_the_memory_store_admits_exactly_the_budget(memory_stack: Stack, door: str) -> None:
    """The same with the memory store, whose checks the HTTP protocol
    answers inside the parser's callback."""
    assert_burst_admits_the_budget(memory_stack, door, 1000)


def assert_burst_admits_the_budget(stack: Stack, door: str, concurrency: int) -> None:
    port, path, headers = door_port(stack, door)
    # The rule's windows are the clock's hours. A burst across a boundary
    # meets the sliding estimate, which weighs the previous window's count by
    # what is left of it (49.99 of 50 just after the boundary): one request
    # more is admitted there, as documented. Bursts here start with 10 s left.
    wait_until(lambda: time.time() % WINDOW_SECONDS < WINDOW_SECONDS - 10, "a window with 10 s left", 15)
    errors_before = sluice_metric(stack, "sluice_store_errors_total")
    internal_before = sluice_metric(stack, "sluice_internal_errors_total")
    statuses = burst(port, concurrency, path, {**headers, "x-k": uuid.uuid4().hex},
                     source=fresh_client_address())
    # Sluice answers nginx's check with 200 or 403 (the page comes from a
    # second call); through a front door the client sees the demo
    # upstream's 200 or the block page's 429.
    refused = 403 if door == "sluice" else 429
    assert statuses == {200: BUDGET, refused: concurrency - BUDGET}
    assert sluice_metric(stack, "sluice_store_errors_total") == errors_before == 0
    assert sluice_metric(stack, "sluice_internal_errors_total") == internal_before == 0


# Two Sluice processes of two workers each, on one Redis: one budget of
# M on one key, whatever the kind of limit, whichever process and worker
# takes a request. A leaky bucket of burst M - 1 fits M (nginx admits
# burst + 1); neither bucket refills in the time of a test.
M = 500
ACROSS_PROCESSES = 1200
LIMITS = {"window": f"{{requests: {M}, per: {WINDOW}}}",
          "tokens": f"{{tokens: {M}, refill: 0.001/m}}",
          "leaky": f"{{rate: 1r/m, burst: {M - 1}, nodelay: true}}"}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[list[SluiceServe]]:
    rules = tmp_path_factory.mktemp("two-processes") / "rules.yaml"
    rules.write_text(f"state: {{backend: redis, url: '{redis_server.url}', fail: closed}}\nrules:\n" + "".join(f"""\
  - id: {kind}
    match: {{header: {{name: x-limit, equals: {kind}}}}}
    key: ["header:x-k"]
    limit: {limit}
    action: block
""" for kind, limit in LIMITS.items()))
    with SluiceServe(rules, workers=2) as first, SluiceServe(rules, workers=2) as second:
        # Every worker connects to Redis (and loads the scripts) before the
        # bursts: fresh connections take turns between the workers.
        for sluice in (first, second):
            assert {sluice.get("/v1/check", {"x-limit": "tokens", "x-k": "warm-up"}) for _ in range(20)} == {200}
        yield [first, second]


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "beside-two-busy-processes"])
@pytest.mark.parametrize("kind", LIMITS)
def test_two_processes_of_two_workers_admit_exactly_the_budget(two_processes: list[SluiceServe],
                                                               redis_server: RedisServer, kind: str,
                                                               busy: bool) -> None:
    if kind == "window":
        # The burst within one window: across a boundary the sliding
        # estimate weighs the previous window (see docs/rules.md), which is not
        # what is tested here.
        wait_until(lambda: time.time() % WINDOW_SECONDS < WINDOW_SECONDS - 5, "a window with 5 s left", 10)
    # Forward-auth answers a refusal with 429, and a store that failed
    # (fail: closed) with 503.
    with busy_cores(redis_server, 2 if busy else 0):
        statuses = burst_over([sluice.port for sluice in two_processes], ACROSS_PROCESSES, "/v1/check",
                              {"x-limit": kind, "x-k": uuid.uuid4().hex}, source=fresh_client_address())
    assert statuses == {200: M, 429: ACROSS_PROCESSES - M}
    for sluice in two_processes:
        # Each connection reaches one of the workers: both are asked.
        assert {metric_at(sluice.port, "sluice_store_errors_total") for _ in range(8)} == {0}
        log = sluice.log.read_text()
        assert "state store unavailable" not in log and "Traceback" not in log
