"""Access log entries through the real engine, on a clock set to each
line's time, and what every rule decided about them.

A replay decides each line as nginx's check would have been decided, and
reports the logged response when it ended; ``replay_logs`` runs it, and
the sweeps' candidate rulesets beside it, in one pass over the logs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from heapq import heappop, heappush
from typing import Any

from sidecar.accesslog import AccessLogs, LogEntry
from sidecar.challenge import FINGERPRINT_HEADER
from sidecar.engine import ALLOW, DENY, Decision, Engine
from sidecar.keys import key_rule_id
from sidecar.limiters import Hit
from sidecar.replay.stats import SHARED_AGENTS, RuleStats, rule_report
from sidecar.replay.sweep import Sweep, sweep_report
from sidecar.request import CheckRequest
from sidecar.rules import CompiledRule, Ruleset
from sidecar.state import Check, Evaluation, ResponseCount
from sidecar.store.memory import MemoryStore


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


class Replay:
    """Feeds log entries to an engine on a virtual clock and keeps the tallies."""

    def __init__(self, ruleset: Ruleset, default_host: str = "", watched: Collection[str] | None = None) -> None:
        """``watched``: the ids of the rules to keep tallies for (all by
        default); a sweep's replays watch only the rule they try. A
        crowdsec: section is left out: its decisions are not in access
        logs, and a replay neither polls a Local API nor sends it alerts."""
        if ruleset.crowdsec is not None:
            ruleset = dataclasses.replace(ruleset, crowdsec=None, crowdsec_rule=None, crowdsec_push=None)
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
            "rules": [rule_report(stats, top, exclude_top) for stats in self.rules.values()],
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
        by_id[sweep.rule_id]["sweep"] = sweep_report(sweep, [run.rules[sweep.rule_id] for run in runs])
    return report


def _timestamp(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    moment = datetime.fromtimestamp(seconds, UTC)
    return moment.isoformat(timespec="milliseconds" if seconds % 1 else "seconds").replace("+00:00", "Z")
