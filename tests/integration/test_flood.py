"""One address floods through the shipped nginx and Envoy configurations
(``sluice config``) with thousands of connections: the application sees at
most the budget plus 1 % of the flood, and an honest client at another
address is never refused beyond its own limit (sidecar.overload)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.integration.flood import FloodStack

ADDRESSES_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "addresses.lua"

pytestmark = pytest.mark.integration

BUDGET = 10
RULES = f"""\
state: {{backend: memory}}
rules:
  - id: per-address
    key: [ip]
    limit: {{requests: {BUDGET}, per: 60s}}
    action: block
"""
SECONDS = 3
# The guard for RULES (sluice config --guard): its floor of 10 requests a
# second per address, with two seconds' worth at once.
GUARD_RATE = 10
GUARD_BURST = 20


@pytest.mark.parametrize(("door", "workers", "connections", "guard"), [
    ("nginx", 1, 2000, False),
    ("nginx", 2, 2000, False),
    ("envoy", 2, 2000, False),
    # Beyond what Sluice answers in time on two cores, the proxy's first
    # tier (sluice config --guard) holds the flood before Sluice is asked.
    ("nginx", 1, 6000, True),
    ("envoy", 2, 6000, True),
], ids=["nginx-1-worker", "nginx-2-workers", "envoy", "nginx-guard", "envoy-guard"])
def test_a_flood_from_one_address_reaches_the_application_at_most_the_budget_plus_one_percent(
        tmp_path: Path, door: str, workers: int, connections: int, guard: bool) -> None:
    with FloodStack(tmp_path, RULES, door, workers, guard) as stack:
        checks_before = stack.metric("sluice_checks_total")
        result = stack.flood(connections, SECONDS)
        checks = stack.metric("sluice_checks_total") - checks_before
        internal_errors = stack.metric("sluice_internal_errors_total")
    honest = [status for status, _ in result.honest]
    # The honest client is let in within its own budget (or more, when a
    # late check of its was let in uncounted), refused only past it: the
    # guard keeps a bucket of its own for its address.
    assert set(honest) <= {200, 429}, honest
    assert honest.count(200) >= min(len(honest), BUDGET)
    flood_reached = result.reached - honest.count(200)
    assert flood_reached <= BUDGET + result.requests // 100, (result.requests, result.reached)
    if guard:
        # Sluice was asked about the flood's address no more than the guard
        # lets through (a second's slack for wrk's start and end).
        assert checks - len(honest) <= GUARD_BURST + GUARD_RATE * (SECONDS + 1), (checks, result.requests)
    assert internal_errors == 0


@pytest.mark.parametrize(("door", "workers"), [("nginx", 1), ("envoy", 2)], ids=["nginx", "envoy"])
def test_a_flood_while_sluice_does_not_answer_is_let_in_by_the_proxy_within_the_unchecked_rate_per_address(
        tmp_path: Path, door: str, workers: int) -> None:
    """A Sluice that answers nothing in time (stopped here) fails open, but
    a flood from one address is not let in for outrunning it: the proxy lets
    each address in within the unchecked rate (the guard's rate of the
    rules: 10 r/s, bursts of 20; nginx's SLUICE_UNCHECKED_RATE, Envoy's
    local_ratelimit after ext_authz) and answers the rest with 429 itself."""
    with FloodStack(tmp_path, RULES, door, workers) as stack:
        assert stack.sluice is not None
        os.kill(stack.sluice.pid, signal.SIGSTOP)
        try:
            result = stack.flood(300, SECONDS)
        finally:
            os.kill(stack.sluice.pid, signal.SIGCONT)
    honest = [status for status, _ in result.honest]
    # Each request waits for the read timeout (1 s): the flood's 300
    # connections make about 300 a second, all of which the proxy's
    # timeout alone would let in.
    assert result.requests > 5 * (GUARD_BURST + GUARD_RATE * (SECONDS + 2)), result.requests
    # What the limit lets through over the flood, and a second of checks
    # sent before it ended and timed out after (a second's slack more).
    flood_reached = result.reached - honest.count(200)
    assert flood_reached <= GUARD_BURST + GUARD_RATE * (SECONDS + 2), (result.requests, result.reached)
    # The honest client at another address has a limit of its own: let in.
    assert honest and set(honest) == {200}, honest


ADDRESSES = 1000
PER_ADDRESS = 2


def test_a_flood_from_a_thousand_addresses_behind_a_trusted_proxy_reaches_at_most_their_budgets_plus_one_percent(
        tmp_path: Path) -> None:
    """Each address far over its budget, and the stored refusals kept by
    the address X-Forwarded-For names, never by the proxy's own."""
    rules = f"""\
client_ip: {{trusted_proxies: [127.0.0.1/32]}}
rules:
  - id: per-address
    key: [ip]
    limit: {{requests: {PER_ADDRESS}, per: 60s}}
    action: block
"""
    with FloodStack(tmp_path, rules, "nginx", 2) as stack:
        result = stack.flood(2000, SECONDS, script=ADDRESSES_SCRIPT)
        internal_errors = stack.metric("sluice_internal_errors_total")
    honest = [status for status, _ in result.honest]
    assert set(honest) <= {200, 429}, honest
    flood_reached = result.reached - honest.count(200)
    assert result.requests > 5 * ADDRESSES * PER_ADDRESS  # each address far over its budget
    assert flood_reached <= ADDRESSES * PER_ADDRESS + result.requests // 100, (result.requests, result.reached)
    assert internal_errors == 0


@pytest.mark.parametrize("refusal", ["ban", "block"])
def test_a_flood_from_a_refused_address_is_answered_by_nginx_and_barely_reaches_sluice(
        tmp_path: Path, refusal: str) -> None:
    """A ban, or a refusal by an address-wide rule, holds for every request
    of the client: nginx answers the flood from its cache (X-Accel-Expires)."""
    answer = "ban: {duration: 10m}" if refusal == "ban" else "penalty: 10m"
    rules = f"""\
rules:
  - id: per-address
    key: [ip]
    limit: {{requests: {BUDGET}, per: 60s}}
    action: {refusal}
    {answer}
"""
    connections = 1000
    with FloodStack(tmp_path, rules, "nginx", 1) as stack:
        before = stack.metric("sluice_checks_total")
        result = stack.flood(connections, SECONDS)
        checks = stack.metric("sluice_checks_total") - before
        internal_errors = stack.metric("sluice_internal_errors_total")
    attempts = result.requests + result.closed  # a ban closes the connection (nginx's 444)
    honest = [status for status, _ in result.honest]
    assert attempts > 20 * BUDGET
    # When nginx's entry ends (every 1-2 s), the requests in flight until
    # the next one is kept miss it: one a connection, each second at most.
    # Without the cache, Sluice sees every request (some 70,000 here).
    assert checks - len(honest) <= BUDGET + connections * (SECONDS + 1), (checks, attempts)
    assert checks < attempts // 10, (checks, attempts)
    assert result.reached - honest.count(200) <= BUDGET + attempts // 100
    # The honest client (another address) gets its whole budget. Past it, a
    # check of its that Sluice answers too late under the flood is let in
    # unchecked by nginx, within nginx's rate per address: rare (once in
    # the runs seen), and bounded here at one a second of the flood.
    assert min(len(honest), BUDGET) <= honest.count(200) <= BUDGET + SECONDS, honest
    assert internal_errors == 0
