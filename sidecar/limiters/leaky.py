"""The leaky bucket: nginx's ``limit_req``; in Redis, ``leaky.lua``."""

from __future__ import annotations

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

from typing import Annotated, Any, ClassVar

from pydantic import Field, PlainValidator, model_validator

from sidecar.config import Rate, parse_rate
from sidecar.limiters import NO_PENALTY, Quota, RuleLimit, registry
from sidecar.limiters.bucket import Bucket, BucketLimit, in_penalty
from sidecar.limiters.records import UNDER_LIMIT, Hit, admitted, place_in_lines, record_equal, record_repr

LEAKY = registry.lua_kind("L", "window", "buckets", "leaky")


@cython.no_gc  # nothing a state holds leads back to it
@cython.cclass
class LeakyState:
    """nginx's two numbers per key: excess in thousandths of a request and
    the time of the last accounted request in milliseconds (a record: see
    ``sidecar.limiters.records.record_repr``)."""

    __match_args__ = ("excess", "last", "penalty_until", "limiter")
    __slots__ = (*__match_args__, "used")

    def __init__(self, excess: int, last: int | None, penalty_until: float, limiter: Any = None) -> None:
        self.excess = excess
        self.last = last  # None: a key never seen
        self.penalty_until = penalty_until
        # The limiter the state belongs to: a reload may give the key another.
        self.limiter = limiter
        self.used = False  # read since the table last passed it over (sidecar.bounded.StateMap)

    def __repr__(self) -> str:
        return record_repr(self)

    def __eq__(self, other: object) -> bool:
        return record_equal(self, other)

    __hash__ = None  # type: ignore[assignment]  # changed in place, as a dataclass's


place_in_lines(LeakyState)  # each instance in one line of the cache, compiled


def _drained_excess(last: int, excess: int, rate: int, now_ms: int, amount: int) -> int:
    """``LeakyBucket._excess`` on C integers (compiled only: the caller
    checked that they fit). The time drained is capped where the bucket is
    empty, so that rate * time stays under 2 ** 63: past it the excess is 0
    whatever the time."""
    elapsed = now_ms - last if now_ms > last else 0
    full = excess + 1000 * amount
    empty_after = full * 1000 // rate + 1  # ms after which rate * ms // 1000 > full
    if elapsed > empty_after:
        elapsed = empty_after
    left = full - rate * elapsed // 1000
    return left if left > 0 else 0


def _in_c_range(last: int, excess: int, rate: int) -> bool:
    """Whether a state's time, excess and the bucket's rate are small enough
    for ``_kept_ms`` and ``_drained_excess``: a time under 2 ** 50 ms in size
    (35,000 years), an excess under 2 ** 40 (a burst of a billion requests),
    a positive rate under 2 ** 50."""
    return -(1 << 50) < last < 1 << 50 and 0 <= excess < 1 << 40 and 0 < rate < 1 << 50


def _kept_ms(last: int, excess: int, rate: int) -> int:
    """``LeakyBucket.expires_at``'s ms on C integers (compiled only: the
    caller checked that they fit)."""
    drained = last + excess * 1000 // rate
    return drained if drained > last + 60_000 else last + 60_000


class LeakyBucket(Bucket):
    """nginx ``limit_req`` arithmetic, integer for integer.

    The rate is kept as requests per second times 1000, truncated as nginx
    truncates (10r/m is 166); time is whole milliseconds of a monotonic clock.
    A request's excess is ``excess - rate * ms / 1000 + 1000`` (integer
    division, clamped at 0; a key's first request has excess 0); it is
    rejected when the excess exceeds the burst, and otherwise held for
    ``(excess - delay) * 1000 / rate`` ms when the excess is over ``delay``
    (``nodelay``: never held). A rejection changes nothing.
    """

    __slots__ = ("rate", "burst", "delay", "holds")

    def __init__(self, rate: Rate, burst: int, delay: int | None, penalty: float | None) -> None:
        self.rate = rate.count * 1000 // rate.period
        self.burst = burst * 1000
        # nodelay (delay None) admits the whole burst at once.
        self.delay = burst * 1000 if delay is None else delay * 1000
        super().__init__(penalty, self.rate / 1000, LEAKY, (str(self.rate), str(self.burst), str(self.delay)))
        self.holds = self.longest_hold() > 0  # may ask to hold a request

    def longest_hold(self) -> float:
        """Seconds the longest-held request waits: the excess is at most
        the burst. The proxy's timeout for Sluice must be longer."""
        return max(0, self.burst - self.delay) * 1000 // self.rate / 1000

    def new_state(self) -> LeakyState:
        # Filled without the call of the class (see WindowCounter.new_state).
        state = cython.cast(LeakyState, LeakyState.__new__(LeakyState))  # compiled: no type test
        state.excess = 0
        state.last = None
        state.penalty_until = NO_PENALTY
        state.limiter = self
        state.used = False
        return state

    def assess(self, state: Any, now: float, lease: str = "", amount: int = 1) -> Hit:
        """``amount`` requests at once add ``amount`` to the excess (the
        first of a key's fills the bucket's first place, as one request does)."""
        record: LeakyState = state  # each method's state is read as its type (Algorithm)
        held = in_penalty(record.penalty_until, now)
        if held is not None:
            return held
        now_ms = int(now * 1000 + 1e-6)  # whole ms; the epsilon absorbs float error
        if record.last is None and amount == 0:
            return UNDER_LIMIT  # a look at a key never seen: nothing to write
        excess = 1000 * (amount - 1) if record.last is None else self._excess(record, now_ms, amount)
        if excess > self.burst:
            return self.refuse(record, now, self._wait_ms(record, now_ms, amount) / 1000)
        delay_ms = 0 if excess <= self.delay else (excess - self.delay) * 1000 // self.rate
        return admitted(delay_ms / 1000, (excess, now_ms))

    def _excess(self, state: LeakyState, now_ms: int, amount: int = 1) -> int:
        assert state.last is not None
        last, excess = state.last, state.excess
        # Compiled, on C integers when they fit, as in expires_at
        # (_in_c_range, a time now as small, a batch under 2 ** 20 requests:
        # _drained_excess); else on Python's.
        if cython.compiled and _in_c_range(last, excess, self.rate) and -(1 << 50) < now_ms < 1 << 50 \
                and 0 <= amount < 1 << 20:
            return _drained_excess(last, excess, self.rate, now_ms, amount)
        elapsed = max(0, now_ms - last)
        return max(0, excess - self.rate * elapsed // 1000 + 1000 * amount)

    def _wait_ms(self, state: LeakyState, now_ms: int, amount: int = 1) -> int:
        """Milliseconds until ``amount`` requests would fit within the burst
        again. A key never seen counts from an empty bucket now: ``amount``
        requests at once beyond the burst and its first place never fit
        (Envoy's ``hits_addend``), and the wait is the time the part over
        the burst takes to drain."""
        last = now_ms if state.last is None else state.last
        needed = state.excess + 1000 * amount - self.burst  # thousandths to drain
        # The smallest ms with rate * ms // 1000 >= needed.
        return max(0, last - (-needed * 1000 // self.rate) - now_ms)

    def commit(self, state: Any, hit: Hit) -> None:
        record: LeakyState = state
        if hit.proposal is not None:
            record.excess, record.last = hit.proposal

    def quota(self, state: LeakyState, now: float, threshold: float) -> Quota:
        """Requests that would still be admitted now, the time to drain, and
        the time the whole burst takes to drain."""
        full_drain = (self.burst + 1000) / self.rate
        if now < state.penalty_until:
            return Quota(0, state.penalty_until - now, full_drain)
        if state.last is None:
            return Quota(self.burst // 1000 + 1, 0.0, full_drain)
        drained = max(0, state.excess - self.rate * max(0, int(now * 1000 + 1e-6) - state.last) // 1000)
        return Quota(max(0, (self.burst - drained) // 1000), drained / self.rate, full_drain)

    def expires_at(self, state: Any) -> float:
        record: LeakyState = state
        if record.last is None:
            return record.penalty_until
        # Like nginx, keep a key at least 60 s after its last request, and
        # until its excess has drained: a forgotten key's next request would
        # start from excess 0 instead of 1000. Once for every new key.
        last, excess = record.last, record.excess
        # Compiled, worked on in C while they fit (_in_c_range), exactly as
        # Python would (the ms kept stay under 2 ** 53, a double's exact
        # integers); larger ones (an injected clock, a burst of 10 ** 12) on
        # Python's integers.
        if cython.compiled and _in_c_range(last, excess, self.rate):
            seconds = _kept_ms(last, excess, self.rate) / 1000  # compiled: on C integers
        else:
            seconds = max(last + excess * 1000 // self.rate, last + 60_000) / 1000
        return record.penalty_until if record.penalty_until > seconds else seconds

    def describe(self) -> str:
        # nginx keeps the rate in thousandths per second, 10r/m as 0.166r/s.
        text = f"rate {self.rate / 1000:g}r/s, burst {self.burst // 1000}"
        if self.delay == self.burst and self.burst:
            text += ", nodelay"
        elif self.delay:
            text += f", delay {self.delay // 1000}"
        return self.with_penalty(text)


class LeakyLimit(BucketLimit):
    tag: ClassVar[str] = "leaky-bucket"
    rate: Annotated[Rate, PlainValidator(parse_rate)]
    burst: int = Field(0, ge=0)
    nodelay: bool = False
    delay: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _delay_or_nodelay(self) -> LeakyLimit:
        if self.nodelay and self.delay is not None:
            raise ValueError("give either nodelay: true or delay, not both")
        return self

    def without_holds(self) -> LeakyLimit:
        """Admits and refuses exactly as this one, but ``nodelay``."""
        return self.model_copy(update={"nodelay": True, "delay": None})


@registry.limit(LeakyLimit, field="rate", needs="burst", threshold="burst", order=4)
def _leaky(limit: LeakyLimit, penalty: float | None) -> RuleLimit:
    """Its header limit is the burst and the request that fits after it."""
    bucket = LeakyBucket(limit.rate, limit.burst, None if limit.nodelay else (limit.delay or 0), penalty)
    return RuleLimit(bucket, limit.burst + 1, penalty)


def _leaks(requests: int, period: float) -> None:
    """nginx's rate: whole requests per whole seconds, in thousandths per second."""
    if period != int(period):
        raise ValueError("a leaky bucket's window is whole seconds")
    if requests * 1000 // int(period) < 1:
        raise ValueError("a leaky bucket leaks at least one request per 1000 s: raise "
                         "requests_per_unit or shorten the window")


@registry.rls_algorithm("leaky_bucket", burst=True, check=_leaks, order=4)
def _rls_leaky(requests: int, period: float, burst: int | None, penalty: float | None) -> RuleLimit:
    """A descriptor's leaky bucket never holds a request (``nodelay``)."""
    bucket = LeakyBucket(Rate(requests, int(period)), burst or 0, None, penalty)
    return RuleLimit(bucket, (burst or 0) + 1, penalty)
