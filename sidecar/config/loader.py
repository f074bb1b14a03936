"""Loading a rules file: its YAML validated against the schema, with
every problem reported at once as ``FILE:LINE: field.path: message``.

Besides the models' own validation, the loader checks what spans several
rules (duplicate ids, overrides naming rules) and what a rule's kind of
limit cannot be combined with, at the field that combines it.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sidecar.config.document import ConfigError, ConfigIssue, Document, Loc, locate, validation_issues
from sidecar.config.models import RulesFile, field_names, limit_tag
from sidecar.limiters import registry


@dataclass(frozen=True, slots=True)
class LoadedRules:
    """A validated rules file, plus what is needed to resolve file references."""

    model: RulesFile
    source: str
    base_dir: Path
    lines: dict[Loc, int]

    def issue(self, loc: Loc, message: str) -> ConfigIssue:
        issue = locate(self.source, self.lines, loc, message)
        if len(loc) > 1 and loc[0] == "rules" and isinstance(loc[1], int) and loc[1] < len(self.model.rules):
            issue = dataclasses.replace(issue, rule=self.model.rules[loc[1]].id)
        return issue


def parse_rules_text(text: str, source: str, base_dir: Path) -> LoadedRules:
    """Validate rules-file text; raise ConfigError listing every problem."""
    document = Document(source, text)
    issues = list(document.issues)
    if not isinstance(document.data, dict):
        issues.append(ConfigIssue(source, 1, "", "the rules file must be a mapping"))
        raise ConfigError(issues)
    if "rules" not in document.data and not document.issues:
        # An empty or truncated file must not turn rate limiting off
        # silently: no rules at all has to be said, as `rules: []`.
        issues.append(ConfigIssue(source, 1, "rules", "the rules file is empty" if not document.data else
                                  "field required (write `rules: []` to run without rules on purpose)"))
    model: RulesFile | None = None
    try:
        # Keep the field order YAML gave us: ``dict`` already does.
        model = RulesFile.model_validate(document.data, context={"base_dir": base_dir})
    except ValidationError as exc:
        issues.extend(validation_issues(document, exc, _did_you_mean))
    issues.extend(_cross_checks(document))
    issues.extend(_limit_checks(document))
    issues.extend(_then_ban_checks(document))
    if issues or model is None:
        issues = [_with_rule_id(issue, document.data.get("rules")) for issue in issues]
        raise ConfigError(sorted(set(issues), key=lambda i: (i.line, i.field, i.message)))
    return LoadedRules(model, source, base_dir, document.lines)


_RULE_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _with_rule_id(issue: ConfigIssue, rules: Any) -> ConfigIssue:
    """The issue, naming the id of the rule its field is in (when it has one)."""
    match = re.match(r"rules\[(\d+)\]", issue.field)
    if match is None or not isinstance(rules, list) or int(match.group(1)) >= len(rules):
        return issue
    rule = rules[int(match.group(1))]
    rule_id = rule.get("id") if isinstance(rule, dict) else None
    if not isinstance(rule_id, str) or not _RULE_ID.fullmatch(rule_id):
        return issue  # no id, or one that is itself in error
    return dataclasses.replace(issue, rule=rule_id)


def _did_you_mean(name: str) -> str:
    """A hint for a misspelt field name: the known name it most looks like."""
    # A name known elsewhere (per: in a concurrency limit) is no misspelling.
    close = difflib.get_close_matches(name, sorted(field_names() - {name}), n=1, cutoff=0.7)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _cross_checks(document: Document) -> list[ConfigIssue]:
    """Checks that span several rules: duplicate ids, override references."""
    issues = []
    rules = document.data.get("rules")
    ids: set[str] = set()
    if isinstance(rules, list):
        for index, rule in enumerate(rules):
            rule_id = rule.get("id") if isinstance(rule, dict) else None
            if isinstance(rule_id, str):
                if rule_id in ids:
                    issues.append(document.issue(("rules", index, "id"),
                                                 f"duplicate rule id {rule_id!r}"))
                ids.add(rule_id)
    overrides = document.data.get("overrides")
    if isinstance(overrides, list):
        for index, override in enumerate(overrides):
            names = override.get("rules") if isinstance(override, dict) else None
            for position, name in enumerate(names if isinstance(names, list) else []):
                if isinstance(name, str) and name not in ids:
                    issues.append(document.issue(("overrides", index, "rules", position),
                                                 f"no rule with id {name!r}"))
    return issues


def _limit_checks(document: Document) -> list[ConfigIssue]:
    """What a rule's kind of limit cannot be combined with, at the field
    that combines it (a rule's own validator could only name the rule)."""
    issues = []
    rules = document.data.get("rules")
    for index, rule in enumerate(rules if isinstance(rules, list) else []):
        tag = limit_tag(rule.get("limit")) if isinstance(rule, dict) else None
        if tag is None:
            continue
        model = registry.limit_kind(tag).model
        for name, reason in model.refused_settings.items():
            if name in rule:
                issues.append(document.issue(("rules", index, name), reason))
        action = rule.get("action")
        if isinstance(action, str) and action in model.refused_actions:
            issues.append(document.issue(("rules", index, "action"), model.refused_actions[action]))
    return issues


def _then_ban_checks(document: Document) -> list[ConfigIssue]:
    """``then_ban_after`` counts per address: the rule's key must hold the
    address (no ``key:`` is host + ip), so that on a Redis Cluster its
    counters share the slot of the address's ban record."""
    issues = []
    rules = document.data.get("rules")
    for index, rule in enumerate(rules if isinstance(rules, list) else []):
        challenge = rule.get("challenge") if isinstance(rule, dict) else None
        if not isinstance(challenge, dict) or challenge.get("then_ban_after") is None:
            continue
        key = rule.get("key")
        if isinstance(key, list) and key and "ip" not in key:
            issues.append(document.issue(("rules", index, "challenge", "then_ban_after"),
                                         "then_ban_after bans an address for its penalties: the rule's key "
                                         "must include ip (e.g. key: [ip, ...])"))
    return issues


def load_rules_file(path: str | Path) -> LoadedRules:
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigIssue(source, 0, "", f"cannot read the rules file: {exc}")]) from None
    return parse_rules_text(text, source, Path(path).resolve().parent)
