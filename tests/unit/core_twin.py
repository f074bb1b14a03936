"""One core in a process of its own, for tests/unit/test_core_parity.py: the
compiled core, or the pure-Python one with SLUICE_PURE_PYTHON=1 (a process
runs one core: sidecar.core chooses at import).

``python -m tests.unit.core_twin`` prints the core it runs on its first
line, then answers each JSON line it reads with one JSON line:

- ``{"trace": [...]}``: the store's answers to a policy trace
  (tests/unit/policy_traces.py) replayed on a fresh memory store;
- ``{"rules": TEXT, "requests": [...]}``: the engine's decision for each
  request under those rules, on a clock the requests move: the outcome,
  the rule, and every number its headers carry;
- ``{"rules": TEXT, "connections": [...]}``: what Sluice's HTTP protocol
  writes on each connection, fed its pieces in turn, under those rules on
  a clock the connections move: every byte of every answer, and whether
  the protocol closed the connection.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import sys
from typing import Any

from uvicorn.server import ServerState

from sidecar import core
from sidecar.at_once import run_at_once
from sidecar.engine import Decision, Engine
from sidecar.request import CheckRequest
from sidecar.store.memory import MemoryStore
from tests.unit.conftest import FakeClock, connection_to, ruleset_from
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


def parity_engine(rules: str, clock: FakeClock) -> Engine:
    """The engine both cores run: the same clocks, the same secret."""
    return Engine(ruleset_from(rules), clock=clock, secret=b"parity" * 6, wall_clock=lambda: 1_700_000_000.0)


def engine_answers(rules: str, requests: list[list[Any]]) -> list[Any]:
    """Each request is [advance, address, method, path, api key]."""
    clock = FakeClock(1_000_000.0)
    engine = parity_engine(rules, clock)
    answers = []
    for advance, address, method, path, api_key in requests:
        clock.advance(advance)
        headers = {"x-api-key": api_key} if api_key else {}
        request = CheckRequest(method, "example.com", path, headers, engine.resolve_client(address, None), "r")
        answers.append(described(engine.decide_now(request)))
    return answers


def protocol_answers(rules: str, connections: list[list[Any]]) -> list[Any]:
    """Each connection is [advance, pieces], its pieces the bytes it
    sends as latin-1 text, each given to ``data_received`` in turn; its
    answer is [what was written, as latin-1 text, whether the protocol
    closed the connection]. Answers of the ASGI path are awaited before
    the connection ends."""
    clock = FakeClock(1_000_000.0)
    engine = parity_engine(rules, clock)
    loop = asyncio.new_event_loop()
    answers = []
    try:
        for advance, pieces in connections:
            clock.advance(advance)
            state = ServerState()
            protocol, transport = connection_to(engine, loop, state)
            for piece in pieces:
                protocol.data_received(piece.encode("latin-1"))
                while state.tasks:
                    loop.run_until_complete(asyncio.gather(*state.tasks))
            closed = transport.closing
            protocol.connection_lost(None)
            answers.append([b"".join(transport.written).decode("latin-1"), closed])
    finally:
        loop.close()
    return answers


COUNTER = itertools.count()


def counted_bytes(size: int) -> bytes:
    """``os.urandom`` in a twin: the same bytes in both processes (lease
    and request ids), in the order they are asked for."""
    return next(COUNTER).to_bytes(size, "big")


def main() -> None:
    os.urandom = counted_bytes  # both cores make the same ids
    logging.disable(logging.WARNING)  # junk is logged; the answers are what is compared
    print(json.dumps(core.which()), flush=True)
    for line in sys.stdin:
        question = json.loads(line)
        if "trace" in question:
            answer = trace_answers(question["trace"])
        elif "connections" in question:
            answer = protocol_answers(question["rules"], question["connections"])
        else:
            answer = engine_answers(question["rules"], question["requests"])
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
