"""The YAML document both configuration formats are read through (rules
files and Rate Limit Service files): data, the line of every field, and
problems at their lines."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sidecar.config import ConfigIssue, Document

TEXT = """\
domain: shop
descriptors:
  - key: path

    value: /login
  - key: ip
"""


def test_a_document_has_the_data_and_the_line_of_every_field_and_item() -> None:
    document = Document("rls.yaml", TEXT)
    assert document.data == {"domain": "shop", "descriptors": [{"key": "path", "value": "/login"}, {"key": "ip"}]}
    assert document.issues == []
    assert document.lines[("domain",)] == 1
    assert document.lines[("descriptors", 0)] == 3
    assert document.lines[("descriptors", 0, "value")] == 5
    assert document.lines[("descriptors", 1, "key")] == 6


def test_an_issue_is_at_the_line_of_the_nearest_field_written() -> None:
    document = Document("rls.yaml", TEXT)
    # A field the file does not have (pydantic's location of a missing one)
    # is reported at its mapping, under its own name.
    issue = document.issue(("descriptors", 1, "rate_limit"), "field required", missing=True)
    assert issue == ConfigIssue("rls.yaml", 6, "descriptors[1].rate_limit", "field required")
    assert str(issue) == "rls.yaml:6: descriptors[1].rate_limit: field required"


def test_a_field_given_twice_is_an_issue_at_its_second_line() -> None:
    document = Document("r.yaml", "rules: []\nmode: shadow\nmode: enforce\n")
    assert document.issues == [ConfigIssue("r.yaml", 3, "mode", "field given twice")]
    assert document.data == {"rules": [], "mode": "shadow"}


def test_text_that_is_not_yaml_is_one_issue_at_its_line_and_no_data() -> None:
    document = Document("r.yaml", "rules:\n  - id: a\n   bad: [\n")
    [issue] = document.issues
    assert (issue.file, issue.line) == ("r.yaml", 3) and issue.message.startswith("invalid YAML: ")
    assert document.data == {}


@given(st.text(max_size=200))
def test_any_text_gives_data_or_issues_never_an_exception(text: str) -> None:
    document = Document("r.yaml", text)
    assert all(issue.file == "r.yaml" and issue.line >= 1 for issue in document.issues)
