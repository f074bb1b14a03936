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

- ``simulate``: the replay itself (``Replay``, ``replay_logs``);
- ``stats``: what it counts per rule and key, and the figures drawn from it;
- ``sweep``: candidate thresholds (``--sweep``);
- ``render``: the report as text and JSON;
- ``page``: the report as one HTML page (``--html``), imported from there.
"""

from sidecar.replay.render import (
    KEY_HEADER,
    NOTHING_REPLAYED,
    RULE_COLUMNS,
    Row,
    answers_text,
    cell_text,
    key_tables,
    late_text,
    not_reached_text,
    notes_text,
    nothing_replayed,
    peak_text,
    refusal_text,
    render_json,
    render_text,
    rule_heading,
    rule_table,
    skipped_text,
    summary_text,
    sweep_table,
    sweep_title,
    without_top_text,
)
from sidecar.replay.simulate import RecordingStore, Replay, VirtualClock, replay_logs
from sidecar.replay.stats import (
    AGENTS_COUNTED,
    PERCENTILES,
    SHARED_AGENTS,
    KeyStats,
    RuleStats,
    bucket_bounds,
    describe_limit,
    peak_bucket,
    peak_histogram,
    peak_unit,
    percentile,
    refusals,
    rule_report,
)
from sidecar.replay.sweep import (
    MAX_CANDIDATES,
    Sweep,
    SweepError,
    build_sweep,
    parse_sweep,
    prepare_sweeps,
    sweep_report,
)

__all__ = [
    # simulate
    "RecordingStore", "Replay", "VirtualClock", "replay_logs",
    # stats
    "AGENTS_COUNTED", "PERCENTILES", "SHARED_AGENTS", "KeyStats", "RuleStats", "bucket_bounds", "describe_limit",
    "peak_bucket", "peak_histogram", "peak_unit", "percentile", "refusals", "rule_report",
    # sweep
    "MAX_CANDIDATES", "Sweep", "SweepError", "build_sweep", "parse_sweep", "prepare_sweeps", "sweep_report",
    # render
    "KEY_HEADER", "NOTHING_REPLAYED", "RULE_COLUMNS", "Row", "answers_text", "cell_text", "key_tables",
    "late_text", "not_reached_text", "notes_text", "nothing_replayed", "peak_text", "refusal_text", "render_json",
    "render_text", "rule_heading", "rule_table", "skipped_text", "summary_text", "sweep_table", "sweep_title",
    "without_top_text",
]
