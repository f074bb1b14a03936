"""What the engine and the state stores say to each other.

The engine hands a store every check of a request at once, in rule order
(``Check``); the store answers with an ``Evaluation``, applying the stop
rules of the pipeline as it goes so that rules after a stopping one are neither
evaluated nor counted. The stores themselves are in ``sidecar.store``.
"""

from __future__ import annotations

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sidecar.config import AutoBanConfig, BanIncrementConfig
from sidecar.keys import CountingKey
from sidecar.limiters import Hit, Quota, lua_number
from sidecar.limiters.base import Limiter
from sidecar.limiters.window import WindowCounter

Clock = Callable[[], float]

# The time of the stores: monotonic seconds on the Unix epoch's scale
# (time.monotonic shifted by the wall clock once, at start). Windows are
# aligned to multiples of their period since the epoch, so a day's window
# ends at 00:00 UTC and a minute's on the minute, as with Redis's own clock
# (which the Redis store counts on) and envoyproxy/ratelimit; setting the
# wall clock later moves nothing.
_EPOCH_OFFSET = time.time() - time.monotonic()
# Compiled, the clock and the offset are C variables of the module (a
# check reads the clock): no lookup of time.monotonic, no float unboxed.
_monotonic = time.monotonic


def epoch_clock() -> float:
    return _monotonic() + _EPOCH_OFFSET


@dataclass(frozen=True, slots=True)
class AutoBan:
    """Challenges per address before the address is banned:
    ``threshold`` challenges within the counter's period are issued, the
    next one is a ban of ``duration`` instead."""

    limiter: WindowCounter
    threshold: int
    duration: float

    @classmethod
    def from_config(cls, auto_ban: AutoBanConfig) -> AutoBan:
        return cls(WindowCounter(auto_ban.challenges, auto_ban.per, auto_ban.per),
                   auto_ban.challenges, auto_ban.ban)

    @staticmethod
    def key(address: str) -> CountingKey:
        # Shaped like a rule's counting key, so logs can describe it; no rule
        # id has a space, so it is nobody else's key.
        return (("challenge auto-ban", ("ip",)), address)


@dataclass(frozen=True, slots=True)
class BanIncrement:
    """A ban rule's ``ban.increment``: the bans of one address by the rule
    escalate while they come within ``remember`` after the last one ended."""

    factor: float
    longest: float
    remember: float

    @classmethod
    def from_config(cls, increment: BanIncrementConfig) -> BanIncrement:
        return cls(increment.factor, increment.max_, increment.remember)

    def following(self, duration: float, last: tuple[int, float] | None) -> tuple[int, float]:
        """The step and length of a ban of ``duration`` after the last
        remembered one (step, length), or the first (None): ``factor`` times
        the last, never shorter than the rule's duration nor longer than
        ``max``. The Redis scripts compute the same (ban_history.lua)."""
        if last is None:
            return 0, duration
        return last[0] + 1, min(max(last[1] * self.factor, duration), self.longest)

    def lua_spec(self, duration: float) -> str:
        """The ban's duration as the Redis scripts read it: 'D F M R'."""
        return " ".join(map(lua_number, (duration, self.factor, self.longest, self.remember)))


# The period over which a challenge rule's unsolved penalties are counted.
PENALTY_DAY = 86400.0


@dataclass(frozen=True, slots=True)
class PenaltyBan:
    """A challenge rule's ``then_ban_after``: the penalties of its key for
    one address are counted, once each (at the first challenged request of
    the penalty), by a sliding window of a day; ``threshold`` of them are
    challenged, the next one is a ban of ``duration`` instead."""

    limiter: WindowCounter
    threshold: int
    duration: float

    @classmethod
    def after(cls, penalties: int, duration: float) -> PenaltyBan:
        return cls(WindowCounter(penalties, PENALTY_DAY, PENALTY_DAY), penalties, duration)

    @staticmethod
    def key(rule_id: str, address: str) -> CountingKey:
        # Shaped like a rule's counting key, and nobody else's (see AutoBan.key).
        return (("unsolved penalties " + rule_id, ("ip",)), address)

    def lua_fields(self) -> tuple[str, ...]:
        """The window's arguments and the ban's duration, for evaluate.lua."""
        return (*self.limiter.redis_args(self.threshold), lua_number(self.duration))


@dataclass(frozen=True)  # not slotted: the compiled core makes an extension type of it (state.pxd)
class CheckSpec:
    """What one matching rule asks of the store, whatever the request's key.

    A rule makes its own when the rules load (``CompiledRule.spec``), and
    one for a verified bot and one per override beside it; a request picks
    one, and makes none.
    """

    rule_id: str
    limiter: Limiter
    threshold: float
    stops: bool  # over limit ends evaluation (block, ban, challenge)
    ban_duration: float | None = None  # over limit bans the client address
    count: bool = True  # False: a response-phase rule, only its penalty is checked
    auto_ban: AutoBan | None = None  # over limit issues a challenge, counted per address
    # Requests this check counts at once (Envoy's hits_addend); 0 looks
    # without counting.
    amount: int = 1
    ban_increment: BanIncrement | None = None  # repeat bans of the address by the rule escalate
    penalty_ban: PenaltyBan | None = None  # over limit counts a penalty towards a ban (then_ban_after)
    # Within its limit, nothing to do after the store but count the hit: no
    # response phase, no reset_on, no concurrency slot (its rule's ``plain``).
    plain: bool = False
    # The limiter's ``deferred`` (charged last), which the policy reads for
    # every check: a field of the compiled spec read in C, where the
    # limiter's is a class attribute looked up by name.
    deferred: bool = field(init=False, repr=False, compare=False)
    # The limiter's ``leases`` (it counts concurrency slots), which the
    # node's table reads for every check, as ``deferred``.
    leases: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "deferred", bool(self.limiter.deferred))
        object.__setattr__(self, "leases", bool(self.limiter.leases))


@cython.freelist(16)
@cython.no_gc  # nothing it holds leads back to it
@cython.cclass
class Check:
    """One matching rule of one request, ready for the store: the rule's
    ``CheckSpec``, the request's counting key, and the request's lease id
    (in a ruleset with a concurrency limit, else "").

    The ruleset's matcher (``rules.compile_matcher``) makes one for every
    matching rule of every request (``add_check``): a slotted object of
    three fields costs what a tuple does. ``Check.of(rule_id, key,
    limiter, ...)`` spells every field of the spec, for the front doors that
    make a spec per request (the Rate Limit Service) and for tests; the
    spec's fields are also properties of the check.
    """

    __slots__ = ("spec", "key", "lease")

    def __init__(self, spec: CheckSpec, key: CountingKey, lease: str = "") -> None:
        self.spec = spec
        self.key = key
        self.lease = lease

    @classmethod
    def of(cls, rule_id: str, key: CountingKey, limiter: Limiter, threshold: float, stops: bool,
           ban_duration: float | None = None, count: bool = True, auto_ban: AutoBan | None = None,
           lease: str = "", amount: int = 1, ban_increment: BanIncrement | None = None,
           penalty_ban: PenaltyBan | None = None) -> Check:
        return cls(CheckSpec(rule_id, limiter, threshold, stops, ban_duration, count, auto_ban, amount,
                             ban_increment, penalty_ban), key, lease)

    def __repr__(self) -> str:
        return f"Check({self.spec!r}, {self.key!r}, {self.lease!r})"

    @property
    def rule_id(self) -> str:
        return self.spec.rule_id

    @property
    def limiter(self) -> Limiter:
        return self.spec.limiter

    @property
    def threshold(self) -> float:
        return self.spec.threshold

    @property
    def stops(self) -> bool:
        return self.spec.stops

    @property
    def ban_duration(self) -> float | None:
        return self.spec.ban_duration

    @property
    def count(self) -> bool:
        return self.spec.count

    @property
    def auto_ban(self) -> AutoBan | None:
        return self.spec.auto_ban

    @property
    def amount(self) -> int:
        return self.spec.amount

    @property
    def ban_increment(self) -> BanIncrement | None:
        return self.spec.ban_increment

    @property
    def penalty_ban(self) -> PenaltyBan | None:
        return self.spec.penalty_ban


def add_check(matched: list[Any], checks: list[Check], rule: Any, spec: CheckSpec, key: CountingKey,
              lease: str) -> None:
    """The ruleset's matcher's step for each rule a request matches: the
    rule to ``matched``, its ``Check`` (``spec``, ``key``, ``lease``) to
    ``checks``. One call of the matcher's for the two (compiled, without
    the call of the class)."""
    check = cython.cast(Check, Check.__new__(Check))  # compiled: no type test
    check.spec = spec
    check.key = key
    check.lease = lease
    matched.append(rule)
    checks.append(check)


@dataclass(frozen=True, slots=True)
class ResponseCount:
    """One response that a response-phase rule counts."""

    key: CountingKey
    limiter: Limiter
    threshold: float
    amount: int = 1


@dataclass(frozen=True, slots=True)
class BanRecord:
    """An address (a client key) or a network refused until ``expires``:
    earned by a rule, or issued by hand with a ``reason``."""

    address: str  # the client key, or the network's CIDR
    rule_id: str  # "" for a ban issued by hand: no rule id is empty
    node: str
    started_wall: float  # wall-clock start, for people reading ban records
    expires: float  # on the store's clock (epoch_clock)
    duration: float
    shadow: bool = False  # a shadow rule's would-be ban: listed, never applied
    step: int = 0  # an escalating ban's: 0 for the first, 1 for the next, ...
    reason: str = ""

    @property
    def manual(self) -> bool:
        return not self.rule_id


@dataclass  # not slotted: the compiled core makes an extension type of it (state.pxd)
@cython.freelist(8)
@cython.no_gc  # nothing it holds leads back to it
@cython.cclass
class Evaluation:
    """What the store decided: an active ban, or per-check hits in order.

    ``hits`` has one entry per check that was evaluated; it stops after the
    first over-limit check with ``stops`` set. ``ban`` is set when the
    client was already banned (nothing evaluated) or became banned now.
    """

    ban: BanRecord | None = None
    new_ban: bool = False
    hits: list[Hit] = field(default_factory=list)
    delay: float = 0.0  # how long to hold the admitted request (leaky buckets)
    # A shared store's answer to ``quotas`` for every check (None for one
    # that does not count), when asked for with the evaluation.
    quotas: list[Quota | None] | None = None
