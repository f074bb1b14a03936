"""Leaky bucket (nginx limit_req, exactly) and token bucket."""

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.app import SluiceApp
from sidecar.config.values import Rate
from sidecar.engine import ALLOW, DENY
from sidecar.limiters.leaky import LeakyBucket
from sidecar.limiters.token import TokenBucket

from .conftest import Harness
from .test_app import call

# --------------------------------------------------------------------------
# A reference model of ngx_http_limit_req_module's arithmetic, transcribed
# from its C logic (lookup for each zone, the last one accounted at once,
# the others accounted afterwards; rejection by any zone charges none).
# --------------------------------------------------------------------------

NGX_MAX_INT_T_VALUE = 2**63 - 1


class NginxZone:
    def __init__(self, count: int, per_minute: bool, burst: int, delay: int | None) -> None:
        scale = 60 if per_minute else 1
        self.rate = count * 1000 // scale
        self.burst = burst * 1000
        # nodelay sets delay = NGX_MAX_INT_T_VALUE / 1000, later * 1000
        self.delay = (NGX_MAX_INT_T_VALUE // 1000) * 1000 if delay is None else delay * 1000
        self.nodes: dict[str, list[int]] = {}  # key -> [excess, last]

    def excess_at(self, node, now):
        """(ms since the node's last request, the excess this request makes)."""
        ms = now - node[1]
        if ms < -60000:
            ms = 1
        elif ms < 0:
            ms = 0
        excess = node[0] - self.rate * ms // 1000 + 1000
        return ms, max(excess, 0)

    def lookup(self, key, now, account):
        node = self.nodes.get(key)
        if node is not None:
            ms, excess = self.excess_at(node, now)
            if excess > self.burst:
                return "BUSY", excess
            if account:
                node[0] = excess
                if ms:
                    node[1] = now
                return "OK", excess
            return "AGAIN", excess
        if account:
            self.nodes[key] = [0, now]
            return "OK", 0
        self.pending_new = key
        return "AGAIN", 0

    def account(self, key, now):
        node = self.nodes.setdefault(key, [0, 0])  # a node created by lookup: last = 0
        ms, excess = self.excess_at(node, now)
        if ms:
            node[1] = now
        node[0] = excess
        return excess


def nginx_handle(zones: list[NginxZone], key: str, now: int):
    """('reject', None) or ('pass', delay_ms) as nginx would decide."""
    excess = 0
    for index, zone in enumerate(zones):
        rc, excess = zone.lookup(key, now, index == len(zones) - 1)
        if rc == "BUSY":
            return "reject", None
    last = zones[-1]
    max_delay = 0 if excess <= last.delay else (excess - last.delay) * 1000 // last.rate
    for zone in reversed(zones[:-1]):
        zone_excess = zone.account(key, now)
        if zone_excess > zone.delay:
            max_delay = max(max_delay, (zone_excess - zone.delay) * 1000 // zone.rate)
    return "pass", max_delay


# --------------------------------------------------------------------------


def leaky_rules(zones) -> str:
    lines = ["rules:"]
    for index, (count, per_minute, burst, delay) in enumerate(zones):
        rate = f"{count}r/{'m' if per_minute else 's'}"
        how = "nodelay: true" if delay is None else f"delay: {delay}"
        lines.append(f"  - id: zone{index}\n    key: [ip]\n"
                     f"    limit: {{rate: {rate}, burst: {burst}, {how}}}\n    action: block")
    return "\n".join(lines) + "\n"


def sluice_handle(h: Harness, now_ms: int):
    h.clock.now = now_ms / 1000
    decision = h.decide_now()
    if decision.outcome == DENY:
        return "reject", None
    return "pass", round(decision.delay * 1000)


zone_strategy = st.tuples(
    st.integers(min_value=1, max_value=50),  # count
    st.booleans(),  # per minute
    st.integers(min_value=0, max_value=8),  # burst
    st.one_of(st.none(), st.integers(min_value=0, max_value=8)),  # None = nodelay
)


@settings(max_examples=300, deadline=None)
@given(zones=st.lists(zone_strategy, min_size=1, max_size=3),
       gaps=st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=60))
def test_leaky_bucket_matches_nginx_decision_for_decision(zones, gaps):
    reference = [NginxZone(*zone) for zone in zones]
    h = Harness(leaky_rules(zones))
    now = 1_000_000_000
    for gap in gaps:
        now += gap
        assert sluice_handle(h, now) == nginx_handle(reference, "client", now), now


def kept_until(last: int, excess: int, rate: int, penalty_until: float) -> float:
    """A leaky key's expiry on Python's integers: nginx's drain of the excess,
    and at least 60 s after the last request, or the penalty's end."""
    return max(max(last + excess * 1000 // rate, last + 60_000) / 1000, penalty_until)


# Either side of the bounds under which the compiled core works a leaky
# state's expiry on C integers (a time under 2 ** 50 ms, an excess under
# 2 ** 40), and where a double stops holding every integer (2 ** 53).
EDGES = st.sampled_from([0, 1, 999, 2 ** 40 - 1, 2 ** 40, 2 ** 50 - 1, 2 ** 50, 2 ** 53 + 1, 2 ** 60, 2 ** 70])


@settings(max_examples=500, deadline=None)
@given(last=st.one_of(st.integers(-2 ** 62, 2 ** 62), EDGES, EDGES.map(lambda edge: -edge)),
       excess=st.one_of(st.integers(0, 2 ** 62), st.integers(2 ** 39, 2 ** 54), EDGES),
       count=st.one_of(st.integers(1, 100), st.integers(1, 10 ** 6), EDGES.filter(lambda edge: edge > 0)),
       per_minute=st.booleans(),
       penalty_until=st.one_of(st.just(float("-inf")), st.floats(-1e17, 1e17)))
def test_a_leaky_key_expires_as_python_integers_say_whatever_its_size(last, excess, count, per_minute,
                                                                      penalty_until):
    bucket = LeakyBucket(Rate(count, 60 if per_minute else 1), 0, None, None)
    state = bucket.new_state()
    state.excess, state.last, state.penalty_until = excess, last, penalty_until
    assert bucket.expires_at(state) == kept_until(last, excess, bucket.rate, penalty_until)


@settings(max_examples=500, deadline=None)
@given(last=st.one_of(st.integers(-2 ** 49, 2 ** 49), st.integers(-2 ** 62, 2 ** 62), EDGES,
                     EDGES.map(lambda edge: -edge)),
       elapsed=st.one_of(st.integers(-10 ** 6, 10 ** 6), st.integers(0, 2 ** 49), st.integers(0, 2 ** 62), EDGES),
       excess=st.one_of(st.integers(0, 10 ** 7), st.integers(0, 2 ** 62), EDGES),
       count=st.one_of(st.integers(1, 100), st.integers(1, 10 ** 6), EDGES.filter(lambda edge: edge > 0)),
       per_minute=st.booleans(),
       amount=st.one_of(st.integers(0, 5), st.integers(2 ** 19, 2 ** 21), st.integers(2 ** 40, 2 ** 52)))
def test_a_leaky_keys_excess_drains_as_python_integers_say_whatever_its_size(last, elapsed, excess, count, per_minute,
                                                                             amount):
    # nginx's excess: the drained part at the rate, then the new requests,
    # never below 0 (the compiled core's C path caps the time drained).
    bucket = LeakyBucket(Rate(count, 60 if per_minute else 1), 0, None, None)
    state = bucket.new_state()
    state.excess, state.last = excess, last
    expected = max(0, excess - bucket.rate * max(0, elapsed) // 1000 + 1000 * amount)
    assert bucket._excess(state, last + elapsed, amount) == expected


def test_a_leaky_key_never_seen_expires_with_its_penalty():
    bucket = LeakyBucket(Rate(10, 1), 5, None, None)
    state = bucket.new_state()
    state.penalty_until = 1234.5
    assert bucket.expires_at(state) == 1234.5


def test_ten_per_minute_is_stored_as_166_thousandths_per_second():
    h = Harness(leaky_rules([(10, True, 0, None)]))
    assert h.engine.ruleset.rules[0].limiter.rate == 166


def test_burst_with_delay_holds_the_excess_at_its_slot():
    # 10 r/s, burst 5, delay 2: the first request free, two more at once,
    # then each one waits 100 ms more than the last; the 7th is rejected.
    h = Harness(leaky_rules([(10, False, 5, 2)]))
    results = [sluice_handle(h, 5_000_000) for _ in range(7)]
    assert results == [("pass", 0), ("pass", 0), ("pass", 0), ("pass", 100), ("pass", 200),
                       ("pass", 300), ("reject", None)]


def test_nodelay_admits_the_burst_at_once_but_still_pays_the_debt():
    h = Harness(leaky_rules([(10, False, 3, None)]))
    assert [sluice_handle(h, 7_000_000) for _ in range(5)] == \
        [("pass", 0)] * 4 + [("reject", None)]
    # 100 ms later exactly one slot has drained.
    assert [sluice_handle(h, 7_000_100) for _ in range(2)] == [("pass", 0), ("reject", None)]


def test_leaky_bucket_headers_report_burst_plus_one_and_time_to_fit():
    h = Harness(leaky_rules([(2, False, 1, None)]))
    for _ in range(2):
        sluice_handle(h, 9_000_000)
    h.clock.now = 9_000_000 / 1000
    decision = h.decide_now()
    assert decision.outcome == DENY
    assert decision.limit == 2  # burst + 1
    assert decision.reset == 1 and decision.retry_after == 1  # 500 ms to drain, rounded up


def test_a_rejection_by_one_bucket_charges_no_other_bucket():
    h = Harness("""
rules:
  - id: wide
    key: [ip]
    limit: {rate: 1r/s, burst: 10, nodelay: true}
    action: block
  - id: narrow
    match: {path: {prefix: /narrow}}
    key: [ip]
    limit: {rate: 1r/m, burst: 0}
    action: block
""")
    assert h.decide_now(path="/narrow").outcome == ALLOW
    for _ in range(5):
        assert h.decide_now(path="/narrow").outcome == DENY
    # "wide" was charged once; ten more fit its burst.
    assert [h.decide_now().outcome for _ in range(11)] == [ALLOW] * 10 + [DENY]


def test_a_request_refused_by_a_window_rule_charges_no_bucket():
    h = Harness("""
rules:
  - id: bucket
    key: [ip]
    limit: {tokens: 2, refill: 1/m}
    action: block
  - id: gate
    match: {path: {prefix: /closed}}
    key: [ip]
    limit: {requests: 0, per: 1h}
    action: block
""")
    h.decide_now(path="/closed")  # starts the gate's penalty, spends a token
    for _ in range(5):
        assert h.decide_now(path="/closed").outcome == DENY
    assert [h.decide_now().outcome for _ in range(2)] == [ALLOW, DENY]


def test_an_observe_bucket_over_its_limit_does_not_exempt_the_request_from_the_others():
    # The observe rule refuses nothing, so the request is admitted: the
    # enforcing bucket is charged, the observe one (over its limit) is not.
    h = Harness("""
rules:
  - id: enforce
    key: [ip]
    limit: {tokens: 5, refill: 1/m}
    action: block
  - id: watch
    key: [ip]
    limit: {tokens: 2, refill: 1/m}
    action: log
""")
    decisions = [h.decide_now() for _ in range(7)]
    assert [d.outcome for d in decisions] == [ALLOW] * 5 + [DENY] * 2
    assert [d.rule.id if d.rule else None for d in decisions[:5]] == [None, None, "watch", "watch", "watch"]


def test_full_wait_queue_rejects_instead_of_queueing():
    h = Harness("""
state: {max_delayed: 2}
rules:
  - id: slow
    key: [ip]
    limit: {rate: 1r/s, burst: 10}
    action: block
""")
    h.decide_now()  # free
    h.engine.delayed = 2  # two requests are waiting already
    decision = h.decide_now()
    assert decision.outcome == DENY
    h.engine.delayed = 1
    assert h.decide_now().delay == 1.0  # refused ones changed nothing


def test_explicit_penalty_on_a_bucket_rule():
    h = Harness("""
rules:
  - id: b
    key: [ip]
    limit: {tokens: 1, refill: 1/s}
    penalty: 1m
    action: block
""")
    assert [h.decide_now().outcome for _ in range(2)] == [ALLOW, DENY]
    h.clock.advance(30)
    decision = h.decide_now()
    assert decision.outcome == DENY and decision.reset == 60 and decision.retry_after == 30


# -- token bucket -----------------------------------------------------------


def test_token_bucket_seed_example():
    """Capacity 3, refill 2/s: three pass at once, the fourth fails, one
    more passes after half a second."""
    h = Harness("""
rules:
  - id: tokens
    key: [ip, path]
    limit: {tokens: 3, refill: 2/s}
    action: block
""")
    assert [h.decide_now().outcome for _ in range(4)] == [ALLOW, ALLOW, ALLOW, DENY]
    h.clock.advance(0.5)
    assert [h.decide_now().outcome for _ in range(2)] == [ALLOW, DENY]
    decision = h.decide_now()
    assert decision.limit == 3 and decision.retry_after == 1


def test_token_cost_is_charged_per_request():
    h = Harness("""
rules:
  - id: tokens
    key: [ip]
    limit: {tokens: 10, refill: 1/s, cost: 4}
    action: block
""")
    assert [h.decide_now().outcome for _ in range(3)] == [ALLOW, ALLOW, DENY]
    h.clock.advance(1.9)
    assert h.decide_now().outcome == DENY  # 3.9 tokens
    h.clock.advance(0.1)
    assert h.decide_now().outcome == ALLOW


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(min_value=1, max_value=20),
       refill=st.floats(min_value=0.01, max_value=50),
       cost=st.integers(min_value=1, max_value=20),
       gaps=st.lists(st.floats(min_value=0, max_value=5), min_size=1, max_size=100))
def test_admitted_cost_never_exceeds_capacity_plus_refill(capacity, refill, cost, gaps):
    cost = min(cost, capacity)
    bucket = TokenBucket(capacity, refill, cost, None)
    state = bucket.new_state()
    now, admitted = 0.0, []
    for gap in gaps:
        now += gap
        hit = bucket.assess(state, now)
        if not hit.over_limit:
            bucket.commit(state, hit)
            admitted.append(now)
    for i, start in enumerate(admitted):
        for j in range(i, len(admitted)):
            spent = (j - i + 1) * cost
            assert spent <= capacity + refill * (admitted[j] - start) + 1e-6


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(min_value=0, max_value=2), min_size=1, max_size=50))
def test_rejected_work_consumes_nothing(gaps):
    bucket = TokenBucket(3, 1.0, 2, None)
    state = bucket.new_state()
    now = 0.0
    for gap in gaps:
        now += gap
        before = (state.tokens, state.last)
        hit = bucket.assess(state, now)
        if hit.over_limit:
            assert (state.tokens, state.last) == before
        else:
            bucket.commit(state, hit)


# -- the held answer ----------------------------------------------------------

SLOW = """
rules:
  - id: slow
    key: [ip]
    limit: {rate: 50r/s, burst: 5}
    action: block
"""


def test_delayed_request_is_answered_after_its_slot_and_frees_it():
    app = SluiceApp(Harness(SLOW).engine)
    headers = {"X-Sluice-Client-Addr": "192.0.2.4", "X-Original-URI": "/"}
    assert call(app, "/v1/nginx/auth", headers)[0] == 200
    assert call(app, "/v1/nginx/auth", headers)[0] == 200  # held 20 ms, then allowed
    assert app.engine.delayed == 0
    assert app.engine.metrics.delayed.value == 1


def test_client_disconnect_while_held_frees_the_slot_without_answering():
    app = SluiceApp(Harness(SLOW).engine)
    headers = [(b"x-sluice-client-addr", b"192.0.2.5"), (b"x-original-uri", b"/")]
    scope = {"type": "http", "path": "/v1/nginx/auth", "headers": headers}
    sent = []
    seen_waiting = []

    async def receive():
        seen_waiting.append(app.engine.delayed)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))  # the free request
    sent.clear()
    asyncio.run(app(scope, receive, send))  # would be held 20 ms
    assert seen_waiting == [1]
    assert sent == []
    assert app.engine.delayed == 0


def test_longest_hold_is_the_full_burst_beyond_delay():
    h = Harness(leaky_rules([(10, False, 20, 5), (10, True, 3, None)]))
    assert h.engine.ruleset.longest_hold == 1.5  # 15 excess at 10 r/s


def test_a_batch_beyond_the_burst_on_a_key_never_seen_is_refused_with_a_defined_wait():
    """Envoy's hits_addend asks for several requests at once: beyond the
    burst and the first place they never fit, and a key never seen is
    refused with the time the part over the burst takes to drain."""
    from sidecar.config import Rate
    from sidecar.limiters.leaky import LeakyBucket

    bucket = LeakyBucket(Rate(2, 1), 2, None, None)  # 2 r/s, burst 2
    hit = bucket.assess(bucket.new_state(), 100.0, "", 4)
    assert (hit.over_limit, hit.retry_after) == (True, 1.0)  # (4000 - 2000) thousandths at 2000 a second
    admitted = bucket.assess(bucket.new_state(), 100.0, "", 3)  # the first place and the burst
    assert (admitted.over_limit, admitted.proposal) == (False, (2000, 100_000))

