"""Prometheus metrics (SPEC §10), each registry owned by one application.

Labelled children are cached per rule so the request path does a dict
lookup, not a label resolution.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.checks = Counter("sluice_checks", "Requests checked.", registry=r)
        self._hits = Counter("sluice_rule_hits", "Requests counted by a rule.", ["rule"], registry=r)
        self._over = Counter("sluice_over_limit", "Over-limit requests by rule and action.",
                             ["rule", "action"], registry=r)
        self.banned_requests = Counter("sluice_banned_requests",
                                       "Requests refused because their address is banned.", registry=r)
        self.invalid_address = Counter("sluice_invalid_client_address",
                                       "Requests whose client address was missing or invalid.",
                                       registry=r)
        self.errors = Counter("sluice_internal_errors",
                              "Checks that failed inside Sluice and were allowed (fail open).",
                              registry=r)
        self.reports = Counter("sluice_responses_reported",
                               "Responses reported through the post-response hook.", registry=r)
        self.reports_refused = Counter("sluice_responses_refused",
                                       "Response reports with a missing, forged or expired token.",
                                       registry=r)
        self.unreportable = Counter("sluice_pending_too_long",
                                    "Requests whose pending counts were too long to carry "
                                    "(their responses go uncounted).", registry=r)
        self.delayed = Counter("sluice_delayed", "Requests held by a leaky bucket before being allowed.",
                               registry=r)
        self.latency = Histogram("sluice_decision_seconds", "Time to decide one request.",
                                 buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                          0.01, 0.025, 0.1), registry=r)
        self.active_bans = Gauge("sluice_active_bans", "IP bans in force on this node.", registry=r)
        self.tracked_keys = Gauge("sluice_tracked_keys", "Counting keys held in memory.", registry=r)
        self._hit_children: dict[str, Counter] = {}
        self._over_children: dict[tuple[str, str], Counter] = {}

    def hit(self, rule_id: str) -> None:
        child = self._hit_children.get(rule_id)
        if child is None:
            child = self._hit_children[rule_id] = self._hits.labels(rule_id)
        child.inc()

    def over_limit(self, rule_id: str, action: str) -> None:
        child = self._over_children.get((rule_id, action))
        if child is None:
            child = self._over_children[(rule_id, action)] = self._over.labels(rule_id, action)
        child.inc()

    def watch(self, active_bans: Callable[[], float], tracked_keys: Callable[[], float]) -> None:
        """Gauges read at scrape time."""
        self.active_bans.set_function(active_bans)
        self.tracked_keys.set_function(tracked_keys)
