"""The replay's report as text and as JSON.

The text and the HTML page (``sidecar.replay.page``) say the same things in
the same words: both are made of the sentences and tables below.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from sidecar.plurals import plural
from sidecar.replay.stats import AGENTS_COUNTED


def render_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2) + "\n"


RULE_COLUMNS = ("matched", "allowed", "observed", "blocked", "challenged", "banned", "ban_closed", "held",
                "not_reached")


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
