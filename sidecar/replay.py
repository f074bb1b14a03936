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
P50/P95/P99 of those peaks across the rule's keys.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from heapq import heappop, heappush, nlargest
from typing import Any, Sequence

from sidecar.accesslog import AccessLogs, LogEntry
from sidecar.challenge import FINGERPRINT_HEADER
from sidecar.clientip import in_networks
from sidecar.config import format_duration
from sidecar.engine import ALLOW, DENY, Decision, Engine
from sidecar.keys import CountingKey, key_rule_id
from sidecar.limiters import Hit
from sidecar.request import CheckRequest
from sidecar.rules import CompiledRule, Ruleset, describe_key
from sidecar.state import Check, Evaluation, ResponseCount
from sidecar.store.memory import MemoryStore

PERCENTILES = (50, 95, 99)
AGENTS_COUNTED = 10  # distinct user agents per key are counted up to this


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

    def __init__(self, ruleset: Ruleset, default_host: str = "") -> None:
        self.ruleset = ruleset
        self.default_host = default_host
        self.clock = VirtualClock()
        self.store = RecordingStore(ruleset.max_keys, ruleset.node, self.clock, wall_clock=self.clock)
        # Pending tokens are dated by the same clock, so they never look stale.
        self.engine = Engine(ruleset, store=self.store, clock=self.clock, wall_clock=self.clock)
        self.rules = {rule.id: RuleStats(rule, rule.limiter.peak_period()) for rule in ruleset.rules}
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
            if not hit.over_limit:
                self.rules[key_rule_id(count.key)].responses_counted += 1

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
            address = request.client.address
            exempt = self.ruleset.exempt
            answers["exempt"] += address is not None and bool(exempt) and in_networks(address, exempt)
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
        earlier_ban = None if evaluation.new_ban else evaluation.ban
        if earlier_ban is not None:
            # Refused at once, no rule evaluated; the ban's rule
            # gets the credit. It may be gone after a reload: not in replay.
            self.answers["closed_by_ban"] += 1
            self.rules[earlier_ban.rule_id].ban_closed += 1
        hits = [] if earlier_ban is not None else evaluation.hits
        for index, check in enumerate(self.store.checks):
            stats = self.rules[check.rule_id]
            stats.matched += 1
            key = stats.add(check.key, now, self._amount(stats.rule, entry), agent, entry.duration)
            if index >= len(hits):
                stats.not_reached += 1
                continue
            hit = hits[index]
            if not hit.over_limit:
                stats.allowed += 1
                if hit.delay and evaluation.delay:  # held only if the request was admitted
                    stats.held += 1
                    stats.longest_hold = max(stats.longest_hold, hit.delay)
                continue
            key.over_limit += 1
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

    def report(self, logs: AccessLogs, top: int = 5) -> dict[str, Any]:
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
            "rules": [_rule_report(stats, top) for stats in self.rules.values()],
        }


def replay_logs(ruleset: Ruleset, names: Sequence[str], top: int = 5,
                default_host: str = "") -> dict[str, Any]:
    """Replay the logs through the rules; raises ``LogError`` for a log
    that cannot be read."""
    replay = Replay(ruleset, default_host)
    with AccessLogs(names) as logs:
        for entry in logs:
            replay.feed(entry)
    replay.report_until(math.inf)  # the responses still in flight at the log's end
    return replay.report(logs, top)


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


def _rule_report(stats: RuleStats, top: int) -> dict[str, Any]:
    rule = stats.rule
    peaks = sorted(key.peak for key in stats.keys.values())
    items = list(stats.keys.items())
    over = [item for item in items if item[1].over_limit]
    return {
        "id": rule.id,
        "action": rule.action,
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
        "responses_counted": stats.responses_counted if rule.response is not None else None,
        "peak_period_seconds": stats.period,
        "peak_unit": peak_unit(rule, stats.period),
        "keys": len(peaks),
        "peak": ({f"p{p}": percentile(peaks, p) for p in PERCENTILES} | {"max": peaks[-1]}) if peaks else None,
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


def render_text(report: dict[str, Any]) -> str:
    lines = [_summary(report)]
    skipped = report["skipped"]
    if skipped["count"]:
        lines.append(f"skipped {skipped['count']:,} lines that are not requests; the first:")
        lines += [f"  {s['log']}:{s['line']}: {s['reason']}: {s['text']}" for s in skipped["examples"]]
    if report["late"]:
        lines.append(f"{report['late']:,} lines were more than {report['reorder_window_seconds']:g} s out "
                     "of time order and were replayed at the time already reached")
    answers = report["answers"]
    lines.append("answers: " + ", ".join(_with_details(answers, total, details) for total, details in (
        ("allowed", (("observed", "observed over a limit"), ("held", "held"), ("exempt", "exempt"))),
        ("denied", (("challenged", "with a challenge page"),)),
        ("closed", (("closed_by_ban", "by active bans"),)))))
    for name, text in (("invalid_client_addresses", "requests without a valid client address "
                        "(counted as one empty address)"),
                       ("responses_without_status", "responses not counted: no status in the log")):
        if report[name]:
            lines.append(f"{report[name]:,} {text}")
    rules = report["rules"]
    if not rules:
        return "\n".join(lines + ["the rules file has no rules"]) + "\n"
    # Columns that are zero for every rule say nothing (--json has them all).
    columns = [c for c in RULE_COLUMNS if c in ("matched", "allowed") or any(r[c] for r in rules)]
    lines.append("")
    lines += _table(("rule", "action") + tuple(c.replace("_", " ") for c in columns),
                    [(r["id"], r["action"]) + tuple(r[c] for c in columns) for r in rules],
                    text_columns=2)
    for rule in rules:
        lines += [""] + _rule_text(rule)
    return "\n".join(lines) + "\n"


def _with_details(counts: dict[str, int], total: str, details: Sequence[tuple[str, str]]) -> str:
    """``23 allowed (3 observed over a limit, 2 held)``, without the zeros."""
    parts = [f"{counts[name]:,} {text}" for name, text in details if counts[name]]
    return f"{counts[total]:,} {total}" + (f" ({', '.join(parts)})" if parts else "")


def _summary(report: dict[str, Any]) -> str:
    logs = report["logs"]
    text = (f"replayed {report['requests']:,} requests from {report['lines']:,} lines of "
            f"{len(logs)} log{'s' if len(logs) != 1 else ''}")
    if report["start"] is not None:
        hours, rest = divmod(round(report["seconds"]), 3600)
        text += f", {report['start']} to {report['end']} ({hours}:{rest // 60:02}:{rest % 60:02} of log time)"
    return text


def _rule_text(rule: dict[str, Any]) -> list[str]:
    lines = [f"{rule['id']}: {rule['action']}, key {', '.join(rule['key'])}, {rule['limit']}"]
    if rule["counts_responses"]:
        lines.append(f"  responses counted: {rule['responses_counted']:,}")
    if rule["held"]:
        lines.append(f"  longest hold: {rule['longest_hold_seconds']:g} s")
    peak = rule["peak"]
    if peak is None:
        lines.append("  no request matched")
        return lines
    keys = f"{rule['keys']:,} key{'s' if rule['keys'] != 1 else ''}"
    lines.append(f"  peak {rule['peak_unit']} per key, over {keys}: "
                 + ", ".join(f"{name if name == 'max' else name.upper()} {value:,}"
                             for name, value in peak.items()))
    header = ("key", "requests", "over limit", "peak", "user agents")
    for title, keys in (("most over limit", rule["top_over_limit"]), ("most requests", rule["top_requests"])):
        if keys:
            rows = [(k["key"], k["requests"], k["over_limit"], k["peak"],
                     f"{k['user_agents']}+" if k["user_agents"] >= AGENTS_COUNTED else k["user_agents"])
                    for k in keys]
            lines += [f"  {title}:"] + ["    " + line for line in _table(header, rows)]
    return lines


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], text_columns: int = 1) -> list[str]:
    """Columns: the first ``text_columns`` left-aligned, the others (numbers)
    right-aligned."""
    cells = [list(header)] + [[f"{v:,}" if isinstance(v, int) else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) if i < text_columns else cell.rjust(width)
                      for i, (cell, width) in enumerate(zip(row, widths))).rstrip()
            for row in cells]
