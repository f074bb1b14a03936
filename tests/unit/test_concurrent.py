"""Concurrency limits: at most N requests of a key in flight, each slot given
back by its response report or by the end of its lease (fake clock)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.at_once import run_at_once
from sidecar.config import ConfigError, parse_rules_text
from sidecar.engine import ALLOW, CLOSE, DENY
from sidecar.limiters.concurrent import ConcurrencyLimiter
from sidecar.replay import Replay, render_text
from sidecar.rules import compile_rules
from sidecar.state import Check
from sidecar.store.memory import MemoryStore

from .conftest import FakeClock, Harness

KEY = (("exports", ("ip",)), "192.0.2.1")


# -- the limiter --------------------------------------------------------------


def take(limiter: ConcurrencyLimiter, state, now: float, lease: str):
    hit = limiter.assess(state, now, lease)
    if not hit.over_limit:
        limiter.commit(state, hit)
    return hit


def test_n_are_admitted_and_the_next_is_refused_until_the_shortest_lease_ends() -> None:
    limiter = ConcurrencyLimiter(2, 30.0)
    state = limiter.new_state()
    assert not take(limiter, state, 100.0, "a").over_limit
    assert not take(limiter, state, 110.0, "b").over_limit
    refused = take(limiter, state, 115.0, "c")
    assert refused.over_limit and refused.retry_after == 15.0  # a's lease ends at 130
    assert set(state.held) == {"a", "b"}
    # At 130 a's lease has ended: c takes its place.
    assert not take(limiter, state, 130.0, "c").over_limit
    assert set(state.held) == {"b", "c"}


def test_a_release_makes_room_at_once() -> None:
    limiter = ConcurrencyLimiter(1, 60.0)
    state = limiter.new_state()
    take(limiter, state, 0.0, "a")
    assert take(limiter, state, 1.0, "b").over_limit
    assert limiter.release(state, "a") and not limiter.release(state, "a")
    assert not take(limiter, state, 1.0, "b").over_limit


def test_quota_is_the_free_slots_and_the_shortest_remaining_lease() -> None:
    limiter = ConcurrencyLimiter(3, 20.0)
    state = limiter.new_state()
    assert limiter.quota(state, 0.0, 3.0) == (3, 0.0, 20.0)
    take(limiter, state, 0.0, "a")
    take(limiter, state, 5.0, "b")
    assert limiter.quota(state, 10.0, 3.0) == (1, 10.0, 20.0)
    assert limiter.quota(state, 21.0, 3.0) == (2, 4.0, 20.0)  # a's lease has ended


def test_a_state_expires_with_its_longest_lease() -> None:
    limiter = ConcurrencyLimiter(3, 20.0)
    state = limiter.new_state()
    assert limiter.expires_at(state) == float("-inf")
    take(limiter, state, 0.0, "a")
    take(limiter, state, 5.0, "b")
    assert limiter.expires_at(state) == 25.0
    assert limiter.describe() == "3 concurrent, lease 20s"


# -- the memory store against a model ------------------------------------------


class Model:
    """The definition: a request is admitted while fewer than N leases are
    live; a lease is live until it is released or its time is up."""

    def __init__(self, limit: int, lease: float) -> None:
        self.limit, self.lease = limit, lease
        self.ends: dict[str, float] = {}

    def live(self, now: float) -> list[float]:
        return [end for end in self.ends.values() if end > now]

    def acquire(self, now: float, lease: str) -> tuple[bool, float]:
        live = self.live(now)
        if len(live) >= self.limit:
            return True, min(live) - now
        self.ends[lease] = now + self.lease
        return False, 0.0

    def release(self, lease: str, now: float) -> tuple[int, int]:
        """(live slots given back, slots given back whatever their lease)."""
        if lease not in self.ends:
            return 0, 0
        return int(self.ends.pop(lease) > now), 1


steps = st.lists(st.one_of(st.tuples(st.just("acquire"), st.floats(0, 3)),
                           st.tuples(st.just("release"), st.integers(0, 30)),
                           st.tuples(st.just("wait"), st.floats(0, 20))), max_size=80)


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(1, 5), lease=st.sampled_from([1.0, 2.5, 10.0]), steps=steps)
def test_the_memory_store_admits_exactly_as_the_model(limit: int, lease: float, steps) -> None:
    clock = FakeClock(0.0)
    store = MemoryStore(100, "n", clock)
    limiter = ConcurrencyLimiter(limit, lease)
    model = Model(limit, lease)
    issued = 0
    for action, value in steps:
        if action == "wait":
            clock.advance(value)
        elif action == "acquire":
            clock.advance(value)
            issued += 1
            check = Check.of("exports", KEY, limiter, float(limit), True, lease=f"r{issued}")
            evaluation = run_at_once(store.evaluate(clock.now, "192.0.2.1", [check], quotas=True))
            [hit] = evaluation.hits
            assert (hit.over_limit, hit.retry_after) == model.acquire(clock.now, f"r{issued}")
            assert evaluation.quotas == [(limit - len(model.live(clock.now)),
                                          min(model.live(clock.now), default=clock.now) - clock.now, lease)]
        else:
            # A release of any id issued so far (again, or one refused).
            lease_id = f"r{value % (issued + 1)}"
            released = run_at_once(store.release(lease_id, [KEY]))
            # A live slot is given back; one whose lease ended may be, if
            # the store has not dropped it yet; nothing else.
            live, taken = model.release(lease_id, clock.now)
            assert live <= released <= taken
        state = store.table.state(KEY)
        # At most N leases per key, whatever happens.
        assert state is None or len(state.held) <= limit


# -- through the engine ---------------------------------------------------------

EXPORTS = """
rules:
  - id: exports
    match: {path: {prefix: /export}}
    key: [ip]
    limit: {concurrent: 2, lease: 30s}
    action: block
    block: {status: 503}
"""


def test_the_n_plus_first_is_refused_with_limit_and_retry_after_of_the_shortest_lease() -> None:
    h = Harness(EXPORTS)
    h.decide_now(path="/export")
    h.clock.advance(10)
    h.decide_now(path="/export")
    h.clock.advance(5)
    refused = h.decide_now(path="/export")
    assert refused.outcome == DENY and refused.page is not None and refused.page.status == 503
    assert (refused.limit, refused.retry_after, refused.reset) == (2, 15, 15)


def test_the_report_of_a_response_gives_its_slot_back() -> None:
    h = Harness(EXPORTS)
    first, second = h.decide_now(path="/export"), h.decide_now(path="/export")
    assert first.pending is not None and second.pending is not None
    assert h.decide_now(path="/export").outcome == DENY
    # Any status: the request is over.
    assert h.engine.record_response_now(first.pending, 500, {}) == 0
    assert h.engine.metrics.released.value == 1
    assert h.decide_now(path="/export").outcome == ALLOW
    # A second report of the same response gives nothing back.
    h.engine.record_response_now(first.pending, 200, {})
    assert h.engine.metrics.released.value == 1
    assert h.decide_now(path="/export").outcome == DENY


def test_a_slot_whose_report_never_comes_ends_with_its_lease() -> None:
    h = Harness(EXPORTS)
    assert h.outcomes(3, path="/export") == [ALLOW, ALLOW, DENY]
    h.clock.advance(29.9)
    assert h.decide_now(path="/export").outcome == DENY
    h.clock.advance(0.1)
    assert h.outcomes(3, path="/export") == [ALLOW, ALLOW, DENY]


def test_a_request_refused_by_another_rule_takes_no_slot() -> None:
    h = Harness(EXPORTS + """
  - id: tight
    match: {path: {prefix: /export}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
""")
    # The first request reaches the window's threshold (allowed); the
    # second is refused by it, after the concurrency rule admitted it.
    first = h.decide_now(path="/export")
    assert h.decide_now(path="/export").outcome == DENY
    assert h.engine.pending.open(first.pending).slots == [("exports", ("192.0.2.1",))]
    assert len(h.engine.store.table.state((("exports", ("ip",)), "192.0.2.1")).held) == 1


def test_an_observe_rule_over_its_limit_lets_the_request_through_and_others_take_their_slots() -> None:
    h = Harness("""
rules:
  - id: watch
    key: [ip]
    limit: {concurrent: 1}
    action: log
  - id: exports
    key: [ip]
    limit: {concurrent: 2}
    action: block
""")
    first, second = h.decide_now(), h.decide_now()
    assert first.rule is None and second.outcome == ALLOW and second.rule is not None
    assert second.rule.id == "watch" and second.limit == 1
    # The observed request holds a slot of exports, not of watch.
    assert h.engine.pending.open(second.pending).slots == [("exports", ("192.0.2.1",))]
    assert h.decide_now().outcome == DENY


def test_slots_and_pending_counts_travel_in_one_token() -> None:
    h = Harness(EXPORTS + """
  - id: failures
    match: {path: {prefix: /export}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    count_on: {status: [500]}
    action: block
""")
    first = h.decide_now(path="/export")
    pending = h.engine.pending.open(first.pending)
    assert pending.counts == [("failures", 1.0, ("192.0.2.1",))] and len(pending.slots) == 1
    h.decide_now(path="/export")
    assert h.engine.record_response_now(first.pending, 500, {}) == 1
    assert h.engine.metrics.released.value == 1
    # The failure put its key in the penalty: refused whatever the slots say.
    assert h.decide_now(path="/export").outcome == DENY


def test_every_request_has_its_own_lease_id() -> None:
    h = Harness(EXPORTS)
    leases = set()
    for _ in range(50):
        decision = h.decide_now(path="/export")
        leases.add(h.engine.pending.open(decision.pending).lease)
        h.engine.record_response_now(decision.pending, 200, {})
    assert len(leases) == 50 and all(len(lease) == 18 for lease in leases)


def test_draft_headers_give_the_free_slots_and_the_lease_as_window() -> None:
    h = Harness("headers: draft\n" + EXPORTS)
    first = h.decide_now(path="/export")
    h.clock.advance(4)
    second = h.decide_now(path="/export")
    assert first.quota == ('"exports";q=2;w=30', '"exports";r=1;t=30')
    assert second.quota == ('"exports";q=2;w=30', '"exports";r=0;t=26')


def test_a_reload_that_removes_the_rule_leaves_its_slots_to_their_leases() -> None:
    h = Harness(EXPORTS)
    decision = h.decide_now(path="/export")
    h.engine.reload(compile_rules(parse_rules_text("rules: []\n", "r.yaml", Path("."))))
    h.engine.record_response_now(decision.pending, 200, {})
    assert h.engine.metrics.released.value == 0 and h.engine.metrics.reports.value == 1


def test_a_reload_that_makes_the_key_a_window_counts_it_afresh() -> None:
    h = Harness(EXPORTS)
    decision = h.decide_now(path="/export")
    h.engine.reload(compile_rules(parse_rules_text(EXPORTS.replace("{concurrent: 2, lease: 30s}",
                                                                   "{requests: 2, per: 1h}"),
                                                   "r.yaml", Path("."))))
    h.engine.record_response_now(decision.pending, 200, {})  # nothing to give back
    assert h.outcomes(3, path="/export") == [ALLOW, ALLOW, DENY]


def test_an_overlong_key_leaves_its_slot_to_its_lease() -> None:
    h = Harness("""
rules:
  - id: exports
    key: ["header:x-api-key"]
    limit: {concurrent: 1, lease: 5s}
    action: block
""")
    key = "k" * 5000
    decision = h.decide_now(headers={"x-api-key": key})
    assert decision.outcome == ALLOW and decision.pending is None
    assert h.engine.metrics.unreportable.value == 1
    assert h.decide_now(headers={"x-api-key": key}).outcome == DENY
    h.clock.advance(5)
    assert h.decide_now(headers={"x-api-key": key}).outcome == ALLOW


def test_block_close_closes_the_request_over_the_limit() -> None:
    h = Harness(EXPORTS.replace("block: {status: 503}", "block: {close: true}"))
    assert h.outcomes(3, path="/export") == [ALLOW, ALLOW, CLOSE]


# -- the rules file ----------------------------------------------------------------


def issues(text: str) -> set[tuple[int, str, str]]:
    with pytest.raises(ConfigError) as info:
        compile_rules(parse_rules_text(text, "rules.yaml", Path(".")))
    return {(issue.line, issue.field, issue.message) for issue in info.value.issues}


def rule(limit: str, more: str = "", action: str = "block") -> str:
    return f"rules:\n  - id: exports\n    key: [ip]\n    limit: {limit}\n    action: {action}\n{more}"


def test_the_lease_defaults_to_a_minute_and_is_a_duration() -> None:
    ruleset = compile_rules(parse_rules_text(rule("{concurrent: 3}"), "r.yaml", Path(".")))
    limiter = ruleset.rules[0].limiter
    assert isinstance(limiter, ConcurrencyLimiter) and (limiter.limit, limiter.lease) == (3, 60.0)
    assert ruleset.rules[0].threshold == 3 and ruleset.rules[0].reset is None and ruleset.leases
    ruleset = compile_rules(parse_rules_text(rule("{concurrent: 1, lease: 2m}"), "r.yaml", Path(".")))
    assert ruleset.rules[0].limiter.lease == 120.0


@pytest.mark.parametrize("limit, field, message", [
    ("{concurrent: 0}", "rules[0].limit.concurrent", "should be greater than or equal to 1, got 0"),
    ("{concurrent: two}", "rules[0].limit.concurrent", "should be a valid integer, got 'two'"),
    ("{concurrent: 2, lease: 500ms}", "rules[0].limit.lease",
     "a lease lasts from 1s to 10m (a response report is accepted for 10 minutes)"),
    ("{concurrent: 2, lease: 1h}", "rules[0].limit.lease",
     "a lease lasts from 1s to 10m (a response report is accepted for 10 minutes)"),
    ("{concurrent: 2, lease: soon}", "rules[0].limit.lease", "expected a duration like '10s', got 'soon'"),
    ("{concurrent: 2, per: 1s}", "rules[0].limit.per", "unknown field"),
])
def test_a_bad_concurrent_limit_is_an_error_at_its_field(limit: str, field: str, message: str) -> None:
    assert issues(rule(limit)) == {(4, field, message)}


@pytest.mark.parametrize("more, line, field, fragment", [
    ("    count_on: {status: [500]}\n", 6, "rules[0].count_on", "counts requests in flight"),
    ("    penalty: 1m\n", 6, "rules[0].penalty", "has no penalty"),
])
def test_settings_a_concurrent_limit_does_not_take_are_errors_at_their_line(more: str, line: int, field: str,
                                                                           fragment: str) -> None:
    [(at, where, message)] = issues(rule("{concurrent: 2}", more))
    assert (at, where) == (line, field) and fragment in message


@pytest.mark.parametrize("action, more, fragment", [
    ("ban", "", "bans no one"),
    ("challenge", "", "would lift a concurrent limit"),
])
def test_ban_and_challenge_are_refused_at_the_action(action: str, more: str, fragment: str) -> None:
    [(line, field, message)] = issues(rule("{concurrent: 2}", more, action=action))
    assert (line, field) == (5, "rules[0].action") and fragment in message


def test_log_and_block_with_a_page_are_accepted() -> None:
    for text in (rule("{concurrent: 2}", action="log"),
                 rule("{concurrent: 2}", "    block: {status: 503, body: busy}\n")):
        assert compile_rules(parse_rules_text(text, "r.yaml", Path("."))).rules


def test_a_concurrent_rule_cannot_be_scaled_by_overrides() -> None:
    text = rule("{concurrent: 2}") + "overrides:\n  - cidrs: [203.0.113.0/24]\n    rules: [exports]\n    multiply: 2\n"
    [(line, field, message)] = issues(text)
    assert (line, field) == (4, "rules[0].limit") and "concurrent rule cannot be listed in overrides" in message


def test_every_problem_of_a_concurrent_rule_is_reported_at_once() -> None:
    text = rule("{concurrent: 0, lease: 1h}", "    penalty: 1m\n    count_on: {status: [500]}\n", action="ban")
    assert {field for _, field, _ in issues(text)} == {
        "rules[0].limit.concurrent", "rules[0].limit.lease", "rules[0].penalty", "rules[0].count_on",
        "rules[0].action"}


# -- sluice replay ---------------------------------------------------------------------

def replay(lines: list[dict]) -> Replay:
    from sidecar.accesslog import parse_line

    replay = Replay(compile_rules(parse_rules_text(EXPORTS, "r.yaml", Path("."))))
    for entry in sorted((parse_line(json.dumps(line)) for line in lines), key=lambda entry: entry.time):
        replay.feed(entry)
    replay.report_until(float("inf"))
    return replay


def export(ended: float, took: float | None, ip: str = "192.0.2.1") -> dict:
    line = {"msec": f"{ended:.3f}", "remote_addr": ip, "request": "GET /export HTTP/1.1", "status": "200"}
    if took is not None:
        line["request_time"] = f"{took:.3f}"
    return line


def test_replay_runs_each_request_from_its_start_to_its_logged_end() -> None:
    # Three exports overlap (started at 1000, 1001, 1002, each ten seconds
    # long): the third is refused. The fourth starts after the first ended.
    result = replay([export(1010, 10), export(1011, 10), export(1012, 10), export(1013, 2)])
    stats = result.rules["exports"]
    assert (stats.allowed, stats.blocked) == (3, 1)
    # The refused one counts towards the peak: it was in flight all the same.
    assert max(key.peak for key in stats.keys.values()) == 3


def test_replay_without_request_times_holds_no_slot() -> None:
    result = replay([export(1000 + i * 0.001, None) for i in range(5)])
    stats = result.rules["exports"]
    assert (stats.allowed, stats.blocked) == (5, 0)
    assert max(key.peak for key in stats.keys.values()) == 1


def test_replay_ends_a_request_longer_than_its_lease_with_the_lease() -> None:
    # Both long ones started at 1000 and 1001, their leases ended at 1030
    # and 1031, long before their responses: at 1020 a third is refused,
    # at 1045 it fits.
    other = "192.0.2.2"
    result = replay([export(1100, 100), export(1101, 100), export(1025, 5), export(1050, 5),
                     # Another key's two long requests, 40 s apart: in flight
                     # for their leases, they never overlap.
                     export(1100, 100, other), export(1140, 100, other)])
    stats = result.rules["exports"]
    assert (stats.allowed, stats.blocked) == (5, 1)
    peaks = {key[1]: key_stats.peak for key, key_stats in stats.keys.items()}
    assert peaks == {"192.0.2.1": 3, other: 1}
    text = render_text(result.report(_no_logs()))
    assert "peak requests in flight at once per key" in text and "2 concurrent, lease 30s" in text


def _no_logs():
    from sidecar.accesslog import AccessLogs

    return AccessLogs([])


@pytest.mark.parametrize("written", ["-1", "nan", "inf", "soon"])
def test_an_unreadable_request_time_skips_the_line(written: str) -> None:
    from sidecar.accesslog import UnparsableLine, parse_line

    line = dict(export(1000, None), request_time=written)
    with pytest.raises(UnparsableLine, match="request_time"):
        parse_line(json.dumps(line))


# -- the example ---------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "concurrent-exports.yaml"


def test_sluice_check_accepts_the_example() -> None:
    result = subprocess.run([sys.executable, "-m", "sidecar", "check", str(EXAMPLE)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == f"{EXAMPLE}: OK, 2 rules\n"


def test_the_example_runs_two_exports_per_api_key_and_observes_the_rest() -> None:
    h = Harness(EXAMPLE.read_text(encoding="utf-8"))
    exports = [h.decide_now(path="/api/export", headers={"x-api-key": "k1"}) for _ in range(3)]
    assert [d.outcome for d in exports] == [ALLOW, ALLOW, DENY]
    assert exports[2].page is not None and exports[2].page.status == 503 and exports[2].limit == 2
    # Another key has slots of its own; an export ends and makes room.
    assert h.decide_now(path="/api/export", headers={"x-api-key": "k2"}).outcome == ALLOW
    h.engine.record_response_now(exports[0].pending, 200, {})
    assert h.decide_now(path="/api/export", headers={"x-api-key": "k1"}).outcome == ALLOW
    # The API at large is only observed: over 20 in flight is let through.
    api = [h.decide_now(path="/api/items") for _ in range(30)]
    assert all(d.outcome == ALLOW for d in api)
    assert [d.rule.id if d.rule else None for d in api][16:18] == [None, "api-in-flight"]


yaml_scalars = st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                         st.booleans(), st.none(), st.text(max_size=12),
                         st.sampled_from(["1s", "10m", "601s", "0.5s", "1h", "2m", "1e3", "~", "[]", "{}"]))


@settings(max_examples=300, deadline=None)
@given(concurrent=yaml_scalars, lease=st.one_of(st.none(), yaml_scalars))
def test_any_concurrent_limit_loads_within_its_bounds_or_is_an_error_at_the_limit(concurrent, lease) -> None:
    fields = {"concurrent": concurrent} if lease is None else {"concurrent": concurrent, "lease": lease}
    text = rule(json.dumps(fields, allow_nan=True).replace("NaN", ".nan").replace("Infinity", ".inf"))
    try:
        ruleset = compile_rules(parse_rules_text(text, "rules.yaml", Path(".")))
    except ConfigError as error:
        assert error.issues and all(issue.line == 4 and issue.field.startswith("rules[0].limit")
                                    for issue in error.issues)
        return
    limiter = ruleset.rules[0].limiter
    assert isinstance(limiter, ConcurrencyLimiter)
    assert limiter.limit >= 1 and 1 <= limiter.lease <= 600
