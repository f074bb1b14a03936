"""``--sweep``: candidate thresholds for a rule, each replayed beside the
rules as they are, and what each would have refused.

The field a rule's limit keeps its threshold in, and the least value it
takes, are its kind's, in the limiter registry.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.config import ConfigError, LoadedRules, load_rules_file
from sidecar.limiters import registry
from sidecar.replay.stats import RuleStats, refusals
from sidecar.rules import Ruleset, compile_rules

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
        raise SweepError(f"no rule {rule_id!r} in {loaded.source}"
                         + (f" (did you mean {close[0]!r}?)" if close else ""))
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
        loaded = load_rules_file(path)
    except ConfigError as exc:
        raise SweepError("; ".join(str(issue) for issue in exc.issues)) from None
    return [build_sweep(loaded, rule_id, candidates) for rule_id, candidates in wanted]


def sweep_report(sweep: Sweep, runs: Sequence[RuleStats]) -> dict[str, Any]:
    return {"field": f"limit.{sweep.field}", "current": sweep.current,
            "candidates": [{"threshold": value} | refusals(stats) for value, stats in zip(sweep.candidates, runs)]}
