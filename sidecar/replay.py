"""``sluice replay``: access logs through the rules in virtual time.

The question it answers is "what would these rules have done to this
traffic?", before anything is enforced. Every log line becomes the
``CheckRequest`` nginx would have sent and is decided by the real engine, on
a clock set to the line's own time: an hour of log replays in moments, and
windows, penalties and bans run out as they would have. Nothing waits — a
leaky bucket's hold is only counted. The logged status (and ``x-score``,
when logged) is reported through ``record_response`` when the response
ended: right after its request, or ``$request_time`` later when the log
has it; the report counts for response-phase rules and gives back the
request's concurrency slots.

Besides what the rules decided, the report measures what the traffic asked
for, to help choose thresholds: for each rule and each of its keys, the
**peak** — the most requests the key sent in any window of the rule's
period (counted responses, or score, for response-phase rules; for a
concurrency limit, the most requests in flight at once) — and the
P50/P95/P99 of those peaks across the rule's keys (also without the
heaviest keys, so that one abuser does not set P99).

And it says whom a threshold would hit: per rule, the distinct keys it
refused and how many of them look like a shared NAT (many user agents
behind one key), which rules were not reached because an earlier one
refused first, and, for a sweep of candidate thresholds, what each
candidate would have refused. A sweep replays the log once per candidate,
in the same pass over the log, so that every figure is exact (a changed
threshold changes what later rules, penalties and bans see).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import math
import re
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from heapq import heappop, heappush, nlargest
from typing import Any, Collection, Sequence

from sidecar import config
from sidecar.accesslog import AccessLogs, LogEntry
from sidecar.challenge import FINGERPRINT_HEADER
from sidecar.config import ConfigError, LoadedRules, format_duration
from sidecar.engine import ALLOW, DENY, Decision, Engine
from sidecar.keys import CountingKey, key_rule_id
from sidecar.limiters import Hit, registry
from sidecar.plurals import plural
from sidecar.request import CheckRequest
from sidecar.rules import CompiledRule, Ruleset, compile_rules, describe_key
from sidecar.state import Check, Evaluation, ResponseCount
from sidecar.store.memory import MemoryStore

PERCENTILES = (50, 95, 99)
AGENTS_COUNTED = 10  # distinct user agents per key are counted up to this
# A key whose requests carry this many distinct user agents looks like many
# people behind one address (a NAT, a corporate proxy) rather than one client.
SHARED_AGENTS = 5


class VirtualClock:
    """The replay's time: the log's, set line by line."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RecordingStore(MemoryStore):
    """The memory store, keeping what it decided about the request in hand
    so that outcomes can be told per rule (the engine's ``Decision`` names
    only the rule whose headers the answer carries)."""

    checks: Sequence[Check] = ()
    evaluation: Evaluation | None = None
    counted: Sequence[tuple[ResponseCount, Hit]] = ()

    def forget(self) -> None:
        self.checks, self.evaluation, self.counted = (), None, ()

    async def evaluate(self, now: float, address: str, checks: Sequence[Check],
                       can_delay: bool = True, quotas: bool = False) -> Evaluation:
        evaluation = await super().evaluate(now, address, checks, can_delay, quotas)
        self.checks, self.evaluation = checks, evaluation
        return evaluation

    async def record(self, now: float, counts: Sequence[ResponseCount]) -> list[Hit]:
        hits = await super().record(now, counts)
        self.counted = list(zip(counts, hits))
        return hits


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


class Replay:
    """Feeds log entries to an engine on a virtual clock and keeps the tallies."""

    def __init__(self, ruleset: Ruleset, default_host: str = "", watched: Collection[str] | None = None) -> None:
        """``watched``: the ids of the rules to keep tallies for (all by
        default); a sweep's replays watch only the rule they try."""
        self.ruleset = ruleset
        self.default_host = default_host
        self.clock = VirtualClock()
        self.store = RecordingStore(ruleset.max_keys, ruleset.node, self.clock, wall_clock=self.clock)
        # Pending tokens are dated by the same clock, so they never look stale.
        self.engine = Engine(ruleset, store=self.store, clock=self.clock, wall_clock=self.clock)
        self.rules = {rule.id: RuleStats(rule, rule.limiter.peak_period()) for rule in ruleset.rules
                      if watched is None or rule.id in watched}
        self.answers = dict.fromkeys(("allowed", "observed", "held", "exempt", "denied", "challenged",
                                      "closed", "closed_by_ban"), 0)
        self.requests = 0
        self.without_status = 0  # response-phase counts that had no logged status to go on
        self.start: float | None = None
        self.end = 0.0  # the time of the last request
        # Reports of responses still to end: (time, order, token, entry), soonest first.
        self._reports: list[tuple[float, int, str, LogEntry]] = []
        self._order = itertools.count()

    def feed(self, entry: LogEntry) -> None:
        self.report_until(entry.time)
        self.clock.now = self.end = entry.time
        if self.start is None:
            self.start = entry.time
        self.requests += 1
        request = self._request(entry)
        self.store.forget()
        decision = self.engine.decide_now(request)
        if decision.delay:
            # Replay runs in virtual time and holds nobody: the slot the
            # decision took is free again at once.
            self.engine.release_hold()
        self._tally_answer(request, decision)
        self._tally_rules(entry, decision)
        if decision.pending is not None:
            if entry.status is None:
                self.without_status += 1  # its concurrency slots end with their lease
                return
            if entry.duration:
                heappush(self._reports, (entry.time + entry.duration, next(self._order), decision.pending, entry))
            else:
                self._report(decision.pending, entry)

    def report_until(self, now: float) -> None:
        """Report the responses that ended by ``now``, each at its own time
        (``now`` is never before the requests already replayed)."""
        reports = self._reports
        while reports and reports[0][0] <= now:
            ended, _, token, entry = heappop(reports)
            self.clock.now = ended
            self._report(token, entry)

    def _report(self, token: str, entry: LogEntry) -> None:
        assert entry.status is not None
        self.store.forget()  # what the report counts, only
        self.engine.record_response_now(token, entry.status, entry.response_headers)
        for count, hit in self.store.counted:
            stats = self.rules.get(key_rule_id(count.key))
            if stats is not None and not hit.over_limit:
                stats.responses_counted += 1

    def _request(self, entry: LogEntry) -> CheckRequest:
        host = entry.host or self.default_host
        headers = entry.headers
        if host:
            headers.setdefault("host", host)
        client = self.engine.resolve_client(entry.peer, headers.get("x-forwarded-for"))
        return CheckRequest(entry.method, host, entry.uri, headers, client, entry.request_id or "replay",
                            tls_fingerprint=headers.get(FINGERPRINT_HEADER, ""))

    def _tally_answer(self, request: CheckRequest, decision: Decision) -> None:
        answers = self.answers
        if decision.outcome == ALLOW:
            answers["allowed"] += 1
            answers["observed"] += decision.rule is not None
            answers["held"] += decision.delay > 0
            answers["exempt"] += self.ruleset.exempt.holds(request.client)
        elif decision.outcome == DENY:
            answers["denied"] += 1
            answers["challenged"] += decision.rule is not None and decision.rule.action == "challenge"
        else:
            answers["closed"] += 1

    def _tally_rules(self, entry: LogEntry, decision: Decision) -> None:
        evaluation = self.store.evaluation
        if evaluation is None:
            return  # exempt, or no rule matched
        now = self.clock.now
        agent = entry.headers.get("user-agent")
        first = ("", "")  # what answered before the rules not reached, if any
        earlier_ban = None if evaluation.new_ban else evaluation.ban
        checks = self.store.checks
        if earlier_ban is not None:
            # Refused at once, no rule evaluated; the ban's rule
            # gets the credit. It may be gone after a reload: not in replay.
            self.answers["closed_by_ban"] += 1
            banning = self.rules.get(earlier_ban.rule_id)
            if banning is not None:
                banning.ban_closed += 1
            first = (earlier_ban.rule_id, "ban")
        elif 0 < len(evaluation.hits) < len(checks):
            # Evaluation stops at the first check that refuses: the last one
            # evaluated, when some were not.
            first = (checks[len(evaluation.hits) - 1].rule_id, "refused")
        hits = [] if earlier_ban is not None else evaluation.hits
        for index, check in enumerate(checks):
            stats = self.rules.get(check.rule_id)
            if stats is None:
                continue  # not watched
            stats.matched += 1
            key = stats.add(check.key, now, self._amount(stats.rule, entry), agent, entry.duration)
            if index >= len(hits):
                stats.not_reached += 1
                stats.not_reached_by[first] += 1
                continue
            hit = hits[index]
            if not hit.over_limit:
                stats.allowed += 1
                if hit.delay and evaluation.delay:  # held only if the request was admitted
                    stats.held += 1
                    stats.longest_hold = max(stats.longest_hold, hit.delay)
                continue
            key.over_limit += 1
            key.refused += check.stops
            if not check.stops:
                stats.observed += 1
            elif evaluation.new_ban or check.ban_duration is not None:
                stats.banned += 1
            elif stats.rule.action == "challenge":
                stats.challenged += 1
            else:
                stats.blocked += 1

    @staticmethod
    def _amount(rule: CompiledRule, entry: LogEntry) -> int:
        """What this request adds to its key's peak: one, or for a
        response-phase rule what its logged response would count."""
        if rule.response is None:
            return 1
        if entry.status is None:
            return 0
        return rule.response.amount(entry.status, entry.response_headers)

    def report(self, logs: AccessLogs, top: int = 5, exclude_top: int = 0) -> dict[str, Any]:
        """The whole result as plain data (what ``--json`` prints)."""
        start = self.start
        return {
            "logs": logs.names,
            "lines": logs.lines,
            "requests": self.requests,
            "skipped": {"count": logs.skipped, "examples": [
                {"log": s.log, "line": s.line, "reason": s.reason, "text": s.text} for s in logs.examples]},
            "late": logs.late,
            "reorder_window_seconds": logs.reorder_window,
            "start": _timestamp(start),
            "end": _timestamp(self.end if start is not None else None),
            "seconds": round(self.end - start, 3) if start is not None else 0,
            "answers": dict(self.answers),
            "invalid_client_addresses": self.engine.metrics.invalid_address.value,
            "responses_without_status": self.without_status,
            "exclude_top": exclude_top,
            "shared_agents": SHARED_AGENTS,
            "rules": [_rule_report(stats, top, exclude_top) for stats in self.rules.values()],
        }


def replay_logs(ruleset: Ruleset, names: Sequence[str], top: int = 5, default_host: str = "",
                exclude_top: int = 0, sweeps: Sequence[Sweep] = ()) -> dict[str, Any]:
    """Replay the logs through the rules, and through each ruleset of the
    sweeps, in one pass over the logs (standard input can be read only
    once); raises ``LogError`` for a log that cannot be read."""
    replay = Replay(ruleset, default_host)
    trials = [[Replay(candidate, default_host, watched={sweep.rule_id}) for candidate in sweep.rulesets]
              for sweep in sweeps]
    replays = [replay] + [trial for runs in trials for trial in runs]
    with AccessLogs(names) as logs:
        for entry in logs:
            for each in replays:
                each.feed(entry)
    for each in replays:
        each.report_until(math.inf)  # the responses still in flight at the log's end
    report = replay.report(logs, top, exclude_top)
    by_id = {rule["id"]: rule for rule in report["rules"]}
    for sweep, runs in zip(sweeps, trials):
        by_id[sweep.rule_id]["sweep"] = _sweep_report(sweep, [run.rules[sweep.rule_id] for run in runs])
    return report


# --------------------------------------------------------------------------
# Sweeps: candidate thresholds for a rule
# --------------------------------------------------------------------------

_SWEEP = re.compile(r"([A-Za-z0-9_.-]{1,64})=(.*)", re.DOTALL)
_CANDIDATE = re.compile(r"[0-9]{1,9}")
MAX_CANDIDATES = 20  # per rule: each is one more replay of the whole log


class SweepError(ValueError):
    """A sweep that cannot be run, in words for the command line."""


@dataclass(frozen=True, slots=True)
class Sweep:
    """Candidate thresholds for one rule, each with a ruleset that has it."""

    rule_id: str
    field: str  # the limit's field that holds the threshold (its kind's, in the registry)
    current: int  # its value in the rules file
    candidates: tuple[int, ...]
    rulesets: tuple[Ruleset, ...]


def parse_sweep(text: str) -> tuple[str, tuple[int, ...]]:
    """``api=5,10,20``: a rule id and its candidate thresholds, ascending
    and each once; raises ``SweepError`` saying what is wrong."""
    match = _SWEEP.fullmatch(text.strip())
    if match is None:
        raise SweepError(f"expected RULE=N,N,... (like api=5,10,20), got {text[:80]!r}")
    rule_id, values = match.groups()
    if not values.strip():
        raise SweepError(f"{rule_id}: no thresholds after '=': give some, like {rule_id}=5,10,20")
    parts = [part.strip() for part in values.split(",")]
    bad = next((part for part in parts if not _CANDIDATE.fullmatch(part)), None)
    if bad is not None:
        raise SweepError(f"{rule_id}: thresholds are whole numbers from 0 to 999999999 separated "
                         f"by commas, got {repr(bad[:40]) if bad else 'an empty one'}")
    candidates = tuple(sorted({int(part) for part in parts}))
    if len(candidates) > MAX_CANDIDATES:
        raise SweepError(f"{rule_id}: at most {MAX_CANDIDATES} thresholds (each replays the whole log), "
                         f"got {len(candidates)}")
    return rule_id, candidates


def build_sweep(loaded: LoadedRules, rule_id: str, candidates: Sequence[int]) -> Sweep:
    """The rules file compiled once per candidate, with the rule's threshold
    set to it; raises ``SweepError`` for an unknown rule or a value its
    limit cannot take."""
    rules = loaded.model.rules
    index = next((i for i, rule in enumerate(rules) if rule.id == rule_id), None)
    if index is None:
        close = difflib.get_close_matches(rule_id, [rule.id for rule in rules], n=1)
        raise SweepError(f"no rule {rule_id!r} in {loaded.source}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    limit = rules[index].limit
    name = registry.limit_kind(limit.tag).threshold
    least = registry.least_threshold(limit)
    low = [value for value in candidates if value < least]
    if low:
        raise SweepError(f"{rule_id}: limit.{name} is at least {least}, got {low[0]}")
    rulesets = []
    for value in candidates:
        changed = list(rules)
        changed[index] = rules[index].model_copy(update={"limit": limit.model_copy(update={name: value})})
        try:
            rulesets.append(compile_rules(dataclasses.replace(
                loaded, model=loaded.model.model_copy(update={"rules": changed}))))
        except ConfigError as exc:
            raise SweepError(f"{rule_id}: limit.{name} {value}: " + "; ".join(str(i) for i in exc.issues)) from None
    return Sweep(rule_id, name, getattr(limit, name), tuple(candidates), tuple(rulesets))


def prepare_sweeps(path: str, wanted: Sequence[tuple[str, tuple[int, ...]]]) -> list[Sweep]:
    """The sweeps asked for on the command line (``parse_sweep``'s), for
    the rules file at ``path``; raises ``SweepError``. Each candidate's
    ruleset is compiled from the file's validated model with one number
    changed, so the file is read again here (the command has checked it)."""
    seen: set[str] = set()
    for rule_id, _ in wanted:
        if rule_id in seen:
            raise SweepError(f"{rule_id} is swept twice: give all its thresholds in one --sweep, "
                             f"like {rule_id}=5,10,20")
        seen.add(rule_id)
    if not wanted:
        return []
    try:
        loaded = config.load_rules_file(path)
    except ConfigError as exc:
        raise SweepError("; ".join(str(issue) for issue in exc.issues)) from None
    return [build_sweep(loaded, rule_id, candidates) for rule_id, candidates in wanted]


def _sweep_report(sweep: Sweep, runs: Sequence[RuleStats]) -> dict[str, Any]:
    return {"field": f"limit.{sweep.field}", "current": sweep.current,
            "candidates": [{"threshold": value} | _refusals(stats) for value, stats in zip(sweep.candidates, runs)]}


# --------------------------------------------------------------------------
# Describing rules and keys
# --------------------------------------------------------------------------


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


def _refusals(stats: RuleStats) -> dict[str, Any]:
    """What the rule refused, and whom: for a ``log`` rule, what it let
    through over its limit (what it would refuse if it enforced)."""
    refuses = stats.rule.stops
    keys = [key for key in stats.keys.values() if (key.refused if refuses else key.over_limit)]
    requests = stats.blocked + stats.challenged + stats.banned + stats.ban_closed if refuses else stats.observed
    return {"refused_requests": requests,
            "refused_keys": len(keys),
            "refused_keys_share": round(len(keys) / len(stats.keys), 4) if stats.keys else 0.0,
            "refused_shared_keys": sum(key.shared for key in keys)}


def _rule_report(stats: RuleStats, top: int, exclude_top: int = 0) -> dict[str, Any]:
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
        **_refusals(stats),
        "sweep": None,
        "top_over_limit": [_key_report(*item) for item in
                           nlargest(top, over, key=lambda item: (item[1].over_limit, item[1].requests))],
        "top_requests": [_key_report(*item) for item in
                         nlargest(top, items, key=lambda item: item[1].requests)],
    }


def _key_report(key: CountingKey, stats: KeyStats) -> dict[str, Any]:
    return {"key": describe_key(key), "requests": stats.requests, "over_limit": stats.over_limit,
            "peak": stats.peak, "user_agents": stats.agent_count}


def _timestamp(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    moment = datetime.fromtimestamp(seconds, timezone.utc)
    return moment.isoformat(timespec="milliseconds" if seconds % 1 else "seconds").replace("+00:00", "Z")


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def render_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2) + "\n"


RULE_COLUMNS = ("matched", "allowed", "observed", "blocked", "challenged", "banned", "ban_closed", "held",
                "not_reached")

# The text and the HTML report say the same things in the same words: both
# are made of the sentences and tables below.

Row = Sequence[Any]


def render_text(report: dict[str, Any]) -> str:
    lines = [summary_text(report)]
    skipped = report["skipped"]
    if skipped["count"]:
        lines.append(skipped_text(report))
        lines += [f"  {s['log']}:{s['line']}: {s['reason']}: {s['text']}" for s in skipped["examples"]]
    lines += [line for line in (late_text(report),) if line]
    lines.append(answers_text(report))
    lines += notes_text(report)
    rules = report["rules"]
    if not rules:
        return _printable("\n".join(lines + ["the rules file has no rules"]) + "\n")
    lines.append("")
    lines += _table(*rule_table(report), text_columns=2)
    not_reached = [line for rule in rules for line in not_reached_text(rule)]
    if not_reached:
        lines += [""] + not_reached
    for rule in rules:
        lines += [""] + _rule_text(rule, report)
    return _printable("\n".join(lines) + "\n")


# Lone surrogates, which a JSON log line can carry as \ud800 escapes in any
# field: they cannot be written as UTF-8.
_SURROGATES = re.compile("[\ud800-\udfff]")


def _printable(text: str) -> str:
    return _SURROGATES.sub("\ufffd", text)


def summary_text(report: dict[str, Any]) -> str:
    text = (f"replayed {plural(report['requests'], 'request')} from {plural(report['lines'], 'line')} of "
            f"{plural(len(report['logs']), 'log')}")
    if report["start"] is not None:
        hours, rest = divmod(round(report["seconds"]), 3600)
        text += f", {report['start']} to {report['end']} ({hours}:{rest // 60:02}:{rest % 60:02} of log time)"
    return text


def skipped_text(report: dict[str, Any]) -> str:
    count = report["skipped"]["count"]
    return f"skipped {plural(count, 'line')} that {'is' if count == 1 else 'are'} not requests; the first:"


# `sluice replay`'s exit status when no line of the logs was a request.
NOTHING_REPLAYED = 3


def nothing_replayed(report: dict[str, Any]) -> str:
    """Why a replay that replayed nothing is an error, in one line."""
    lines = report["lines"]
    if not lines:
        return "the logs have no lines: nothing was replayed"
    return (f"none of the {plural(lines, 'line')} of the logs is a request in nginx's combined format or "
            "a JSON line with the request's fields: nothing was replayed")


def late_text(report: dict[str, Any]) -> str:
    if not report["late"]:
        return ""
    late = report["late"]
    were = "was" if late == 1 else "were"
    return (f"{plural(late, 'line')} {were} more than {report['reorder_window_seconds']:g} s out "
            f"of time order and {were} replayed at the time already reached")


def answers_text(report: dict[str, Any]) -> str:
    answers = report["answers"]
    return "answers: " + ", ".join(_with_details(answers, total, details) for total, details in (
        ("allowed", (("observed", "observed over a limit"), ("held", "held"), ("exempt", "exempt"))),
        ("denied", (("challenged", "with a challenge page"),)),
        ("closed", (("closed_by_ban", "by active bans"),))))


def notes_text(report: dict[str, Any]) -> list[str]:
    return [f"{report[name]:,} {text}" for name, text in (
        ("invalid_client_addresses", "requests without a valid client address (counted as one empty address)"),
        ("responses_without_status", "responses not counted: no status in the log")) if report[name]]


def _with_details(counts: dict[str, int], total: str, details: Sequence[tuple[str, str]]) -> str:
    """``23 allowed (3 observed over a limit, 2 held)``, without the zeros."""
    parts = [f"{counts[name]:,} {text}" for name, text in details if counts[name]]
    return f"{counts[total]:,} {total}" + (f" ({', '.join(parts)})" if parts else "")


def rule_table(report: dict[str, Any]) -> tuple[Row, Sequence[Row]]:
    """Every rule's outcomes, one row each; columns that are zero for every
    rule say nothing and are left out (``--json`` has them all)."""
    rules = report["rules"]
    columns = [c for c in RULE_COLUMNS if c in ("matched", "allowed") or any(r[c] for r in rules)]
    return (("rule", "action") + tuple(c.replace("_", " ") for c in columns),
            [(r["id"], r["action"]) + tuple(r[c] for c in columns) for r in rules])


def not_reached_text(rule: dict[str, Any]) -> list[str]:
    """Why a rule matched requests it never evaluated: an earlier rule
    refused them, or an active ban closed them."""
    lines = []
    for cause in rule["not_reached_because"]:
        count = cause["requests"]
        them = "them" if count != 1 else "it"
        what = (f"`{cause['rule']}` refused {them} first" if cause["by"] == "refused"
                else f"a ban by `{cause['rule']}` closed {them} first")
        lines.append(f"`{rule['id']}` was not reached for {plural(count, 'request')} because {what}")
    return lines


def rule_heading(rule: dict[str, Any]) -> str:
    return f"{rule['id']}: {rule['action']}, key {', '.join(rule['key'])}, {rule['limit']}"


def peak_text(rule: dict[str, Any]) -> str:
    return (f"peak {rule['peak_unit']} per key, over {plural(rule['keys'], 'key')}: "
            + _percentiles(rule["peak"]))


def without_top_text(rule: dict[str, Any], excluded: int) -> str:
    """The percentiles without the ``excluded`` heaviest keys ("" when
    none were to be left out)."""
    if not excluded or rule["peak"] is None:
        return ""
    text = f"without the {plural(excluded, 'heaviest key')}: "
    rest = rule["peak_without_top"]
    return text + (_percentiles(rest) if rest is not None else "no key left")


def _percentiles(peak: dict[str, int]) -> str:
    return ", ".join(f"{name if name == 'max' else name.upper()} {value:,}" for name, value in peak.items())


def refusal_text(rule: dict[str, Any], shared_agents: int) -> str:
    """Whom the rule refused (a ``log`` rule: let through over its limit)."""
    what = "refused" if rule["refuses"] else \
        f"would refuse (shadow, action {rule['action']})" if rule.get("shadow") else \
        f"over the limit, let through (action {rule['action']})"
    if not rule["refused_requests"] and not rule["refused_keys"]:
        return f"{what}: none"
    return (f"{what}: {plural(rule['refused_requests'], 'request')} from {rule['refused_keys']:,} of "
            f"{plural(rule['keys'], 'key')} ({rule['refused_keys_share']:.1%}), "
            f"{rule['refused_shared_keys']:,} of them with {shared_agents}+ user agents (a shared NAT?)")


def sweep_title(rule: dict[str, Any]) -> str:
    sweep = rule["sweep"]
    what = "what each would refuse" if rule["refuses"] else \
        f"what each lets through over the limit (action {rule['action']})"
    return f"sweep of {sweep['field']} (now {sweep['current']:,}), {what}:"


def sweep_table(rule: dict[str, Any], shared_agents: int) -> tuple[Row, Sequence[Row]]:
    sweep = rule["sweep"]
    word = "refused" if rule["refuses"] else "over limit"
    header = (sweep["field"], f"{word} requests", f"{word} keys", "share of keys",
              f"of them {shared_agents}+ user agents")
    rows = [(f"{c['threshold']:,} (now)" if c["threshold"] == sweep["current"] else c["threshold"],
             c["refused_requests"], c["refused_keys"], f"{c['refused_keys_share']:.1%}", c["refused_shared_keys"])
            for c in sweep["candidates"]]
    return header, rows


KEY_HEADER = ("key", "requests", "over limit", "peak", "user agents")


def key_tables(rule: dict[str, Any]) -> list[tuple[str, Row, Sequence[Row]]]:
    """The top keys by over-limit requests and by requests: (title, header, rows)."""
    tables: list[tuple[str, Row, Sequence[Row]]] = []
    for title, keys in (("most over limit", rule["top_over_limit"]), ("most requests", rule["top_requests"])):
        if keys:
            rows: list[Row] = [(k["key"], k["requests"], k["over_limit"], k["peak"],
                                f"{k['user_agents']}+" if k["user_agents"] >= AGENTS_COUNTED else k["user_agents"])
                               for k in keys]
            tables.append((title, KEY_HEADER, rows))
    return tables


def _rule_text(rule: dict[str, Any], report: dict[str, Any]) -> list[str]:
    lines = [rule_heading(rule)]
    if rule["counts_responses"]:
        lines.append(f"  responses counted: {rule['responses_counted']:,}")
    if rule["held"]:
        lines.append(f"  longest hold: {rule['longest_hold_seconds']:g} s")
    if rule["peak"] is None:
        lines.append("  no request matched")
        return lines
    lines.append("  " + peak_text(rule))
    without = without_top_text(rule, report["exclude_top"])
    if without:
        lines.append("  " + without)
    lines.append("  " + refusal_text(rule, report["shared_agents"]))
    if rule["sweep"] is not None:
        lines.append("  " + sweep_title(rule))
        lines += ["    " + line for line in _table(*sweep_table(rule, report["shared_agents"]))]
    for title, header, rows in key_tables(rule):
        lines += [f"  {title}:"] + ["    " + line for line in _table(header, rows)]
    return lines


def cell_text(value: Any) -> str:
    """A table cell as both reports show it: integers with thousands separators."""
    return f"{value:,}" if isinstance(value, int) else str(value)


def _table(header: Row, rows: Sequence[Row], text_columns: int = 1) -> list[str]:
    """Columns: the first ``text_columns`` left-aligned, the others (numbers)
    right-aligned."""
    cells = [list(header)] + [[cell_text(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) if i < text_columns else cell.rjust(width)
                      for i, (cell, width) in enumerate(zip(row, widths))).rstrip()
            for row in cells]
