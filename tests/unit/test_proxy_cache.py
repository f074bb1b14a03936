"""nginx answers a refusal that holds for every request of a client from its
cache, for as long as Sluice says (``X-Accel-Expires: @N``, the last Unix
second): only such refusals say so, never past their end, and two seconds
at most."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from sidecar.engine import ALLOW, CLOSE, DENY
from sidecar.frontdoors.nginx import PROXY_EXPIRES_HEADER, answer_nginx
from sidecar.overload import PROXY_SECONDS, proxy_expires
from sidecar.request import CheckRequest

from .conftest import Harness

RULES = """
rules:
  - id: per-address
    key: [ip]
    limit: {requests: 3, per: 10s}
    action: block
  - id: api
    match: {path: {prefix: /api/}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: block
"""
BANS = """
rules:
  - id: bans
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: ban
    ban: {duration: BAN}
"""
EPOCH = 1_800_000_000.25


class Node(Harness):
    """An engine whose wall clock moves with its fake clock; ``shared``
    marks its store as awaited, as Redis is."""

    def __init__(self, text: str = RULES, shared: bool = False) -> None:
        super().__init__(text)
        start = self.clock()
        self.engine.wall_clock = lambda: EPOCH + self.clock() - start
        self.engine.store.answers_at_once = not shared  # type: ignore[misc]

    def ask(self, ip: str = "192.0.2.1", path: str = "/") -> tuple[str, str | None]:
        """The decision's outcome and the X-Accel-Expires of nginx's answer."""
        request: CheckRequest = self.request(ip=ip, path=path)
        decision = self.engine.decide_now(request)
        _, headers, _ = answer_nginx(request, decision)
        return decision.outcome, dict(headers).get(PROXY_EXPIRES_HEADER)

    def wall(self) -> float:
        return self.engine.wall_clock()


@given(now=st.floats(1e9, 2e9), hold=st.floats(0, 10))
def test_the_second_given_to_nginx_ends_by_the_end_of_the_refusal_and_is_the_last_such(now: float, hold: float) -> None:
    last = proxy_expires(now + hold, now)
    if last:
        # nginx serves it through the end of second `last`, a later one than now's.
        assert math.floor(now) < last and last + 1 <= now + hold
        assert last + 2 > now + hold  # no later second would do
    else:
        assert math.floor(now + hold) - 1 <= math.floor(now)


def test_an_address_wide_refusal_is_cached_by_nginx_for_two_seconds_at_most_and_nothing_else_is() -> None:
    node = Node()
    assert [node.ask() for _ in range(3)] == [(ALLOW, None)] * 3
    outcome, expires = node.ask()
    assert outcome == DENY and expires == f"@{math.floor(node.wall() + PROXY_SECONDS) - 1}"
    # Another client's refusal by the rule of one path holds for that path only.
    assert node.ask(ip="192.0.2.7", path="/api/a") == (ALLOW, None)
    assert node.ask(ip="192.0.2.7", path="/api/a") == (DENY, None)


def test_nginx_holds_a_refusal_through_whole_seconds_that_end_by_its_end() -> None:
    node = Node(RULES.replace("per: 10s}", "per: 10s, window: fixed}", 1))
    for _ in range(3):
        node.ask()
    window_ends = node.wall() + 10
    node.clock.advance(8)  # two seconds left: nginx holds it through the next second, and no longer
    outcome, expires = node.ask()
    assert outcome == DENY and expires == f"@{math.floor(window_ends) - 1}"
    assert int(expires[1:]) + 1 <= window_ends
    node.clock.advance(0.8)  # 1.2 s left, ending within the next second: not cached
    assert node.ask() == (DENY, None)
    node.clock.advance(1.2)
    assert node.ask() == (ALLOW, None)


def test_over_a_shared_store_nginx_holds_a_refusal_as_long_and_a_ban_not_at_all() -> None:
    node = Node(shared=True)
    for _ in range(3):
        node.ask()
    outcome, expires = node.ask()
    assert outcome == DENY and expires == f"@{math.floor(node.wall() + PROXY_SECONDS) - 1}"
    banned = Node(BANS.replace("BAN", "1h"), shared=True)
    assert [outcome for outcome, _ in (banned.ask(), banned.ask(), banned.ask())] == [ALLOW, CLOSE, CLOSE]
    assert banned.ask()[1] is None


def test_a_ban_is_cached_until_it_ends_and_two_seconds_at_most() -> None:
    long = Node(BANS.replace("BAN", "1h"))
    assert long.ask() == (ALLOW, None)
    outcome, expires = long.ask()
    assert outcome == CLOSE and expires == f"@{math.floor(long.wall() + PROXY_SECONDS) - 1}"
    short = Node(BANS.replace("BAN", "3s"))
    short.ask()
    banned_at = short.wall()
    short.ask()
    short.clock.advance(1.5)
    outcome, expires = short.ask()
    assert outcome == CLOSE and expires is not None and int(expires[1:]) + 1 <= banned_at + 3
