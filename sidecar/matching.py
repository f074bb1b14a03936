"""The ruleset's rules as data the compiled core runs in C: a ``Program``.

``rules.compile_matcher`` writes a ruleset's rules as one Python function
(``Ruleset.match``), which the pure-Python core runs and
``sluice check --explain`` prints. Interpreted, that function is about
half the cost of a ten-rule check: its tests, the keys' tuples and the
calls that add each check are bytecode. The compiled core runs the same
rules as a ``Program`` instead: a step a rule (its condition as a tree of
``Node``, its challenge, its spec and its key's ``Part``s), walked by C
code that reads the request's fields and compares them natively, builds
each key's tuple and adds each ``Check`` without a Python call.

What the program does not test natively (an address range, a JWT claim, a
country, a fingerprint) is a ``call`` leaf or part: a function compiled
from the matcher's own code for it, handed the same fields. A ruleset
whose rules choose their spec per request (verified bots, overrides,
tiers) has no program: its matcher runs (``rules.compile_matcher``).

The module's pure-Python twin is the reference the tests hold it to: on
any rules and requests, a program adds the same rules, checks and keys as
the matcher (tests/unit/test_matcher.py).
"""

from __future__ import annotations

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

from collections.abc import Callable, Sequence
from typing import Any

from sidecar.request import CheckRequest, cookie_value, query_value
from sidecar.state import Check, CheckSpec

COMPILED: bool = cython.compiled  # whether this module runs compiled (the engine runs programs only then)

# What a condition's node is (Node.kind): a group, a negation, a call, or a
# leaf testing one of the request's fields.
_ALL = 0
_ANY = 1
_NOT = 2
_CALL = 3
_PATH = 4
_HOST = 5
_METHOD = 6
_HEADER = 7
_COOKIE = 8
_QUERY = 9
# How a leaf tests its field's value (Node.op).
_EQUALS = 0
_IN = 1
_PREFIX = 2
_REGEX = 3
_PRESENT = 4
_ABSENT = 5
# A regex leaf keeps its answers for the values it tested last (a site's
# paths repeat; a pattern's search costs about ten times a dict lookup):
# at most MEMO_SIZE values of at most MEMO_LONGEST characters, forgotten
# all at once when full, so that what a client sends bounds nothing.
MEMO_SIZE = 1024
MEMO_LONGEST = 256
# What a key's part is (Part.kind).
_CLIENT = 10
_URI = 11
_SESSION = 12

_FIELDS = {"path": _PATH, "host": _HOST, "method": _METHOD, "header": _HEADER, "cookie": _COOKIE, "query": _QUERY}
_OPS = {"equals": _EQUALS, "in": _IN, "prefix": _PREFIX, "regex": _REGEX, "present": _PRESENT, "absent": _ABSENT}
_PARTS = {"ip": _CLIENT, "host": _HOST, "method": _METHOD, "path": _PATH, "uri": _URI, "header": _HEADER,
          "cookie": _COOKIE, "query": _QUERY, "session": _SESSION}

# A call leaf's or part's function: handed the request and the fields the
# matcher is handed (rules.MATCHER_FIELDS).
Call = Callable[[CheckRequest, str, str, str, "dict[str, str]", str], Any]


class Node:
    """A condition's node: ``all`` or ``any`` of its parts, ``not`` of its
    one part, a ``call``, or a leaf: a field (``path``, ``host``,
    ``method``, or a ``header``, ``cookie`` or ``query`` parameter by
    ``name``) tested by ``op`` against ``value``: ``equals`` a string,
    ``in`` a frozenset, ``prefix``, ``regex`` (a compiled pattern's search),
    ``present`` or ``absent`` (a named field). A regex leaf's ``memo``
    holds its answers for the values it tested last."""

    __slots__ = ("kind", "op", "name", "text", "values", "function", "parts", "memo")

    def __init__(self, kind: int, op: int = 0, name: str = "", value: object = None,
                 parts: tuple[Node, ...] = ()) -> None:
        self.kind = kind
        self.op = op
        self.name = name
        self.text = value if isinstance(value, str) else ""
        self.values = value if isinstance(value, frozenset) else frozenset()
        self.function: Any = value if callable(value) else None
        self.parts = parts
        self.memo: dict[str, bool] = {}


def leaf(field: str, op: str, value: object = None, name: str = "") -> Node:
    """A field's test (``field``: path, host, method, header, cookie or
    query; ``op``: equals, in, prefix, regex, present or absent)."""
    return Node(_FIELDS[field], _OPS[op], name, value)


def call(function: Call) -> Node:
    """A leaf the program calls: true when ``function`` returns a true value."""
    return Node(_CALL, value=function)


def all_of(parts: Sequence[Node]) -> Node:
    return Node(_ALL, parts=tuple(parts))


def any_of(parts: Sequence[Node]) -> Node:
    return Node(_ANY, parts=tuple(parts))


def not_of(part: Node) -> Node:
    return Node(_NOT, parts=(part,))


class Part:
    """A counting key's value: the client's key (``ip``), ``host``,
    ``method``, ``path``, ``uri``, a ``header``, ``cookie`` or ``query``
    parameter by ``name`` ("" when missing), a ``session`` cookie (tagged,
    or the tagged client key without it), or a ``call``."""

    __slots__ = ("kind", "name", "function")

    def __init__(self, kind: str, name: str = "", function: Call | None = None) -> None:
        self.kind = _CALL if kind == "call" else _PARTS[kind]
        self.name = name
        self.function = function


class Step:
    """One rule of the program: its condition (None: every request), whether
    it is a challenge (whose credential passes the request and ends the
    evaluation), the rule and spec its check carries, and its key: the
    rule's prefix and its parts' values."""

    __slots__ = ("condition", "challenge", "rule", "spec", "prefix", "parts")

    def __init__(self, condition: Node | None, challenge: bool, rule: object, spec: CheckSpec,
                 prefix: object, parts: Sequence[Part]) -> None:
        self.condition = condition
        self.challenge = challenge
        self.rule = rule
        self.spec = spec
        self.prefix = prefix
        self.parts = tuple(parts)


class Program:
    """The rules in order, run for each request as the matcher runs them
    (``rules.compile_matcher``): each rule's condition, stopping at the
    first leaf that decides; a challenge's credential, which passes the
    request and ends the evaluation (True); then the rule's check (its spec
    and the request's key, with ``lease``) to ``checks`` and the rule to
    ``matched``, and its key to ``states.hint`` (the compiled memory map the
    checks are read from next, or None)."""

    __slots__ = ("steps",)

    def __init__(self, steps: Sequence[Step]) -> None:
        self.steps = tuple(steps)

    def run(self, request: CheckRequest, client_key: str, matched: list[Any], checks: list[Check], lease: str,
            has_credential: Callable[[Any, CheckRequest], bool], states: Any = None) -> bool:
        method, host, path = request.method, request.host, request.path
        fields = request.headers
        # A mapping of another type (tests) is read as a dict.
        headers: dict[str, str] = fields if type(fields) is dict else dict(fields)
        steps = self.steps
        for index in range(len(steps)):
            step = cython.cast(Step, steps[index])  # compiled: no type test (a program holds steps)
            if step.condition is not None and not _holds(step.condition, request, method, host, path, headers,
                                                          client_key):
                continue
            if step.challenge and has_credential(step.rule, request):
                return True
            parts = step.parts
            count = len(parts)
            key: tuple[Any, ...]
            if count == 1:
                key = (step.prefix, _value(cython.cast(Part, parts[0]), request, method, host, path, headers,
                                           client_key))
            elif count == 2:
                key = (step.prefix,
                       _value(cython.cast(Part, parts[0]), request, method, host, path, headers, client_key),
                       _value(cython.cast(Part, parts[1]), request, method, host, path, headers, client_key))
            else:
                key = (step.prefix, *[_value(cython.cast(Part, part), request, method, host, path, headers,
                                             client_key) for part in parts])
            check = cython.cast(Check, Check.__new__(Check))  # compiled: no type test
            check.spec = step.spec
            check.key = key
            check.lease = lease
            if states is not None:
                # The compiled memory map asks for the key's index entry now,
                # on its way while the next rules are matched (StateMap.hint).
                states.hint(key, len(checks))
            matched.append(step.rule)
            checks.append(check)
        return False


def _holds(node: Node, request: CheckRequest, method: str, host: str, path: str, headers: dict[str, str],
           client_key: str) -> bool:
    """Whether the request passes the condition ``node``."""
    kind = node.kind
    if kind == _ALL:
        for part in node.parts:
            if not _holds(cython.cast(Node, part), request, method, host, path, headers, client_key):
                return False
        return True
    if kind == _ANY:
        for part in node.parts:
            if _holds(cython.cast(Node, part), request, method, host, path, headers, client_key):
                return True
        return False
    if kind == _NOT:
        return not _holds(cython.cast(Node, node.parts[0]), request, method, host, path, headers, client_key)
    if kind == _CALL:
        return bool(node.function(request, method, host, path, headers, client_key))
    value: object
    if kind == _PATH:
        value = path
    elif kind == _HOST:
        value = host
    elif kind == _METHOD:
        value = method
    else:  # a named field: a header, a cookie or a query parameter (a value is never None)
        name = node.name
        value = headers.get(name) if kind == _HEADER else cookie_value(request, name) if kind == _COOKIE \
            else query_value(request, name)
        op = node.op
        if op == _PRESENT:
            return value is not None
        if op == _ABSENT:
            return value is None
        if value is None:
            return False
    op = node.op
    if op == _EQUALS:
        return value == node.text
    if op == _IN:
        return value in node.values
    if op == _PREFIX:
        if type(value) is str:  # every field's value: compiled, a str's startswith in C
            return cython.cast(str, value).startswith(node.text)
        return bool(value.startswith(node.text))
    memo = node.memo
    found = memo.get(value)
    if found is not None:
        return found
    found = node.function(value) is not None
    if type(value) is str and len(cython.cast(str, value)) <= MEMO_LONGEST:
        if len(memo) >= MEMO_SIZE:
            memo.clear()
        memo[cython.cast(str, value)] = found
    return found


def _value(part: Part, request: CheckRequest, method: str, host: str, path: str, headers: dict[str, str],
           client_key: str) -> object:
    """A key's value of the request: one part's."""
    kind = part.kind
    if kind == _CLIENT:
        return client_key
    if kind == _PATH:
        return path
    if kind == _HOST:
        return host
    if kind == _HEADER:
        return headers.get(part.name, "")
    if kind == _SESSION:
        # Tagged, so that a cookie whose value equals an address is still another key.
        value = cookie_value(request, part.name)
        return ("ip", client_key) if value is None else ("cookie", value)
    if kind == _QUERY:
        value = query_value(request, part.name)
        return "" if value is None else value
    if kind == _COOKIE:
        value = cookie_value(request, part.name)
        return "" if value is None else value
    if kind == _METHOD:
        return method
    if kind == _URI:
        return request.uri
    assert part.function is not None
    return part.function(request, method, host, path, headers, client_key)


