"""`sluice replay --html`: the report page, rendered by headless Chromium.

The page is loaded through the DevTools protocol (tests/integration/browser.py),
which reports every console message, uncaught exception, browser log entry
(a blocked or failed load) and network request of the page. The test reads the rendered page back and
checks it against the text report the same command printed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.browser import Chromium

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "examples" / "replay.yaml"
LOG = REPO / "examples" / "access.log.sample"


# --------------------------------------------------------------------------
# What the page shows
# --------------------------------------------------------------------------

READ_PAGE = """(() => {
  const text = element => element ? element.textContent.trim() : null;
  const table = element => [...element.rows].map(row => [...row.cells].map(cell => cell.textContent.trim()));
  return {
    summary: text(document.querySelector("p.summary")),
    answers: text(document.querySelector("p.answers")),
    rules: table(document.querySelector("table.rules")),
    notReached: [...document.querySelectorAll("ul.not-reached li")].map(text),
    scripts: document.scripts.length,
    sections: [...document.querySelectorAll("section.rule")].map(section => {
      const svg = section.querySelector("svg");
      return {
        id: section.dataset.rule,
        paragraphs: [...section.querySelectorAll("p")].map(text),
        svgs: section.querySelectorAll("svg").length,
        width: svg ? svg.getBoundingClientRect().width : 0,
        height: svg ? svg.getBoundingClientRect().height : 0,
        bars: [...section.querySelectorAll("svg rect.bar")].length,
        counts: [...section.querySelectorAll("svg text.count")].map(text),
        thresholds: [...section.querySelectorAll("svg text.label")].map(text),
        tables: [...section.querySelectorAll("table")].map(table),
      };
    }),
  };
})()"""


def cells(line: str) -> list[str]:
    """A row of a text-report table: columns are two spaces apart or more."""
    return re.split(r"\s{2,}", line.strip())


def text_blocks(text: str) -> dict[str, list[str]]:
    """The text report's per-rule blocks, by rule id: the lines after the
    rule's heading line up to the next blank line."""
    blocks: dict[str, list[str]] = {}
    for block in text.split("\n\n"):
        lines = block.splitlines()
        match = re.match(r"([A-Za-z0-9_.-]+): ", lines[0]) if lines else None
        if match and len(lines) > 1 and lines[1].startswith("  "):
            blocks[match.group(1)] = lines
    return blocks


def text_tables(block: list[str]) -> list[list[list[str]]]:
    """The tables of a rule's block: runs of lines indented by four spaces."""
    tables: list[list[list[str]]] = []
    previous = False
    for line in block:
        is_row = line.startswith("    ")
        if is_row and not previous:
            tables.append([])
        if is_row:
            tables[-1].append(cells(line))
        previous = is_row
    return tables


def replay_with_html(tmp_path: Path, *options: str) -> tuple[str, Path]:
    page = tmp_path / "report.html"
    result = subprocess.run([sys.executable, "-m", "sidecar", "replay", "--config", str(RULES), *options,
                             "--html", str(page), str(LOG)], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout, page


def test_the_report_page_loads_clean_and_shows_what_the_text_report_says(tmp_path):
    text, page_file = replay_with_html(tmp_path, "--sweep", "api=10,20,50", "--sweep", "scrapers=30,60,100",
                                       "--exclude-top", "1", "--top", "3")
    with Chromium(tmp_path / "profile") as page:
        url = page_file.as_uri()
        page.open(url)
        shown = page.evaluate(READ_PAGE)
    assert page.problems() == []
    assert page.requested() == [url]  # the page itself, nothing else
    assert shown["scripts"] == 0

    lines = text.splitlines()
    assert shown["summary"] == lines[0]
    assert shown["answers"] in lines
    rule_rows = [cells(line) for line in lines[lines.index("") + 1:] if line][:len(shown["rules"])]
    assert shown["rules"] == rule_rows
    assert shown["notReached"] == [line.replace("`", "") for line in lines if " was not reached for " in line]
    assert shown["notReached"]  # the sample log has an api refusal that hides scrapers

    blocks = text_blocks(text)
    assert [section["id"] for section in shown["sections"]] == [row[0] for row in rule_rows[1:]] == list(blocks)
    for section in shown["sections"]:
        block = blocks[section["id"]]
        assert section["paragraphs"] == [line.strip() for line in block if not line.startswith("    ")
                                         and not line.endswith(":")], section["id"]
        assert section["tables"] == text_tables(block), section["id"]
        # One chart, drawn at its size, with a bar and a count per bucket that has keys.
        assert section["svgs"] == 1 and section["width"] > 300 and section["height"] > 100
        keys = int(re.search(r"over ([\d,]+) keys?:", block[1]).group(1).replace(",", ""))
        assert sum(int(count.replace(",", "")) for count in section["counts"]) == keys
        assert section["bars"] == len(section["counts"]) > 0
    thresholds = {section["id"]: section["thresholds"] for section in shown["sections"]}
    assert thresholds == {"api": ["10", "20 now", "50"], "scrapers": ["30", "60", "100 now"], "per-ip": []}


def test_the_browser_check_sees_errors_failed_loads_and_requests(tmp_path):
    # The same checks on a page that has everything the report must not.
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><head><meta charset="utf-8"><title>bad</title></head><body>'
                   '<img src="missing.png"><script>console.error("logged"); throw new Error("thrown")</script>'
                   "</body></html>", encoding="utf-8")
    with Chromium(tmp_path / "profile") as page:
        page.open(bad.as_uri())
    assert "console.error: logged" in page.problems()
    assert any(problem.startswith("uncaught: Error: thrown") for problem in page.problems())
    assert any("ERR_FILE_NOT_FOUND" in problem for problem in page.problems())
    assert (tmp_path / "missing.png").as_uri() in page.requested()


def test_markup_from_the_log_stays_text_in_the_browser(tmp_path):
    # A key (the path) and a skipped line carrying markup: shown as text,
    # nothing runs, nothing is fetched.
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - id: paths\n    key: [path]\n    limit: {requests: 1, per: 10s}\n"
                     "    action: block\n", encoding="utf-8")
    attack = '/<script>console.error("ran")</script><img src=x onerror=console.error(1)>'
    log = tmp_path / "access.log"
    line = json.dumps({"remote_addr": "192.0.2.1", "msec": "1709287200", "request_method": "GET",
                       "request_uri": attack, "status": "200"})
    log.write_text("\n".join([line, line, "<svg onload=console.error(2)> not a log line"]) + "\n",
                   encoding="utf-8")
    page_file = tmp_path / "report.html"
    result = subprocess.run([sys.executable, "-m", "sidecar", "replay", "--config", str(rules), "--html",
                             str(page_file), str(log)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    with Chromium(tmp_path / "profile") as page:
        page.open(page_file.as_uri())
        shown = page.evaluate("""({
          scripts: document.scripts.length,
          images: document.images.length,
          handlers: [...document.querySelectorAll("*")]
            .filter(e => [...e.attributes].some(a => a.name.startsWith("on"))).length,
          keys: [...document.querySelectorAll("table.keys td:first-child")].map(td => td.textContent),
          skipped: [...document.querySelectorAll("ul.skipped li")].map(li => li.textContent),
        })""")
    assert page.problems() == [] and page.requested() == [page_file.as_uri()]
    assert shown["scripts"] == shown["images"] == shown["handlers"] == 0
    assert f"path={attack}" in shown["keys"]
    assert any("<svg onload=console.error(2)>" in line for line in shown["skipped"])
