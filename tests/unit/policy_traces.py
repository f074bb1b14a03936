"""Random traces of requests and responses through a store, at the store's
seam, and what the store answered: for the property tests that hold every
implementation of the request-phase policy (the memory store's table, the
smallest table, the Redis store's Lua) to ``sidecar.policy``.

A trace mixes every kind of check the policy knows: windows that block,
observe or only look, a ban rule whose bans escalate, a challenge counted
towards an auto-ban, a challenge with then_ban_after, token and leaky
buckets, and a concurrency limit; for two addresses and the unknown one,
with reported responses, released slots and the draft quotas now and then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from sidecar.config import Rate
from sidecar.limiters.concurrent import ConcurrencyLimiter
from sidecar.limiters.leaky import LeakyBucket
from sidecar.limiters.token import TokenBucket
from sidecar.limiters.window import WindowCounter
from sidecar.state import AutoBan, BanIncrement, Check, CheckSpec, PenaltyBan, ResponseCount
from sidecar.store import Deciding

START = 1_000_000.0

SPECS = {
    "block": CheckSpec("block", WindowCounter(3, 10.0, 5.0), 3.0, True),
    "fixed": CheckSpec("fixed", WindowCounter(2, 4.0, 4.0, sliding=False), 2.0, True),
    "ban": CheckSpec("ban", WindowCounter(2, 10.0, 10.0), 2.0, True, ban_duration=20.0,
                     ban_increment=BanIncrement(2.0, 80.0, 60.0)),
    "gate": CheckSpec("gate", WindowCounter(1, 10.0, 10.0), 1.0, True,
                      auto_ban=AutoBan(WindowCounter(2, 60.0, 60.0), 2, 30.0)),
    "hard": CheckSpec("hard", WindowCounter(1, 5.0, 5.0), 1.0, True, penalty_ban=PenaltyBan.after(2, 40.0)),
    "tokens": CheckSpec("tokens", TokenBucket(3, 1.0, 1, None), 3.0, True),
    "paced": CheckSpec("paced", LeakyBucket(Rate(2, 1), 3, 1, None), 4.0, True),
    # Four requests at once (Envoy's hits_addend), more than the burst and
    # its first place: refused even on a key never seen, with a penalty.
    "batch": CheckSpec("batch", LeakyBucket(Rate(2, 1), 2, None, 2.0), 3.0, True, amount=4),
    "watch": CheckSpec("watch", WindowCounter(2, 5.0, 3.0), 2.0, False),
    "look": CheckSpec("look", WindowCounter(2, 10.0, 6.0), 2.0, True, count=False),
    "slots": CheckSpec("slots", ConcurrencyLimiter(2, 8.0), 2.0, True),
    # Keyed by a path every address shares (see ``key``), yet bans the address.
    "by-path": CheckSpec("by-path", WindowCounter(4, 10.0, 10.0), 4.0, True, ban_duration=15.0,
                         ban_increment=BanIncrement(3.0, 100.0, 30.0)),
}
ADDRESSES = ("192.0.2.1", "192.0.2.1", "192.0.2.1", "192.0.2.2", "")  # one address most of the time


def key(rule: str, address: str) -> Any:
    if rule == "by-path":
        return ((rule, ("path",)), "/everyone")
    return ((rule, ("ip",)), address)


@dataclass(frozen=True)
class Request:
    """A burst of ``repeat`` requests at once, of the address and rules."""

    address: str
    rules: tuple[str, ...]
    can_delay: bool
    quotas: bool
    repeat: int


@dataclass(frozen=True)
class Response:
    """A reported response: counted by the look-only rule's key, and the
    slots of an earlier request given back."""

    address: str
    amount: int
    release: int  # which earlier request's lease, counted back from the last


Step = tuple[float, Request | Response]

requests = st.builds(Request, st.sampled_from(ADDRESSES),
                     st.lists(st.sampled_from(sorted(SPECS)), min_size=1, max_size=2, unique=True).map(tuple),
                     st.booleans(), st.booleans(), st.integers(1, 4))
responses = st.builds(Response, st.sampled_from(ADDRESSES), st.integers(0, 2), st.integers(1, 3))
steps: st.SearchStrategy[Step] = st.tuples(
    st.sampled_from([0.0, 0.0, 0.0, 0.0, 0.05, 0.3, 0.5, 1.3, 4.0, 11.0, 35.0]),
    st.one_of(requests, requests, requests, responses))  # mostly requests
traces = st.lists(steps, min_size=5, max_size=50)


def _rounded(value: float) -> float:
    # To the nanosecond: a shared store's ban comes back as the time it has
    # left, which the store adds to the caller's clock again.
    return round(value, 9)


async def replay(store: Deciding, trace: list[Step]) -> list[Any]:
    """What the store answered at every step of the trace."""
    now = START
    leases: list[str] = []
    answers: list[Any] = []
    for n, (advance, step) in enumerate(trace):
        now += advance
        if isinstance(step, Request):
            for burst in range(step.repeat):
                leases.append(f"r{n}.{burst}")
                answers.append(await _decide(store, now, step, leases[-1]))
        else:
            lease = leases[-step.release] if len(leases) >= step.release else None
            answers.append(await _respond(store, now, step, lease))
    return answers


async def _decide(store: Deciding, now: float, request: Request, lease: str) -> Any:
    checks = [Check(SPECS[rule], key(rule, request.address), lease) for rule in request.rules]
    evaluation = await store.evaluate(now, request.address, checks, request.can_delay, request.quotas)
    ban, hits = evaluation.ban, evaluation.hits
    refused = ban is not None or bool(hits) and hits[-1].over_limit and checks[len(hits) - 1].stops
    return (None if ban is None else (ban.address, ban.rule_id, _rounded(ban.expires - now), ban.duration, ban.step),
            evaluation.new_ban, [(hit.over_limit, _rounded(hit.retry_after)) for hit in hits],
            _rounded(evaluation.delay),
            # The quotas of an admitted request: a refused one's are never
            # read (a shared store's cache of keys over limit answers
            # without them).
            None if refused or evaluation.quotas is None else
            [None if quota is None else tuple(map(_rounded, quota)) for quota in evaluation.quotas])


async def _respond(store: Deciding, now: float, response: Response, lease: str | None) -> Any:
    look = SPECS["look"]
    hits = await store.record(now, [ResponseCount(key("look", response.address), look.limiter, look.threshold,
                                                  response.amount)])
    released = 0 if lease is None else await store.release(lease, [key("slots", response.address)])
    return [(hit.over_limit, _rounded(hit.retry_after)) for hit in hits], released
