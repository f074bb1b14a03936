"""The compiled core decides as the pure-Python one, decision by decision
and header by header.

A process runs one core (sidecar.core chooses once, at import), so each
core answers in a process of its own (tests/unit/core_twin.py): the
compiled one, and the pure-Python one with SLUICE_PURE_PYTHON=1. Hypothesis
generates the questions; both answer each, and the answers must be equal:

- policy traces (tests/unit/policy_traces.py, the traces the Lua parity
  test uses): every kind of check, bans, escalation, buckets, concurrency
  slots, reported responses and quotas, at the store's seam;
- rule sets and request sequences through the engine: each decision's
  outcome, its rule, and every number of its headers (limit, reset,
  Retry-After, the delay, the draft RateLimit fields, the page's status);
- rule sets and connections through Sluice's HTTP protocol: the checks of
  nginx, Envoy and forward-auth proxies (whole, cut in two, pipelined, with
  a body, from malformed addresses) and junk, every byte answered.

Without a compiled core built here the two processes would run the same
code, and the tests skip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar import core
from tests.unit.policy_traces import Request, Step, traces

REPO = Path(__file__).resolve().parents[2]


class Twin:
    """A process answering with one core."""

    def __init__(self, pure: bool) -> None:
        env = {key: value for key, value in os.environ.items() if key != core.PURE_ENV}
        if pure:
            env[core.PURE_ENV] = "1"
        self.process = subprocess.Popen([sys.executable, "-m", "tests.unit.core_twin"], cwd=REPO, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.which: str = json.loads(self.process.stdout.readline())

    def ask(self, question: dict[str, Any]) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(question) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer, f"the {self.which} process ended"
        return json.loads(answer)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def twins() -> Iterator[tuple[Twin, Twin]]:
    compiled, pure = Twin(pure=False), Twin(pure=True)
    try:
        if not compiled.which.startswith("compiled core"):
            pytest.skip(f"no compiled core to compare here: {compiled.which}")
        assert pure.which == "pure-Python core (SLUICE_PURE_PYTHON=1)"
        yield compiled, pure
    finally:
        compiled.close()
        pure.close()


def encoded(step: Step) -> list[Any]:
    """A trace's step as core_twin.step_of reads it."""
    advance, what = step
    if isinstance(what, Request):
        return [advance, "request", what.address, list(what.rules), what.can_delay, what.quotas, what.repeat]
    return [advance, "response", what.address, what.amount, what.release]


def both(twins: tuple[Twin, Twin], question: dict[str, Any]) -> tuple[Any, Any]:
    compiled, pure = twins
    return compiled.ask(question), pure.ask(question)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trace=traces)
def test_the_compiled_policy_answers_every_step_as_the_pure_one(twins: tuple[Twin, Twin], trace: list[Step]) -> None:
    compiled, pure = both(twins, {"trace": [encoded(step) for step in trace]})

    assert compiled == pure
    assert len(compiled) >= len(trace)  # an answer per request of each burst, and per response


# Rule sets: each kind of limit, each action a kind takes, keys of one or two
# dimensions, some rules only for a path; standard or draft headers; exempt networks.
WINDOWS = st.fixed_dictionaries({"requests": st.integers(0, 4), "per": st.sampled_from(["1s", "3s", "10s"]),
                                 "window": st.sampled_from(["sliding", "fixed"])})
TOKENS = st.fixed_dictionaries({"tokens": st.integers(1, 4), "refill": st.sampled_from(["1/s", "3/s", "1/m"])})
LEAKY = st.fixed_dictionaries({"rate": st.sampled_from(["1r/s", "5r/s", "30r/m"]), "burst": st.integers(0, 3),
                               "nodelay": st.booleans()})
CONCURRENT = st.fixed_dictionaries({"concurrent": st.integers(1, 3), "lease": st.sampled_from(["2s", "30s"])})


@st.composite
def rules(draw: st.DrawFn) -> dict[str, Any]:
    limit = draw(st.one_of(WINDOWS, TOKENS, LEAKY, CONCURRENT))
    actions = ["block", "log"] + (["ban"] if "requests" in limit else [])
    rule: dict[str, Any] = {"key": draw(st.sampled_from([["ip"], ["ip", "path"], ["header:x-api-key"]])),
                            "limit": limit, "action": draw(st.sampled_from(actions))}
    if rule["action"] == "ban":
        rule["ban"] = {"duration": draw(st.sampled_from(["5s", "1m"]))}
    if draw(st.booleans()):
        rule["match"] = {"path": {"prefix": "/api"}}
    return rule


@st.composite
def rule_sets(draw: st.DrawFn) -> str:
    chosen = draw(st.lists(rules(), min_size=1, max_size=5))
    document = {"headers": draw(st.sampled_from(["standard", "draft"])),
                # Exempt networks: none, or holding some of the clients (see checks).
                "exempt": draw(st.sampled_from([[], ["192.0.2.2/32"], ["2001:db8::/32", "192.0.2.0/24"]])),
                "rules": [{"id": f"rule-{n}", **rule} for n, rule in enumerate(chosen)]}
    return json.dumps(document)  # JSON is YAML


checks = st.lists(st.tuples(st.sampled_from([0.0, 0.0, 0.0, 0.01, 0.2, 0.7, 1.5, 4.0, 12.0]),
                            st.sampled_from(["192.0.2.1", "192.0.2.1", "192.0.2.2", "2001:db8::1"]),
                            st.sampled_from(["GET", "POST"]), st.sampled_from(["/", "/api/items", "/api/login"]),
                            st.sampled_from(["", "key-a", "key-b"])).map(list), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=rule_sets(), requests=checks)
def test_the_compiled_core_decides_and_writes_headers_as_the_pure_one(twins: tuple[Twin, Twin], text: str,
                                                                       requests: list[list[Any]]) -> None:
    compiled, pure = both(twins, {"rules": text, "requests": requests})

    assert compiled == pure
    assert len(compiled) == len(requests)


# Connections to Sluice's HTTP protocol: proxies' checks and junk.
# One client most often, so that rules refuse; malformed addresses too.
CLIENTS = st.sampled_from(["192.0.2.1", "192.0.2.1", "192.0.2.1", "192.0.2.2", "2001:db8::1", "2001:db8::1:2",
                           "not-an-address", ""])
URIS = st.sampled_from(["/", "/api/items?q=1", "/api/login", "/api/%6Cogin", "//api/./items", "/a b"])


@st.composite
def proxy_checks(draw: st.DrawFn) -> bytes:
    """A check as nginx, Envoy or a forward-auth proxy sends it, now and
    then with a body (read by the parser, not the head reader)."""
    proxy, client, uri = draw(st.sampled_from(["nginx", "envoy", "forward-auth"])), draw(CLIENTS), draw(URIS)
    method = draw(st.sampled_from(["GET", "POST", "HEAD"]))
    fields = [f"X-Request-Id: {draw(st.integers(0, 9))}"]
    if proxy == "nginx":
        line = "GET /v1/nginx/auth"
        fields += [f"X-Sluice-Client-Addr: {client}", f"X-Original-Method: {method}", f"X-Original-URI: {uri}",
                   "X-Original-Host: shop.example"]
    elif proxy == "envoy":
        line = f"{method} /v1/envoy/auth{uri.replace(' ', '%20')}"
        fields += ["Host: shop.example", f"X-Sluice-Client-Addr: {client}"]
    else:
        line = "GET /v1/check"
        fields += [f"X-Forwarded-Method: {method}", f"X-Forwarded-Uri: {uri}", "X-Forwarded-Host: shop.example",
                   f"X-Forwarded-For: {client}"]
    fields += draw(st.lists(st.sampled_from([
        "X-Api-Key: key-a", "X-Api-Key: key-b", "Accept: text/html", "Accept: application/json",
        "Cookie: sid=abc; theme=dark", "X-Forwarded-For: 203.0.113.9, 192.0.2.1", "Connection: close",
        "X-Sluice-Sent: 1000000.5", "X-Sluice-Sent: junk"]), max_size=4))
    body = draw(st.sampled_from(["", "", "hello"]))
    if body:
        fields.append(f"Content-Length: {len(body)}")
    return ("\r\n".join([f"{line} HTTP/1.1", *fields]) + "\r\n\r\n" + body).encode("latin-1")


junk = st.one_of(st.binary(max_size=120), st.sampled_from([
    b"GET /v1/nginx/auth HTTP/1.1\r\nBad Header\r\n\r\n", b"GET /v1/nginx/auth HTTP/9.9\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\n\r\n", b"GET /nowhere HTTP/1.1\r\n\r\n",
    b"POST /v1/nginx/auth HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"]))


@st.composite
def connections(draw: st.DrawFn) -> list[Any]:
    """[advance, pieces]: one or more requests sent at once, cut anywhere."""
    sent = b"".join(draw(st.lists(st.one_of(proxy_checks(), proxy_checks(), junk), min_size=1, max_size=3)))
    cuts = sorted(draw(st.lists(st.integers(0, len(sent)), max_size=2)))
    pieces = [sent[start:end] for start, end in zip([0, *cuts], [*cuts, len(sent)]) if end > start]
    advance = draw(st.sampled_from([0.0, 0.0, 0.3, 2.0, 30.0]))
    return [advance, [piece.decode("latin-1") for piece in pieces]]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=rule_sets(), sent=st.lists(connections(), min_size=1, max_size=12))
def test_the_compiled_protocol_answers_every_connection_as_the_pure_one(twins: tuple[Twin, Twin], text: str,
                                                                        sent: list[Any]) -> None:
    compiled, pure = both(twins, {"rules": text, "connections": sent})

    assert compiled == pure
    assert len(compiled) == len(sent)


def test_the_twins_run_the_two_cores(twins: tuple[Twin, Twin]) -> None:
    compiled, pure = twins
    assert compiled.which.startswith("compiled core (Cython ") and pure.which.startswith("pure-Python core")
