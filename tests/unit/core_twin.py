"""One core in a process of its own, for tests/unit/test_core_parity.py: the
compiled core, or the pure-Python one with SLUICE_PURE_PYTHON=1 (a process
runs one core: sidecar.core chooses at import).

``python -m tests.unit.core_twin`` prints the core it runs on its first
line, then answers each JSON line it reads with one JSON line:

- ``{"trace": [...]}``: the store's answers to a policy trace
  (tests/unit/policy_traces.py) replayed on a fresh memory store;
- ``{"rules": TEXT, "requests": [...]}``: the engine's decision for each
  request under those rules, on a clock the requests move: the outcome,
  the rule, and every number its headers carry.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from sidecar import core
from sidecar.at_once import run_at_once
from sidecar.engine import Decision, Engine
from sidecar.request import CheckRequest
from sidecar.store.memory import MemoryStore
from tests.unit.conftest import FakeClock, ruleset_from
from tests.unit.policy_traces import Request, Response, Step, replay


def step_of(encoded: list[Any]) -> Step:
    """A trace's step from its JSON: [advance, "request", address, rules,
    can_delay, quotas, repeat] or [advance, "response", address, amount, release]."""
    advance, kind, *fields = encoded
    if kind == "request":
        address, rules, can_delay, quotas, repeat = fields
        return advance, Request(address, tuple(rules), can_delay, quotas, repeat)
    address, amount, release = fields
    return advance, Response(address, amount, release)


def trace_answers(encoded: list[list[Any]]) -> list[Any]:
    store = MemoryStore(10_000, "node", clock=lambda: 0.0)
    return run_at_once(replay(store, [step_of(step) for step in encoded]))


def described(decision: Decision) -> list[Any]:
    """What the proxy's answer is made of: outcome, rule, headers' numbers."""
    return [str(decision.outcome), None if decision.rule is None else decision.rule.id, decision.limit,
            decision.reset, decision.retry_after, round(decision.delay, 9),
            None if decision.quota is None else list(decision.quota),
            None if decision.page is None else decision.page.status]


def engine_answers(rules: str, requests: list[list[Any]]) -> list[Any]:
    """Each request is [advance, address, method, path, api key]."""
    clock = FakeClock(1_000_000.0)
    engine = Engine(ruleset_from(rules), clock=clock, secret=b"parity" * 6, wall_clock=lambda: 1_700_000_000.0)
    answers = []
    for advance, address, method, path, api_key in requests:
        clock.advance(advance)
        headers = {"x-api-key": api_key} if api_key else {}
        request = CheckRequest(method, "example.com", path, headers, engine.resolve_client(address, None), "r")
        answers.append(described(engine.decide_now(request)))
    return answers


def main() -> None:
    print(json.dumps(core.which()), flush=True)
    for line in sys.stdin:
        question = json.loads(line)
        if "trace" in question:
            answer = trace_answers(question["trace"])
        else:
            answer = engine_answers(question["rules"], question["requests"])
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
