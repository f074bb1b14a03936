"""Window counter arithmetic with exact, injected time."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.limiters.window import WindowCounter


def run(counter: WindowCounter, times, threshold=None):
    state = counter.new_state()
    limit = counter.threshold if threshold is None else threshold
    return [counter.hit(state, t, limit).over_limit for t in times]


def test_requests_up_to_threshold_pass_and_the_next_ones_are_over_limit():
    counter = WindowCounter(threshold=3, period=60, penalty=60)
    assert run(counter, [600.0, 601.0, 602.0, 603.0, 604.0]) == [False, False, False, True, True]


def test_penalty_starts_when_threshold_is_reached_not_at_window_boundary():
    counter = WindowCounter(threshold=2, period=10, penalty=10)
    state = counter.new_state()
    assert not counter.hit(state, 105.0, 2).over_limit
    assert not counter.hit(state, 107.0, 2).over_limit  # reaches 2: penalty 107..117
    hit = counter.hit(state, 116.5, 2)
    assert hit.over_limit and math.isclose(hit.retry_after, 0.5)
    assert not counter.hit(state, 117.0, 2).over_limit


def test_over_limit_requests_are_not_counted():
    counter = WindowCounter(threshold=2, period=10, penalty=3, sliding=False)
    state = counter.new_state()
    counter.hit(state, 100.0, 2)
    counter.hit(state, 100.5, 2)
    for t in (101.0, 102.0, 103.0):
        assert counter.hit(state, t, 2).over_limit
    assert state.current == 2


def test_threshold_zero_behaves_as_one():
    counter = WindowCounter(threshold=0, period=10, penalty=10)
    assert counter.threshold == 1
    assert run(counter, [50.0, 51.0]) == [False, True]


def test_explicit_penalty_outlasts_the_window():
    counter = WindowCounter(threshold=1, period=10, penalty=600)
    state = counter.new_state()
    counter.hit(state, 0.0, 1)
    assert counter.hit(state, 599.0, 1).over_limit
    assert not counter.hit(state, 600.0, 1).over_limit


def test_sliding_estimate_weights_previous_window_by_remaining_share():
    # N = 60, 15 s into the current window: the previous window weighs 75 %.
    counter = WindowCounter(threshold=10, period=60, penalty=60)
    state = counter.new_state()
    for i in range(8):
        counter.hit(state, 60.0 + i, 100)  # 8 in window [60, 120), no penalty at 100
    # At 135: 8 * 0.75 = 6 from before; the 4th request here brings 6 + 4 = 10.
    assert [counter.hit(state, 135.0, 10).over_limit for _ in range(4)] == [False] * 4
    assert counter.hit(state, 135.0, 10).over_limit


def test_estimate_is_compared_as_a_real_number():
    counter = WindowCounter(threshold=3, period=60, penalty=60)
    state = counter.new_state()
    counter.hit(state, 0.0, 100)
    counter.hit(state, 1.0, 100)
    counter.hit(state, 2.0, 100)  # 3 in window 0
    # 30.6 s into window 1: previous weighs 3 * 29.4/60 = 1.47; +1 = 2.47 < 3
    assert not counter.hit(state, 90.6, 3).over_limit
    # +1 more = 3.47 >= 3: penalty starts, this one still allowed
    assert not counter.hit(state, 90.6, 3).over_limit
    assert counter.hit(state, 90.7, 3).over_limit


def test_fixed_window_resets_at_the_boundary():
    counter = WindowCounter(threshold=3, period=10, penalty=1, sliding=False)
    state = counter.new_state()
    assert run(counter, []) == []
    for t in (8.0, 8.5):
        assert not counter.hit(state, t, 3).over_limit
    # A fixed window forgets the previous window entirely: its known weakness.
    for t in (10.0, 10.1, 10.2):
        assert not counter.hit(state, t, 3).over_limit


def test_a_gap_of_several_windows_forgets_everything():
    counter = WindowCounter(threshold=5, period=10, penalty=10)
    state = counter.new_state()
    for _ in range(4):
        counter.hit(state, 10.0, 5)
    counter.hit(state, 35.0, 5)
    assert state.previous == 0 and state.current == 1


@settings(max_examples=200)
@given(
    threshold=st.integers(min_value=1, max_value=20),
    period=st.integers(min_value=1, max_value=120),
    gaps=st.lists(st.floats(min_value=0, max_value=30, allow_nan=False), min_size=1, max_size=200),
)
def test_fixed_window_never_admits_more_than_threshold_per_window(threshold, period, gaps):
    counter = WindowCounter(threshold=threshold, period=period, penalty=period, sliding=False)
    state = counter.new_state()
    now, admitted = 1000.0, {}
    for gap in gaps:
        now += gap
        if not counter.hit(state, now, threshold).over_limit:
            window = int(now // period)
            admitted[window] = admitted.get(window, 0) + 1
    assert all(count <= threshold for count in admitted.values())


@settings(max_examples=200)
@given(
    threshold=st.integers(min_value=1, max_value=20),
    period=st.integers(min_value=1, max_value=120),
    gaps=st.lists(st.floats(min_value=0, max_value=30, allow_nan=False), min_size=1, max_size=200),
)
def test_sliding_window_admits_at_most_threshold_in_a_row_without_pause(threshold, period, gaps):
    """Whatever the history, a key can never be admitted more than M times
    within one penalty-free stretch of a single window: the M-th starts the
    penalty."""
    counter = WindowCounter(threshold=threshold, period=period, penalty=period)
    state = counter.new_state()
    now = 1000.0
    for gap in gaps:
        now += gap
        counter.hit(state, now, threshold)
        assert state.current <= threshold
