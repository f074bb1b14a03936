"""Prometheus metrics, each registry owned by one application.

The request path only adds to plain integers (a prometheus_client counter
takes a lock on every increment, several times the cost of the rest of a
decision); a collector turns them into Prometheus families at scrape time.
Everything runs on the event loop's thread, so no lock is needed.
"""

from __future__ import annotations

import bisect
import collections
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from sidecar.config import Action

LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class Tally:
    """A counter without a lock."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount


class LatencyHistogram:
    __slots__ = ("counts", "total", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds
        self.count += 1


# name, help text: the plain counters the engine and the app add to.
COUNTERS = {
    "checks": ("sluice_checks", "Requests checked."),
    "banned_requests": ("sluice_banned_requests", "Requests refused because their address is banned."),
    "invalid_address": ("sluice_invalid_client_address",
                        "Requests whose client address was missing or invalid."),
    "errors": ("sluice_internal_errors", "Checks that failed inside Sluice and were allowed (fail open)."),
    "store_errors": ("sluice_store_errors",
                     "Store operations that failed because the shared store was unavailable."),
    "reports": ("sluice_responses_reported", "Responses reported through the post-response hook."),
    "reports_refused": ("sluice_responses_refused",
                        "Response reports with a missing, forged or expired token."),
    "unreportable": ("sluice_pending_too_long",
                     "Requests whose pending counts were too long to carry (their responses go uncounted)."),
    "released": ("sluice_concurrency_released",
                 "Concurrency slots given back by response reports (a slot without one ends with its lease)."),
    "delayed": ("sluice_delayed", "Requests held by a leaky bucket before being allowed."),
    "challenges_issued": ("sluice_challenges_issued", "Challenge pages sent."),
    "challenges_passed": ("sluice_challenges_passed",
                          "Challenges solved: a credential cookie was issued."),
    "challenges_failed": ("sluice_challenge_solutions_refused",
                          "Challenge solutions refused: forged, expired, another client's, or wrong."),
    "credentials": ("sluice_challenge_credentials_accepted",
                    "Requests that passed a challenge rule with a valid credential."),
}


class Metrics(Collector):
    checks: Tally
    banned_requests: Tally
    invalid_address: Tally
    errors: Tally
    store_errors: Tally
    reports: Tally
    reports_refused: Tally
    unreportable: Tally
    released: Tally
    delayed: Tally
    challenges_issued: Tally
    challenges_passed: Tally
    challenges_failed: Tally
    credentials: Tally

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        for attribute in COUNTERS:
            setattr(self, attribute, Tally())
        self.latency = LatencyHistogram()
        # Requests counted per rule id: the hot path adds to it directly.
        self.rule_hits: collections.Counter[str] = collections.Counter()
        self._over: dict[tuple[str, str], Tally] = {}
        self._gauges: dict[str, tuple[str, Callable[[], float]]] = {}
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)

    def hit(self, rule_id: str) -> None:
        self.rule_hits[rule_id] += 1

    def over_limit(self, rule_id: str, action: Action) -> None:
        tally = self._over.get((rule_id, action))
        if tally is None:
            tally = self._over[(rule_id, action)] = Tally()
        tally.value += 1

    def hits_of(self, rule_id: str) -> int:
        return self.rule_hits[rule_id]

    def over_limit_of(self, rule_id: str) -> dict[str, int]:
        return {action: tally.value for (rule, action), tally in self._over.items() if rule == rule_id}

    def watch(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time."""
        self._gauges[name] = (documentation, read)

    def collect(self) -> Iterator:
        for attribute, (name, documentation) in COUNTERS.items():
            yield CounterMetricFamily(name, documentation, value=getattr(self, attribute).value)
        hits = CounterMetricFamily("sluice_rule_hits", "Requests counted by a rule.", labels=["rule"])
        for rule_id, count in self.rule_hits.items():
            hits.add_metric([rule_id], count)
        yield hits
        over = CounterMetricFamily("sluice_over_limit", "Over-limit requests by rule and action.",
                                   labels=["rule", "action"])
        for (rule_id, action), tally in self._over.items():
            over.add_metric([rule_id, action], tally.value)
        yield over
        for name, (documentation, read) in self._gauges.items():
            yield GaugeMetricFamily(name, documentation, value=read())
        latency = self.latency
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, LATENCY_BUCKETS), "+Inf"), latency.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily("sluice_decision_seconds", "Time to decide one request.",
                                    buckets=buckets, sum_value=latency.total)
