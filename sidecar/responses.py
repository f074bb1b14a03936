"""The response phase (SPEC §8): a reported response counts for the rules
that were pending on its request.

The pending (rule, threshold, key values) travel with the request in a
signed token (sidecar.pending) that the proxy hands back with the response's
status and headers; nothing is kept in Sluice between the two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sidecar.limiters import Hit
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
        """Count the response for every pending rule whose response
        condition matches; how many counted."""
        prepared = self._counts(token, status, headers)
        if prepared is None:
            return 0
        engine = self._engine
        try:
            hits = await engine.store.record(engine.clock(), prepared[1])
        except StoreUnavailable as exc:
            engine.store_failed(exc)  # the counts are lost, as with a lost report
            return 0
        return self._counted(*prepared, hits)

    def _counts(self, token: str, status: int, headers: dict[str, str]
                ) -> tuple[list[CompiledRule], list[ResponseCount]] | None:
        """The counts a report makes, or None when it makes none."""
        engine = self._engine
        entries = engine.pending.open(token)
        metrics = engine.metrics
        if entries is None:
            metrics.reports_refused.inc()
            return None
        metrics.reports.inc()
        ruleset = engine.ruleset
        rules: list[CompiledRule] = []
        counts: list[ResponseCount] = []
        for rule_id, threshold, values in entries:
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
