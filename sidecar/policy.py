"""The request-phase policy, written once: what the checks of a request do
to the state of their keys, and when a refusal bans the client.

The engine hands a store every check of a request at once, in rule order;
the policy answers with an ``Evaluation``:

- a client banned now is refused, and nothing is counted;
- each check then looks at its key (a response-phase rule), counts it (a
  window) or assesses it (a bucket, a concurrency limit), in order, and the
  first one over its limit that stops ends the evaluation: the rules after
  it are neither evaluated nor counted;
- that refusal may ban the client: a ban rule's ban, which escalates with
  ``ban.increment``; a challenge past the address's ``auto_ban``; or the
  penalty past a challenge rule's ``then_ban_after``. Issuing a ban clears
  the key that triggered it;
- buckets and concurrency slots are charged last, only when the request
  is admitted by all of them and no check refused it (as nginx does with
  several ``limit_req`` zones);
- with ``quotas``, each counting check's (remaining, reset, window) after
  the decision, for the draft RateLimit fields.

It works over a ``StateTable``: the few primitives an in-process backend
implements (the memory store's ``MemoryTable``), and nothing of the policy.
The Redis store runs the same policy in Lua (``sidecar/lua/evaluate.lua``,
and ``RedisStore._combined`` across the slots of a Redis Cluster) for one
round trip and one atomic step; the parity tests hold it to this module.
"""

from __future__ import annotations

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

from sidecar.keys import CountingKey
from sidecar.keystate import limiter_of
from sidecar.limiters.base import DeferredLimiter, Limiter
from sidecar.limiters.records import UNDER_LIMIT, Hit, refused
from sidecar.state import BanIncrement, BanRecord, Check, CheckSpec, Evaluation, PenaltyBan

# What bans react to, kept as notes beside the bans (``StateTable.note``),
# named (kind, address, rule id): the step and length of an address's last
# escalating ban by a rule, and the end of the rule's last penalty counted
# towards then_ban_after. In Redis, ban_history.lua's keys.
BAN_STEP = "ban step"
COUNTED_PENALTY = "counted penalty"
Note = tuple[str, str, str]


class StateTable(Protocol):
    """The primitives an in-process backend implements: the state of each
    key, the ban of each address, and the notes that bans react to. The
    table bounds and expires them as it likes (the memory store's evicts
    the least recently used), and decides nothing.

    States are the limiters' own objects, changed in place: a state read
    and counted is not written back."""

    def state(self, key: Hashable) -> Any:
        """The key's stored state, or None. A read is a use: when the
        table is full, the least recently used keys go first."""

    def keep(self, key: Hashable, state: Any) -> None:
        """Store a state the key does not hold yet: a new key's, or one
        that replaces a state of another algorithm."""

    def expect(self, checks: Sequence[Check]) -> None:
        """A hint, given before the checks' keys are read in turn: a table
        may ask for their memory ahead (the compiled memory map does), or
        ignore it."""

    def forget(self, key: Hashable) -> bool:
        """Drop the key's state; whether it had one."""

    def ban(self, address: str) -> BanRecord | None:
        """The address's ban record, in force or ended; None when none is kept."""

    def keep_ban(self, record: BanRecord) -> None:
        """Keep a ban record, replacing the address's."""

    def note(self, name: Note, now: float) -> Any:
        """The value of a note kept until after ``now``, else None."""

    def keep_note(self, name: Note, value: Any, until: float) -> None:
        """Keep a note until ``until``, replacing the one of that name."""


def evaluated(hits: list[Hit]) -> Evaluation:
    """The evaluation of a request whose hits are being appended to
    ``hits``: no ban, no delay yet (made for every request; compiled,
    without the call of the class and its defaults)."""
    evaluation = cython.cast(Evaluation, Evaluation.__new__(Evaluation))  # compiled: no type test
    evaluation.ban = None
    evaluation.new_ban = False
    evaluation.hits = hits
    evaluation.delay = 0.0
    evaluation.quotas = None
    return evaluation


def carried_over(state: Any, limiter: Limiter) -> Any:
    """A state counted by a limiter that a reload replaced: its counts carry
    over to a limiter of the same algorithm, else it starts anew (None)."""
    if type(limiter_of(state)) is not type(limiter):
        return None
    state.limiter = limiter
    return state


@cython.cclass
class TableInC:
    """A table whose primitives the compiled policy calls in C rather than
    as bound methods (the node's table, ``sidecar.store.node``): a base
    without state whose methods its subclass overrides. The memory table's
    map is called in C as it is (``_compiled_map``)."""

    def state(self, key: Hashable) -> Any:
        raise NotImplementedError

    def keep(self, key: Hashable, state: Any) -> None:
        raise NotImplementedError

    def expect(self, checks: Sequence[Check]) -> None:
        raise NotImplementedError

    def ban(self, address: str) -> BanRecord | None:
        raise NotImplementedError

    # What the engine asks of the node's table in C, for every check.

    def catch_up(self) -> bool:
        """Catch up with what other processes changed (a table of one
        process's own has nothing to): whether anything had."""
        return False

    def decide(self, policy: Policy, now: float, address: str, checks: Sequence[Check], can_delay: bool,
               quotas: bool) -> Evaluation:
        """``policy.evaluate`` of the checks over this table, as one
        transaction."""
        raise NotImplementedError


@cython.cclass
class _CalledByName(TableInC):
    """Any other table (the memory table without the compiled map, a
    plug-in's, the tests'), its primitives called by name: the policy
    reads and writes every table but the compiled map through
    ``TableInC``."""

    def __init__(self, table: StateTable) -> None:
        self.table = table

    def state(self, key: Hashable) -> Any:
        return self.table.state(key)

    def keep(self, key: Hashable, state: Any) -> None:
        self.table.keep(key, state)

    def expect(self, checks: Sequence[Check]) -> None:
        self.table.expect(checks)

    def ban(self, address: str) -> BanRecord | None:
        return self.table.ban(address)


def _compiled_map(table: StateTable) -> Any:
    """The table's map when the policy can call it in C: compiled, the
    memory table's compiled map (sidecar._statemap); else None."""
    states = getattr(table, "states", None)
    kind = type(states)
    return states if cython.compiled and (kind.__module__, kind.__name__) == ("sidecar._statemap", "StateMap") else None


def _keep(states: Any, in_c: TableInC, key: Hashable, state: Any, limiter: Limiter) -> None:
    """A state stored: by the compiled map in C, its expiry asked of its
    limiter in C, else by the table (``TableInC``)."""
    if states is not None:
        states.store(key, state, limiter.expires_at(state))
    else:
        in_c.keep(key, state)


class Policy:
    """The request-phase policy over one table; bans it issues are signed
    with ``node`` and stamped with ``wall_clock``."""

    __slots__ = ("table", "node", "wall_clock", "_map", "_in_c")

    def __init__(self, table: StateTable, node: str, wall_clock: Callable[[], float] = time.time) -> None:
        self.table = table
        self.node = node
        self.wall_clock = wall_clock
        # Compiled, over the memory table's compiled map: the map itself,
        # whose reads and writes evaluate calls in C (else through the
        # table's bound methods, a Python call each).
        self._map = _compiled_map(table)
        self._in_c = table if isinstance(table, TableInC) else _CalledByName(table)

    def evaluate(self, now: float, address: str, checks: Sequence[Check], can_delay: bool = True,
                 quotas: bool = False) -> Evaluation:
        """The ban check and every check in order, in one step; see the
        module's docstring. ``can_delay`` False refuses a request a leaky
        bucket would hold (the wait queue is full)."""
        in_c = self._in_c
        ban = in_c.ban(address)
        if ban is not None and now < ban.expires:
            return Evaluation(ban=ban)
        hits: list[Hit] = []
        evaluation = evaluated(hits)
        deferred: list[tuple[CountingKey, DeferredLimiter, Any, bool, Hit]] = []
        stopped = False
        states = self._map  # the compiled map, read and written in C; else the table
        if len(checks) > 1:
            if states is not None:
                states.expect(checks)
            else:
                in_c.expect(checks)
        for check in checks:
            spec = check.spec
            key = check.key
            limiter = spec.limiter
            state = states.get(key) if states is not None else in_c.state(key)
            if state is not None and limiter_of(state) is not limiter:
                state = carried_over(state, limiter)
            if not spec.count:  # a look: a response-phase rule's penalty
                hit = limiter.peek(state, now) if state is not None else UNDER_LIMIT
            elif not spec.deferred:  # the limiter's, read in C
                if state is None:
                    # A key never seen (or forgotten): under key rotation, most of them.
                    state = limiter.new_state()
                    hit = limiter.hit(state, now, spec.threshold, spec.amount)
                    _keep(states, in_c, key, state, limiter)
                else:
                    hit = limiter.hit(state, now, spec.threshold, spec.amount)
            else:  # a bucket or a concurrency limit: assessed now, charged last
                bucket: DeferredLimiter = limiter  # type: ignore[assignment]  # deferred: the protocol's other half
                stored = state is not None
                if not stored:
                    state = bucket.new_state()
                hit = bucket.assess(state, now, check.lease, spec.amount)
                if hit.delay and not can_delay:
                    hit = refused(hit.delay)  # the wait queue is full: refuse
                elif hit.over_limit and not stored and bucket.expires_at(state) > now:
                    # A new key refused by its own bucket (a batch beyond the
                    # burst, Envoy's hits_addend) whose refusal started the
                    # rule's penalty: kept for it, as in Redis.
                    _keep(states, in_c, key, state, limiter)
                    stored = True
                deferred.append((key, bucket, state, stored, hit))
            hits.append(hit)
            if hit.over_limit and spec.stops:
                stopped = True
                if address:
                    self._refused(evaluation, now, address, spec, key, hit)
                break
        if deferred and not stopped:
            # One over its limit that did not refuse (observe mode) is not
            # charged itself. A refused request leaves no new key (a ban
            # cleared its key), but for a penalty its own bucket's refusal
            # started (above).
            for key, limiter, state, stored, hit in deferred:
                if not hit.over_limit:
                    limiter.commit(state, hit)
                    evaluation.delay = max(evaluation.delay, hit.delay)
                    if not stored:
                        _keep(states, in_c, key, state, limiter)
        if quotas and evaluation.ban is None:
            evaluation.quotas = [check.limiter.quota(self.state_for(check.key, check.limiter), now, check.threshold)
                                 if check.spec.count else None for check in checks]
        return evaluation

    def _refused(self, evaluation: Evaluation, now: float, address: str, spec: CheckSpec, key: CountingKey,
                 hit: Hit) -> None:
        """What a stopping refusal of the address's request does beyond the
        refusal: a ban, when the rule, its auto-ban or its then_ban_after
        calls for one."""
        ban_key, ban_duration = key, spec.ban_duration
        auto_ban = spec.auto_ban
        if auto_ban is not None:
            # One more challenge for this address: past the auto-ban
            # threshold, a ban instead.
            ban_key = auto_ban.key(address)
            if self.count(ban_key, auto_ban.limiter, now, auto_ban.threshold, 1).over_limit:
                ban_duration = auto_ban.duration
        penalty_ban = spec.penalty_ban
        if penalty_ban is not None and ban_duration is None and \
                self._unsolved_penalty(now, address, spec.rule_id, hit, penalty_ban):
            ban_key, ban_duration = penalty_ban.key(spec.rule_id, address), penalty_ban.duration
        if ban_duration is not None:
            # Issuing a ban clears the triggering key.
            self.table.forget(ban_key)
            evaluation.ban = self.ban(now, address, spec.rule_id, ban_duration,
                                      spec.ban_increment if ban_duration == spec.ban_duration else None)
            evaluation.new_ban = True

    def _unsolved_penalty(self, now: float, address: str, rule_id: str, hit: Hit,
                          penalty_ban: PenaltyBan) -> bool:
        """Count the penalty this challenged request is in, once (a new
        penalty can only start after the last counted one ended); True when
        it is one past ``then_ban_after`` within the day."""
        name = (COUNTED_PENALTY, address, rule_id)
        if self.table.note(name, now) is not None:
            return False
        self.table.keep_note(name, True, now + hit.retry_after)
        return self.count(penalty_ban.key(rule_id, address), penalty_ban.limiter, now, penalty_ban.threshold,
                          1).over_limit

    def ban(self, now: float, address: str, rule_id: str, duration: float,
            increment: BanIncrement | None = None, reason: str = "") -> BanRecord:
        """Ban an address (a rule's ban, or one by hand with a ``reason``
        and no rule id), replacing any ban it has."""
        step = 0
        if increment is not None:
            step, duration = self._escalated(now, address, rule_id, duration, increment)
        record = BanRecord(address, rule_id, self.node, self.wall_clock(), now + duration, duration, step=step,
                           reason=reason)
        self.table.keep_ban(record)
        return record

    def _escalated(self, now: float, address: str, rule_id: str, duration: float,
                   increment: BanIncrement) -> tuple[int, float]:
        """The step and length of an escalating ban, remembered until
        ``remember`` after it ends (a lifted ban is remembered all the same)."""
        name = (BAN_STEP, address, rule_id)
        step, duration = increment.following(duration, self.table.note(name, now))
        self.table.keep_note(name, (step, duration), now + duration + increment.remember)
        return step, duration

    def count(self, key: Hashable, limiter: Limiter, now: float, threshold: float, amount: int) -> Hit:
        """Count at once, whatever the limiter (a bucket is charged when it
        has room): a reported response, a challenge towards the auto-ban, a
        penalty towards then_ban_after."""
        table = self.table
        state = table.state(key)
        if state is not None and (limiter_of(state) is limiter or carried_over(state, limiter) is not None):
            return limiter.hit(state, now, threshold, amount)
        state = limiter.new_state()  # a new key, or the rule was reloaded as another algorithm
        hit = limiter.hit(state, now, threshold, amount)
        table.keep(key, state)
        return hit

    def state_for(self, key: Hashable, limiter: Limiter) -> Any:
        """The key's state for this limiter, stored or new (not stored)."""
        state = self.table.state(key)
        if state is not None and limiter_of(state) is not limiter:
            state = carried_over(state, limiter)
        return state if state is not None else limiter.new_state()

    def release(self, lease: str, keys: Sequence[Hashable]) -> int:
        """Give back the concurrency slots taken under ``lease``, one per
        key; how many were held. A key with no slot held is forgotten."""
        released = 0
        table = self.table
        for key in keys:
            state = table.state(key)
            # A reload may have made the key another kind's.
            own = limiter_of(state) if state is not None else None
            if own is not None and own.leases and own.release(state, lease):
                released += 1
                if not state.held:
                    table.forget(key)
        return released

    def reset(self, keys: Sequence[Hashable]) -> int:
        """Clear the keys' counters and penalties; how many were stored."""
        forget = self.table.forget
        return sum(forget(key) for key in keys)
