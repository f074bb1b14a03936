"""``sluice replay --html``: the replay's report as one self-contained page.

The page is made from the same report data, sentences and tables as the
text report (``sidecar.replay.render``), so the two always agree. It needs
nothing but itself: no script, no external style sheet, font or image; the
charts are inline SVG drawn here. Its Content-Security-Policy forbids loading
anything, which also makes any markup smuggled in from the log inert.

Everything a log line can put into the report (keys, paths, user agents,
the text of skipped lines, the logs' names) is attacker-controlled: every
string goes through ``escape`` on its way into the page.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from typing import Any

from sidecar.plurals import plural
from sidecar.replay.render import (
    Row,
    answers_text,
    cell_text,
    key_tables,
    late_text,
    not_reached_text,
    notes_text,
    peak_text,
    refusal_text,
    rule_heading,
    rule_table,
    skipped_text,
    summary_text,
    sweep_table,
    sweep_title,
    without_top_text,
)
from sidecar.replay.stats import bucket_bounds, peak_bucket

# C0 and C1 controls (tab and newline aside) and lone surrogates, which a
# JSON log line can carry as escapes: shown as U+FFFD, never written raw.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_CODE = re.compile(r"`([^`]*)`")

STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; color: #222; max-width: 62rem; margin: 2rem auto; padding: 0 1rem; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.2rem; margin-top: 2.5rem; border-top: 1px solid #ccc; padding-top: 1rem; }
h3 { font-size: 1rem; margin-bottom: .3rem; }
table { border-collapse: collapse; margin: .5rem 0 1rem; }
th, td { padding: .2rem .6rem; border-bottom: 1px solid #e4e4e4; text-align: right; white-space: nowrap; }
th:first-child, td:first-child, table.rules td:nth-child(2) { text-align: left; }
td:first-child { white-space: normal; word-break: break-all; }
th { font-weight: 600; border-bottom: 2px solid #bbb; }
code, .skipped { font-family: ui-monospace, monospace; font-size: .9em; }
.skipped { word-break: break-all; }
svg { display: block; max-width: 100%; height: auto; }
svg .bar { fill: #4a7fb5; } svg .count, svg .tick { font-size: 10px; fill: #333; }
svg .axis { stroke: #888; } svg .threshold { stroke: #c0392b; stroke-width: 1.5; }
svg .current { stroke: #222; stroke-dasharray: 4 3; } svg .label { font-size: 11px; fill: #c0392b; }
svg .label.current { fill: #222; stroke: none; }
figcaption { font-size: .85rem; color: #555; }
"""

# Nothing may be fetched, no script may run: only the inline style applies.
CSP = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"


def escape(value: object) -> str:
    """Text for HTML content and quoted attributes, unprintable characters replaced."""
    return html.escape(_UNPRINTABLE.sub("\ufffd", str(value)), quote=True)


def render_html(report: dict[str, Any]) -> str:
    """The whole page."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             "<title>Sluice replay report</title>", f"<style>{STYLE}</style></head><body>",
             "<h1>Sluice replay report</h1>", _paragraph(summary_text(report), "summary")]
    skipped = report["skipped"]
    if skipped["count"]:
        parts.append(_paragraph(skipped_text(report)))
        parts.append('<ul class="skipped">' + "".join(
            f"<li>{escape(s['log'])}:{s['line']}: {escape(s['reason'])}: {escape(s['text'])}</li>"
            for s in skipped["examples"]) + "</ul>")
    for line in [late_text(report), answers_text(report), *notes_text(report)]:
        if line:
            parts.append(_paragraph(line, "answers" if line.startswith("answers:") else ""))
    rules = report["rules"]
    if not rules:
        parts.append(_paragraph("the rules file has no rules"))
    else:
        parts.append(_table(*rule_table(report), css="rules", text_columns=2))
        not_reached = [line for rule in rules for line in not_reached_text(rule)]
        if not_reached:
            parts.append('<ul class="not-reached">' + "".join(f"<li>{_with_code(line)}</li>" for line in not_reached)
                         + "</ul>")
        parts += [_rule_section(rule, report) for rule in rules]
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _rule_section(rule: dict[str, Any], report: dict[str, Any]) -> str:
    parts = [f'<section class="rule" id="rule-{escape(rule["id"])}" data-rule="{escape(rule["id"])}">',
             f"<h2>{escape(rule['id'])}</h2>", _paragraph(rule_heading(rule), "heading")]
    if rule["counts_responses"]:
        parts.append(_paragraph(f"responses counted: {rule['responses_counted']:,}"))
    if rule["held"]:
        parts.append(_paragraph(f"longest hold: {rule['longest_hold_seconds']:g} s"))
    if rule["peak"] is None:
        parts.append(_paragraph("no request matched"))
        return "\n".join(parts + ["</section>"])
    parts.append(_paragraph(peak_text(rule), "peak"))
    without = without_top_text(rule, report["exclude_top"])
    if without:
        parts.append(_paragraph(without, "without-top"))
    parts.append(_paragraph(refusal_text(rule, report["shared_agents"]), "refused"))
    sweep = rule["sweep"]
    thresholds = [c["threshold"] for c in sweep["candidates"]] if sweep is not None else []
    current = sweep["current"] if sweep is not None else None
    parts.append("<figure>" + histogram_svg(rule["peak_histogram"], thresholds, current, rule["peak_unit"])
                 + f"<figcaption>Keys by their peak {escape(rule['peak_unit'])}, in buckets that double"
                 " (bar heights on a log scale, the number of keys on each bar)"
                 + ("; red lines: the sweep's thresholds, dashed: the rule's own" if sweep is not None else "")
                 + ".</figcaption></figure>")
    if sweep is not None:
        parts.append(f"<h3>{escape(sweep_title(rule))}</h3>")
        parts.append(_table(*sweep_table(rule, report["shared_agents"]), css="sweep"))
    for title, header, rows in key_tables(rule):
        parts.append(f"<h3>{escape(title)}</h3>")
        parts.append(_table(header, rows, css="keys"))
    return "\n".join(parts + ["</section>"])


def _paragraph(text: str, css: str = "") -> str:
    return f'<p class="{css}">{escape(text)}</p>' if css else f"<p>{escape(text)}</p>"


def _with_code(text: str) -> str:
    """Escaped text, with `rule` ids set as code."""
    return _CODE.sub(r"<code>\1</code>", escape(text))


def _table(header: Row, rows: Sequence[Row], css: str, text_columns: int = 1) -> str:
    head = "".join(f"<th>{escape(cell)}</th>" for cell in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(cell_text(cell))}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


# --------------------------------------------------------------------------
# The histogram
# --------------------------------------------------------------------------

WIDTH, HEIGHT = 720, 230
LEFT, RIGHT, TOP, BOTTOM = 16, 16, 40, 34  # margins: threshold labels above, bucket labels below


def threshold_position(threshold: int) -> float:
    """Where a threshold falls on the bucket axis (bucket b spans [b, b+1)):
    between its value and the next, so that keys whose peak is at most the
    threshold are left of it. Within a bucket, by the share of its values."""
    bucket = peak_bucket(threshold)
    low, high = bucket_bounds(bucket)
    return bucket + (threshold - low + 1) / (high - low + 1)


def histogram_svg(buckets: Sequence[dict[str, int]], thresholds: Sequence[int], current: int | None,
                  unit: str) -> str:
    """Keys per bucket of peaks as bars, and a vertical line per threshold."""
    lines = sorted(set(thresholds) | ({current} if current is not None else set()))
    first = min([peak_bucket(b["low"]) for b in buckets] + [peak_bucket(t) for t in lines])
    last = max([peak_bucket(b["low"]) for b in buckets] + [math.ceil(threshold_position(t)) - 1 for t in lines])
    count = last - first + 1
    width = (WIDTH - LEFT - RIGHT) / count
    base = HEIGHT - BOTTOM
    tallest = math.log10(1 + max((b["keys"] for b in buckets), default=1))

    def x(position: float) -> float:
        return LEFT + (position - first) * width

    parts = [f'<svg class="histogram" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape("keys by peak " + unit)}">',
             f'<line class="axis" x1="{LEFT}" y1="{base}" x2="{WIDTH - RIGHT}" y2="{base}"/>']
    every = 1 if count <= 12 else 2  # bucket labels, every other one when crowded
    by_bucket = {peak_bucket(b["low"]): b["keys"] for b in buckets}
    for bucket in range(first, last + 1):
        low, high = bucket_bounds(bucket)
        span = f"{low:,}" if low == high else f"{low:,}\u2013{high:,}"
        keys = by_bucket.get(bucket, 0)
        left = x(bucket)
        if keys:
            height = max(2.0, (base - TOP - 14) * math.log10(1 + keys) / tallest)
            parts.append(f'<rect class="bar" x="{left + 1:.1f}" y="{base - height:.1f}" width="{width - 2:.1f}" '
                         f'height="{height:.1f}"><title>{span}: {plural(keys, "key")}</title></rect>')
            parts.append(f'<text class="count" x="{left + width / 2:.1f}" y="{base - height - 3:.1f}" '
                         f'text-anchor="middle">{keys:,}</text>')
        if (bucket - first) % every == 0:
            parts.append(f'<text class="tick" x="{left + width / 2:.1f}" y="{base + 14}" '
                         f'text-anchor="middle">{span if count <= 12 else f"{low:,}"}</text>')
    parts.append(f'<text class="tick" x="{LEFT + (WIDTH - LEFT - RIGHT) / 2:.1f}" y="{HEIGHT - 4}" '
                 f'text-anchor="middle">{escape("peak " + unit)}</text>')
    parts += _threshold_lines(lines, current, x, base)
    return "".join(parts) + "</svg>"


def _threshold_lines(lines: Sequence[int], current: int | None, x: Any, base: float) -> list[str]:
    """A line and a label per threshold; labels of lines close together
    alternate between two rows."""
    parts = []
    previous, row = -math.inf, 0
    for threshold in lines:
        at = x(threshold_position(threshold))
        row = 1 - row if at - previous < 36 else 0
        previous = at
        css = "threshold current" if threshold == current else "threshold"
        label = f"{threshold:,} now" if threshold == current else f"{threshold:,}"
        parts.append(f'<line class="{css}" x1="{at:.1f}" y1="{TOP - 6}" x2="{at:.1f}" y2="{base}"/>')
        parts.append(f'<text class="label{" current" if threshold == current else ""}" x="{at:.1f}" '
                     f'y="{TOP - 24 + 12 * row}" text-anchor="middle">{label}</text>')
    return parts
