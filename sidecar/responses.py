"""The response phase: a reported response counts for the rules
that were pending on its request, and gives back the concurrency slots the
request held.

The pending (rule, threshold, key values), and the slots with the request's
lease id, travel with the request in a signed token (sidecar.pending) that
the proxy hands back with the response's status and headers; nothing is
kept in Sluice between the two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from sidecar.decisionlog import DecisionLog
from sidecar.keys import CountingKey
from sidecar.limiters import Hit
from sidecar.metrics import Metrics
from sidecar.pending import KeyValues, Pending, PendingTokens
from sidecar.rules import CompiledRule, Ruleset
from sidecar.state import ResponseCount
from sidecar.store import Deciding, StoreUnavailable


class Engine(Protocol):
    """What the response phase reads of the engine that runs it
    (``sidecar.engine.Engine``): its current rules, store and tokens, and
    where it counts and logs."""

    @property
    def ruleset(self) -> Ruleset: ...
    @property
    def store(self) -> Deciding: ...
    @property
    def pending(self) -> PendingTokens: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def log(self) -> DecisionLog: ...
    @property
    def clock(self) -> Callable[[], float]: ...

    def store_failed(self, exc: Exception) -> None: ...


class ResponsePhase:
    """Counts reported responses against the engine's current rules and store."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def record(self, token: str, status: int, headers: dict[str, str]) -> int:
        """Give back the request's concurrency slots, and count the response
        for every pending rule whose response condition matches; how many
        counted."""
        engine = self._engine
        pending = engine.pending.open(token)
        if pending is None:
            engine.metrics.reports_refused.inc()
            return 0
        engine.metrics.reports.inc()
        if pending.slots:
            await self._release(pending)
        resets, prepared = self._walk(pending, status, headers)
        if resets:
            try:
                await engine.store.reset(resets)
            except StoreUnavailable as exc:
                engine.store_failed(exc)  # the key keeps its count, as with a lost report
            engine.metrics.resets.inc(len(resets))
        if prepared is None:
            return 0
        try:
            hits = await engine.store.record(engine.clock(), prepared[1])
        except StoreUnavailable as exc:
            engine.store_failed(exc)  # the counts are lost, as with a lost report
            return 0
        return self._counted(*prepared, hits)

    def _key(self, rule_id: str, values: KeyValues) -> tuple[CompiledRule, CountingKey] | None:
        """A pending entry's rule and counting key under the rules running
        now; None when a reload removed the rule or changed its dimensions
        (the entry is dropped: its slots end with their lease, its count
        is lost as with a lost report)."""
        rule = self._engine.ruleset.by_id.get(rule_id)
        if rule is None or len(values) != len(rule.key_prefix[1]):
            return None
        return rule, (rule.key_prefix, *values)

    async def _release(self, pending: Pending) -> None:
        engine = self._engine
        keys = [found[1] for found in (self._key(rule_id, values) for rule_id, values in pending.slots)
                if found is not None]
        if not keys:
            return
        try:
            released = await engine.store.release(pending.lease, keys)
        except StoreUnavailable as exc:
            engine.store_failed(exc)  # the slots end with their lease, as with a lost report
            return
        engine.metrics.released.inc(released)

    def _walk(self, pending: Pending, status: int, headers: dict[str, str]
              ) -> tuple[list[CountingKey], tuple[list[CompiledRule], list[ResponseCount]] | None]:
        """What the response does to the pending rules, in one walk: the
        keys it clears (rules whose ``reset_on`` names its status), and the
        counts it makes (None when it makes none)."""
        resets: list[CountingKey] = []
        rules: list[CompiledRule] = []
        counts: list[ResponseCount] = []
        for rule_id, threshold, values in pending.counts:
            found = self._key(rule_id, values)
            if found is None:
                continue
            rule, key = found
            if rule.reset_on is not None and status in rule.reset_on:
                resets.append(key)
            if rule.response is not None:
                amount = rule.response.amount(status, headers)
                if amount:
                    rules.append(rule)
                    counts.append(ResponseCount(key, rule.limiter, threshold, amount))
        return resets, ((rules, counts) if counts else None)

    def _counted(self, rules: list[CompiledRule], counts: list[ResponseCount], hits: list[Hit]) -> int:
        engine = self._engine
        for rule, count, hit in zip(rules, counts, hits):
            if not hit.over_limit:
                engine.metrics.hit(rule.id)
                engine.log.counted(rule, count)
        return sum(not hit.over_limit for hit in hits)
