"""Prometheus metrics, each registry owned by one application.

The request path only adds to plain integers (a prometheus_client counter
takes a lock on every increment, several times the cost of the rest of a
decision); a collector turns them into Prometheus families at scrape time.
Everything runs on the event loop's thread, so no lock is needed.

Names: ``sluice_`` and what is counted, in the plural, with ``_total`` for
counters (``sluice_challenges_issued_total``); a gauge says what it holds
(``sluice_active_bans``). The registry also carries prometheus_client's
process, garbage collector and platform collectors.

With several workers, a scrape answers for all of them
(sidecar.nodemetrics); the request path is the same.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from sidecar import version
from sidecar.config import Action
from sidecar.identity import OUTCOMES as JWT_OUTCOMES
from sidecar.latency import LATENCY_BUCKETS, LatencyHistogram, RuleSetCount, Tally

if TYPE_CHECKING:
    from sidecar.nodemetrics import NodeMetrics

_Key = TypeVar("_Key")


class Counts(dict[_Key, int]):
    """Counts by key, a missing one 0: what ``collections.Counter`` gives
    ``counts[key] += 1``, at a plain dict's cost (a Counter's own
    ``__delitem__`` sends every store through a Python-level call)."""

    __slots__ = ()

    def __missing__(self, key: _Key) -> int:
        return 0


def add_one(counts: dict[_Key, int], key: _Key) -> None:
    """One more of ``key`` in a plain dict of counts."""
    counts[key] = counts.get(key, 0) + 1


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
    "resets": ("sluice_keys_reset", "Counting keys cleared by a reported response (reset_on)."),
    "released": ("sluice_concurrency_released",
                 "Concurrency slots given back by response reports (a slot without one ends with its lease)."),
    "delayed": ("sluice_delayed", "Requests held by a leaky bucket before being allowed."),
    "challenges_issued": ("sluice_challenges_issued", "Challenge pages sent."),
    "challenges_solved": ("sluice_challenges_solved",
                          "Challenges solved: a credential cookie was issued."),
    "challenges_refused": ("sluice_challenges_refused",
                           "Challenge solutions refused: forged, expired, another client's, or wrong."),
    "credentials": ("sluice_challenge_credentials_accepted",
                    "Requests let in by a challenge rule's valid credential (the rules before it within limits)."),
}
# Sets of rule ids held before they are added up (see Metrics.rule_sets):
# a ruleset's requests are counted by a few sets, which stay; any number of
# them takes bounded memory.
RULE_SETS = 1024
# Old names still exported beside the new, for one release: old name, attribute.
DEPRECATED = {"sluice_counter_resets": "resets"}


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
    resets: Tally
    delayed: Tally
    challenges_issued: Tally
    challenges_solved: Tally
    challenges_refused: Tally
    credentials: Tally

    def __init__(self, registry: CollectorRegistry | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        for attribute in COUNTERS:
            setattr(self, attribute, Tally())
        self.latency = LatencyHistogram()
        # Requests counted per rule id (``rule_hits``). The hot path counts
        # the ids a request was counted by as one set, in the set's count
        # in ``rule_sets`` (``count_rules``; the engine holds the one it added
        # to last): one addition a request, where one per rule costs ten
        # times as much. Reading ``rule_hits`` adds the sets up, as does
        # ``count_of`` past ``RULE_SETS`` of them.
        self._rule_hits: collections.Counter[str] = collections.Counter()
        self.rule_sets: dict[tuple[str, ...], RuleSetCount] = {}
        # Checks answered, by (front door, outcome): the app adds to it directly.
        # A plain dict, each door adding with get (add_one): a subclass's
        # item reads cost three times a dict's.
        self.decisions: dict[tuple[str, str], int] = {}
        # Over-limit requests by (rule id, action): the hot path adds to it directly.
        self.over_limits: Counts[tuple[str, str]] = Counts()
        # Late checks answered by the overload policy, by (rule, outcome).
        self.overload_decisions: Counts[tuple[str, str]] = Counts()
        # Actions shadow rules would have taken, by (rule, action).
        self.shadow_actions: Counts[tuple[str, str]] = Counts()
        # Tokens read for rules on claims, by outcome (sidecar.identity.OUTCOMES:
        # a plain dict of every outcome, counted once per request that reads
        # a token, where a Counter's += costs twice as much), and fetches of
        # a JWKS URL, by result; and the keys tokens are verified with.
        self.jwt_tokens: dict[str, int] = dict.fromkeys(JWT_OUTCOMES, 0)
        self.jwt_fetches: collections.Counter[str] = collections.Counter()
        self.jwt_keys: Callable[[], int] = lambda: 0
        # A CrowdSec Local API's (sidecar.crowdsec): polls by result, decisions
        # of the stream not applied by reason, requests its decisions
        # refused, challenged or let past a captcha, alerts by result; and
        # the decisions held, by type (None without a crowdsec: section).
        self.crowdsec_polls: collections.Counter[str] = collections.Counter()
        self.crowdsec_ignored: collections.Counter[str] = collections.Counter()
        self.crowdsec_requests: collections.Counter[str] = collections.Counter()
        self.crowdsec_alerts: collections.Counter[str] = collections.Counter()
        self.crowdsec_decisions: Callable[[], dict[str, int] | None] = lambda: None
        self._gauges: dict[str, tuple[str, Callable[[], float]]] = {}
        self._wall_clock = wall_clock
        self.reloads = {"success": Tally(), "failure": Tally()}
        # Made with the engine, whose rules were just loaded.
        self.rules_loaded_at = wall_clock()
        self.version = version()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        # This worker's part of a node of several (``share``).
        self.node: NodeMetrics | None = None

    def share(self, directory: str) -> None:
        """Scrapes answer for every worker writing into ``directory``."""
        from sidecar.nodemetrics import NodeMetrics

        self.node = NodeMetrics(self.registry, directory)

    async def exposition(self) -> bytes:
        """What /metrics answers: this process's metrics, or the node's."""
        if self.node is None:
            return generate_latest(self.registry)
        return await self.node.exposition()

    @property
    def rule_hits(self) -> collections.Counter[str]:
        """Requests counted per rule id, with the sets counted since the
        last read added up."""
        if self.rule_sets:
            self.add_up_rule_sets()
        return self._rule_hits

    def add_up_rule_sets(self) -> None:
        """Add the sets counted in ``rule_sets`` to ``rule_hits``; their
        counts are no longer live (a holder asks ``count_of`` again)."""
        hits, sets = self._rule_hits, self.rule_sets
        for ids, count in sets.items():
            if count.value:
                for rule_id in ids:
                    hits[rule_id] += count.value
            count.live = False
        sets.clear()

    def count_rules(self, ids: Sequence[str]) -> None:
        """A request counted by the rules ``ids``: one addition to the
        count of that set (one per rule costs ten times as much). The
        engine holds the count it added to last instead
        (``Engine._count_rules``)."""
        self.count_of(ids if type(ids) is tuple else tuple(ids)).value += 1

    def count_of(self, ids: tuple[str, ...]) -> RuleSetCount:
        """The live count of the set of rules ``ids``, made when new (the
        sets added up first past ``RULE_SETS``: bounded memory whatever
        sets come)."""
        sets = self.rule_sets
        count = sets.get(ids)
        if count is None:
            if len(sets) >= RULE_SETS:
                self.add_up_rule_sets()
            count = sets[ids] = RuleSetCount()
        return count

    def hit(self, rule_id: str) -> None:
        self._rule_hits[rule_id] += 1

    def refused_again(self, rule_id: str, action: Action, front_door: str, outcome: str) -> None:
        """A stored refusal sent again (sidecar.overload.StoredRefusal),
        counted in one call as its decision was: a check, its latency (none),
        the rule's refusal or the ban's, and the front door's answer."""
        self.checks.value += 1
        latency = self.latency  # observe(0.0), written out: the first bucket's
        latency.counts[0] += 1
        latency.count += 1
        if rule_id:
            self.over_limits[rule_id, action] += 1
        else:
            self.banned_requests.inc()
        add_one(self.decisions, (front_door, outcome))

    def over_limit(self, rule_id: str, action: Action) -> None:
        self.over_limits[rule_id, action] += 1

    def shadow_action(self, rule_id: str, action: str) -> None:
        self.shadow_actions[rule_id, action] += 1

    def hits_of(self, rule_id: str) -> int:
        return self.rule_hits[rule_id]

    def over_limit_of(self, rule_id: str) -> dict[str, int]:
        return {action: count for (rule, action), count in self.over_limits.items() if rule == rule_id}

    def reloaded(self, succeeded: bool) -> None:
        """A reload of the rules file: its new rules run, or it was refused."""
        self.reloads["success" if succeeded else "failure"].inc()
        if succeeded:
            self.rules_loaded_at = self._wall_clock()

    def watch(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A value read at scrape time: a counter when ``name`` ends in
        ``_total`` (a running count), else a gauge."""
        self._gauges[name] = (documentation, read)

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("sluice_build_info", "The running Sluice, by version (always 1).", labels=["version"])
        info.add_metric([self.version], 1)
        yield info
        for attribute, (name, documentation) in COUNTERS.items():
            yield CounterMetricFamily(name, documentation, value=getattr(self, attribute).value)
        for name, attribute in DEPRECATED.items():
            yield CounterMetricFamily(name, f"Deprecated: use {COUNTERS[attribute][0]}_total; removed in the "
                                      "next release.", value=getattr(self, attribute).value)
        decisions = CounterMetricFamily("sluice_decisions", "Checks answered, by front door and what the "
                                        "proxy was told (a check that failed inside Sluice: allow).",
                                        labels=["front_door", "outcome"])
        for (front_door, outcome), count in self.decisions.items():
            decisions.add_metric([front_door, outcome], count)
        yield decisions
        reloads = CounterMetricFamily("sluice_reloads", "Reloads of the rules file: success (the new "
                                      "rules run) or failure (refused, the old rules keep running).",
                                      labels=["result"])
        for result, tally in self.reloads.items():
            reloads.add_metric([result], tally.value)
        yield reloads
        yield GaugeMetricFamily("sluice_last_reload_timestamp_seconds",
                                "When the running rules were loaded (Unix time): at start, or by the "
                                "last successful reload.", value=self.rules_loaded_at)
        hits = CounterMetricFamily("sluice_rule_hits", "Requests counted by a rule.", labels=["rule"])
        for rule_id, count in self.rule_hits.items():
            hits.add_metric([rule_id], count)
        yield hits
        over = CounterMetricFamily("sluice_over_limit", "Over-limit requests by rule and action.",
                                   labels=["rule", "action"])
        for (rule_id, action), count in self.over_limits.items():
            over.add_metric([rule_id, action], count)
        yield over
        shadow = CounterMetricFamily("sluice_shadow_actions", "Blocks, bans and challenges shadow rules would "
                                     "have applied (the requests were allowed), by rule and action.",
                                     labels=["rule", "action"])
        for (rule_id, action), count in self.shadow_actions.items():
            shadow.add_metric([rule_id, action], count)
        yield shadow
        overload = CounterMetricFamily(
            "sluice_overload_decisions", "Checks that reached Sluice later than overload.after, answered "
            "without the shared store: refused (the client was known over the rule's limit, or banned), "
            "closed (an overload: closed rule refused it), refused_locally (over the rule's limit by this "
            "node's count of late checks) or open (let in, counted on this node), by rule.",
            labels=["rule", "outcome"])
        for (rule_id, outcome), count in self.overload_decisions.items():
            overload.add_metric([rule_id, outcome], count)
        yield overload
        tokens = CounterMetricFamily("sluice_jwt_tokens", "Requests whose token a rule read, by outcome: valid, "
                                     "or why it gave no claims (missing, malformed, too_long, algorithm, "
                                     "unknown_key, bad_signature, expired, not_yet_valid, bad_claims, no_keys).",
                                     labels=["outcome"])
        for outcome, count in self.jwt_tokens.items():
            if count:
                tokens.add_metric([outcome], count)
        yield tokens
        fetches = CounterMetricFamily("sluice_jwt_key_fetches", "Fetches of the JWKS URL, by result "
                                      "(succeeded, failed: the last keys are kept).", labels=["result"])
        for result, count in self.jwt_fetches.items():
            fetches.add_metric([result], count)
        yield fetches
        yield GaugeMetricFamily("sluice_jwt_keys", "Keys tokens are verified with now (0 without a jwt: "
                                "section, or before a JWKS URL answered).", value=self.jwt_keys())
        yield from self._crowdsec_families()
        for name, (documentation, read) in self._gauges.items():
            family = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
            yield family(name, documentation, value=read())
        latency = self.latency
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, LATENCY_BUCKETS), "+Inf"), latency.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily("sluice_decision_seconds", "Time to decide one request.",
                                    buckets=buckets, sum_value=latency.total)

    def _crowdsec_families(self) -> Iterator[Metric]:
        """The crowdsec: section's families (empty without one)."""
        held = self.crowdsec_decisions()
        families = (
            ("sluice_crowdsec_polls", "Polls of the CrowdSec Local API's decision stream, by result (succeeded; "
             "failed: not reachable or an HTTP error; refused: the bouncer key; garbage: not a stream). On "
             "failure the last decisions are kept.", "result", self.crowdsec_polls),
            ("sluice_crowdsec_decisions_ignored", "Decisions of the stream not applied, by reason (scope: not Ip "
             "or Range; type: not ban or captcha, or captcha: ignore; invalid; expired; own: this node's bans "
             "read back; over_max: over crowdsec.max_decisions).", "reason", self.crowdsec_ignored),
            ("sluice_crowdsec_requests", "Requests a CrowdSec decision applied to, by what it did (ban: closed; "
             "captcha: challenged; captcha_passed: a solved challenge's credential let it on to the rules).",
             "decision", self.crowdsec_requests),
            ("sluice_crowdsec_alerts", "Sluice's bans sent to the CrowdSec Local API as alerts, by result "
             "(sent; failed: tried again later; dropped: the queue was full).", "result", self.crowdsec_alerts),
        )
        for name, documentation, label, counts in families:
            family = CounterMetricFamily(name, documentation, labels=[label])
            for value, count in list(counts.items()):
                family.add_metric([value], count)
            yield family
        gauge = GaugeMetricFamily("sluice_crowdsec_decisions", "CrowdSec decisions applied now, by type "
                                  "(ban, captcha; 0 without a crowdsec: section).", labels=["type"])
        for kind, count in (held or {"ban": 0, "captcha": 0}).items():
            gauge.add_metric([kind], count)
        yield gauge
