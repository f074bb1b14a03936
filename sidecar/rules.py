"""Compiling a validated rules file into ready-to-run objects.

Everything here runs once per load. The result, a ``Ruleset``, holds compiled
regexes, parsed networks, small predicate and key-extractor functions and
limiter objects; evaluating a request is then lookups and arithmetic only
(STYLE: compile, then run).
"""

from __future__ import annotations

import dataclasses
import linecache
import math
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, cast

from sidecar import config, matching
from sidecar.actions import CHALLENGE_PAGE, BlockPage
from sidecar.challenge import cookie_name
from sidecar.clientip import ClientAddress, ClientIPResolver, NetworkSet
from sidecar.config import ConfigError, ConfigIssue, LoadedRules, Loc, resolve_file
from sidecar.crowdsec import AlertPusher, CrowdSecBouncer
from sidecar.geo import GeoDatabase, asn_of, country_of
from sidecar.identity import JwtReader, parse_jwks
from sidecar.keys import CountingKey, KeyPrefix, key_dimensions, key_values
from sidecar.limiters.base import Limiter
from sidecar.limiters.registry import build_limiter
from sidecar.request import CheckRequest
from sidecar.state import AutoBan, BanIncrement, Check, CheckSpec, PenaltyBan, add_check
from sidecar.store.redis_cluster import parse_node
from sidecar.tiers import Tiers, read_assignments

Predicate = Callable[[CheckRequest], bool]
KeyBuilder = Callable[[CheckRequest], CountingKey]
# The ruleset's rules for one request (``compile_matcher``): appends the
# matching rules and their checks to the two lists; True when a challenge
# credential ended the evaluation. Called with the request, its fields of
# ``MATCHER_FIELDS`` (``Ruleset.match_request``), the two lists, the
# request's lease id and the challenge credential's test.
Matcher = Callable[[CheckRequest, str, str, str, "dict[str, str]", str, "list[CompiledRule]", "list[Check]", str,
                    Callable[["CompiledRule", CheckRequest], bool]], bool]

# --------------------------------------------------------------------------
# Generated source
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GeneratedSource:
    """Python source that Sluice wrote and runs, as tracebacks, pdb and
    ``inspect`` show it: registered with ``linecache`` under ``filename``
    (nothing is written to disk), and given again by ``get_source`` (the
    loader protocol linecache asks a frame's globals for) if the cache is
    cleared."""

    filename: str
    text: str

    def get_source(self, _module: str) -> str:
        return self.text

    def run(self, namespace: dict[str, object]) -> None:
        """Register the text, and run it in ``namespace``."""
        lines = self.text.splitlines(keepends=True)
        # A line is printable ASCII (comments show values through _shown), so
        # linecache's lines are the compiler's: a traceback's line is its own.
        assert all(line.rstrip("\n").isascii() and line.rstrip("\n").isprintable() for line in lines)
        linecache.cache[self.filename] = (len(self.text), None, lines, self.filename)
        # A module name that is not imported, or inspect would read that module.
        namespace.update(__name__="sidecar.rules.generated", __loader__=self)
        exec(compile(self.text, self.filename, "exec"), namespace)  # noqa: S102 - our fragments only


class _Expression:
    """One rule's condition or key as a single Python expression, made into
    one function when the rules load: a request then costs one call, not a
    call per leaf and per dimension.

    Nothing from the rules file is ever written into the source as code:
    every value (a header name, a string to compare, a compiled regex,
    networks) is a constant the expression names (``c1``, ``c2``, ...),
    bound in the function's namespace. The source is built from the fixed
    fragments below, identifiers made of a rule id's letters, digits and
    underscores, and comments (``_shown``, which cannot end a line).

    A standalone function reads the request's fields by name. The matcher
    (``compile_matcher``) is handed those of ``MATCHER_FIELDS`` with the
    request, read in C by the compiled engine: ``in_matcher`` names them as
    its parameters.
    """

    def __init__(self, jwt: JwtReader | None = None, geo: Mapping[str, GeoDatabase] | None = None,
                 in_matcher: bool = False) -> None:
        self.namespace: dict[str, object] = {"__builtins__": {}}
        self.in_matcher = in_matcher
        self._constants = 0
        self._values = 0
        if jwt is not None:  # a request's claims, read once (sidecar.identity)
            self.namespace["jwt_claim"] = jwt.claim
        for name, database in (geo or {}).items():  # geo_asn, geo_country (sidecar.geo)
            self.namespace[f"geo_{name}"] = database.value_of

    def constant(self, value: object, name: str | None = None) -> str:
        """The name ``value`` is bound to: ``name``, or the next ``cN``."""
        if name is None:
            self._constants += 1
            name = f"c{self._constants}"
        self.namespace[name] = value
        return name

    def field(self, name: str) -> str:
        """The expression of the request's field ``name`` (one of
        ``MATCHER_FIELDS``, or another attribute of ``CheckRequest``)."""
        if name == "client_key":
            return name if self.in_matcher else "request.client.key"
        return name if self.in_matcher and name in MATCHER_FIELDS else f"request.{name}"

    def value(self) -> str:
        """A fresh local name, for a value read once and tested twice."""
        self._values += 1
        return f"v{self._values}"

    def function(self, expression: str) -> Callable[[CheckRequest], object]:
        function = eval(f"lambda request: {expression}", self.namespace)  # noqa: S307 - our fragments only
        return cast(Callable[[CheckRequest], object], function)

    def call(self, expression: str) -> matching.Call:
        """A matcher's expression as a function of the request and the
        matcher's fields: a program's call leaf or part (sidecar.matching)."""
        assert self.in_matcher
        function = eval(f"lambda request, {', '.join(MATCHER_FIELDS)}: {expression}",  # noqa: S307 - our fragments only
                        self.namespace)
        return cast(matching.Call, function)


def _shown(value: object, limit: int = 80) -> str:
    """A value from the rules file as a comment shows it: ``ascii`` escapes
    every line break and control character, so a comment stays one line."""
    text = ascii(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --------------------------------------------------------------------------
# Conditions
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Test:
    """A condition's leaf: its expression, what it tests in the rules
    file's words, and where the rules file says it."""

    code: str
    says: str
    loc: Loc
    native: matching.Node | None = None  # the program's leaf for it, when the program tests it natively


@dataclass(frozen=True, slots=True)
class _Group:
    """Parts joined by ``and`` (several leaves, ``all``) or ``or`` (``any``);
    evaluated in the file's order, stopping at the first that decides."""

    joins: Literal["and", "or"]
    parts: tuple[_Node, ...]


@dataclass(frozen=True, slots=True)
class _Not:
    part: _Node


_Node = _Test | _Group | _Not


def _string_op(test: config.StringTest | config.NamedTest | config.JwtTest) -> tuple[str, object]:
    """A string test's operation (equals, in, prefix or regex) and what it
    tests against (a string, a frozenset, or a compiled pattern's search)."""
    if test.equals is not None:
        return "equals", test.equals
    if test.in_ is not None:
        return "in", frozenset(test.in_)
    if test.prefix is not None:
        return "prefix", test.prefix
    assert test.regex is not None  # the model requires one test of the four
    return "regex", test.regex.search


def _string_test(test: config.StringTest | config.NamedTest | config.JwtTest, value: str,
                 source: _Expression) -> tuple[str, str]:
    """The test of ``value`` (an expression of a string), and what it tests."""
    op, against = _string_op(test)
    name = source.constant(against)
    if op == "equals":
        return f"{value} == {name}", f"equals {_shown(test.equals)}"
    if op == "in":
        return f"{value} in {name}", f"in {_shown(test.in_)}"
    if op == "prefix":
        return f"{value}.startswith({name})", f"prefix {_shown(test.prefix)}"
    assert test.regex is not None
    return f"{name}({value}) is not None", f"regex {_shown(test.regex.pattern)}"


def _native(field: str, test: config.StringTest | config.NamedTest, name: str = "") -> matching.Node:
    """The program's leaf of a test of a field (``name``: a named one's)."""
    if isinstance(test, config.NamedTest) and test.present is not None:
        return matching.leaf(field, "present" if test.present else "absent", name=name)
    op, against = _string_op(test)
    return matching.leaf(field, op, against, name)


def _value_test(lookup: str, present: Callable[[bool], str], test: config.NamedTest | config.JwtTest,
                label: str, source: _Expression) -> tuple[str, str]:
    """The test of a value found by name (``lookup``, an expression that is
    None without it), and what it tests; ``present`` is the code of a
    ``present:`` test."""
    if test.present is not None:
        return present(test.present), f"{label} {'present' if test.present else 'absent'}"
    value = source.value()
    code, says = _string_test(test, value, source)
    return f"(({value} := {lookup}) is not None and {code})", f"{label} {says}"


def _named_test(mapping: str, test: config.NamedTest, name: str, source: _Expression) -> tuple[str, str]:
    """A header's, cookie's or query parameter's test; ``mapping`` is the
    request's mapping of them."""
    key = source.constant(name)
    return _value_test(f"{mapping}.get({key})", lambda present: f"({key} {'in' if present else 'not in'} {mapping})",
                       test, _shown(name), source)


def _claim_test(test: config.JwtTest, source: _Expression) -> tuple[str, str]:
    """A test of a claim of the request's valid token; a request without
    one, or whose token lacks the claim, fails it (``present: false``
    aside)."""
    claim = f"jwt_claim(request, {source.constant(test.claim)})"
    return _value_test(claim, lambda present: f"({claim} {'is not' if present else 'is'} None)", test,
                       f"jwt claim {_shown(test.claim)}", source)


def _condition(condition: config.Condition, source: _Expression, loc: Loc) -> _Node:
    """A ``match:`` mapping (at ``loc`` in the file): several leaves mean all,
    tested in this order."""
    parts: list[_Node] = []
    if condition.all is not None:
        parts.append(_joined("and", [_condition(c, source, loc + ("all", i)) for i, c in enumerate(condition.all)]))
    if condition.any is not None:
        parts.append(_joined("or", [_condition(c, source, loc + ("any", i)) for i, c in enumerate(condition.any)]))
    if condition.not_ is not None:
        parts.append(_Not(_condition(condition.not_, source, loc + ("not",))))
    if condition.path is not None:
        code, says = _string_test(condition.path, source.field("path"), source)
        parts.append(_Test(code, f"path {says}", loc + ("path",), _native("path", condition.path)))
    if condition.host is not None:
        code, says = _string_test(condition.host, source.field("host"), source)
        parts.append(_Test(code, f"host {says}", loc + ("host",), _native("host", condition.host)))
    for name, fingerprint_test in (("ja3", condition.ja3), ("ja4", condition.ja4)):
        if fingerprint_test is not None:
            code, says = _string_test(fingerprint_test, _dimension_value(name, source), source)
            parts.append(_Test(code, f"{name} {says}", loc + (name,)))
    if condition.method is not None:
        methods = [m.upper() for m in condition.method]
        parts.append(_Test(f"{source.field('method')} in {source.constant(frozenset(methods))}",
                           f"method in {_shown(methods)}", loc + ("method",),
                           matching.leaf("method", "in", frozenset(methods))))
    for field_name, tests, mapping, fold in (("header", condition.header, "headers", True),
                                             ("cookie", condition.cookie, "cookies", False),
                                             ("query", condition.query, "query", False)):
        for index, test in enumerate(tests or ()):
            name = test.name.lower() if fold else test.name
            code, says = _named_test(source.field(mapping), test, name, source)
            parts.append(_Test(code, f"{field_name} {says}", loc + (field_name, index),
                               _native(field_name, test, name)))
    for name, geo_test in (("asn", condition.asn), ("country", condition.country)):
        if geo_test is not None:
            parts.append(_Test(f"geo_{name}(request) in {source.constant(frozenset(geo_test.in_))}",
                               f"{name} in {_shown(geo_test.in_)}", loc + (name,)))
    for index, claim_test in enumerate(condition.jwt or ()):
        parts.append(_Test(*_claim_test(claim_test, source), loc + ("jwt", index)))
    if condition.ip is not None:
        networks = NetworkSet(condition.ip.in_)
        parts.append(_Test(f"{source.constant(networks)}.holds(request.client)",
                           f"ip in {_shown([str(network) for network in networks])}", loc + ("ip",)))
    return _joined("and", parts)


def _joined(joins: Literal["and", "or"], parts: list[_Node]) -> _Node:
    """``parts`` joined, a group of the same kind spliced in (``a and (b and
    c)`` is ``a and b and c``, evaluated in the same order), one part alone."""
    flat: list[_Node] = []
    for part in parts:
        flat.extend(part.parts if isinstance(part, _Group) and part.joins == joins else (part,))
    return flat[0] if len(flat) == 1 else _Group(joins, tuple(flat))


def _inline(node: _Node) -> str:
    """A condition as one expression."""
    if isinstance(node, _Test):
        return f"({node.code})"
    if isinstance(node, _Not):
        return f"(not {_inline(node.part)})"
    if not node.parts:
        return "True" if node.joins == "and" else "False"
    return "(" + f" {node.joins} ".join(_inline(part) for part in node.parts) + ")"


def _program_node(node: _Node, source: _Expression) -> matching.Node:
    """A condition as the program's node: its leaves natively where they
    can be, else a call of their matcher's code."""
    if isinstance(node, _Test):
        return node.native if node.native is not None else matching.call(source.call(node.code))
    if isinstance(node, _Not):
        return matching.not_of(_program_node(node.part, source))
    parts = [_program_node(part, source) for part in node.parts]
    return matching.all_of(parts) if node.joins == "and" else matching.any_of(parts)


def _condition_lines(node: _Node, indent: str, comment: Callable[[_Test], str]) -> list[str]:
    """A condition as lines of source, one leaf a line with ``comment``'s
    comment: a traceback from a leaf shows that leaf's line."""
    if isinstance(node, _Test):
        return [f"{indent}{node.code}  # {comment(node)}"]
    if isinstance(node, _Not):
        return [f"{indent}not (", *_condition_lines(node.part, indent + "    ", comment), f"{indent})"]
    if not node.parts:
        return [f"{indent}{'True' if node.joins == 'and' else 'False'}"]
    inner = indent + "    "
    lines = [f"{indent}("]
    for index, part in enumerate(node.parts):
        part_lines = _condition_lines(part, inner, comment)
        if index:
            part_lines[0] = f"{inner}{node.joins} {part_lines[0][len(inner):]}"
        lines += part_lines
    return lines + [f"{indent})"]


def compile_condition(condition: config.Condition, jwt: JwtReader | None = None,
                      geo: Mapping[str, GeoDatabase] | None = None) -> Predicate:
    """A ``match:`` mapping as one predicate (``jwt``: the ruleset's
    reader of tokens, for a condition on claims; ``geo``: its databases)."""
    source = _Expression(jwt, geo)
    # Every leaf is a comparison, so the expression's value is a bool.
    return cast(Predicate, source.function(_inline(_condition(condition, source, ()))))


# --------------------------------------------------------------------------
# Counting keys
# --------------------------------------------------------------------------

GEO_DIMENSIONS = ("asn", "country")  # looked up in the geoip: section's databases
# Where the proxy reports the client's TLS fingerprints (JA3, JA4).
JA3_HEADER, JA4_HEADER = "x-sluice-ja3", "x-sluice-ja4"
# The request's fields the compiled engine hands the matcher with the
# request (read in C: an attribute read in the matcher is a generic one),
# in the order of its parameters; "client_key" is the client's key.
MATCHER_FIELDS = ("method", "host", "path", "headers", "client_key")
_FIELD_DIMENSIONS = {"ip": "client_key", "host": "host", "method": "method", "path": "path", "uri": "uri"}
# The client's TLS fingerprints, as the proxy reports them (the shipped
# Envoy fragments from its TLS inspector; nginx clears them).
_FINGERPRINT_HEADERS = {"ja3": JA3_HEADER, "ja4": JA4_HEADER}


def _dimension_value(dimension: str, source: _Expression) -> str:
    """The expression of a dimension's value (a missing one is "")."""
    if dimension in _FIELD_DIMENSIONS:
        return source.field(_FIELD_DIMENSIONS[dimension])
    if dimension in GEO_DIMENSIONS:
        return f"geo_{dimension}(request)"
    if dimension in _FINGERPRINT_HEADERS:
        return f"{source.field('headers')}.get({_FINGERPRINT_HEADERS[dimension]!r}, '')"
    kind, _, name = dimension.partition(":")
    mapping = {"header": "headers", "cookie": "cookies", "query": "query"}.get(kind)
    if mapping is not None:
        return f"{source.field(mapping)}.get({source.constant(name)}, '')"
    if kind == "jwt":
        # A claim of the request's valid token, else the client address:
        # tagged as session: is, so that a claim equal to an address is
        # still another key.
        value = source.value()
        client_key = source.field("client_key")
        return (f"(('ip', {client_key}) if ({value} := jwt_claim(request, {source.constant(name)})) "
                f"is None else ('jwt', {value}))")
    # session:COOKIE falls back to the client address; the two are tagged so
    # that a cookie whose value equals an address is still another key.
    value = source.value()
    return (f"(('ip', {source.field('client_key')}) if ({value} := {source.field('cookies')}.get("
            f"{source.constant(name)})) is None "
            f"else ('cookie', {value}))")


def _key_part(dimension: str, source: _Expression) -> matching.Part:
    """A dimension's value as the program's part of a key: natively where it
    can be (``_dimension_value`` says what each is), else a call of its
    matcher's code."""
    if dimension in _FIELD_DIMENSIONS:
        return matching.Part(dimension)
    if dimension in _FINGERPRINT_HEADERS:
        return matching.Part("header", _FINGERPRINT_HEADERS[dimension])
    kind, _, name = dimension.partition(":")
    if kind in ("header", "cookie", "query", "session"):
        return matching.Part(kind, name)
    return matching.Part("call", function=source.call(_dimension_value(dimension, source)))


def compile_key(rule_id: str, dimensions: list[str], jwt: JwtReader | None = None,
                geo: Mapping[str, GeoDatabase] | None = None) -> tuple[KeyPrefix, KeyBuilder]:
    """The key is the rule id, the sorted dimension names and their values.

    Keys are tuples (``CountingKey``), so values containing any separator
    cannot make two different tuples collide; sorting makes the written
    order irrelevant. No dimensions means host + client address.
    """
    prefix = (rule_id, tuple(sorted(dimensions or ["host", "ip"])))
    source = _Expression(jwt, geo)
    return prefix, cast(KeyBuilder, source.function(_key(prefix, source)))


def _key(prefix: KeyPrefix, source: _Expression, name: str | None = None) -> str:
    """The expression of a key with ``prefix`` (bound to ``name``, if given),
    from the request."""
    values = ", ".join(_dimension_value(dimension, source) for dimension in prefix[1])
    return f"({source.constant(prefix, name)}, {values})"


def describe_key(key: CountingKey) -> str:
    """A counting key as one readable string, for logs."""
    return " ".join(f"{name}={value!r}" if isinstance(value, tuple) else f"{name}={value}"
                    for name, value in zip(key_dimensions(key), key_values(key)))


# --------------------------------------------------------------------------
# Rules and the rule set
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Override:
    networks: NetworkSet
    multiply: float


@dataclass(frozen=True, slots=True)
class VerifiedBot:
    networks: NetworkSet
    user_agent: object | None  # compiled regex

    def matches(self, request: CheckRequest) -> bool:
        if not self.networks.holds(request.client):
            return False
        return self.user_agent is None or \
            self.user_agent.search(request.headers.get("user-agent", "")) is not None  # type: ignore[attr-defined]


MAX_SCORE = 1_000_000


def parse_score(value: str | None) -> int:
    """An upstream's score: an integer 1..1,000,000, else 0 (not counted)."""
    if value is None:
        return 0
    value = value.strip()
    if not (value.isascii() and value.isdigit() and len(value) <= 7):
        return 0
    score = int(value)
    return score if 1 <= score <= MAX_SCORE else 0


@dataclass(frozen=True, slots=True)
class ResponseCounting:
    """Which responses a response-phase rule counts, and by how much.

    ``count_on`` status and header conditions must all hold; a score budget
    counts the score in ``score_header``.
    """

    statuses: frozenset[int] | None = None
    header: str | None = None
    header_equals: str | None = None
    header_present: bool | None = None
    score_header: str | None = None

    def amount(self, status: int, headers: dict[str, str]) -> int:
        """How much this response adds to the key's count: 0 means nothing."""
        if self.statuses is not None and status not in self.statuses:
            return 0
        if self.header is not None:
            value = headers.get(self.header)
            if self.header_present is not None:
                if (value is not None) is not self.header_present:
                    return 0
            elif value != self.header_equals:
                return 0
        if self.score_header is not None:
            return parse_score(headers.get(self.score_header))
        return 1

    @classmethod
    def from_config(cls, count_on: config.CountOn | None, score_header: str | None) -> ResponseCounting:
        header = count_on.header if count_on is not None else None
        return cls(
            statuses=frozenset(count_on.status) if count_on is not None and count_on.status else None,
            header=header.name.lower() if header is not None else None,
            header_equals=header.equals if header is not None else None,
            header_present=header.present if header is not None else None,
            score_header=score_header,
        )


@dataclass(frozen=True, slots=True)
class ChallengeSettings:
    """A challenge rule's credential: its cookie and how long it lasts."""

    cookie: str
    ttl: float


@dataclass(frozen=True, slots=True)
class CompiledRule:
    id: str
    action: config.Action
    # The rule's own condition and key, one function each (for the admin,
    # tools and tests); Ruleset.match writes both inline for requests.
    condition: Predicate | None
    key: KeyBuilder
    key_prefix: KeyPrefix
    limiter: Limiter
    threshold: int  # X-RateLimit-Limit (threshold 0 reports 1; bucket capacity or burst + 1)
    reset: int | None  # X-RateLimit-Reset: the penalty length; None: the time until a request fits
    overrides: tuple[Override, ...]
    page: BlockPage | None  # block: status and page, or close; challenge: its page
    ban_duration: float | None
    response: ResponseCounting | None  # set: counted when the response is reported
    challenge: ChallengeSettings | None = None
    # Shadow mode: evaluated and counted as enforcing, its action not
    # applied (the request is allowed, the would-be action logged).
    shadow: bool = False
    # Response statuses that clear the key's counter and penalty (reset_on).
    reset_on: frozenset[int] | None = None
    ban_increment: BanIncrement | None = None  # ban.increment: repeat bans escalate
    penalty_ban: PenaltyBan | None = None  # challenge.then_ban_after: unsolved penalties ban
    # A challenge rule's: the ruleset's challenges per address before a ban.
    auto_ban: AutoBan | None = None
    # overload: closed: a late check it matches is refused unless known within limits.
    overload_closed: bool = False
    # Its threshold by the request's tier (sidecar.tiers), for the tiers it lists.
    tiers: Mapping[str, float] | None = None
    # Derived once, read on every request.
    stops: bool = field(init=False)  # over limit ends evaluation: every action but log, unless shadow
    counts: bool = field(init=False)  # counted at request time (no count_on, no score)
    applied_ban: float | None = field(init=False)  # the ban the store issues: none in shadow mode
    base_threshold: float = field(init=False)  # the threshold as a float, before overrides
    # What the rule asks of the store for a request it matches; for a
    # verified bot (never banned, by a challenge's bans neither).
    spec: CheckSpec = field(init=False)
    bot_spec: CheckSpec = field(init=False)
    # Per override: its networks, and the spec and bot spec with its threshold.
    override_specs: tuple[tuple[NetworkSet, CheckSpec, CheckSpec], ...] = field(init=False)
    # Per tier it lists: the spec and bot spec with the tier's threshold.
    tier_specs: Mapping[str, tuple[CheckSpec, CheckSpec]] = field(init=False)

    def __post_init__(self) -> None:
        stops = self.action != "log" and not self.shadow
        counts = self.response is None
        applied_ban = None if self.shadow else self.ban_duration
        threshold = float(self.threshold)
        # A shadow challenge is never issued, so it counts towards no ban.
        bans_for_challenges = self.challenge is not None and not self.shadow
        # Nothing to do after the store when within the limit but count the
        # hit (the spec's plain): no response phase, no reset_on, no slot.
        plain = counts and self.reset_on is None and not self.limiter.leases
        spec = CheckSpec(self.id, self.limiter, threshold, stops, applied_ban, counts,
                         self.auto_ban if bans_for_challenges else None, 1, self.ban_increment,
                         self.penalty_ban if bans_for_challenges else None, plain)
        # A verified bot that triggers a ban is let through.
        bot_spec = dataclasses.replace(spec, stops=stops and applied_ban is None, ban_duration=None,
                                       auto_ban=None, penalty_ban=None)
        if bot_spec == spec:
            bot_spec = spec  # nothing a verified bot changes: the engine need not ask
        override_specs = tuple(
            (override.networks, dataclasses.replace(spec, threshold=self.threshold * override.multiply),
             dataclasses.replace(bot_spec, threshold=self.threshold * override.multiply))
            for override in self.overrides)
        tier_specs = {tier: (dataclasses.replace(spec, threshold=tier_threshold),
                             dataclasses.replace(bot_spec, threshold=tier_threshold))
                      for tier, tier_threshold in (self.tiers or {}).items()}
        for name, value in (("stops", stops), ("counts", counts), ("applied_ban", applied_ban),
                            ("base_threshold", threshold), ("spec", spec), ("bot_spec", bot_spec),
                            ("override_specs", override_specs), ("tier_specs", tier_specs)):
            object.__setattr__(self, name, value)

    def spec_for(self, client: ClientAddress, spec: CheckSpec) -> CheckSpec:
        """``spec`` (the rule's, or its bot spec) with the threshold of the
        first override whose networks hold the client's address."""
        for networks, scaled, bot_scaled in self.override_specs:
            if networks.holds(client):
                return bot_scaled if spec is self.bot_spec and spec is not self.spec else scaled
        return spec

    def spec_for_tier(self, tier: str, spec: CheckSpec) -> CheckSpec:
        """``spec`` (the rule's, or its bot spec) with the threshold of
        ``tier``, when the rule lists it."""
        specs = self.tier_specs.get(tier)
        if specs is None:
            return spec
        return specs[1] if spec is self.bot_spec and spec is not self.spec else specs[0]

    def threshold_for(self, client: ClientAddress | None) -> float:
        """The threshold for a client, after overrides."""
        return self.spec_for(client, self.spec).threshold if client is not None else self.base_threshold


@dataclass(frozen=True, slots=True)
class Ruleset:
    rules: tuple[CompiledRule, ...]
    by_id: dict[str, CompiledRule]
    resolver: ClientIPResolver
    exempt: NetworkSet
    verified_bots: tuple[VerifiedBot, ...]
    node: str
    max_keys: int
    max_delayed: int
    backend: config.Backend
    url: str  # the shared store's, with backend redis
    cluster: tuple[tuple[str, int], ...]  # a Redis Cluster's configured nodes, or none
    sentinel: config.SentinelConfig | None  # or the sentinels that name its master
    fail: config.FailMode  # a request when the shared store is unavailable
    source: str
    secret: bytes | None  # HMAC key from challenge.secret_file
    draft_headers: bool  # RateLimit-Policy / RateLimit on allowed responses
    log_keys: config.LogKeys  # how decision lines show counting-key values
    difficulty: int  # proof-of-work zero bits of a challenge
    auto_ban: AutoBan  # challenges per address before it is banned
    match: Matcher  # the rules for one request, in order (compile_matcher)
    match_source: GeneratedSource  # match's source: what tracebacks show, and `sluice check --explain`
    # The same rules as data, which the compiled core runs in C (sidecar.matching):
    # None when a rule chooses its spec per request (verified bots, overrides, tiers).
    program: matching.Program | None
    overload_after: float = 0.25  # a check this late is answered by the overload policy
    # Whose refusals hold for every request of the client (sidecar.overload.AddressRefusals):
    # the id of the file's first rule when it qualifies, and bans.
    address_wide_rule: str | None = None
    address_wide_bans: bool = False
    jwt: JwtReader | None = None  # reads requests' tokens (the jwt: section)
    tiers: Tiers | None = None  # a request's tier (the tiers: section)
    geo: Mapping[str, GeoDatabase] = field(default_factory=dict)  # the geoip: section's databases
    notes: tuple[str, ...] = ()  # warnings found while compiling
    # The crowdsec: section's: the LAPI's decisions, the rule whose challenge
    # a captcha decision gets, and the sender of Sluice's bans as alerts.
    crowdsec: CrowdSecBouncer | None = None
    crowdsec_rule: CompiledRule | None = None
    crowdsec_push: AlertPusher | None = None
    holds: bool = field(init=False)  # any rule may hold a request (read for every request)
    leases: bool = field(init=False)  # any rule takes concurrency slots: requests need a lease id

    def __post_init__(self) -> None:
        object.__setattr__(self, "holds", any(rule.limiter.holds for rule in self.rules))
        object.__setattr__(self, "leases", any(rule.limiter.leases for rule in self.rules))

    @property
    def warnings(self) -> list[str]:
        """What is valid but probably not meant, said at load and reload."""
        if not self.rules:
            return [f"{self.source}: no rules (`rules: []`): every request is allowed", *self.notes]
        return list(self.notes)

    @property
    def longest_hold(self) -> float:
        """The longest a rule (a leaky bucket's) may hold a request, in seconds."""
        return max((rule.limiter.longest_hold() for rule in self.rules), default=0.0)

    def match_request(self, request: CheckRequest, matched: list[CompiledRule], checks: list[Check], lease: str,
                      has_credential: Callable[[CompiledRule, CheckRequest], bool]) -> bool:
        """The matcher called as the engine calls it (``Engine._prepare``,
        which reads the fields in C): the request's rules and checks
        appended to ``matched`` and ``checks``; True when a challenge
        credential ended the evaluation."""
        return self.match(request, request.method, request.host, request.path, request.headers, request.client.key,
                          matched, checks, lease, has_credential)


_MATCHER_HEAD = """\
# The rules of {source} as Sluice runs them, written when the file
# loaded (sidecar.rules.compile_matcher). Nothing is written to disk:
# tracebacks and debuggers show this text as {filename},
# and `sluice check --explain FILE` prints it.
#
# Every rule, in the file's order: its condition, leaf by leaf, stopping
# at the first that decides; for a challenge, the challenge's credential,
# which passes the request and ends the evaluation; then the rule is
# matched, and its check (its limit, as a spec, and the request's counting
# key) goes to the state store, which decides every check of the request
# at once. Values from the file are the constants c1, c2, ...: each line's
# comment gives its rule, its line in the file and what it tests.
def match(request, {fields}, matched, checks, lease, has_credential):
    # The engine hands the request's fields the rules read most, with the
    # request (sidecar.rules.MATCHER_FIELDS); client_key is the ip dimension.
    verified = None  # whether the request is a verified bot's, once asked
"""


def compile_matcher(rules: Sequence[tuple[CompiledRule, config.Rule]], verified_bots: Sequence[VerifiedBot],
                    loaded: LoadedRules, jwt: JwtReader | None = None,
                    geo: Mapping[str, GeoDatabase] | None = None,
                    tiers: Tiers | None = None) -> tuple[Matcher, GeneratedSource, matching.Program | None]:
    """The ruleset's rules, in order, as one function: what the engine did
    for each rule of each request (its condition, a challenge credential,
    a verified bot's spec, an override's, its key) written out, with every
    rule's condition and key inline instead of a call each; and its source,
    which tracebacks show and ``sluice check --explain`` prints; and the
    same rules as a program for the compiled core (``sidecar.matching``),
    or None when a rule chooses its spec per request (verified bots,
    overrides, tiers): the matcher runs those.

    As in ``_Expression``, no value from the file is written as code: every
    rule, spec and value is a bound constant (``rule_ID``, ``spec_ID``,
    ``c1``, ...), and comments show the values.
    """
    source = _Expression(jwt, geo, in_matcher=True)
    filename = f"{loaded.source}.matcher.py"
    lines = _MATCHER_HEAD.format(source=_shown(loaded.source, 200), filename=_shown(filename, 200),
                                 fields=", ".join(MATCHER_FIELDS)).splitlines()
    source.constant(add_check, "add_check")
    source.constant(lambda request: any(bot.matches(request) for bot in verified_bots), "is_verified_bot")
    if tiers is not None and any(rule.tiers for rule, _ in rules):
        source.constant(tiers.tier_of, "tier_of")
        lines.append("    tier = None  # the request's tier, once a rule with tiers asks (sidecar.tiers)")
    def line_of(loc: Loc) -> int:
        return loaded.issue(loc, "").line

    positions = {id(model): index for index, model in enumerate(loaded.model.rules)}
    steps: list[matching.Step | None] = []
    for rule, model in rules:
        overrides = [line_of(("overrides", index)) for index, override in enumerate(loaded.model.overrides)
                     if rule.id in override.rules]
        rule_lines, step = _rule_lines(rule, model, ("rules", positions[id(model)]), bool(verified_bots),
                                       overrides, source, line_of)
        lines += ["", *rule_lines]
        steps.append(step)
    lines.append("    return False")
    generated = GeneratedSource(filename, "\n".join(lines) + "\n")
    generated.run(source.namespace)
    program = None if None in steps else matching.Program(cast(list[matching.Step], steps))
    return cast(Matcher, source.namespace["match"]), generated, program


def _rule_lines(rule: CompiledRule, model: config.Rule, loc: Loc, verified_bots: bool, override_lines: list[int],
                source: _Expression, line_of: Callable[[Loc], int]) -> tuple[list[str], matching.Step | None]:
    """One rule's part of the matcher: its lines, with comments saying
    which rule and which line of the file each comes from (``line_of`` a
    location; ``override_lines``, the overrides that list the rule); and
    its step of the program, or None when it chooses its spec per request."""
    names = _rule_names(rule.id, source)
    name = source.constant(rule, names.format("rule"))
    lines = [f"    # rules[{loc[1]}]: {rule.id} (line {line_of(loc)}), {rule.action}"
             + (", in shadow mode" if rule.shadow else "")]
    indent = "    "
    program_condition = None
    if model.match is not None:
        condition = _condition(model.match, source, loc + ("match",))
        program_condition = _program_node(condition, source)
        condition_lines = _condition_lines(condition, indent,
                                           lambda test: f"{rule.id} (line {line_of(test.loc)}): {test.says}")
        condition_lines[0] = f"{indent}if {condition_lines[0][len(indent):]}"
        if isinstance(condition, _Test):  # one line: the colon before its comment
            code, _, comment = condition_lines[0].partition("  # ")
            condition_lines[0] = f"{code}:  # {comment}"
        else:
            condition_lines[-1] += ":"
        lines += condition_lines
        indent = "        "
    if rule.challenge is not None:
        lines += [f"{indent}if has_credential({name}, request):  # {rule.id}: its challenge solved",
                  f"{indent}    return True  # the request passes, and no later rule is evaluated"]
    spec = source.constant(rule.spec, names.format("spec"))
    # Verified bots are never banned, not even for challenges; the
    # challenge itself applies to them as block does.
    for_bots = verified_bots and rule.bot_spec is not rule.spec
    if for_bots or rule.overrides or rule.tiers:
        lines.append(f"{indent}spec = {spec}")
        spec = "spec"
    if for_bots:
        lines += [f"{indent}if verified is None:",
                  f"{indent}    verified = is_verified_bot(request)  # verified_bots: networks and user agent",
                  f"{indent}if verified:",
                  f"{indent}    spec = {source.constant(rule.bot_spec, names.format('bot_spec'))}"
                  f"  # {rule.id}: a verified bot is never banned"]
    if rule.overrides:
        lines.append(f"{indent}spec = {name}.spec_for(request.client, spec)  # {rule.id}: the threshold of the "
                     f"first override holding the client ({_lines_said(override_lines)})")
    if rule.tiers:
        lines += [f"{indent}if tier is None:",
                  f"{indent}    tier = tier_of(request)  # tiers: its identity's assignment, a claim, or the default",
                  f"{indent}spec = {name}.spec_for_tier(tier, spec)  # {rule.id} (line {line_of(loc + ('tiers',))}): "
                  f"the threshold of the request's tier"]
    key = _key(rule.key_prefix, source, names.format("key"))
    lines.append(f"{indent}add_check(matched, checks, {name}, {spec}, {key}, lease)"
                 f"  # {rule.id} (line {line_of(loc + ('key',))}): key {', '.join(rule.key_prefix[1])}"
                 + ("" if model.key else " (the default)"))
    if for_bots or rule.overrides or rule.tiers:
        return lines, None
    parts = [_key_part(dimension, source) for dimension in rule.key_prefix[1]]
    return lines, matching.Step(program_condition, rule.challenge is not None, rule, rule.spec, rule.key_prefix,
                                parts)


def _lines_said(lines: Sequence[int]) -> str:
    return ("line " if len(lines) == 1 else "lines ") + ", ".join(map(str, lines))


def _rule_names(rule_id: str, source: _Expression) -> str:
    """The pattern of a rule's constants' names (``rule_login``,
    ``spec_login``, ...): its id's letters, digits and underscores, made
    unique in the matcher."""
    base = re.sub(r"[^A-Za-z0-9_]", "_", rule_id)
    suffix, number = "", 1
    while f"rule_{base}{suffix}" in source.namespace:
        number += 1
        suffix = f"_{number}"
    return f"{{}}_{base}{suffix}"


def compile_rules(loaded: LoadedRules, shadow: bool = False) -> Ruleset:
    """Build the immutable ruleset; raise ConfigError for what cannot run.
    ``shadow`` puts every rule in shadow mode (``sluice serve --shadow``),
    as the file's ``mode: shadow`` does."""
    model = loaded.model
    issues: list[ConfigIssue] = []
    overrides: dict[str, list[Override]] = {}
    for override in model.overrides:
        for rule_id in override.rules:
            overrides.setdefault(rule_id, []).append(Override(NetworkSet(override.cidrs), override.multiply))
    auto_ban = AutoBan.from_config(model.challenge.auto_ban)
    node = model.node or socket.gethostname()
    notes: list[str] = []
    crowdsec = _crowdsec(model, node, loaded, issues, notes)
    jwt = _jwt_reader(model.jwt, loaded, issues)
    geo = _geo_databases(model.geoip, loaded)
    declared = {"jwt": jwt is not None, **{name: name in geo for name in GEO_DIMENSIONS}}
    tiers = _tiers(model.tiers, loaded, jwt, issues)
    rules: list[CompiledRule] = []
    compiled_from: list[tuple[CompiledRule, config.Rule]] = []
    for index, rule in enumerate(model.rules):
        loc = ("rules", index)
        if _reads_undeclared(rule, loc, declared, loaded, issues):
            continue
        page = None
        if rule.action == "block":
            block = rule.block or config.BlockAction()
            try:
                page = BlockPage.from_config(block, loaded.base_dir)
            except (OSError, UnicodeDecodeError) as exc:
                # Read at validation already; this is a file changed since.
                issues.append(loaded.issue(loc + ("block", "body_file"),
                                           f"cannot read the page template: {exc}"))
                continue
        challenge = None
        penalty_ban = None
        if rule.action == "challenge":
            page = CHALLENGE_PAGE
            settings = rule.challenge or config.ChallengeAction()
            challenge = ChallengeSettings(cookie_name(rule.id), settings.ttl)
            if settings.then_ban_after is not None:
                penalty_ban = PenaltyBan.after(settings.then_ban_after, model.challenge.auto_ban.ban)
        ban = rule.ban or config.BanAction()
        key_prefix, key = compile_key(rule.id, rule.key, jwt, geo)
        in_shadow = rule.shadow or shadow or model.mode == "shadow"
        limit = build_limiter(rule.limit.without_holds() if in_shadow else rule.limit, rule.penalty)
        if rule.id in overrides and not limit.limiter.scalable:
            issues.append(loaded.issue(loc + ("limit",), "overrides scale request and score "
                                       "thresholds; a bucket or concurrent rule cannot be listed in "
                                       "overrides"))
            continue
        tier_thresholds = _tier_thresholds(rule, loc, model.tiers, rule.id in overrides, limit.limiter, loaded,
                                           issues)
        if rule.tiers is not None and tier_thresholds is None:
            continue
        counts_responses = rule.count_on is not None or limit.score_header is not None
        response = ResponseCounting.from_config(rule.count_on, limit.score_header) if counts_responses else None
        rules.append(CompiledRule(
            id=rule.id,
            action=rule.action,
            condition=compile_condition(rule.match, jwt, geo) if rule.match is not None else None,
            key=key,
            key_prefix=key_prefix,
            limiter=limit.limiter,
            threshold=limit.threshold,
            reset=max(1, math.ceil(limit.penalty)) if limit.penalty is not None else None,
            overrides=tuple(overrides.get(rule.id, ())),
            page=page,
            ban_duration=ban.duration if rule.action == "ban" else None,
            response=response,
            challenge=challenge,
            shadow=in_shadow,
            reset_on=frozenset(rule.reset_on.status) if rule.reset_on is not None else None,
            ban_increment=BanIncrement.from_config(ban.increment) if ban.increment is not None else None,
            penalty_ban=penalty_ban,
            auto_ban=auto_ban if challenge is not None else None,
            overload_closed=rule.overload == "closed",
            tiers=tier_thresholds,
        ))
        compiled_from.append((rules[-1], rule))
    if issues:
        raise ConfigError(issues)
    client_ip = model.client_ip
    verified_bots = tuple(VerifiedBot(NetworkSet(b.cidrs), b.user_agent) for b in model.verified_bots)
    match, match_source, program = compile_matcher(compiled_from, verified_bots, loaded, jwt, geo, tiers)
    # The resolver tells each client it makes whether it is exempt.
    exempt = NetworkSet(model.exempt)
    crowdsec_rule = _crowdsec_rule(model.crowdsec) if crowdsec[0] is not None else None
    notes.extend(f"{loaded.source}: geoip.{name}: {database.problem}; the {name} dimension is empty until "
                 "it can be read" for name, database in geo.items() if database.problem is not None)
    return Ruleset(
        rules=tuple(rules),
        # The solution of a captcha decision's challenge finds its rule here.
        by_id={rule.id: rule for rule in (*rules, *([crowdsec_rule] if crowdsec_rule is not None else []))},
        resolver=ClientIPResolver(tuple(client_ip.trusted_proxies), client_ip.ipv4_prefix,
                                  client_ip.ipv6_prefix, exempt=exempt),
        exempt=exempt,
        verified_bots=verified_bots,
        node=node,
        max_keys=model.state.max_keys,
        max_delayed=model.state.max_delayed,
        backend=model.state.backend,
        url=model.state.url,
        cluster=tuple(parse_node(node) for node in model.state.cluster.nodes) if model.state.cluster else (),
        sentinel=model.state.sentinel,
        fail=model.state.fail,
        source=loaded.source,
        secret=_read_secret(model.challenge.secret_file, loaded.base_dir),
        draft_headers=model.headers == "draft",
        log_keys=model.decision_log.keys,
        difficulty=model.challenge.difficulty,
        auto_ban=auto_ban,
        match=match,
        program=program,
        match_source=match_source,
        overload_after=model.overload.after,
        address_wide_rule=_address_wide_rule(compiled_from, verified_bots),
        address_wide_bans=not verified_bots,
        jwt=jwt,
        tiers=tiers,
        geo=geo,
        notes=tuple(notes),
        crowdsec=crowdsec[0],
        crowdsec_rule=crowdsec_rule,
        crowdsec_push=crowdsec[1],
    )


# What a rule may read only when the file's section for it says where from.
_SECTIONS = {"jwt": "a jwt: section saying where tokens are and how they are verified",
             "asn": "geoip.asn, the ASN database", "country": "geoip.country, the Country database"}


def _reads_undeclared(rule: config.Rule, loc: Loc, declared: Mapping[str, bool], loaded: LoadedRules,
                      issues: list[ConfigIssue]) -> bool:
    """Whether a rule reads claims, an ASN or a country that the file does
    not say where to find (an issue each place it does)."""
    found = False
    for index, dimension in enumerate(rule.key):
        source = dimension.partition(":")[0]
        if source in _SECTIONS and not declared[source]:
            issues.append(loaded.issue(loc + ("key", index), f"{dimension} needs {_SECTIONS[source]}"))
            found = True
    for source, says in _SECTIONS.items():
        if rule.match is not None and rule.match.uses(source) and not declared[source]:
            issues.append(loaded.issue(loc + ("match",), f"a {source} condition needs {says}"))
            found = True
    return found


def _tiers(settings: config.TiersConfig | None, loaded: LoadedRules, jwt: JwtReader | None,
           issues: list[ConfigIssue]) -> Tiers | None:
    """The ``tiers:`` section compiled; its file of assignments is read now."""
    if settings is None:
        return None
    names = tuple(settings.names)
    if settings.default not in names:
        issues.append(loaded.issue(("tiers", "default"), f"no tier {settings.default!r}; the tiers are "
                                                         f"{', '.join(names)} (tiers.names)"))
    for field_name, uses_jwt in (("identity", (settings.identity or "").startswith("jwt:")),
                                 ("claim", settings.claim is not None)):
        if uses_jwt and jwt is None:
            issues.append(loaded.issue(("tiers", field_name), "a token's claim needs the jwt: section"))
    assigned: dict[str, str] = {}
    if settings.file is not None:
        path = resolve_file(settings.file, loaded.base_dir)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            issues.append(loaded.issue(("tiers", "file"), f"cannot read the tiers file: {exc}"))
        else:
            assigned, problems = read_assignments(str(path), text, names)
            issues.extend(problems)
    # The identity and the claim as the matcher reads dimensions (_dimension_value),
    # but plain: a missing one is no identity, never the client's address.
    source = _Expression(jwt)

    def reader(expression: str) -> Callable[[CheckRequest], str | None]:
        return cast(Callable[[CheckRequest], "str | None"], source.function(expression))

    identity = claim = None
    if jwt is not None and settings.claim is not None:
        claim = reader(f"jwt_claim(request, {source.constant(settings.claim)})")
    if settings.identity is not None:
        kind, _, name = settings.identity.partition(":")
        if kind != "jwt":
            identity = reader(_dimension_value(settings.identity, source))
        elif jwt is not None:
            identity = reader(f"jwt_claim(request, {source.constant(name)})")
    return Tiers(names, settings.default, identity, settings.identity or "", claim, assigned)


def _tier_thresholds(rule: config.Rule, loc: Loc, settings: config.TiersConfig | None, overridden: bool,
                     limiter: Limiter, loaded: LoadedRules, issues: list[ConfigIssue]) -> dict[str, float] | None:
    """A rule's ``tiers:`` as each tier's threshold, or None (with an issue
    each place it is wrong, or no tiers given)."""
    if rule.tiers is None:
        return None
    before = len(issues)
    where = loc + ("tiers",)
    if settings is None:
        issues.append(loaded.issue(where, "tiers need the tiers: section (its names, its default, and how a "
                                          "request's tier is found)"))
        return None
    if not limiter.scalable:
        issues.append(loaded.issue(where, "tiers set a request or score threshold; a bucket or concurrent "
                                          "rule cannot have tiers"))
        return None
    if overridden:
        issues.append(loaded.issue(where, "a rule takes its threshold from its tiers or from overrides, "
                                          "not both"))
    period = getattr(rule.limit, "per", None)
    thresholds: dict[str, float] = {}
    for tier, threshold in rule.tiers.items():
        if tier not in settings.names:
            issues.append(loaded.issue(where + (tier,), f"no tier {tier!r}; the tiers are "
                                                        f"{', '.join(settings.names)} (tiers.names)"))
        elif threshold.per is not None and threshold.per != period:
            issues.append(loaded.issue(where + (tier,), f"the rule counts per {config.format_duration(period)} "
                                                        f"(limit.per): write {threshold.count}, or "
                                                        f"{threshold.count}/{config.format_duration(period)}"
                                       if period is not None else "write a number"))
        thresholds[tier] = float(threshold.count)
    return thresholds if len(issues) == before else None


def _geo_databases(settings: config.GeoipConfig | None, loaded: LoadedRules) -> dict[str, GeoDatabase]:
    """The ``geoip:`` section's databases, opened now (one that cannot be
    read is kept, with its problem, and read once it can be)."""
    if settings is None:
        return {}
    fields = {"asn": asn_of, "country": country_of}
    return {name: GeoDatabase(str(resolve_file(path, loaded.base_dir)), fields[name])
            for name in GEO_DIMENSIONS if (path := getattr(settings, name)) is not None}


def _jwt_reader(settings: config.JwtConfig | None, loaded: LoadedRules,
                issues: list[ConfigIssue]) -> JwtReader | None:
    """The reader of the ``jwt:`` section; its JWKS file is read now."""
    if settings is None:
        return None
    keys = None
    fetching: dict[str, Any] = {}  # a JWKS URL's settings; the reader's defaults otherwise
    if settings.keys is not None:
        fetching = {"url": settings.keys.url, "refresh": settings.keys.refresh, "timeout": settings.keys.timeout}
        if settings.keys.file is not None:
            try:
                text = resolve_file(settings.keys.file, loaded.base_dir).read_text(encoding="utf-8")
                keys = parse_jwks(text, tuple(settings.algorithms))
            except (OSError, UnicodeDecodeError) as exc:
                issues.append(loaded.issue(("jwt", "keys", "file"), f"cannot read the JWKS file: {exc}"))
            except ValueError as exc:
                issues.append(loaded.issue(("jwt", "keys", "file"), f"the JWKS file is unusable: {exc}"))
    token = settings.token
    return JwtReader(header=token.header, cookie=token.cookie, payload_header=token.payload_header, keys=keys,
                     verified_by_proxy=settings.verified_by_proxy, algorithms=tuple(settings.algorithms),
                     issuer=settings.issuer, audience=settings.audience, leeway=settings.leeway, **fetching)


# The id of the rule a CrowdSec captcha decision's challenge is issued
# for (its credential cookie is sluice_pass_crowdsec); no rule of the file
# may have it while the file has a crowdsec: section.
CROWDSEC_RULE = "crowdsec"


def _crowdsec(model: config.RulesFile, node: str, loaded: LoadedRules, issues: list[ConfigIssue],
              notes: list[str]) -> tuple[CrowdSecBouncer | None, AlertPusher | None]:
    """The ``crowdsec:`` section's bouncer and alert sender, inert until
    the engine starts them; their secrets read now (a variable of the
    environment that is not set is a warning: ``sluice check`` may run
    where the secrets are not)."""
    settings = model.crowdsec
    if settings is None:
        return None, None
    for index, rule in enumerate(model.rules):
        if rule.id == CROWDSEC_RULE:
            issues.append(loaded.issue(("rules", index, "id"), f"the rule id {CROWDSEC_RULE!r} is the crowdsec: "
                                       "section's (its captcha decisions' challenge); choose another"))
    key = _secret_of(settings.key_file, settings.key_env, ("crowdsec", "key_file"), "bouncer key",
                     loaded, issues, notes)
    if settings.captcha == "challenge" and model.challenge.secret_file is None:
        notes.append(f"{loaded.source}: crowdsec.captcha: challenge: a captcha decision gets Sluice's challenge, "
                     "signed with challenge.secret_file, and the file sets none: a secret of this node's process "
                     "signs it (a credential is accepted by no other node, nor after a restart); set "
                     "challenge.secret_file, or captcha: ban")
    bouncer = CrowdSecBouncer(settings.url, key, settings.poll, settings.timeout, settings.captcha,
                              settings.max_decisions, node)
    push = settings.push_bans
    if push is None:
        return bouncer, None
    password = _secret_of(push.password_file, push.password_env, ("crowdsec", "push_bans", "password_file"),
                          "machine password", loaded, issues, notes)
    return bouncer, AlertPusher(settings.url, push.machine_id, password, settings.timeout, push.queue, node,
                                retry=settings.poll)


def _secret_of(file: str | None, variable: str | None, loc: Loc, what: str, loaded: LoadedRules,
               issues: list[ConfigIssue], notes: list[str]) -> str | None:
    """A secret from its file (read at validation already: a file changed
    since is an issue) or its environment variable (unset: a note)."""
    if file is not None:
        try:
            return resolve_file(file, loaded.base_dir).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            issues.append(loaded.issue(loc, f"cannot read the {what} file: {exc}"))
            return None
    assert variable is not None
    value = os.environ.get(variable, "").strip()
    if not value:
        notes.append(f"{loaded.source}: the environment variable {variable} (the {what}) is not set here; "
                     "Sluice cannot talk to the Local API without it")
        return None
    return value


def _crowdsec_rule(settings: config.CrowdSecConfig | None) -> CompiledRule:
    """The rule a captcha decision's challenge is issued for: its page and
    credential are a challenge rule's; it counts nothing."""
    assert settings is not None
    model = config.Rule.model_validate({"id": CROWDSEC_RULE, "limit": {"requests": 1, "per": "1s"},
                                        "action": "challenge"})
    key_prefix, key = compile_key(CROWDSEC_RULE, ["ip"])
    return CompiledRule(id=CROWDSEC_RULE, action="challenge", condition=None, key=key, key_prefix=key_prefix,
                        limiter=build_limiter(model.limit, None).limiter, threshold=0, reset=None, overrides=(),
                        page=CHALLENGE_PAGE, ban_duration=None, response=None,
                        challenge=ChallengeSettings(cookie_name(CROWDSEC_RULE), settings.captcha_ttl))


def _address_wide_rule(rules: Sequence[tuple[CompiledRule, config.Rule]],
                       verified_bots: Sequence[VerifiedBot]) -> str | None:
    """The rule whose refusal of a client holds for every request of that
    client while it lasts, if there is one: the first rule of the file, when
    it matches every request, is keyed by the address alone, and refuses at
    request time without a challenge; and the file has no verified bots
    (known by their user agent, and never banned). A later challenge rule's
    credential ends an evaluation only after the first rule has counted,
    so it changes nothing here. Its refusals are then answered again as
    stored bytes."""
    if not rules or verified_bots:
        return None
    first, source = rules[0]
    qualifies = (source.match is None and source.key == ["ip"] and first.stops and first.counts
                 and first.challenge is None and first.reset_on is None and not first.limiter.holds
                 and not first.limiter.leases)
    return first.id if qualifies else None


def _read_secret(name: str | None, base_dir: Path) -> bytes | None:
    if name is None:
        return None
    return config.resolve_file(name, base_dir).read_bytes().strip() or None


def load_ruleset(path: str, shadow: bool = False) -> Ruleset:
    return compile_rules(config.load_rules_file(path), shadow)


def default_ruleset(shadow: bool = False) -> Ruleset:
    """The embedded demo rules (``sluice serve --demo-rules``, ``make run``)."""
    text = resources.files("sidecar").joinpath("default_rules.yaml").read_text(encoding="utf-8")
    return compile_rules(config.parse_rules_text(text, "<default rules>", Path.cwd()), shadow)


def no_ruleset(shadow: bool = False) -> Ruleset:
    """No rules: ``sluice serve --rls-config`` without ``--config`` serves
    the Rate Limit Service alone, and its checks allow every request."""
    return compile_rules(config.parse_rules_text("rules: []\n", "<no --config>", Path.cwd()), shadow)

