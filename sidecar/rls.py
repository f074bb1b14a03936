"""Rate Limit Service configurations: envoyproxy/ratelimit's YAML, read as it is.

One file per domain: ``domain`` and a tree of ``descriptors``, each a
``key`` with an optional ``value`` (a ``*`` in it matches any run of
characters), a ``rate_limit`` (``unit`` and ``requests_per_unit``, or
``unlimited: true``; ``name`` and ``replaces``), ``shadow_mode``,
``quota_mode``, ``detailed_metric``, ``value_to_metric``,
``share_threshold``, ``metadata`` (kept for other tools, unread) and nested
``descriptors``. A path is one file or a directory of them (every ``.yaml``
and ``.yml`` file under it, dot files skipped), like envoyproxy/ratelimit's
runtime directory.

Sluice's own settings go under a descriptor's ``sluice:`` key, which
envoyproxy/ratelimit rejects as an unknown key rather than ignoring it:
``algorithm`` (``fixed``, the default, as envoyproxy/ratelimit counts;
``sliding``; ``token_bucket``; ``leaky_bucket``), ``window`` (any length,
instead of the unit's), ``burst``, ``penalty`` and ``ban``.

Loading happens at start and on reload; every problem of every file is
reported at once as ``FILE:LINE: field: message``, as for rules files. The
compiled ``RlsConfig`` answers which limit a request's descriptor falls
under (``RlsConfig.match``), most specific entry first.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import CoreSchema

from sidecar.config import ConfigError, ConfigIssue, Document, Duration, Strict, validation_issues
from sidecar.limiters import RuleLimit, registry
from sidecar.limiters.base import Limiter

# Seconds per unit, and the unit's number in the protocol
# (RateLimitResponse.RateLimit.Unit).
UNITS: dict[str, tuple[float, int]] = {
    "second": (1.0, 1), "minute": (60.0, 2), "hour": (3600.0, 3), "day": (86400.0, 4),
    "month": (30 * 86400.0, 5), "year": (365 * 86400.0, 6), "week": (7 * 86400.0, 7),
}
UNIT_NAMES = {number: name for name, (_, number) in UNITS.items()}


class _RegisteredAlgorithms:
    """The schema of ``algorithm:``: one of the names the limiter registry
    holds when the schema is built (again after each registration)."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        names = tuple(algorithm.name for algorithm in registry.rls_algorithms())
        return handler.generate_schema(Literal[names])


Algorithm = Annotated[str, _RegisteredAlgorithms()]


# --------------------------------------------------------------------------
# The files
# --------------------------------------------------------------------------


class Replace(Strict):
    name: str = Field(min_length=1)


class RateLimit(Strict):
    unit: str | None = None
    requests_per_unit: int | None = Field(None, ge=0)
    unlimited: bool = False
    name: str | None = None
    replaces: list[Replace] = []

    @field_validator("unit")
    @classmethod
    def _unit(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if value.lower() not in UNITS:
            raise ValueError(f"unknown unit {value!r} (one of {', '.join(UNITS)})")
        return value.lower()

    @model_validator(mode="after")
    def _whole(self) -> RateLimit:
        if self.name is not None and self.name in {replace.name for replace in self.replaces}:
            raise ValueError(f"a limit cannot replace itself (name {self.name!r} is in its replaces)")
        if self.unlimited:
            if self.unit is not None or self.requests_per_unit is not None:
                raise ValueError("an unlimited rate limit has no unit and no requests_per_unit")
        elif self.unit is None or self.requests_per_unit is None:
            raise ValueError("give unit and requests_per_unit, or unlimited: true")
        return self


class Extension(Strict):
    """What Sluice adds to a descriptor, under its ``sluice:`` key."""

    # Built at first use, and again when an algorithm is registered.
    model_config = ConfigDict(defer_build=True)

    algorithm: Algorithm = "fixed"
    window: Duration | None = None  # the period, instead of the unit's
    burst: int | None = Field(None, ge=0)
    penalty: Duration | None = None  # refused for this long once over the limit
    ban: Duration | None = None  # the remote_address entry's address is banned

    @field_validator("ban")
    @classmethod
    def _ban_range(cls, value: float | None) -> float | None:
        if value is not None and not 1 <= value <= 365 * 86400:
            raise ValueError("a ban lasts from 1s to 1y")
        return value

    @model_validator(mode="after")
    def _fits_algorithm(self) -> Extension:
        if self.burst is not None and not registry.rls_algorithm_named(self.algorithm).burst:
            buckets = [algorithm.name for algorithm in registry.rls_algorithms() if algorithm.burst]
            raise ValueError(f"burst is a bucket's (algorithm: {' or '.join(buckets)})")
        return self


def _text(value: Any) -> Any:
    """An entry's key or value as text: YAML reads ``value: 500`` as a
    number and ``value: yes`` as true, which are the text ``500`` and
    ``true`` to the protocol."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, int) else value


EntryText = Annotated[str, BeforeValidator(_text)]


class Descriptor(Strict):
    model_config = ConfigDict(defer_build=True)  # as Extension's

    key: EntryText
    value: EntryText | None = None
    rate_limit: RateLimit | None = None
    descriptors: list[Descriptor] = []
    shadow_mode: bool = False
    quota_mode: bool = False
    detailed_metric: bool = False
    value_to_metric: bool = False
    share_threshold: bool = False
    metadata: Any = None
    sluice: Extension | None = None

    @field_validator("key")
    @classmethod
    def _key(cls, value: str) -> str:
        if not value:
            raise ValueError("a descriptor's key cannot be empty")
        return value

    @model_validator(mode="after")
    def _extension_needs_a_limit(self) -> Descriptor:
        if self.share_threshold and "*" not in (self.value or ""):
            raise ValueError("share_threshold shares one counter among the values a wildcard value "
                             "matches: give this descriptor a value with '*'")
        extension, rate_limit = self.sluice, self.rate_limit
        if extension is None:
            return self
        if rate_limit is None or rate_limit.unlimited:
            raise ValueError("sluice: shapes a rate_limit: give this descriptor one that is not unlimited")
        assert rate_limit.unit is not None and rate_limit.requests_per_unit is not None
        period = extension.window or UNITS[rate_limit.unit][0]
        registry.rls_algorithm_named(extension.algorithm).check(rate_limit.requests_per_unit, period)
        return self


class RlsFile(Strict):
    model_config = ConfigDict(defer_build=True)  # as Extension's

    domain: str = Field(min_length=1)
    descriptors: list[Descriptor] = []


def _rebuild() -> None:
    """The schema of a configuration, for the algorithms registered now."""
    for model in (Extension, Descriptor, RlsFile):
        model.model_rebuild(force=True)


registry.on_change(_rebuild)


# --------------------------------------------------------------------------
# What a request is matched against
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Limit:
    """A descriptor's compiled ``rate_limit``; ``limiter`` None is unlimited."""

    rule_id: str  # domain.key_value... of the configuration
    levels: tuple[str, ...]  # key_value... after the domain: the statistics' names
    limiter: Limiter | None
    threshold: float
    requests_per_unit: int
    unit: int  # the protocol's unit number (0: unlimited)
    name: str = ""
    replaces: tuple[str, ...] = ()
    shadow: bool = False
    quota_mode: bool = False
    ban: float | None = None


@dataclass(slots=True)
class Node:
    """One level of a domain's descriptor tree."""

    limit: Limit | None = None
    exact: dict[tuple[str, str], Node] = field(default_factory=dict)
    # (key, the value pattern, node), in the file's order.
    patterns: list[tuple[str, re.Pattern[str], Node]] = field(default_factory=list)
    any_value: dict[str, Node] = field(default_factory=dict)
    stat_part: str = ""  # key_value (a pattern's as written), or key for an entry that takes any value
    detailed_metric: bool = False
    value_to_metric: bool = False
    shared: str | None = None  # share_threshold: the pattern counts for every value it matches

    def child(self, key: str, value: str) -> Node | None:
        """The entry's node, most specific first: the exact value, then the
        first pattern that matches it, then the key with any value."""
        node = self.exact.get((key, value))
        if node is not None:
            return node
        for pattern_key, pattern, candidate in self.patterns:
            if pattern_key == key and pattern.fullmatch(value):
                return candidate
        return self.any_value.get(key)


@dataclass(frozen=True, slots=True)
class Match:
    """Where a request's descriptor falls: its limit, its metric's levels
    (after the domain) and the values it counts by."""

    limit: Limit
    levels: tuple[str, ...]
    values: tuple[str, ...]


# How many distinct overrides (requests_per_unit, unit) a process builds
# limiters for; past it, an override is counted with the configured limit.
MAX_OVERRIDES = 256


@dataclass
class RlsConfig:
    """Every domain's tree, and the files they came from."""

    domains: dict[str, Node]
    sources: tuple[str, ...] = ()
    near_limit_ratio: float = 0.8
    _overrides: dict[tuple[int, int], Limiter] = field(default_factory=dict)

    @property
    def limits(self) -> int:
        count, nodes = 0, list(self.domains.values())
        while nodes:
            node = nodes.pop()
            count += node.limit is not None
            nodes.extend(node.exact.values())
            nodes.extend(candidate for _, _, candidate in node.patterns)
            nodes.extend(node.any_value.values())
        return count

    def match(self, domain: str, entries: list[tuple[str, str]]) -> Match | None:
        """The limit of a descriptor's entries, or None. A limit applies
        only to a descriptor that ends on its node: one with more entries
        than the tree is deep, or that ends on a node without a
        rate_limit, has none; a level that matched is never retried as
        another."""
        node = self.domains.get(domain)
        if node is None or not entries:
            return None
        path: list[Node] = []
        for key, value in entries:
            child = node.child(key, value)
            if child is None:
                return None
            path.append(child)
            node = child
        if node.limit is None:
            return None
        values = tuple(value if step.shared is None else step.shared for step, (_, value) in zip(path, entries))
        if node.detailed_metric:  # every level as the request gave it
            levels = tuple(f"{key}_{value}" for key, value in entries)
        else:
            levels = tuple(f"{key}_{value}" if step.value_to_metric else step.stat_part
                           for step, (key, value) in zip(path, entries))
        return Match(node.limit, levels, values)

    def override(self, requests_per_unit: int, unit: int) -> Limiter | None:
        """The limiter of a request's own limit (``RateLimitDescriptor.limit``):
        a fixed window of its unit. None for an unknown unit, or once
        ``MAX_OVERRIDES`` others exist."""
        if unit not in UNIT_NAMES:
            return None
        limiter = self._overrides.get((requests_per_unit, unit))
        if limiter is None:
            if len(self._overrides) >= MAX_OVERRIDES:
                return None
            limiter = self._overrides[requests_per_unit, unit] = build_rls_limiter(
                requests_per_unit, UNIT_NAMES[unit], Extension()).limiter
        return limiter




# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


def rls_files(path: str | Path) -> list[Path]:
    """The configuration files of ``path``: itself, or every ``.yaml`` and
    ``.yml`` file under the directory, dot files and dot folders skipped."""
    root = Path(path)
    if not root.is_dir():
        return [root]
    return sorted(file for file in root.rglob("*")
                  if file.suffix in (".yaml", ".yml") and file.is_file()
                  and not any(part.startswith(".") for part in file.relative_to(root).parts))


def load_rls(path: str | Path, near_limit_ratio: float = 0.8) -> RlsConfig:
    """Every file of ``path``, validated and compiled; ConfigError listing
    every problem of every file."""
    files = rls_files(path)
    issues: list[ConfigIssue] = []
    if not files:
        raise ConfigError([ConfigIssue(str(path), 0, "", "no .yaml or .yml file in this directory")])
    domains: dict[str, Node] = {}
    seen: dict[str, str] = {}  # domain -> the file that gave it
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            issues.append(ConfigIssue(str(file), 0, "", f"cannot read the file: {exc}"))
            continue
        try:
            model = parse_rls_text(text, str(file))
        except ConfigError as exc:
            issues.extend(exc.issues)
            continue
        if model.domain in seen:
            issues.append(ConfigIssue(str(file), 1, "domain",
                                      f"domain {model.domain!r} is already configured in {seen[model.domain]}"))
            continue
        seen[model.domain] = str(file)
        domains[model.domain] = compile_domain(model)
    if issues:
        raise ConfigError(issues)
    return RlsConfig(domains, tuple(str(file) for file in files), near_limit_ratio)


def is_rls_text(text: str) -> bool:
    """Whether a file reads as a Rate Limit Service configuration (a
    top-level ``domain``) rather than a rules file, for ``sluice check``."""
    document = Document("", text)
    return isinstance(document.data, dict) and "domain" in document.data and "rules" not in document.data


def parse_rls_text(text: str, source: str) -> RlsFile:
    """One file, validated; ConfigError listing every problem."""
    document = Document(source, text)
    issues = list(document.issues)
    if not isinstance(document.data, dict):
        raise ConfigError(issues + [ConfigIssue(source, 1, "", "a configuration file must be a mapping")])
    model: RlsFile | None = None
    try:
        model = RlsFile.model_validate(document.data)
    except ValidationError as exc:
        issues.extend(validation_issues(document, exc, _did_you_mean))
    if isinstance(document.data.get("descriptors"), list):
        issues.extend(_tree_checks(document, document.data["descriptors"], ("descriptors",), False))
    if issues or model is None:
        raise ConfigError(sorted(set(issues), key=lambda i: (i.line, i.field, i.message)))
    return model


def _did_you_mean(name: str) -> str:
    """A hint for a misspelt field: the known name it most looks like."""
    names = sorted({field.alias or field_name for model in (RlsFile, Descriptor, RateLimit, Replace, Extension)
                    for field_name, field in model.model_fields.items()})
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.7)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _tree_checks(document: Document, descriptors: list[Any], loc: tuple[str | int, ...],
                 has_address: bool) -> list[ConfigIssue]:
    """What spans descriptors: the same entry twice at one level, and a ban
    with no address to ban."""
    issues = []
    seen: set[tuple[Any, Any]] = set()
    for index, descriptor in enumerate(descriptors):
        if not isinstance(descriptor, dict):
            continue
        here = loc + (index,)
        entry = (descriptor.get("key"), descriptor.get("value"))
        if entry in seen:
            name = entry[0] if entry[1] is None else f"{entry[0]}_{entry[1]}"
            issues.append(document.issue(here + ("key",), f"duplicate descriptor {name!r} at this level"))
        seen.add(entry)
        address = has_address or descriptor.get("key") == "remote_address"
        extension = descriptor.get("sluice")
        if isinstance(extension, dict) and extension.get("ban") is not None and not address:
            issues.append(document.issue(here + ("sluice", "ban"),
                                         "a ban bans a client address: put this descriptor under (or at) a "
                                         "remote_address entry"))
        children = descriptor.get("descriptors")
        if isinstance(children, list):
            issues.extend(_tree_checks(document, children, here + ("descriptors",), address))
    return issues


def compile_domain(model: RlsFile) -> Node:
    root = Node()
    _add_children(root, model.domain, (), model.descriptors)
    return root


def _add_children(parent: Node, domain: str, levels: tuple[str, ...], descriptors: list[Descriptor]) -> None:
    for descriptor in descriptors:
        part = descriptor.key if descriptor.value is None else f"{descriptor.key}_{descriptor.value}"
        value = descriptor.value
        node = Node(stat_part=part, detailed_metric=descriptor.detailed_metric,
                    value_to_metric=descriptor.value_to_metric,
                    shared=value if descriptor.share_threshold else None)
        node.limit = None if descriptor.rate_limit is None else _limit(domain, (*levels, part), descriptor)
        if value is None:
            parent.any_value[descriptor.key] = node
        elif "*" in value:
            pattern = re.compile(".*".join(re.escape(piece) for piece in value.split("*")), re.DOTALL)
            parent.patterns.append((descriptor.key, pattern, node))
        else:
            parent.exact[descriptor.key, value] = node
        _add_children(node, domain, (*levels, part), descriptor.descriptors)


def _limit(domain: str, levels: tuple[str, ...], descriptor: Descriptor) -> Limit:
    rule_id = ".".join((domain, *levels))
    rate_limit = descriptor.rate_limit
    assert rate_limit is not None
    name, replaces = rate_limit.name or "", tuple(replace.name for replace in rate_limit.replaces)
    if rate_limit.unlimited:
        return Limit(rule_id, levels, None, math.inf, 0, 0, name, replaces, descriptor.shadow_mode,
                     descriptor.quota_mode)
    assert rate_limit.unit is not None and rate_limit.requests_per_unit is not None
    extension = descriptor.sluice or Extension()
    compiled = build_rls_limiter(rate_limit.requests_per_unit, rate_limit.unit, extension)
    return Limit(rule_id, levels, compiled.limiter, compiled.threshold, rate_limit.requests_per_unit,
                 UNITS[rate_limit.unit][1], name, replaces, descriptor.shadow_mode, descriptor.quota_mode,
                 extension.ban)


def build_rls_limiter(requests: int, unit: str, extension: Extension) -> RuleLimit:
    """A descriptor's limiter: ``requests`` per unit (or per ``window``)
    counted by the extension's algorithm (see each in ``sidecar.limiters``:
    windows admit what fits whole; a bucket holds ``burst`` and gives
    ``requests`` back per period)."""
    period = extension.window or UNITS[unit][0]
    algorithm = registry.rls_algorithm_named(extension.algorithm)
    return algorithm.build(requests, period, extension.burst, extension.penalty)
