"""YAML with the line of every field, and problems reported at those lines.

A ``Document`` is plain Python data read from YAML, with the line where each
field and item was written; the problems found in it, by YAML or by a
model's validation (``validation_issues``), are ``ConfigIssue`` values shown
as ``FILE:LINE: field.path: message``, all of them at once in a
``ConfigError``. Rules files (``sidecar.config.loader``) and Rate Limit
Service configurations (``sidecar.rls``) are both read through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

# Where a value is in a document: field names and list indexes, outermost first.
Loc = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    file: str
    line: int  # 0: the file as a whole (it could not be read)
    field: str
    message: str
    rule: str = ""  # the id of the rule the field belongs to, when it has one

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        field = self.field
        if self.rule and field.startswith("rules["):
            # rules[3](api-key).limit: the rule's id beside its position,
            # with no space, so the field stays one word of the line
            end = field.index("]") + 1
            field = f"{field[:end]}({self.rule}){field[end:]}"
        return f"{where}: {field}: {self.message}" if field else f"{where}: {self.message}"


class ConfigError(Exception):
    """A rules file that cannot be used; ``issues`` lists every problem."""

    def __init__(self, issues: list[ConfigIssue]) -> None:
        self.issues = issues
        super().__init__("\n".join(str(issue) for issue in issues))


class Document:
    """Plain Python data from YAML plus the line of every field and item,
    and what was written for the unquoted values YAML read as booleans or
    numbers (``yes``, ``off``, ``1_000``), to say so where text was due."""

    def __init__(self, file: str, text: str) -> None:
        self.file = file
        self.lines: dict[Loc, int] = {(): 1}
        self.written: dict[Loc, str] = {}
        self.issues: list[ConfigIssue] = []
        self._constructor = yaml.constructor.SafeConstructor()
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            line = mark.line + 1 if mark is not None else 1
            problem = getattr(exc, "problem", None) or str(exc)
            self.issues.append(ConfigIssue(file, line, "", f"invalid YAML: {problem}"))
            self.data: Any = {}
            return
        self.data = {} if node is None else self._convert(node, ())

    def _convert(self, node: yaml.Node, loc: Loc) -> Any:
        if isinstance(node, yaml.MappingNode):
            result: dict[str, Any] = {}
            for key_node, value_node in node.value:
                key = self._scalar(key_node, loc)
                line = key_node.start_mark.line + 1
                if not isinstance(key, str):
                    read = yaml_read(key_node.value, key) if isinstance(key_node, yaml.ScalarNode) else None
                    message = (f"field names must be text; {read}; quote it: \"{key_node.value}\":" if read
                               else f"field names must be text, got {key!r}")
                    self.issues.append(ConfigIssue(self.file, line, format_loc(loc), message))
                    continue
                if key in result:
                    self.issues.append(ConfigIssue(self.file, line, format_loc(loc + (key,)),
                                                   "field given twice"))
                    continue
                self.lines[loc + (key,)] = line
                result[key] = self._convert(value_node, loc + (key,))
            return result
        if isinstance(node, yaml.SequenceNode):
            items = []
            for index, item in enumerate(node.value):
                self.lines[loc + (index,)] = item.start_mark.line + 1
                items.append(self._convert(item, loc + (index,)))
            return items
        value = self._scalar(node, loc)
        if isinstance(value, (bool, int, float)) and isinstance(node, yaml.ScalarNode) and node.style is None:
            self.written[loc] = node.value
        return value

    def _scalar(self, node: yaml.Node, loc: Loc) -> Any:
        try:
            return self._constructor.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, TypeError) as exc:
            problem = getattr(exc, "problem", None) or str(exc)
            self.issues.append(ConfigIssue(self.file, node.start_mark.line + 1, format_loc(loc),
                                           f"invalid YAML value: {problem}"))
            return None

    def issue(self, loc: Loc, message: str, missing: bool = False) -> ConfigIssue:
        """An issue at ``loc`` (a pydantic location, possibly with union tags)."""
        return locate(self.file, self.lines, self.path(loc, missing), message)

    def path(self, loc: Loc, missing: bool = False) -> Loc:
        """Where a pydantic location is in the document: without union tags
        or list indexes pydantic invented (the missing field's name kept)."""
        path: list[str | int] = []
        current = self.data
        for index, part in enumerate(loc):
            if isinstance(current, dict) and isinstance(part, str) and part in current:
                current = current[part]
            elif isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current):
                current = current[part]
            elif missing and index == len(loc) - 1:
                path.append(part)
                break
            else:
                continue  # a union tag or a list index pydantic invented
            path.append(part)
        return tuple(path)

    def read_as_text(self, loc: Loc, expected_text: bool) -> str | None:
        """What to say about a value written unquoted that YAML read as a
        boolean or number, where ``expected_text`` says text was due."""
        path = self.path(loc)
        written = self.written.get(path)
        if written is None:
            return None
        value = self.data
        for part in path:
            value = value[part]
        read = yaml_read(written, value)
        if not expected_text:
            return read
        field = f"{path[-1]}: " if path and isinstance(path[-1], str) else ""
        return f"{read}; quote it: {field}\"{written}\""


def yaml_read(written: str, value: Any) -> str:
    """YAML 1.1 reads yes/no/on/off as booleans and 1_000, 0x1f, 1:30 as numbers."""
    if isinstance(value, bool):
        return f"YAML read {written} as {str(value).lower()}"
    if written == str(value):
        return f"YAML read {written} as a number"
    return f"YAML read {written} as the number {value!r}"


def format_loc(loc: Loc) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + ("in" if part == "in_" else "not" if part == "not_" else part)
    return text


_MESSAGES = {
    "extra_forbidden": "unknown field",
    "missing": "field required",
}


_SHOW_INPUT = {"literal_error", "greater_than", "greater_than_equal", "less_than",
               "less_than_equal", "too_short", "too_long", "string_too_short"}


def _message(error: ErrorDetails) -> str:
    kind = error["type"]
    if kind in _MESSAGES:
        return _MESSAGES[kind]
    message = error["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    message = message.replace("Input should be", "should be")
    if kind.endswith("_type") or kind in _SHOW_INPUT:
        message = f"{message}, got {error.get('input')!r}"
    return message


def locate(file: str, lines: dict[Loc, int], loc: Loc, message: str) -> ConfigIssue:
    """An issue at ``loc``, on the line of its nearest field that has one."""
    for depth in range(len(loc), -1, -1):
        if loc[:depth] in lines:
            return ConfigIssue(file, lines[loc[:depth]], format_loc(loc), message)
    return ConfigIssue(file, 1, format_loc(loc), message)


def validation_issues(document: Document, exc: ValidationError,
                      hint: Callable[[str], str]) -> list[ConfigIssue]:
    """A model's validation errors as issues at their lines; ``hint`` gives
    an unknown field's did-you-mean (or "")."""
    issues = []
    for error in exc.errors():
        message = _message(error)
        if error["type"] == "extra_forbidden" and error["loc"]:
            message += hint(str(error["loc"][-1]))
        elif error["type"] in ("string_type", "literal_error") and isinstance(error["input"], (bool, int, float)):
            read = document.read_as_text(tuple(error["loc"]), error["type"] == "string_type")
            if read is not None:
                message = read if error["type"] == "string_type" else f"{message} ({read})"
        issues.append(document.issue(tuple(error["loc"]), message, missing=error["type"] == "missing"))
    return issues
