"""A check that reaches Sluice too late is answered at once by the overload
policy (sidecar.overload): refused when its client is known over a limit,
else as its rules' ``overload:`` says; a stamp alone never makes a check late."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.actions import BlockPage, PageTemplate
from sidecar.at_once import run_at_once
from sidecar.config import ConfigError
from sidecar.engine import ALLOW, CLOSE, DENY
from sidecar.frontdoors.nginx import MAX_INLINE_PAGE, PAGE_HEADER, PAGE_STATUS_HEADER, answer_nginx, inline_page
from sidecar.overload import STORED_KEY_FIELDS, TICK_SECONDS, LoopWatch, RefusalMemory, stored_key
from sidecar.request import CheckRequest, parse_sent

from .conftest import Harness, ruleset_from

RULES = """
rules:
  - id: per-ip
    key: [ip]
    limit: {requests: 3, per: 60s}
    action: block
"""
BAN_RULES = """
rules:
  - id: bans
    key: [ip]
    limit: {requests: 1, per: 60s}
    action: ban
    ban: {duration: 1h}
"""
NOW = 1_800_000_000.0


class Overloaded(Harness):
    """An engine whose wall clock is NOW and whose serving loop is
    ``behind``, over a store that is awaited as a shared one is (a late
    check over this node's memory is decided in full)."""

    def __init__(self, text: str = RULES, behind: float = 1.0, awaited: bool = True) -> None:
        super().__init__(text)
        self.engine.store.answers_at_once = not awaited  # type: ignore[misc]
        self.behind = behind
        self.engine.wall_clock = lambda: NOW
        self.engine.loop_behind = lambda: self.behind

    def check(self, late: float = 0.0, ip: str = "192.0.2.1", path: str = "/"):
        client = self.engine.resolve_client(ip, None)
        request = CheckRequest("GET", "example.com", path, {}, client, "req-1", sent=NOW - late)
        return self.engine.decide_now(request)


def test_a_late_check_of_a_client_over_its_limit_is_refused_as_before_without_the_store():
    h = Overloaded()
    assert [h.check().outcome for _ in range(4)] == [ALLOW, ALLOW, ALLOW, DENY]
    evaluations = h.engine.metrics.checks.value
    h.clock.advance(10)
    decision = h.check(late=2.0)
    assert decision.outcome == DENY and decision.rule.id == "per-ip"
    # Retry-After still counts down to when the key may send again.
    assert decision.retry_after == 50
    assert h.engine.metrics.overload_decisions == {("per-ip", "refused"): 1}
    assert h.engine.metrics.checks.value == evaluations + 1


def test_a_late_check_of_a_client_within_its_limits_is_let_in_and_counted_on_this_node_only():
    h = Overloaded()
    assert h.check(late=2.0).outcome == ALLOW
    assert h.check(late=2.0).outcome == ALLOW
    assert h.engine.metrics.overload_decisions == {("per-ip", "open"): 2}
    # Not counted in the store: the client still has its whole budget there.
    assert [h.check().outcome for _ in range(4)] == [ALLOW, ALLOW, ALLOW, DENY]


def test_late_checks_of_a_client_no_refusal_is_known_for_get_one_budget_on_this_node_then_are_refused():
    """A flood's first checks, all late before the shared store's first
    refusal came back: counted on this node, not let in without end."""
    h = Overloaded()
    outcomes = [h.check(late=2.0).outcome for _ in range(50)]
    assert outcomes == [ALLOW] * 3 + [DENY] * 47
    assert h.engine.metrics.overload_decisions == {("per-ip", "open"): 3, ("per-ip", "refused_locally"): 1,
                                                   ("per-ip", "refused"): 46}
    assert h.engine.metrics.over_limit_of("per-ip") == {"block": 47}
    refused = h.check(late=2.0)
    assert refused.rule.id == "per-ip" and refused.retry_after == 60
    # The late count is this node's own: the store still has the whole budget.
    assert [h.check().outcome for _ in range(4)] == [ALLOW, ALLOW, ALLOW, DENY]
    # It ends with the rule's window, like any count.
    h.clock.advance(61)
    assert h.check(late=2.0).outcome == ALLOW


def test_late_checks_count_on_from_what_the_shared_store_admitted_on_this_node():
    """The checks the store admitted are this node's share of the count: a
    client that spent its budget on time gets no second one when late."""
    h = Overloaded()
    assert [h.check().outcome for _ in range(2)] == [ALLOW, ALLOW]
    assert [h.check(late=2.0).outcome for _ in range(3)] == [ALLOW, DENY, DENY]
    assert h.engine.metrics.overload_decisions == {("per-ip", "open"): 1, ("per-ip", "refused_locally"): 1,
                                                   ("per-ip", "refused"): 1}


def test_a_concurrency_rules_slots_admitted_by_the_shared_store_are_not_held_by_the_late_count():
    """A slot is given back to the shared store when its response is
    reported, never to this node's count: it must not fill that count."""
    h = Overloaded("""
rules:
  - id: parallel
    key: [ip]
    limit: {concurrent: 2}
    action: block
""")
    for _ in range(5):
        decision = h.check()
        assert decision.outcome == ALLOW
        assert h.engine.record_response_now(decision.pending, 200, {}) >= 0  # the slot given back
    assert h.check(late=2.0).outcome == ALLOW


def test_a_ban_rule_over_its_limit_by_the_late_count_refuses_without_banning():
    """A ban is the shared store's to issue: a node's count of late checks
    closes the request, and the client is not banned anywhere."""
    h = Overloaded(BAN_RULES)
    assert [h.check(late=5.0).outcome for _ in range(3)] == [ALLOW, CLOSE, CLOSE]
    assert run_at_once(h.engine.active_bans()) == []
    assert h.check().outcome == ALLOW  # on time: the store's own count, and no ban


def test_an_admin_reset_forgets_the_late_count():
    h = Overloaded()
    assert [h.check(late=2.0).outcome for _ in range(4)] == [ALLOW, ALLOW, ALLOW, DENY]
    h.engine.forget_refusals()
    assert h.check(late=2.0).outcome == ALLOW


def test_an_overload_closed_rule_refuses_a_late_check_with_503_while_an_open_one_lets_it_in():
    h = Overloaded("""
rules:
  - id: login
    match: {path: {prefix: /login}}
    key: [ip]
    limit: {requests: 5, per: 60s}
    action: block
    overload: closed
  - id: browse
    key: [ip]
    limit: {requests: 100, per: 60s}
    action: block
""")
    shut = h.check(late=1.0, path="/login")
    assert shut.outcome == DENY and shut.page.status == 503 and shut.retry_after == 1
    assert h.check(late=1.0, path="/shop").outcome == ALLOW
    assert h.engine.metrics.overload_decisions == {("login", "closed"): 1, ("browse", "open"): 1}


def test_a_late_check_of_a_banned_client_is_closed():
    h = Overloaded(BAN_RULES)
    assert [h.check().outcome for _ in range(2)] == [ALLOW, CLOSE]
    h.clock.advance(600)
    assert h.check(late=5.0).outcome == CLOSE
    assert h.engine.metrics.overload_decisions == {("ban", "refused"): 1}
    h.clock.advance(3600)
    assert h.check(late=5.0).outcome == ALLOW  # the ban ended: forgotten


def test_an_old_stamp_is_not_trusted_while_the_loop_is_on_time():
    """A proxy that does not set X-Sluice-Sent passes the client's on: a
    forged stamp must not buy an uncounted request."""
    h = Overloaded(behind=0.0)
    assert [h.check(late=30.0).outcome for _ in range(4)] == [ALLOW, ALLOW, ALLOW, DENY]
    assert h.engine.metrics.overload_decisions == {}


def test_a_late_check_over_this_nodes_memory_is_decided_in_full():
    h = Overloaded(awaited=False)
    assert [h.check(late=2.0).outcome for _ in range(4)] == [ALLOW, ALLOW, ALLOW, DENY]
    assert h.engine.metrics.overload_decisions == {}


def test_a_check_on_time_is_decided_in_full_while_the_loop_is_behind():
    h = Overloaded(behind=5.0)
    assert [h.check(late=0.1).outcome for _ in range(4)] == [ALLOW, ALLOW, ALLOW, DENY]
    assert h.engine.metrics.overload_decisions == {}


def test_overload_after_comes_from_the_rules_file_and_is_checked():
    assert ruleset_from("overload: {after: 2s}\nrules: []").overload_after == 2.0
    with pytest.raises(ConfigError, match="overload.after"):
        ruleset_from("overload: {after: 5ms}\nrules: []")
    with pytest.raises(ConfigError, match="overload"):
        ruleset_from(RULES + "    overload: sometimes\n")


def test_the_refusal_memory_forgets_ended_refusals_and_the_oldest_beyond_its_capacity():
    memory = RefusalMemory(2)
    memory.remember("a", 10.0, "A")
    memory.remember("b", 10.0, "B")
    assert memory.recall("a", 5.0) == (10.0, "A")
    memory.remember("c", 10.0, "C")
    assert memory.recall("a", 5.0) is None and len(memory) == 2
    assert memory.recall("b", 10.0) is None  # ended at 10


def test_the_loop_watch_says_how_late_its_timer_is():
    now = [100.0]

    class Loop:
        def call_later(self, delay, callback):
            self.callback = callback

        def is_closed(self):
            return False

    watch, loop = LoopWatch(lambda: now[0]), Loop()
    assert watch.behind() == 0.0  # not watching: never behind
    watch.watch(loop)
    now[0] += TICK_SECONDS
    assert watch.behind() == 0.0
    now[0] += 0.5
    assert watch.behind() == pytest.approx(0.5)
    loop.callback()
    assert watch.behind() == 0.0


@given(st.text(max_size=40))
def test_any_stamp_text_is_a_time_or_none(text):
    sent = parse_sent(text)
    assert sent == 0.0 or (sent > 0 and sent == float(text))


def test_an_nginx_refusal_carries_its_page_so_nginx_needs_no_second_call():
    h = Harness(RULES)
    for _ in range(3):
        h.decide_now()
    request = h.request()
    status, headers, body = answer_nginx(request, h.engine.decide_now(request))
    fields = dict(headers)
    assert status == 403 and body == b""
    assert fields[PAGE_STATUS_HEADER] == "429" and fields["Retry-After"] == "60"
    page = fields[PAGE_HEADER]
    assert "429 Too Many Requests" in page and "req-1" in page and "\n" not in page


@pytest.mark.parametrize("text", ["<script>go()</script>", "a\x01b", "<PRE>\n kept\n</PRE>"])
def test_a_page_whose_line_breaks_matter_is_fetched_instead(text):
    assert PageTemplate(text).one_line() is None


def test_a_page_too_long_for_a_header_field_is_fetched_instead():
    page = BlockPage(429, PageTemplate("x" * MAX_INLINE_PAGE + "${{http_host}}"), False)
    client = Harness(RULES).engine.resolve_client("192.0.2.1", None)
    assert inline_page(page, CheckRequest("GET", "", "/", {}, client, "r")) is not None
    assert inline_page(page, CheckRequest("GET", "h", "/", {}, client, "r")) is None


@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="\x00\x01"), max_size=30), max_size=6))
def test_a_page_on_one_line_renders_as_the_page_with_line_breaks_as_spaces(pieces):
    text = "${{request_id}}".join(pieces)
    one_line = PageTemplate(text).one_line()
    if one_line is not None:
        rendered = one_line.render("192.0.2.1", "h", "req-1")
        expected = PageTemplate(text).render("192.0.2.1", "h", "req-1")
        assert rendered == expected.replace(b"\r\n", b" ").replace(b"\n", b" ").replace(b"\r", b" ")


def test_a_stored_refusal_is_found_by_its_door_method_and_the_fields_named() -> None:
    headers = {name: name.upper() for name in STORED_KEY_FIELDS} | {"x-request-id": "r", "cookie": "a=b"}
    assert stored_key("envoy", "HEAD", headers) == ("envoy", "HEAD", *(name.upper() for name in STORED_KEY_FIELDS))
    assert stored_key("nginx", "GET", {}) == ("nginx", "GET", None, None, None, None, None)
