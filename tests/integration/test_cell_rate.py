"""A new limiter is its module, its Lua and its tests: the cell rate
(``cell_rate.py`` and ``cell_rate.lua``, which only these tests know) is
registered here and goes where every limiter of Sluice goes: a rules file
that names it, decisions on the memory store and on a real redis-server
(the same ones, exact floats and all), the admin API's description of its
keys, ``sluice replay`` with ``--sweep``, and a Rate Limit Service
descriptor. Withdrawn, it is unknown again."""

from __future__ import annotations

import asyncio
import importlib
import json
import random
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from click.testing import CliRunner

from sidecar import cli
from sidecar.config import ConfigError, parse_rules_text
from sidecar.engine import ALLOW, DENY, Engine
from sidecar.limiters import registry
from sidecar.request import CheckRequest
from sidecar.rls import load_rls
from sidecar.schema import rules_schema_text
from sidecar.store.memory import MemoryStore
from sidecar.store.redis import RedisStore
from tests.integration.redis_server import RedisServer
from tests.unit.conftest import FakeClock, ruleset_from

pytestmark = pytest.mark.integration

MODULE = "tests.integration.cell_rate"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cell_rate() -> Iterator[ModuleType]:
    """The cell rate, registered for the test and withdrawn after it."""
    with registry.scope():
        known = sys.modules.get(MODULE)
        yield importlib.reload(known) if known is not None else importlib.import_module(MODULE)


RULES = """\
headers: draft
overrides:
  - cidrs: [192.0.2.2/32]
    rules: [paced]
    multiply: 2
rules:
  - id: paced
    key: [ip, path]
    limit: {cells: 3, per: 2s}
    action: block
  - id: steady
    key: [ip]
    limit: {cells: 5, per: 1s}
    action: block
"""


def request(engine: Engine, ip: str, path: str = "/") -> CheckRequest:
    return CheckRequest("GET", "example.com", path, {}, engine.resolve_client(ip, None), "r")


class Recording:
    """A store that keeps what it answers: each hit's exact retry time, and
    the quotas of an admitted request (a refused one's are not read, and the
    Redis store answers a key it knows over limit without them)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.answers: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        evaluation = await self.store.evaluate(*args, **kwargs)
        hits = [(hit.over_limit, hit.retry_after) for hit in evaluation.hits]
        self.answers.append((hits, None if any(over for over, _ in hits) else evaluation.quotas))
        return evaluation


def test_a_rules_file_names_the_cell_rate_and_the_engine_spreads_its_requests(cell_rate: ModuleType) -> None:
    """Three at once from rest, then one every 2 s / 3."""
    async def run() -> list[tuple[str, int]]:
        clock = FakeClock()
        engine = Engine(ruleset_from(RULES), clock=clock)
        seen = []
        for step in (0, 0, 0, 0, 0.5, 0.2, 0.1):
            clock.advance(step)
            decision = await engine.decide(request(engine, "192.0.2.1"))
            seen.append((decision.outcome, decision.retry_after))
        return seen
    assert asyncio.run(run()) == [(ALLOW, 0), (ALLOW, 0), (ALLOW, 0), (DENY, 1), (DENY, 1), (ALLOW, 0),
                                  (DENY, 1)]


def test_the_redis_store_decides_the_cell_rate_as_the_memory_store(cell_rate: ModuleType,
                                                                  redis_server: RedisServer) -> None:
    """A random trace through both stores on one clock: two cell rates per
    request, one scaled by an override, and the draft fields' quotas.
    Outcomes, exact retry times and quotas must all be equal, and Redis
    holds the cell rate's own keys (so its Lua ran)."""
    redis_server.client().flushdb()
    rng = random.Random(7)
    trace = [(rng.choice(["192.0.2.1", "192.0.2.2"]), rng.choice(["/a", "/b"]),
              rng.choice([0.0, 0.0, 0.05, 0.1, 0.31, 0.7, 2.5])) for _ in range(300)]

    async def run() -> tuple[list[Any], list[Any], Recording, Recording]:
        clock = FakeClock(1_000_000.0)
        ruleset = ruleset_from(RULES)
        shared = Engine(ruleset, store=Recording(RedisStore.from_url(redis_server.url, "a", server_time=False)),
                        clock=clock)
        local = Engine(ruleset, store=Recording(MemoryStore(1000, "a", clock)), clock=clock)
        got, expected = [], []
        for ip, path, step in trace:
            clock.advance(step)
            for engine, into in ((shared, got), (local, expected)):
                decision = await engine.decide(request(engine, ip, path))
                into.append((decision.outcome, decision.rule.id if decision.rule else None,
                             decision.retry_after, decision.quota))
        await shared.store.close()
        return got, expected, shared.store, local.store
    got, expected, shared_store, local_store = asyncio.run(run())
    assert got == expected
    assert shared_store.answers == local_store.answers
    assert {rule for outcome, rule, *_ in got if outcome == DENY} == {"paced", "steady"}
    client = redis_server.client()
    keys = [key.decode() if isinstance(key, bytes) else key for key in client.keys("sluice:*:count:*")]
    assert keys and all(client.hget(key, "k") in (b"G", "G") for key in keys)
    assert all(client.pttl(key) > 0 for key in keys)


def test_the_admin_api_describes_a_cell_rate_key_alike_on_both_stores(cell_rate: ModuleType,
                                                                      redis_server: RedisServer) -> None:
    redis_server.client().flushdb()
    ruleset = ruleset_from("rules:\n  - id: cells\n    key: [ip]\n    limit: {cells: 4, per: 8s}\n"
                           "    action: block\n")
    limiter = ruleset.rules[0].limiter
    key = (("cells", ("ip",)), "192.0.2.9")

    async def describe(store: Any) -> list[Any]:
        clock = FakeClock(100.0)
        engine = Engine(ruleset, store=store, clock=clock)
        for _ in range(3):
            await engine.decide(request(engine, "192.0.2.9"))
        states = await store.describe_keys(101.0, [(key, limiter, 4.0), (key, limiter, 2.0), (key, None, 0.0),
                                                   ((("gone", ("ip",)), "192.0.2.9"), limiter, 4.0)])
        await store.close()
        return [None if state is None else (state.key, state.penalty, state.quota) for state in states]
    on_memory = asyncio.run(describe(MemoryStore(1000, "a", clock=lambda: 101.0)))
    on_redis = asyncio.run(describe(RedisStore.from_url(redis_server.url, "a", server_time=False)))
    # Three of four cells spent at 100 s, one interval (2 s) back by 101.5 s:
    # at 101 s, one request at once, and at rest at 106 s.
    assert on_memory == on_redis == [(key, 0.0, (1, 5.0, 8.0)), (key, 0.0, (0, 5.0, 8.0)), (key, 0.0, None), None]


def combined(ip: str, t: float) -> str:
    stamp = datetime.fromtimestamp(t, UTC).strftime("%d/%b/%Y:%H:%M:%S +0000")
    return f'{ip} - - [{stamp}] "GET / HTTP/1.1" 200 512 "-" "test-agent"'


def replay(tmp_path: Path, *options: str) -> Any:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - id: cells\n    key: [ip]\n    limit: {cells: 3, per: 1m}\n    action: block\n")
    log = tmp_path / "access.log"
    # One address sends 5 at one instant, another 1.
    t0 = 1709287200.0
    log.write_text("\n".join([combined("192.0.2.1", t0)] * 5 + [combined("192.0.2.2", t0)]) + "\n")
    return CliRunner().invoke(cli.main, ["replay", "--config", str(rules), *options, str(log)])


def test_sluice_replay_sweeps_the_cells(cell_rate: ModuleType, tmp_path: Path) -> None:
    result = replay(tmp_path, "--json", "--sweep", "cells=5,1,2")
    assert result.exit_code == 0, result.output
    [rule] = json.loads(result.output)["rules"]
    sweep = rule["sweep"]
    assert (sweep["field"], sweep["current"]) == ("limit.cells", 3)
    assert [(c["threshold"], c["refused_requests"]) for c in sweep["candidates"]] == [(1, 4), (2, 3), (5, 0)]


def test_a_sweep_below_one_cell_is_a_clear_error(cell_rate: ModuleType, tmp_path: Path) -> None:
    result = replay(tmp_path, "--sweep", "cells=0,2")
    assert result.exit_code == 2
    assert "cells: limit.cells is at least 1, got 0" in result.output
    assert "Traceback" not in result.output


def issues(text: str) -> list[tuple[int, str, str]]:
    with pytest.raises(ConfigError) as error:
        parse_rules_text(text, "r.yaml", Path("."))
    return [(issue.line, issue.field, issue.message) for issue in error.value.issues]


def test_the_rules_file_checks_the_cell_rate_at_its_fields(cell_rate: ModuleType) -> None:
    head = "rules:\n  - id: cells\n"
    assert issues(head + "    limit: {cells: 0, per: 1s}\n    action: block\n") == [
        (3, "rules[0].limit.cells", "should be greater than or equal to 1, got 0")]
    assert issues(head + "    limit: {cells: 2, per: 1s}\n    penalty: 1m\n    action: block\n") == [
        (4, "rules[0].penalty", "a cell rate has no penalty: a request is refused until its cell comes")]
    [(_, field, message)] = issues(head + "    limit: {per: 1s}\n    action: block\n")
    assert field == "rules[0].limit" and message.endswith("rate (with burst), concurrent, cells (with per)")


def test_a_rate_limit_service_descriptor_names_the_cell_rate(cell_rate: ModuleType, tmp_path: Path) -> None:
    entry = ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: %d}\n"
             "    sluice: {algorithm: cell_rate%s}\n")
    (tmp_path / "ok.yaml").write_text(entry % (6, ""))
    match = load_rls(str(tmp_path / "ok.yaml")).match("d", [("k", "any")])
    assert match is not None
    limiter = match.limit.limiter
    assert isinstance(limiter, cell_rate.CellRate) and (limiter.cells, limiter.period) == (6, 60.0)
    for name, values, message in (("burst.yaml", (6, ", burst: 2"), "burst is a bucket's (algorithm: "
                                                                       "token_bucket or leaky_bucket)"),
                                  ("none.yaml", (0, ""), "a cell rate needs requests_per_unit of at least 1")):
        (tmp_path / name).write_text(entry % values)
        with pytest.raises(ConfigError) as error:
            load_rls(str(tmp_path / name))
        assert [issue.message for issue in error.value.issues] == [message]


def test_withdrawn_the_cell_rate_is_unknown_again() -> None:
    rules = "rules:\n  - id: cells\n    limit: {cells: 2, per: 1s}\n    action: block\n"
    misspelt_rules = rules.replace("{cells: 2", "{requests: 2, cels: 2")
    schema = rules_schema_text()
    with registry.scope():
        known = sys.modules.get(MODULE)
        importlib.reload(known) if known is not None else importlib.import_module(MODULE)
        assert parse_rules_text(rules, "r.yaml", Path(".")).model.rules[0].limit.tag == "cell-rate"
        assert "CellRateLimit" in rules_schema_text()
        [(_, _, misspelt)] = issues(misspelt_rules)
    # A field name of its model is known while it is registered, for hints.
    assert misspelt == "unknown field (did you mean 'cells'?)"
    [(_, field, message)] = issues(rules)
    assert field == "rules[0].limit" and "cells" not in message
    [(_, _, misspelt)] = issues(misspelt_rules)
    assert "cells" not in misspelt
    assert rules_schema_text() == schema


def test_no_file_of_sluice_names_the_cell_rate() -> None:
    """It is declared in its own files only: Sluice reads the registry."""
    names = ("cell_rate", "cell-rate", "cellrate", "cell rate")
    for path in (REPO / "sidecar").rglob("*"):
        if path.is_file() and path.suffix in (".py", ".lua", ".yaml", ".json", ".html", ".txt"):
            text = path.read_text(encoding="utf-8").lower()
            assert not any(name in text for name in names), path
