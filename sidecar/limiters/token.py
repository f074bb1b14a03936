"""The token bucket; in Redis, ``token.lua``."""

from __future__ import annotations

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

from typing import Annotated, Any, ClassVar

from pydantic import Field, PlainValidator, model_validator

from sidecar.config import parse_refill
from sidecar.limiters import NO_PENALTY, Quota, RuleLimit, lua_number, registry
from sidecar.limiters.bucket import Bucket, BucketLimit, in_penalty
from sidecar.limiters.records import Hit, admitted, place_in_lines, record_equal, record_repr
from sidecar.plurals import plural

TOKEN = registry.lua_kind("T", "window", "buckets", "token")


@cython.no_gc  # nothing a state holds leads back to it
@cython.cclass
class TokenState:
    """The tokens left, when they were counted (None: a key never seen) and
    the end of the penalty period (a record: see ``sidecar.limiters.records.record_repr``)."""

    __match_args__ = ("tokens", "last", "penalty_until", "limiter")
    __slots__ = (*__match_args__, "used")

    def __init__(self, tokens: float, last: float | None, penalty_until: float, limiter: Any = None) -> None:
        self.tokens = tokens
        self.last = last
        self.penalty_until = penalty_until
        # The limiter the state belongs to: a reload may give the key another.
        self.limiter = limiter
        self.used = False  # read since the table last passed it over (sidecar.bounded.StateMap)

    def __repr__(self) -> str:
        return record_repr(self)

    def __eq__(self, other: object) -> bool:
        return record_equal(self, other)

    __hash__ = None  # type: ignore[assignment]  # changed in place, as a dataclass's


place_in_lines(TokenState)  # each instance in one line of the cache, compiled


class TokenBucket(Bucket):
    """Token bucket: starts full, refills on demand as
    ``min(B, tokens + r * elapsed)``, admits only when the cost fits, then
    deducts it. Rejected work consumes nothing."""

    __slots__ = ("capacity", "refill", "cost")
    holds = False

    def __init__(self, capacity: int, refill: float, cost: int, penalty: float | None) -> None:
        self.capacity = capacity
        self.refill = refill  # tokens per second
        self.cost = cost
        super().__init__(penalty, refill, TOKEN, (str(capacity), lua_number(refill), str(cost)))

    def new_state(self) -> TokenState:
        # Filled without the call of the class (see WindowCounter.new_state).
        state = cython.cast(TokenState, TokenState.__new__(TokenState))  # compiled: no type test
        state.tokens = float(self.capacity)
        state.last = None
        state.penalty_until = NO_PENALTY
        state.limiter = self
        state.used = False
        return state

    def tokens_at(self, state: TokenState, now: float) -> float:
        if state.last is None:
            return state.tokens
        last: float = state.last  # compiled: a C double, and the arithmetic in C
        return min(float(self.capacity), state.tokens + self.refill * max(0.0, now - last))

    def assess(self, state: Any, now: float, lease: str = "", amount: int = 1) -> Hit:
        """``amount`` requests at once cost ``amount`` times the cost (0: a
        look that takes nothing)."""
        record: TokenState = state  # each method's state is read as its type (Algorithm)
        held = in_penalty(record.penalty_until, now)
        if held is not None:
            return held
        tokens = self.tokens_at(record, now)
        cost = self.cost * amount
        if cost > tokens:
            return self.refuse(record, now, (cost - tokens) / self.refill)
        return admitted(0.0, (tokens - cost, now))

    def commit(self, state: Any, hit: Hit) -> None:
        record: TokenState = state
        record.tokens, record.last = hit.proposal

    def quota(self, state: TokenState, now: float, threshold: float) -> Quota:
        """Requests the tokens now cover, and the time until the bucket is full."""
        if now < state.penalty_until:
            return Quota(0, state.penalty_until - now, self.capacity / self.refill)
        tokens = self.tokens_at(state, now)
        return Quota(int(tokens // self.cost), (self.capacity - tokens) / self.refill, self.capacity / self.refill)

    def expires_at(self, state: Any) -> float:
        record: TokenState = state
        if record.last is None:
            return record.penalty_until
        last: float = record.last  # compiled: C doubles, as in tokens_at
        full_at = last + (float(self.capacity) - record.tokens) / self.refill
        return max(full_at, record.penalty_until)

    def describe(self) -> str:
        text = f"{plural(self.capacity, 'token')}, refill {self.refill:g}/s"
        if self.cost != 1:
            text += f", cost {self.cost}"
        return self.with_penalty(text)


class TokenLimit(BucketLimit):
    tag: ClassVar[str] = "token-bucket"
    tokens: int = Field(ge=1)
    refill: Annotated[float, PlainValidator(parse_refill)]
    cost: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _cost_fits(self) -> TokenLimit:
        if self.cost > self.tokens:
            raise ValueError(f"cost {self.cost} can never be admitted by a bucket of "
                             f"{plural(self.tokens, 'token')}")
        return self


# A bucket smaller than the cost admits nothing.
@registry.limit(TokenLimit, field="tokens", needs="refill", threshold="tokens", least=lambda limit: limit.cost,
                order=3)
def _token(limit: TokenLimit, penalty: float | None) -> RuleLimit:
    return RuleLimit(TokenBucket(limit.tokens, limit.refill, limit.cost, penalty), limit.tokens, penalty)


def _refills(requests: int, period: float) -> None:
    if requests < 1:
        raise ValueError("a token bucket needs requests_per_unit of at least 1 (its refill)")


@registry.rls_algorithm("token_bucket", burst=True, check=_refills, order=3)
def _rls_token(requests: int, period: float, burst: int | None, penalty: float | None) -> RuleLimit:
    """A descriptor's bucket holds its burst (``requests`` when unset) and
    gives ``requests`` back per period."""
    capacity = max(burst if burst is not None else requests, 1)
    return RuleLimit(TokenBucket(capacity, requests / period, 1, penalty), capacity, penalty)
