"""What a replay counts for each rule and each of its keys, and the
figures the report draws from it: peaks and their percentiles, the
histogram of peaks, whom a rule refused, and the rule and its limit in words.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush, nlargest
from typing import Any

from sidecar.config import format_duration
from sidecar.keys import CountingKey
from sidecar.rules import CompiledRule, describe_key

PERCENTILES = (50, 95, 99)
AGENTS_COUNTED = 10  # distinct user agents per key are counted up to this
# A key whose requests carry this many distinct user agents looks like many
# people behind one address (a NAT, a corporate proxy) rather than one client.
SHARED_AGENTS = 5


@dataclass(slots=True)
class KeyStats:
    requests: int = 0  # matching requests, whatever was decided about them
    over_limit: int = 0
    refused: int = 0  # over limit and refused by the rule (not `log`, not a verified bot)
    peak: int = 0  # the most requests (or counted amount) in one period
    in_window: int = 0  # ... in the period up to now
    first_agent: int | None = None  # hash of the first user agent seen
    agents: set[int] | None = None  # made only when a second one appears

    def add_agent(self, agent: str | None) -> None:
        fingerprint = hash(agent)
        if self.agents is None:
            if self.first_agent is None or fingerprint == self.first_agent:
                self.first_agent = fingerprint
                return
            self.agents = {self.first_agent}
        if len(self.agents) < AGENTS_COUNTED:
            self.agents.add(fingerprint)

    @property
    def agent_count(self) -> int:
        return len(self.agents) if self.agents is not None else int(self.first_agent is not None)

    @property
    def shared(self) -> bool:
        """Looks like many clients behind one key: a shared NAT or proxy."""
        return self.agent_count >= SHARED_AGENTS


@dataclass(slots=True)
class RuleStats:
    """What one rule did, and the traffic it saw, key by key."""

    rule: CompiledRule
    period: float  # of the peaks
    matched: int = 0
    allowed: int = 0
    observed: int = 0  # over limit and let through: `log`, or a verified bot on a ban rule
    blocked: int = 0
    challenged: int = 0  # shown the challenge page (whether a browser would solve it, a log cannot say)
    banned: int = 0  # bans issued, a challenge's auto-ban included (the triggering request is closed)
    ban_closed: int = 0  # later requests closed by this rule's bans, whatever they matched
    held: int = 0  # allowed after a leaky-bucket hold
    longest_hold: float = 0.0
    not_reached: int = 0  # matched, but an earlier rule or an active ban answered first
    # Those requests by what answered first: (rule id, "refused" or "ban").
    not_reached_by: Counter[tuple[str, str]] = field(default_factory=Counter)
    responses_counted: int = 0
    keys: dict[CountingKey, KeyStats] = field(default_factory=dict)
    # (time, key, amount) of the last period, oldest first, for the peaks.
    recent: deque[tuple[float, KeyStats, int]] = field(default_factory=deque)
    # A concurrency limit's requests in flight: (end, order, key), soonest first.
    in_flight: list[tuple[float, int, KeyStats]] = field(default_factory=list)

    def add(self, key: CountingKey, now: float, amount: int, agent: str | None,
            duration: float = 0.0) -> KeyStats:
        stats = self.keys.get(key)
        if stats is None:
            stats = self.keys[key] = KeyStats()
        stats.requests += 1
        stats.add_agent(agent)
        if self.rule.limiter.leases:
            self._fly(stats, now, duration)
        elif amount:
            recent = self.recent
            horizon = now - self.period
            while recent and recent[0][0] <= horizon:
                _, old, old_amount = recent.popleft()
                old.in_window -= old_amount
            recent.append((now, stats, amount))
            stats.in_window += amount
            stats.peak = max(stats.peak, stats.in_window)
        return stats

    def _fly(self, stats: KeyStats, now: float, duration: float) -> None:
        """A request in flight from now for its duration, and its lease (the
        period) at most; its key's peak is the most in flight at once."""
        in_flight = self.in_flight
        while in_flight and in_flight[0][0] <= now:
            heappop(in_flight)[2].in_window -= 1
        heappush(in_flight, (now + min(duration, self.period), next(_flights), stats))
        stats.in_window += 1
        stats.peak = max(stats.peak, stats.in_window)


_flights = itertools.count()  # orders requests in flight that end at once


def describe_limit(rule: CompiledRule) -> str:
    """The limiter's own words, and which responses it counts."""
    text = rule.limiter.describe()
    counting = rule.response
    if counting is not None:
        conditions = []
        if counting.statuses is not None:
            conditions.append("status " + "/".join(str(s) for s in sorted(counting.statuses)))
        if counting.header is not None:
            conditions.append(f"{counting.header} present" if counting.header_present
                              else f"no {counting.header}" if counting.header_present is False
                              else f"{counting.header}: {counting.header_equals}")
        if counting.score_header is not None:
            conditions.append(f"score from {counting.score_header}")
        text += ", counting responses: " + ", ".join(conditions)
    return text


def peak_unit(rule: CompiledRule, period: float) -> str:
    """What a rule's peaks count: ``requests per 10s``."""
    if rule.limiter.leases:
        return "requests in flight at once"
    if rule.response is None:
        what = "requests"
    elif rule.response.score_header is not None:
        what = "score"
    else:
        what = "counted responses"
    return f"{what} per {format_duration(period)}"


def percentile(values: Sequence[int], percent: int) -> int:
    """Nearest rank over sorted ``values``: the smallest value that at least
    ``percent`` % of them do not exceed."""
    rank = -(-percent * len(values) // 100)  # ceil, in integers
    return values[max(rank, 1) - 1]


def peak_bucket(peak: int) -> int:
    """The log-scale bucket of a peak: 0 holds 0, bucket b > 0 holds
    2^(b-1) to 2^b - 1 (1; 2-3; 4-7; ...)."""
    return peak.bit_length()


def bucket_bounds(bucket: int) -> tuple[int, int]:
    """The smallest and largest peak of a bucket."""
    return (0, 0) if bucket == 0 else (1 << (bucket - 1), (1 << bucket) - 1)


def peak_histogram(peaks: Sequence[int]) -> list[dict[str, int]]:
    """Keys per log-scale bucket of their peaks, from the lowest bucket
    that has a key to the highest (empty ones between included)."""
    counts = Counter(peak_bucket(peak) for peak in peaks)
    if not counts:
        return []
    return [{"low": low, "high": high, "keys": counts.get(bucket, 0)}
            for bucket in range(min(counts), max(counts) + 1) for low, high in (bucket_bounds(bucket),)]


def _peak_summary(peaks: Sequence[int]) -> dict[str, int] | None:
    """P50/P95/P99 and max of sorted ``peaks``; None for none."""
    if not peaks:
        return None
    return {f"p{p}": percentile(peaks, p) for p in PERCENTILES} | {"max": peaks[-1]}


def refusals(stats: RuleStats) -> dict[str, Any]:
    """What the rule refused, and whom: for a ``log`` rule, what it let
    through over its limit (what it would refuse if it enforced)."""
    refuses = stats.rule.stops
    keys = [key for key in stats.keys.values() if (key.refused if refuses else key.over_limit)]
    requests = stats.blocked + stats.challenged + stats.banned + stats.ban_closed if refuses else stats.observed
    return {"refused_requests": requests,
            "refused_keys": len(keys),
            "refused_keys_share": round(len(keys) / len(stats.keys), 4) if stats.keys else 0.0,
            "refused_shared_keys": sum(key.shared for key in keys)}


def rule_report(stats: RuleStats, top: int, exclude_top: int = 0) -> dict[str, Any]:
    rule = stats.rule
    peaks = sorted(key.peak for key in stats.keys.values())
    items = list(stats.keys.items())
    over = [item for item in items if item[1].over_limit]
    return {
        "id": rule.id,
        "action": rule.action,
        "refuses": rule.stops,
        "shadow": rule.shadow,
        "key": list(rule.key_prefix[1]),
        "limit": describe_limit(rule),
        "counts_responses": rule.response is not None,
        "matched": stats.matched,
        "allowed": stats.allowed,
        "observed": stats.observed,
        "blocked": stats.blocked,
        "challenged": stats.challenged,
        "banned": stats.banned,
        "ban_closed": stats.ban_closed,
        "held": stats.held,
        "longest_hold_seconds": stats.longest_hold,
        "not_reached": stats.not_reached,
        "not_reached_because": [{"rule": rule_id, "by": by, "requests": count}
                                for (rule_id, by), count in stats.not_reached_by.most_common()],
        "responses_counted": stats.responses_counted if rule.response is not None else None,
        "peak_period_seconds": stats.period,
        "peak_unit": peak_unit(rule, stats.period),
        "keys": len(peaks),
        "peak": _peak_summary(peaks),
        # The heaviest keys by peak left out (none left: None).
        "peak_without_top": _peak_summary(peaks[:max(0, len(peaks) - exclude_top)]) if exclude_top else None,
        "peak_histogram": peak_histogram(peaks),
        **refusals(stats),
        "sweep": None,
        "top_over_limit": [_key_report(*item) for item in
                           nlargest(top, over, key=lambda item: (item[1].over_limit, item[1].requests))],
        "top_requests": [_key_report(*item) for item in
                         nlargest(top, items, key=lambda item: item[1].requests)],
    }


def _key_report(key: CountingKey, stats: KeyStats) -> dict[str, Any]:
    return {"key": describe_key(key), "requests": stats.requests, "over_limit": stats.over_limit,
            "peak": stats.peak, "user_agents": stats.agent_count}
