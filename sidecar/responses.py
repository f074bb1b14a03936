"""The response phase: a reported response counts for the rules
that were pending on its request, and gives back the concurrency slots the
request held.

The pending (rule, threshold, key values), and the slots with the request's
lease id, travel with the request in a signed token (sidecar.pending) that
the proxy hands back with the response's status and headers; nothing is
kept in Sluice between the two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sidecar.keys import CountingKey
from sidecar.limiters import Hit
from sidecar.pending import Pending, SlotEntry
from sidecar.rules import CompiledRule
from sidecar.state import ResponseCount
from sidecar.store import StoreUnavailable

if TYPE_CHECKING:
    from sidecar.engine import Engine


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
        resets = self._resets(pending, status)
        if resets:
            try:
                await engine.store.reset(resets)
            except StoreUnavailable as exc:
                engine.store_failed(exc)  # the key keeps its count, as with a lost report
            engine.metrics.resets.inc(len(resets))
        prepared = self._counts(pending, status, headers)
        if prepared is None:
            return 0
        try:
            hits = await engine.store.record(engine.clock(), prepared[1])
        except StoreUnavailable as exc:
            engine.store_failed(exc)  # the counts are lost, as with a lost report
            return 0
        return self._counted(*prepared, hits)

    async def _release(self, pending: Pending) -> None:
        engine = self._engine
        keys = self._slot_keys(pending.slots)
        if not keys:
            return
        try:
            released = await engine.store.release(pending.lease, keys)
        except StoreUnavailable as exc:
            engine.store_failed(exc)  # the slots end with their lease, as with a lost report
            return
        engine.metrics.released.inc(released)

    def _slot_keys(self, slots: list[SlotEntry]) -> list[CountingKey]:
        """The counting keys of the slots; a reload that removed a rule, or
        changed its dimensions, leaves its slots to their leases."""
        by_id = self._engine.ruleset.by_id
        keys: list[CountingKey] = []
        for rule_id, values in slots:
            rule = by_id.get(rule_id)
            if rule is not None and len(values) == len(rule.key_prefix[1]):
                keys.append((rule.key_prefix, *values))
        return keys

    def _resets(self, pending: Pending, status: int) -> list[CountingKey]:
        """The keys this response clears: of the pending rules whose
        ``reset_on`` names its status."""
        by_id = self._engine.ruleset.by_id
        keys: list[CountingKey] = []
        for rule_id, _, values in pending.counts:
            rule = by_id.get(rule_id)
            if rule is not None and rule.reset_on is not None and status in rule.reset_on \
                    and len(values) == len(rule.key_prefix[1]):
                keys.append((rule.key_prefix, *values))
        return keys

    def _counts(self, pending: Pending, status: int, headers: dict[str, str]
                ) -> tuple[list[CompiledRule], list[ResponseCount]] | None:
        """The counts a report makes, or None when it makes none."""
        ruleset = self._engine.ruleset
        rules: list[CompiledRule] = []
        counts: list[ResponseCount] = []
        for rule_id, threshold, values in pending.counts:
            rule = ruleset.by_id.get(rule_id)
            # A reload may have removed the rule or changed its dimensions.
            if rule is None or rule.response is None or len(values) != len(rule.key_prefix[1]):
                continue
            amount = rule.response.amount(status, headers)
            if amount:
                rules.append(rule)
                counts.append(ResponseCount((rule.key_prefix, *values), rule.limiter, threshold, amount))
        return (rules, counts) if counts else None

    def _counted(self, rules: list[CompiledRule], counts: list[ResponseCount], hits: list[Hit]) -> int:
        engine = self._engine
        for rule, count, hit in zip(rules, counts, hits):
            if not hit.over_limit:
                engine.metrics.hit(rule.id)
                engine.log.counted(rule, count)
        return sum(not hit.over_limit for hit in hits)
