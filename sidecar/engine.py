"""The request-phase pipeline: exempt, ban, rules in order, answer.

The engine talks to one ``StateStore`` and awaits it; it never learns which
backend it has."""

from __future__ import annotations

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

import dataclasses
import enum
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sidecar.actions import BlockPage, draft_fields
from sidecar.at_once import run_at_once
from sidecar.challenge import Challenges, IssuedChallenge
from sidecar.clientip import UNKNOWN_CLIENT, ClientAddress
from sidecar.crowdsec import BAN, CrowdSecDecision
from sidecar.decisionlog import DecisionLog
from sidecar.keys import key_values
from sidecar.latency import RuleSetCount
from sidecar.limiters.records import Hit
from sidecar.matching import COMPILED
from sidecar.metrics import Metrics
from sidecar.networkbans import NetworkBans
from sidecar.overload import (
    BEHIND_SHARE,
    PROXY_SECONDS,
    SHARED_STORED_SECONDS,
    STORED_SECONDS,
    AddressRefusals,
    RefusalMemory,
    StoredRefusal,
    proxy_expires,
)
from sidecar.pending import PendingEntry, PendingTokens, SlotEntry
from sidecar.policy import Policy, TableInC
from sidecar.ratelog import RateLimitedLog
from sidecar.request import UNRESOLVED, CheckRequest
from sidecar.responses import ResponsePhase
from sidecar.rules import CompiledRule, Ruleset
from sidecar.signing import derive_key
from sidecar.state import BanRecord, Check, Clock, Evaluation, epoch_clock
from sidecar.store import StateStore, StoreUnavailable, open_local_counts, open_store
from sidecar.store.local import PlainEvaluation, plain_evaluation, plain_policy, plain_table
from sidecar.tokens import Tokens

if TYPE_CHECKING:
    from sidecar.tracing import Tracing

log = logging.getLogger("sluice")


def retry_after_seconds(wait: float) -> int:
    """Whole seconds until the key may send again: rounded up, at least 1."""
    return max(1, math.ceil(wait))


class Outcome(enum.StrEnum):
    """What the proxy is told: let the request in, refuse it with a page,
    or close the client's connection."""

    ALLOW = "allow"
    DENY = "deny"
    CLOSE = "close"


ALLOW, DENY, CLOSE = Outcome.ALLOW, Outcome.DENY, Outcome.CLOSE


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """The answer for the proxy.

    ``rule`` is the rule whose headers the response carries (the one that
    ended evaluation, or else the first over-limit ``log`` rule); ``page`` is
    set for a ``deny``.
    """

    outcome: Outcome
    rule: CompiledRule | None = None
    limit: int = 0  # X-RateLimit-Limit
    reset: int = 0  # X-RateLimit-Reset
    retry_after: int = 0
    page: BlockPage | None = None
    pending: str | None = None  # token for the response report
    delay: float = 0.0  # hold an allowed request this long first (leaky bucket)
    quota: tuple[str, str] | None = None  # RateLimit-Policy and RateLimit values
    challenge: IssuedChallenge | None = None  # set for a challenge page

    @property
    def over_limit(self) -> bool:
        return self.rule is not None


ALLOWED = Decision(outcome=ALLOW)
CLOSED = Decision(outcome=CLOSE)
# fail: closed and the shared store unavailable: a refusal no rule
# made, with the built-in 503 page.
STORE_UNAVAILABLE = Decision(outcome=DENY, retry_after=1, page=BlockPage.builtin(503))
# The page of a late check refused by an `overload: closed` rule.
OVERLOADED_PAGE = BlockPage.builtin(503)
# The RefusalMemory entry of a banned client key (no rule id is empty).
BANNED = ""


@dataclass(slots=True)
class Tally:
    """The answer to checks a front door made itself (``decide_checks``:
    the Rate Limit Service's descriptors): the store's ``evaluation``, and
    for each check in order whether it is over its limit (refused by a
    ban, or not evaluated because a ban ended the evaluation, included).
    ``banned``: the client was refused by a ban issued before; ``failed``:
    the store did not answer, and the whole request is let in (ALLOW, fail:
    open) or refused (DENY, fail: closed)."""

    evaluation: Evaluation
    over: list[bool]
    banned: bool = False
    failed: Outcome | None = None


class Engine:
    """Evaluates requests against the current ruleset and the state store.

    ``ruleset`` may be replaced at any time (reload): a request sees either
    the old or the new rules, never a mix, because it reads the attribute once.
    """

    def __init__(self, ruleset: Ruleset, store: StateStore | None = None,
                 clock: Clock = epoch_clock, metrics: Metrics | None = None,
                 secret: bytes | None = None, wall_clock: Clock = time.time, workers: int = 1) -> None:
        self.ruleset = ruleset
        self.workers = workers  # processes of one sluice serve: they share a CrowdSec bouncer key
        self.clock = clock
        self.wall_clock = wall_clock
        # The node's secret: signs tokens and keys the decision log's hashes.
        self._secret = secret or ruleset.secret or os.urandom(32)
        self.tokens = Tokens.from_secret(self._secret, wall_clock)
        self.store: StateStore = store if store is not None else \
            open_store(ruleset.backend, ruleset.url, ruleset.max_keys, ruleset.node, clock,
                       cluster=ruleset.cluster, sentinel=ruleset.sentinel)
        self.metrics = metrics if metrics is not None else Metrics()
        self._checks = self.metrics.checks  # counted by every check (compiled: a C field's)
        self.log = DecisionLog(lambda: self._ruleset.node, wall_clock, keys=lambda: self._ruleset.log_keys,
                               secret=lambda: self._secret, clock=clock)
        self.responses = ResponsePhase(self)
        self._credential_check = self._has_credential  # bound once: the rules get it for every request
        # Counted always, logged at most every 10 s / 60 s.
        self._store_error_log = RateLimitedLog(log, 10)
        self._bad_address_log = RateLimitedLog(log, 60, clock)
        # Requests held by a leaky bucket right now, or about to be: a
        # decision takes a slot before asking the store, and a decision that
        # holds keeps it until the caller's release_hold (state.max_delayed).
        self.delayed = 0
        # What this node refused and still refuses, for late checks
        # (sidecar.overload), and how far the serving loop is behind (the
        # HTTP service sets it; without one, checks are never late).
        self.refusals = RefusalMemory(ruleset.max_keys)
        self.late_counts = self._late_counts(ruleset)
        self.loop_behind: Clock = lambda: 0.0
        # Answers the HTTP protocol sends again without a decision.
        self.address_refusals = AddressRefusals(ruleset.max_keys)
        # The store whose policy decide_now calls as a plain function, and
        # that function (None: its evaluate is run as a coroutine).
        self._plain_for: object = None
        # The rules the last request was counted by, and their set's count
        # (_count_rules).
        self._counted_ids: list[str] = []
        self._counted: RuleSetCount | None = None
        self._plain: PlainEvaluation | None = None
        self._policy: Policy | None = None  # the memory store's policy, when _plain is its evaluate
        # The node-wide store's table and the policy it decides with (None
        # for any other store: _learn_store), and its network bans.
        self._table: TableInC | None = None
        self._table_policy: Policy | None = None
        self._table_bans = NetworkBans()
        self.metrics.jwt_keys = lambda: self._ruleset.jwt.key_count if self._ruleset.jwt is not None else 0
        self.metrics.crowdsec_decisions = lambda: self._ruleset.crowdsec.table.counts \
            if self._ruleset.crowdsec is not None else None
        self._start(ruleset)
        # A span per check, when sluice serve --otlp-endpoint is given (sidecar.tracing).
        self.tracing: Tracing | None = None

    @property
    def ruleset(self) -> Ruleset:
        """The rules every request is decided by; replaced at reload."""
        return self._ruleset

    @ruleset.setter
    def ruleset(self, ruleset: Ruleset) -> None:
        # With it, what every check reads of it (compiled: C fields).
        self._ruleset = ruleset
        self._match = ruleset.match
        # Compiled, the rules run as a program (sidecar.matching); the pure
        # core runs the matcher, which is faster there.
        self._program = ruleset.program if COMPILED else None
        self._resolver = ruleset.resolver
        self._exempt = ruleset.exempt
        self._exempting = bool(ruleset.exempt.networks)
        self._crowdsec = ruleset.crowdsec
        self._holds = ruleset.holds
        self._leases = ruleset.leases
        self._draft_headers = ruleset.draft_headers

    @property
    def pending(self) -> PendingTokens:
        return self.tokens.pending

    @property
    def challenges(self) -> Challenges:
        return self.tokens.challenges

    def reload(self, ruleset: Ruleset) -> None:
        """Run new rules from the next request on; counters and bans stay."""
        if ruleset.secret is not None:
            self._secret = ruleset.secret
            self.tokens = Tokens.from_secret(ruleset.secret, self.wall_clock)
        self.store.configure(ruleset.max_keys, ruleset.node)
        self.refusals.capacity = self.address_refusals.capacity = ruleset.max_keys
        old = self._ruleset.jwt
        if old is not None and ruleset.jwt is not None:
            ruleset.jwt.follow(old)
        previous = self._ruleset
        if previous.crowdsec is not None and ruleset.crowdsec is not None:
            ruleset.crowdsec.follow(previous.crowdsec)
        self._start(ruleset)
        self.ruleset = ruleset
        if old is not None and old is not ruleset.jwt:
            old.close()
        self._close_crowdsec(previous)
        self.forget_refusals()

    def _start(self, ruleset: Ruleset) -> None:
        """The ruleset's tokens are read on this engine's wall clock and
        counted in its metrics, a JWKS URL is fetched from now on, its
        tiers read the store's assignments, and a CrowdSec Local API is
        polled (and sent alerts) from now on."""
        if ruleset.jwt is not None:
            ruleset.jwt.start(self.wall_clock, self.metrics.jwt_tokens, self.metrics.jwt_fetches)
        if ruleset.tiers is not None:
            ruleset.tiers.assigned = self.store.tier_assignments
        metrics = self.metrics
        if ruleset.crowdsec is not None:
            ruleset.crowdsec.start(self.clock, metrics.crowdsec_polls, metrics.crowdsec_ignored,
                                   whole_list=self.workers > 1)
        if ruleset.crowdsec_push is not None:
            ruleset.crowdsec_push.start(metrics.crowdsec_alerts)

    @staticmethod
    def _close_crowdsec(ruleset: Ruleset) -> None:
        if ruleset.crowdsec is not None:
            ruleset.crowdsec.close()
        if ruleset.crowdsec_push is not None:
            ruleset.crowdsec_push.close()

    def close(self) -> None:
        """Stop what runs beside the decisions (a JWKS URL's fetches, a
        CrowdSec Local API's polls and alerts, the export of spans, after
        the last batch)."""
        if self._ruleset.jwt is not None:
            self._ruleset.jwt.close()
        self._close_crowdsec(self._ruleset)
        if self.tracing is not None:
            self.tracing.close()

    def derived_key(self, purpose: bytes) -> bytes:
        """A key of the node's secret for one ``purpose`` (a trace's hashes)."""
        return derive_key(self._secret, purpose)

    def forget_refusals(self) -> None:
        """State changed other than by a decision (a reload, a ban lifted or
        issued by hand, keys reset): what was refused is decided anew, and
        late checks are counted anew."""
        self.refusals = RefusalMemory(self.refusals.capacity)
        self.address_refusals.clear()
        self.late_counts = self._late_counts(self._ruleset)

    def _late_counts(self, ruleset: Ruleset) -> Policy:
        """Where late checks that an `overload: open` rule lets in are
        counted: this node's memory, bounded like the store."""
        return open_local_counts(ruleset.max_keys, ruleset.node, self.clock, self.wall_clock)

    def refused_again(self, stored: StoredRefusal, front_door: str) -> None:
        """Count a stored refusal sent again as its decision was counted,
        the front door's answer included: one call into the metrics, and
        one into the decision log for a rule's refusal."""
        self.metrics.refused_again(stored.rule_id, stored.action, front_door,  # type: ignore[arg-type]
                                   stored.outcome)
        if stored.rule_id:
            self.log.folded(stored.log_key)

    # -- client address ---------------------------------------------------

    def resolve_client(self, peer: str, forwarded_for: str | None) -> ClientAddress:
        client = self._ruleset.resolver.resolve(peer, forwarded_for)
        if client is UNKNOWN_CLIENT:
            self._unknown_client(peer)
        return client

    def _unknown_client(self, peer: str) -> None:
        """Counted as the empty value, in a metric always and in the log at
        most once per minute."""
        self.metrics.invalid_address.inc()
        self._bad_address_log.warning("client address missing or invalid (%r); counting it as the "
                                      "empty value (reported once per minute)", peer[:100])

    # -- the decision -----------------------------------------------------

    async def decide(self, request: CheckRequest) -> Decision:
        """The decision for one request: one call to the store, or none for
        a check that came too late (see ``late``). A request a front door
        described (its client ``UNRESOLVED``) has its client resolved first,
        once. Over a store that answers at once (this node's memory) it is
        ``decide_now``: no coroutine of its own, nor of the store's."""
        if self.store.answers_at_once:
            return self.decide_now(request)
        if request.client is UNRESOLVED:
            self._resolve(request)
        if request.sent and self.late(request.sent):
            return self._overloaded(request)
        prepared = self._prepare(request)
        if not isinstance(prepared, tuple):  # a Decision (tested in C, where a Python class's isinstance walks it)
            return prepared
        # The hold slot is taken before the store is asked: decisions in
        # flight at once must not all see the same free room.
        held = self._reserve_hold(prepared[1]) if self._holds else False
        decision: Decision | None = None
        try:
            now = self.clock()
            evaluated = await self._evaluate(now, request.client.key, prepared[1], held, self._draft_headers)
            if not isinstance(evaluated, Evaluation):
                decision = evaluated  # a Decision: the store did not answer
            else:
                matched, checks = prepared
                decision = self._conclude(request, matched, checks, evaluated)
                if decision.outcome is ALLOW:
                    # The shared store admitted it: so does this node's count of
                    # late checks, which then starts from this node's share.
                    self._count_here(now, matched, checks, admitted=True)
        finally:
            if held:
                self._release_unless_held(decision)
        return decision

    @cython.locals(request=CheckRequest)
    def decide_now(self, request: CheckRequest) -> Decision:
        """``decide`` as a plain function, over a store that answers at
        once (the memory store): what the HTTP protocol runs for every
        check, and replay and tests. Over such a store a late check is
        decided in full all the same: the decision costs a few µs beside
        the check's own reading and writing, and counts exactly. Over a
        shared store, ``decide``'s coroutine run at once (it must not wait)."""
        store = self.store
        if not store.answers_at_once:
            return run_at_once(self.decide(request))
        if request.client is UNRESOLVED:
            self._resolve(request)
        prepared = self._prepare(request)
        if not isinstance(prepared, tuple):  # a Decision (tested in C, where a Python class's isinstance walks it)
            return prepared
        matched, checks = prepared
        held = self._reserve_hold(checks) if self._holds else False
        decision: Decision | None = None
        try:
            evaluated = self._evaluate_now(store, self.clock(), request.client.key, checks, held,
                                           self._draft_headers)
            if not isinstance(evaluated, Evaluation):
                decision = evaluated  # a Decision: the store did not answer
            else:
                decision = self._conclude(request, matched, checks, evaluated)
        finally:
            if held:
                self._release_unless_held(decision)
        return decision

    def _resolve(self, request: CheckRequest) -> None:
        """The client of a request a front door described (``UNRESOLVED``):
        ``resolve_client``, written out (this runs for every check)."""
        resolver = self._resolver
        client = resolver.resolve(request.peer, request.forwarded_for)
        if client is UNKNOWN_CLIENT:
            self._unknown_client(request.peer)
        request.client = client

    async def decide_checks(self, checks: list[Check], client: str, shadow: Sequence[bool],
                            domain: str) -> Tally:
        """The pipeline of a front door that makes its checks itself (the
        Rate Limit Service's descriptors), in the store the rules count in:
        every check counted on its own and asked its quota, in one step.
        ``client`` is the client key a ban is issued to ("" for none). A
        check over its limit is counted by its rule id and written to the
        decision log under ``domain``; a ``shadow`` one (same order as
        ``checks``) only observed."""
        metrics = self.metrics
        self._checks.value += 1
        if not checks:
            return Tally(Evaluation(), [])
        evaluation = await self._evaluate(self.clock(), client, checks, False, True)
        if isinstance(evaluation, Decision):
            return Tally(Evaluation(), [], failed=evaluation.outcome)
        banned = evaluation.ban is not None and not evaluation.new_ban
        if evaluation.new_ban:
            self._push_ban(evaluation.ban)
        hits = evaluation.hits
        evaluated = len(hits)
        over: list[bool] = []
        for index, check in enumerate(checks):
            refused = banned or index >= evaluated or hits[index].over_limit
            over.append(refused)
            if refused:
                observed = shadow[index]
                metrics.over_limit(check.rule_id, "log" if observed else
                                   "ban" if check.ban_duration is not None else "block")
                self.log.rls(domain, check.rule_id, check.key, observed, banned or evaluation.new_ban)
        return Tally(evaluation, over, banned)

    async def _evaluate(self, now: float, client: str, checks: Sequence[Check], can_delay: bool,
                        quotas: bool) -> Evaluation | Decision:
        """The one step of every decision that asks the store (``decide``'s
        and ``decide_checks``'): its evaluation of ``checks`` for the client
        key ``client``, in one call, with a client refused by a ban issued
        before counted; or, when the store did not answer, the decision
        ``state.fail`` gives (fail open or closed; counted and logged)."""
        try:
            evaluation = await self.store.evaluate(now, client, checks, can_delay=can_delay, quotas=quotas)
        except StoreUnavailable as exc:
            return self._unavailable(exc)
        if evaluation.ban is not None and not evaluation.new_ban:
            self.metrics.banned_requests.inc()
        return evaluation

    def _evaluate_now(self, store: StateStore, now: float, client: str, checks: Sequence[Check],
                      can_delay: bool, quotas: bool) -> Evaluation | Decision:
        """``_evaluate`` over a store that answers at once: its policy
        called as a plain function when the store's ``evaluate`` is the
        policy's own (``plain_evaluation``), else its coroutine run at once."""
        if store is not self._plain_for:
            self._learn_store(store)
        policy = self._policy
        table = self._table
        table_policy = self._table_policy
        plain = self._plain
        try:
            if policy is not None:  # the memory store's: called in C
                evaluation = policy.evaluate(now, client, checks, can_delay, quotas)
            elif table is not None and table_policy is not None:  # the node-wide store's transaction: in C
                evaluation = table.decide(table_policy, now, client, checks, can_delay, quotas)
            elif plain is not None:
                evaluation = plain(now, client, checks, can_delay, quotas)
            else:
                evaluation = run_at_once(store.evaluate(now, client, checks, can_delay=can_delay, quotas=quotas))
        except StoreUnavailable as exc:
            return self._unavailable(exc)
        if evaluation.ban is not None and not evaluation.new_ban:
            self.metrics.banned_requests.inc()
        return evaluation

    def _learn_store(self, store: StateStore) -> None:
        """What a check asks of the store, learnt once a store (tests and
        tools may replace the engine's): the memory store's policy, called
        in C; the node-wide store's table, whose transaction and catching
        up with the other workers are called in C, and its network bans;
        else the store's evaluation as a plain function, when it has one."""
        self._plain_for, self._plain = store, plain_evaluation(store)
        policy = plain_policy(store)
        self._policy = policy if type(policy) is Policy else None
        shared = plain_table(store)
        self._table = self._table_policy = None
        if shared is not None:
            self._table, self._table_policy, self._table_bans = shared

    # -- overload (sidecar.overload) ------------------------------------------

    def late(self, sent: float) -> bool:
        """Whether a check the proxy sent at ``sent`` (Unix seconds) waited
        past overload.after, while the serving loop is behind."""
        after = self._ruleset.overload_after
        return self.wall_clock() - sent > after and self.loop_behind() >= after * BEHIND_SHARE

    def _overloaded(self, request: CheckRequest) -> Decision:
        """A late check's answer, without the shared store: refused as this
        node refused the client last, else by the first matching `overload:
        closed` rule, else decided by this node's own count of late checks
        (``late_counts``). Counted by rule and outcome."""
        prepared = self._prepare(request)
        if not isinstance(prepared, tuple):  # a Decision (tested in C, where a Python class's isinstance walks it)
            return prepared
        matched, checks = prepared
        now = self.clock()
        refusals = self.refusals
        tally = self.metrics.overload_decisions
        if request.client.key and refusals.recall((BANNED, request.client.key), now) is not None:
            tally["ban", "refused"] += 1
            self.metrics.banned_requests.inc()
            return CLOSED
        enforcing = [(rule, check) for rule, check in zip(matched, checks) if rule.stops]
        for rule, check in enforcing:
            remembered = refusals.recall((rule.id, check.key), now)
            if remembered is not None:
                tally[rule.id, "refused"] += 1
                self.metrics.over_limit(rule.id, rule.action)
                until, decision = remembered
                assert isinstance(decision, Decision)
                if decision.outcome != DENY:
                    return decision
                return dataclasses.replace(decision, retry_after=retry_after_seconds(until - now))
        for rule, check in enforcing:
            if rule.overload_closed:
                tally[rule.id, "closed"] += 1
                return Decision(outcome=DENY, rule=rule, limit=math.ceil(check.spec.threshold), reset=1,
                                retry_after=1, page=OVERLOADED_PAGE if rule.page is None else rule.page.for_status(503))
        refused = self._count_here(now, matched, checks)
        if refused is not None:
            # Over its limit by this node's own count: refused as a decision
            # would, without a ban (a ban is the shared store's to issue),
            # and remembered as any refusal.
            rule, check, hit = refused
            tally[rule.id, "refused_locally"] += 1
            self.metrics.over_limit(rule.id, rule.action)
            decision = self._apply(request, rule, *self._limit_and_reset(rule, check, hit), hit, False)
            self._remember(request, rule, check, hit, decision, None)
            self.log.matched(request, rule, check, decision.outcome)
            return decision
        tally[enforcing[0][0].id if enforcing else "none", "open"] += 1
        if request.credential:
            self.metrics.credentials.inc()
        return ALLOWED

    def _count_here(self, now: float, matched: list[CompiledRule], checks: list[Check],
                    admitted: bool = False) -> tuple[CompiledRule, Check, Hit] | None:
        """Count a request in ``late_counts``, this node's own count of what
        it let in over a shared store (``admitted`` by the store, or late
        and let in by `overload: open`), for each enforcing rule in order;
        the first one over its limit here, if any, which ends the count."""
        count_now = self.late_counts.count
        for rule, check in zip(matched, checks):
            spec = check.spec
            if not rule.stops or not spec.count or not spec.amount:
                continue  # observed, or a response-phase rule's look: only the shared store knows its penalty
            if admitted and spec.limiter.leases:
                continue  # its slot is given back to the shared store, never to this count
            hit = count_now(check.key, spec.limiter, now, spec.threshold, spec.amount)
            if hit.over_limit:
                return rule, check, hit
        return None

    def _remember(self, request: CheckRequest, rule: CompiledRule, check: Check, hit: Hit,
                  decision: Decision, ban: BanRecord | None) -> None:
        """Note a refusal for late checks: until the client's ban ends, or
        until the rule's key may send again. A challenge is issued anew
        for every request, so it is not remembered."""
        if ban is not None:
            self._refused_by_ban(request, ban)
        elif rule.challenge is None:
            self.refusals.remember((rule.id, check.key), self.clock() + hit.retry_after, decision)

    def _holds_for_the_address(self, request: CheckRequest, rule: CompiledRule, check: Check, hit: Hit,
                               decision: Decision, evaluation: Evaluation) -> None:
        """Say until when the refusal by the ruleset's address-wide rule is
        the answer to every request of this client, as it is now: while its
        Retry-After (and X-RateLimit-Reset) stay the same whole seconds, its
        decision-log line stays folded, and STORED_SECONDS at most."""
        if evaluation.ban is not None:
            return  # the ban's own (_refused_by_ban)
        now = self.clock()
        wait = hit.retry_after
        shown = retry_after_seconds(wait)
        log_key = (rule.id, check.key, decision.outcome, False)
        longest = STORED_SECONDS if self.store.answers_at_once else SHARED_STORED_SECONDS
        request.refused_until = min(now + (wait - (shown - 1) if shown > 1 else wait), now + longest,
                                    self.log.fold_deadline(log_key))
        request.refused_as = (rule.id, rule.action, log_key)
        self._proxy_holds(request, min(wait, PROXY_SECONDS))

    def _refused_by_ban(self, request: CheckRequest, ban: BanRecord) -> None:
        """Note a banned client's refusal: for late checks until the ban
        ends, and, on a store of this node only (a ban lifted on another
        node must let the client in at once), as stored bytes for a while."""
        if not request.client.key:
            return
        self.refusals.remember((BANNED, request.client.key), ban.expires, CLOSED)
        if self._ruleset.address_wide_bans and self.store.answers_at_once:
            now = self.clock()
            request.refused_until = min(ban.expires, now + STORED_SECONDS)
            self._proxy_holds(request, min(ban.expires - now, PROXY_SECONDS))

    def _proxy_holds(self, request: CheckRequest, seconds: float) -> None:
        """Let nginx answer this refusal itself for the next ``seconds``
        (its Retry-After then overstates the wait by that much at most)."""
        now = self.wall_clock()
        request.proxy_expires = proxy_expires(now + seconds, now)

    # -- held requests (leaky-bucket delays) ---------------------------------

    def _reserve_hold(self, checks: list[Check]) -> bool:
        """Take one of ``state.max_delayed`` hold slots for a request that a
        leaky bucket may hold; False when it may not be held (queue full,
        or no rule that holds)."""
        if self.delayed >= self._ruleset.max_delayed or not any(check.limiter.holds for check in checks):
            return False
        self.delayed += 1
        return True

    def _release_unless_held(self, decision: Decision | None) -> None:
        """A reserved slot stays taken only by a decision that holds the
        request; the caller releases it with ``release_hold`` after the wait."""
        if decision is None or decision.delay <= 0:
            self.delayed -= 1

    def release_hold(self) -> None:
        """The wait of a decision with a ``delay`` ended (or was abandoned)."""
        self.delayed -= 1

    def _unavailable(self, exc: StoreUnavailable) -> Decision:
        """The store did not answer (counted and logged): the request let
        in or refused as ``state.fail`` says."""
        self.store_failed(exc)
        return ALLOWED if self._ruleset.fail == "open" else STORE_UNAVAILABLE

    def store_failed(self, exc: Exception) -> None:
        """Counted always, logged at most every 10 s."""
        self.metrics.store_errors.inc()
        self._store_error_log.warning("state store unavailable (%s); requests %s until it answers again "
                                      "(reported every 10 s at most)", exc,
                                      "are allowed" if self._ruleset.fail == "open" else "are refused")

    def _prepare(self, request: CheckRequest) -> Decision | tuple[list[CompiledRule], list[Check]]:
        """The matching rules and their checks, or the decision when the
        store need not be asked."""
        metrics = self.metrics
        self._checks.value += 1  # Tally.inc without the call: every request
        store = self.store
        if store is not self._plain_for:
            self._learn_store(store)
        table = self._table
        if table is not None:
            # The node-wide store's: what other workers changed caught up
            # with (one read of a counter, in C), its network bans read then.
            table.catch_up()
            network_bans = self._table_bans
        else:
            network_bans = store.network_bans  # banned by hand (sidecar.networkbans)
        # Networks are looked up by the address's value (sidecar.clientip.NetworkSet):
        # a new client's address object is never made for them.
        client = request.client
        exempt = self._exempt
        # A client the ruleset's resolver made knows whether it is exempt (no lookup).
        if self._exempting and (client.exempt if client.exempt_by is exempt else client.exempt_in(exempt)):
            return ALLOWED
        # Asked only while a network is banned (nearly never).
        if network_bans.banning and network_bans.find_client(client, self.clock()) is not None:
            metrics.banned_requests.value += 1
            return CLOSED
        crowdsec = self._crowdsec  # a CrowdSec Local API's decisions (sidecar.crowdsec)
        if crowdsec is not None:
            found = crowdsec.table.find_client(client, self.clock())
            if found is not None:
                decided = self._crowdsec_decision(request, found)
                if decided is not None:
                    return decided

        matched: list[CompiledRule] = []
        checks: list[Check] = []
        # The id the request's concurrency slots are taken under, and given
        # back by: unique across nodes and workers without coordination.
        lease = os.urandom(9).hex() if self._leases else ""
        # The rules in order: as a program (sidecar.matching), or their
        # matcher (rules.compile_matcher), handed the fields they read most,
        # read here in C (Ruleset.match_request).
        program = self._program
        if program is not None:
            # The memory map the policy reads the checks' keys from (compiled;
            # known from the first decision on), hinted each key as it is
            # made once it is large enough to take hints.
            states = self._policy._map if self._policy is not None else None
            if states is not None and not states.takes_hints():
                states = None
            ended = program.run(request, client.key, matched, checks, lease, self._credential_check, states)
        else:
            ended = self._match(request, request.method, request.host, request.path, request.headers, client.key,
                                matched, checks, lease, self._credential_check)
        if ended:
            # A challenge credential ended the evaluation: counted when the
            # rules before it let the request in.
            request.credential = True
        if not checks and not store.may_be_banned():
            if request.credential:
                metrics.credentials.inc()
            return ALLOWED
        return matched, checks

    def _crowdsec_decision(self, request: CheckRequest, found: CrowdSecDecision) -> Decision | None:
        """A CrowdSec decision on the client: a ban closes the connection,
        as a network ban does; a captcha gets the challenge of the
        crowdsec: section's rule, unless the request carries its
        credential (None: the rules decide). Counted by what it did."""
        tally = self.metrics.crowdsec_requests
        if found.kind == BAN:
            tally["ban"] += 1
            return CLOSED
        rule = self._ruleset.crowdsec_rule
        assert rule is not None and rule.challenge is not None
        if self._has_credential(rule, request):
            tally["captcha_passed"] += 1
            return None
        tally["captcha"] += 1
        self.metrics.challenges_issued.inc()
        challenge = self.challenges.issue(rule.id, request.client.key, request.tls_fingerprint, request.uri,
                                          self._ruleset.difficulty)
        return Decision(outcome=DENY, rule=rule, retry_after=1, page=rule.page, challenge=challenge)

    def _count_rules(self, ids: list[str]) -> None:
        """``Metrics.count_rules``, with the count it added to last kept:
        added to again while the same rules count the requests (nearly
        always) and the metrics have not added it up since (a scrape)."""
        count = self._counted
        if count is None or not count.live or ids != self._counted_ids:
            self._counted_ids = ids
            count = self._counted = self.metrics.count_of(tuple(ids))
        count.value += 1

    def _conclude(self, request: CheckRequest, matched: list[CompiledRule], checks: list[Check],
                  evaluation: Evaluation) -> Decision:
        """The decision from the store's evaluation."""
        metrics = self.metrics
        if evaluation.ban is not None and not evaluation.new_ban:
            # Banned (counted by _evaluate): no evaluation, no counting, no
            # per-request log.
            self._refused_by_ban(request, evaluation.ban)
            return CLOSED

        observed: Decision | None = None
        pending: list[PendingEntry] = []
        # The concurrency slots the store took: one per leasing check within
        # its limit, as the request is not refused.
        slots: list[SlotEntry] = []
        # The ids of the rules that counted the request, added to the
        # metrics at once (_count_rules).
        counted: list[str] = []
        hits = evaluation.hits
        for index in range(len(checks)):  # the three lists in step (compiled: read in C, without zip's tuples)
            rule, check, hit = matched[index], checks[index], hits[index]
            if not hit.over_limit:
                spec = check.spec
                if spec.plain:  # the rule's, read from the check's spec: a field in C
                    counted.append(spec.rule_id)
                    continue
                key = check.key
                if rule.counts:
                    counted.append(rule.id)
                    if rule.reset_on is not None:
                        # A response it names clears the key, when it is reported.
                        pending.append((rule.id, spec.threshold, key_values(key)))
                    if spec.limiter.leases:
                        slots.append((rule.id, key_values(key)))
                else:
                    # Counted, maybe, when the response is reported.
                    pending.append((rule.id, spec.threshold, key_values(key)))
                continue
            if rule.reset_on is not None and rule.counts:
                pending.append((rule.id, check.spec.threshold, key_values(check.key)))
            limit, reset = self._limit_and_reset(rule, check, hit)
            if rule.shadow:
                observed = observed or Decision(outcome=ALLOW, rule=rule, limit=limit, reset=reset)
                self._shadowed(request, rule, check)
                continue
            metrics.over_limits[rule.id, rule.action] += 1
            if check.spec.stops:
                self._count_rules(counted)
                return self._refuse(request, rule, check, hit, limit, reset, evaluation)
            if rule.action == "log" and observed is None:
                observed = Decision(outcome=ALLOW, rule=rule, limit=limit, reset=reset)
            self.log.matched(request, rule, check, "observe" if rule.action == "log" else "verified-bot")
        self._count_rules(counted)
        if request.credential:
            metrics.credentials.inc()
        token = None
        if pending or slots:
            # The report gives the slots back; without a token they end
            # with their lease.
            token = self.pending.issue(pending, checks[0].lease, slots)
            if token is None:
                metrics.unreportable.inc()
        allowed = observed or ALLOWED
        quota = self._quota(matched, checks, evaluation) if self._draft_headers else None
        if token is None and not evaluation.delay and quota is None:
            return allowed
        if evaluation.delay:
            metrics.delayed.inc()
        return Decision(outcome=ALLOW, rule=allowed.rule, limit=allowed.limit, reset=allowed.reset,
                        pending=token, delay=evaluation.delay, quota=quota)

    def _refuse(self, request: CheckRequest, rule: CompiledRule, check: Check, hit: Hit, limit: int, reset: int,
                evaluation: Evaluation) -> Decision:
        """A rule that stops is over its limit: the request refused as its
        action says, remembered for late checks and logged; the refusal of
        the ruleset's address-wide rule holds for the client's every request."""
        decision = self._apply(request, rule, limit, reset, hit, evaluation.new_ban)
        if evaluation.new_ban:
            self._push_ban(evaluation.ban)
        self._remember(request, rule, check, hit, decision, evaluation.ban)
        self.log.matched(request, rule, check, decision.outcome, banned=evaluation.ban is not None,
                         ban=evaluation.ban)
        if rule.id == self._ruleset.address_wide_rule and request.client.key:
            self._holds_for_the_address(request, rule, check, hit, decision, evaluation)
        return decision

    def _push_ban(self, ban: BanRecord | None) -> None:
        """A ban just issued, sent to CrowdSec as an alert when the
        crowdsec: section says so (queued: sent by its own thread)."""
        push = self._ruleset.crowdsec_push
        if push is not None and ban is not None and ban.address and not ban.shadow:
            push.offer(ban, ban.expires - self.clock())

    @staticmethod
    def _limit_and_reset(rule: CompiledRule, check: Check, hit: Hit) -> tuple[int, int]:
        """X-RateLimit-Limit and X-RateLimit-Reset of a rule over its limit.
        Bucket rules without a penalty report when the next request fits."""
        reset = rule.reset if rule.reset is not None else retry_after_seconds(hit.retry_after)
        return math.ceil(check.spec.threshold), reset

    def _shadowed(self, request: CheckRequest, rule: CompiledRule, check: Check) -> None:
        """A shadow rule over its limit: its action is counted and logged
        as it would have been applied; a would-be ban is recorded as a
        shadow ban, which refuses nothing."""
        self.metrics.shadow_action(rule.id, rule.action)
        if rule.ban_duration is not None and request.client.key:
            now = self.clock()
            self.store.record_shadow_ban(BanRecord(request.client.key, rule.id, self._ruleset.node,
                                                   self.wall_clock(), now + rule.ban_duration, rule.ban_duration,
                                                   shadow=True))
        self.log.matched(request, rule, check, "allow", shadow=True)

    def _quota(self, matched: list[CompiledRule], checks: list[Check],
               evaluation: Evaluation) -> tuple[str, str] | None:
        """The draft RateLimit fields for the enforcing request-phase rules
        of an allowed request; the store answered their quotas with the
        evaluation, in the same step."""
        assert evaluation.quotas is not None
        quotas = [(rule.id, check.spec.threshold, quota)
                  for rule, check, quota in zip(matched, checks, evaluation.quotas)
                  if check.spec.count and rule.action != "log" and quota is not None]
        return draft_fields(quotas) if quotas else None

    async def record_response(self, token: str, status: int, headers: dict[str, str]) -> int:
        """The proxy reports a response; how many rules counted it."""
        return await self.responses.record(token, status, headers)

    def record_response_now(self, token: str, status: int, headers: dict[str, str]) -> int:
        """``record_response`` without an event loop (memory store)."""
        return run_at_once(self.record_response(token, status, headers))

    # -- bans, for the admin API --------------------------------------------

    async def active_bans(self) -> list[BanRecord]:
        """The bans in force, then the shadow bans (which refuse nobody)."""
        now = self.clock()
        return await self.store.active_bans(now) + await self.store.shadow_bans(now)

    async def lift_ban(self, address: str) -> bool:
        self.forget_refusals()
        shadow = await self.store.lift_shadow_ban(address)
        return await self.store.lift_ban(address) or shadow

    def _apply(self, request: CheckRequest, rule: CompiledRule, limit: int, reset: int, hit: Hit,
               banned: bool) -> Decision:
        if banned or rule.page is None or rule.page.close:
            # ban, a challenge's auto-ban, or block with close: true
            return Decision(outcome=CLOSE, rule=rule, limit=limit, reset=reset)
        challenge = None
        if rule.challenge is not None:
            self.metrics.challenges_issued.inc()
            challenge = self.challenges.issue(rule.id, request.client.key,
                                              request.tls_fingerprint,
                                              request.uri, self._ruleset.difficulty)
        return Decision(outcome=DENY, rule=rule, limit=limit, reset=reset,
                        retry_after=retry_after_seconds(hit.retry_after), page=rule.page, challenge=challenge)

    def _has_credential(self, rule: CompiledRule, request: CheckRequest) -> bool:
        assert rule.challenge is not None
        credential = request.cookies.get(rule.challenge.cookie) if "cookie" in request.headers else None
        return credential is not None and self.challenges.accepts(
            credential, rule.id, request.client.key, request.tls_fingerprint)
