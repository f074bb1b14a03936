"""The rules file: YAML with line tracking, a strict schema, readable errors.

Loading happens once (at start and on reload). Every problem in the file is
reported at once as ``FILE:LINE: field.path: message``; the
per-request path never sees any of this, only the compiled objects built from
the validated model (see ``sidecar.rules``).
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Literal, Mapping, Union

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    GetCoreSchemaHandler,
    PlainValidator,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import CoreSchema

from sidecar.limiters import registry

Loc = tuple[str | int, ...]

# --------------------------------------------------------------------------
# Scalars with units
# --------------------------------------------------------------------------

# A duration is one or more terms from the largest unit to the smallest, each
# unit at most once: 10s, 1h30m, 1d12h, 2m30s, 1.5h. Computed as fractions,
# so that a written value is read to the nearest float (1s1ms is 1.001).
_DURATION_UNITS: dict[str, Fraction] = {
    "y": Fraction(365 * 86400), "w": Fraction(7 * 86400), "d": Fraction(86400), "h": Fraction(3600),
    "m": Fraction(60), "s": Fraction(1), "ms": Fraction(1, 1000)}
_UNIT_ORDER = tuple(_DURATION_UNITS)
_DURATION_TERM = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w|y)(?![a-z])", re.ASCII)
_DURATION_EXAMPLE = "expected a duration like '10s'"
# format_duration's units: no weeks or years, so that a week stays 7d as
# it always was written.
_FORMAT_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
_RATE_RE = re.compile(r"^\s*(\d+)\s*r/(s|m)\s*$")
_REFILL_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/(s|m)\s*$")


def parse_duration(value: Any) -> float:
    """Seconds as a number, or a string with units: 500ms, 10s, 15m, 1h30m,
    1d12h, 2w, 1y. ValueError, with what to write instead, for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{_DURATION_EXAMPLE}, got {_shown(value)}")
    try:
        seconds = _duration_text(value) if isinstance(value, str) else float(value)
    except OverflowError:  # beyond a float: a huge int, or digits that make one
        seconds = math.inf
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(f"a duration must be positive, got {_shown(value)}")
    if math.isinf(seconds):
        raise ValueError(f"a duration must be positive and finite, got {_shown(value)}")
    return seconds


def _shown(value: Any, longest: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= longest else text[:longest] + "..."


# More digits than this make a number beyond any float (and Fraction's int
# refuses 4,300 of them).
_MOST_DIGITS = 400


def _duration_text(text: str) -> float:
    total = Fraction(0)
    position = 0
    previous = -1
    stripped = text.rstrip()
    while position < len(stripped) or position == 0:
        match = _DURATION_TERM.match(stripped, position)
        if match is None:
            raise ValueError(f"{_DURATION_EXAMPLE}, got {_shown(text)}{_duration_hint(text)}")
        order = _UNIT_ORDER.index(match.group(2))
        if order <= previous:
            raise ValueError(f"units go from the largest to the smallest, each once (1h30m, 2m30s), "
                             f"got {_shown(text)}")
        previous = order
        number = match.group(1)
        total += Fraction(number) * _DURATION_UNITS[match.group(2)] if len(number) <= _MOST_DIGITS \
            else Fraction(10) ** _MOST_DIGITS
        position = match.end()
    return float(total)  # OverflowError beyond a float


def _duration_hint(text: str) -> str:
    """A did-you-mean for a near miss: a bare number, or an upper-case unit."""
    stripped = text.strip()
    if stripped.startswith("-"):
        return " (a duration is positive)"
    if re.fullmatch(r"\d+(?:\.\d+)?", stripped, re.ASCII):
        return f" (did you mean '{stripped}s'?)"
    # M is left alone: a month or a minute?
    lower = stripped.lower()
    if lower != stripped and "M" not in stripped:
        try:
            _duration_text(lower)
        except ValueError:
            return ""
        return f" (did you mean {lower!r}?)"
    return ""


def format_duration(seconds: float) -> str:
    """A period as the rules file would write it, which parse_duration reads
    back as the same number: 500ms, 10s, 15m, 1h30m, 7d."""
    milliseconds = round(seconds * 1000) if 0 < seconds * 1000 < math.inf else 0
    if not milliseconds or float(Fraction(milliseconds, 1000)) != seconds:
        # Finer than a millisecond: the number of seconds, in full.
        return f"{format(Decimal(repr(seconds)), 'f')}s"
    whole, rest = divmod(milliseconds, 1000)
    terms = []
    for unit, size in _FORMAT_UNITS:
        count, whole = divmod(whole, size)
        if count:
            terms.append(f"{count}{unit}")
    if rest:
        terms.append(f"{rest}ms")
    return "".join(terms)


@dataclass(frozen=True, slots=True)
class Rate:
    """``Nr/s`` or ``Nr/m``: a count per period (1 s or 60 s)."""

    count: int
    period: int

    def __str__(self) -> str:
        return f"{self.count}r/{'s' if self.period == 1 else 'm'}"


def parse_rate(value: Any) -> Rate:
    match = _RATE_RE.match(str(value)) if isinstance(value, str) else None
    if match is None or int(match.group(1)) == 0:
        raise ValueError(f"expected a rate like '10r/s' or '30r/m', got {value!r}")
    return Rate(int(match.group(1)), 1 if match.group(2) == "s" else 60)


def parse_refill(value: Any) -> float:
    """Token refill ``N/s`` or ``N/m``, returned as tokens per second."""
    match = _REFILL_RE.match(str(value)) if isinstance(value, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"expected a refill rate like '2/s' or '30/m', got {value!r}")
    return float(match.group(1)) / (1 if match.group(2) == "s" else 60)


def parse_network(value: Any) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    if not isinstance(value, str):
        raise ValueError(f"expected a CIDR like '10.0.0.0/8', got {value!r}")
    try:
        network = ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        raise ValueError(f"expected a CIDR like '10.0.0.0/8', got {value!r}") from None
    if network.network_address != ipaddress.ip_interface(value.strip()).ip:
        raise ValueError(f"{value!r} has host bits set; did you mean '{network}'?")
    return network


def parse_regex(value: Any) -> re.Pattern[str]:
    if not isinstance(value, str):
        raise ValueError(f"expected a regular expression, got {value!r}")
    try:
        return re.compile(value)
    except re.error as exc:
        raise ValueError(f"invalid regular expression {value!r}: {exc}") from None


# Sentinel's own port, when a node names none.
SENTINEL_PORT = 26379
_HOST_PORT_RE = re.compile(r"^(?:\[([0-9A-Fa-f:.]+)\]|([A-Za-z0-9_.-]+))(?::(\d{1,5}))?$")


def parse_host_port(value: Any) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 address in brackets; the port defaults to
    Sentinel's 26379)."""
    match = _HOST_PORT_RE.match(value.strip()) if isinstance(value, str) else None
    if match is None or (match.group(1) and not _is_ipv6(match.group(1))):
        raise ValueError(f"expected HOST:PORT like '10.0.0.5:26379' (an IPv6 address in brackets: "
                         f"'[2001:db8::5]:26379'), got {value!r}")
    port = int(match.group(3) or SENTINEL_PORT)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range in {value!r}")
    return match.group(1) or match.group(2), port


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
        return True
    except ValueError:
        return False


Duration = Annotated[float, PlainValidator(parse_duration)]
HostPort = Annotated[tuple[str, int], PlainValidator(parse_host_port)]
Network = Annotated[Any, PlainValidator(parse_network)]
Regex = Annotated[Any, PlainValidator(parse_regex)]

_DIMENSIONS = ("ip", "host", "method", "path", "uri")
_NAMED_DIMENSIONS = ("header", "cookie", "query", "session")
RULE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def parse_dimension(value: Any) -> str:
    if isinstance(value, str):
        if value in _DIMENSIONS:
            return value
        kind, sep, name = value.partition(":")
        if sep and kind in _NAMED_DIMENSIONS and name.strip():
            # Header names are case-insensitive; cookie and query
            # names are not.
            return f"{kind}:{name.strip().lower() if kind == 'header' else name.strip()}"
    raise ValueError(
        f"unknown dimension {value!r}; expected one of {', '.join(_DIMENSIONS)} "
        "or header:NAME, cookie:NAME, query:NAME, session:COOKIE"
    )


Dimension = Annotated[str, PlainValidator(parse_dimension)]


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, dict) else value


# --------------------------------------------------------------------------
# The schema
# --------------------------------------------------------------------------


class Strict(BaseModel):
    # strict: YAML's `true` is not the number 1, nor "10" a count.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, strict=True)


class StringTest(Strict):
    """One test on a string value; exactly one operator."""

    equals: str | None = None
    in_: list[str] | None = Field(None, alias="in")
    prefix: str | None = None
    regex: Regex | None = None

    @model_validator(mode="after")
    def _one_operator(self) -> "StringTest":
        _exactly_one(self, ("equals", "in_", "prefix", "regex"))
        return self


class NamedTest(Strict):
    """A test on a header, cookie or query parameter found by name."""

    name: str = Field(min_length=1)
    equals: str | None = None
    in_: list[str] | None = Field(None, alias="in")
    prefix: str | None = None
    regex: Regex | None = None
    present: bool | None = None

    @model_validator(mode="after")
    def _one_operator(self) -> "NamedTest":
        _exactly_one(self, ("equals", "in_", "prefix", "regex", "present"))
        return self


class IPTest(Strict):
    in_: list[Network] = Field(alias="in", min_length=1)


NamedTests = Annotated[list[NamedTest], BeforeValidator(_as_list)]


class Condition(Strict):
    """A ``match:`` mapping: several leaves mean all of them."""

    all: list["Condition"] | None = Field(None, min_length=1)
    any: list["Condition"] | None = Field(None, min_length=1)
    not_: "Condition | None" = Field(None, alias="not")
    path: StringTest | None = None
    host: StringTest | None = None
    method: Annotated[list[str], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)] | None = None
    header: NamedTests | None = None
    cookie: NamedTests | None = None
    query: NamedTests | None = None
    ip: IPTest | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> "Condition":
        if not any(getattr(self, name) is not None for name in type(self).model_fields):
            raise ValueError("a condition needs at least one of all, any, not, path, host, "
                             "method, header, cookie, query, ip")
        return self


# The rules file's closed vocabularies, kept as types by the compiled rules.
Action = Literal["log", "block", "ban", "challenge"]
Backend = Literal["memory", "redis"]
FailMode = Literal["open", "closed"]  # a request while the shared store is unavailable
# A request that Sluice answers late, past overload.after (see sidecar.overload).
OverloadMode = Literal["open", "closed"]


class LimitModel(Strict):
    """A kind of ``limit:``. Each is declared with its limiter, in its module
    of ``sidecar.limiters`` (see ``sidecar.limiters.registry``): ``Limit``
    is every kind registered there, told apart by the field each has."""

    tag: ClassVar[str]
    # Rule settings this kind of limit does not take, each with the reason,
    # reported at the setting: fields of the rule, and actions by name.
    refused_settings: ClassVar[Mapping[str, str]] = {}
    refused_actions: ClassVar[Mapping[str, str]] = {}

    def check_rule(self, rule: "Rule") -> None:
        """Raise ValueError for what the rule's other settings cannot do
        with this limit."""

    def without_holds(self) -> "LimitModel":
        """The limit of a shadow rule, which admits and refuses as this one
        but never holds a request (holding it would apply the rule)."""
        return self


def _limit_tag(value: Any) -> str | None:
    """The kind of a limit as the rules file writes it: the first kind
    whose field it has."""
    if isinstance(value, dict):
        for kind in registry.limit_kinds():
            if kind.field in value:
                tag: str = kind.model.tag
                return tag
    return None


class _RegisteredLimits:
    """The schema of ``limit:``: one of the kinds the registry holds when
    the schema is built (again after each registration; see ``_rebuild``)."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        kinds = registry.limit_kinds()
        choices = tuple(Annotated[kind.model, Tag(kind.model.tag)] for kind in kinds)
        union = Annotated[
            Union[choices],  # type: ignore[valid-type]
            Discriminator(_limit_tag, custom_error_type="limit_kind",
                          custom_error_message="expected a limit with one of: "
                          + ", ".join(kind.usage for kind in kinds)),
        ]
        return handler.generate_schema(union)


Limit = Annotated[LimitModel, _RegisteredLimits()]


# What the built-in page can be sent as: HTML or JSON as the client's Accept
# header prefers (auto), or always one of them.
BUILTIN_PAGE_TYPES = ("auto", "text/html", "application/json")
# The media types of a page of one's own: a registered top-level type, a
# subtype, parameters (RFC 9110, section 8.3.1).
_TOKEN = r"[A-Za-z0-9!#$%&'*+.^_`|~-]+"
_MEDIA_TYPE = re.compile(rf"(?:application|audio|font|image|message|model|multipart|text|video)/{_TOKEN}"
                         rf"(?:\s*;\s*{_TOKEN}=(?:{_TOKEN}|\"[^\"\\]*\"))*", re.IGNORECASE)
# What a misspelt type is most likely meant to be.
_COMMON_TYPES = (*BUILTIN_PAGE_TYPES, "text/plain", "application/problem+json", "application/xml", "text/xml")
_TYPE_ALIASES = {"json": "application/json", "html": "text/html", "text/json": "application/json",
                 "application/html": "text/html", "xml": "application/xml", "text": "text/plain",
                 "plain": "text/plain", "txt": "text/plain"}


def _did_you_mean_type(value: str, known: tuple[str, ...]) -> str:
    """The known type a misspelt one is closest to, by its full name or
    its short one (jsno: json: application/json)."""
    names = {**{name: name for name in known},
             **{alias: name for alias, name in _TYPE_ALIASES.items() if name in known}}
    close = difflib.get_close_matches(value.strip().lower(), list(names), n=1, cutoff=0.7)
    return f" (did you mean {names[close[0]]!r}?)" if close else ""


class BlockAction(Strict):
    status: int = Field(429, ge=400, le=599)
    body: str | None = None
    body_file: str | None = None
    close: bool = False
    # The built-in page: auto (the default), text/html or application/json;
    # a body of one's own: its media type (text/html unless given).
    content_type: str | None = None

    @field_validator("content_type")
    @classmethod
    def _media_type(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        if info.data.get("close"):
            raise ValueError("close: true sends no page; remove content_type")
        if info.data.get("body") is None and info.data.get("body_file") is None:
            if value.strip().lower() not in BUILTIN_PAGE_TYPES:
                raise ValueError(f"the built-in page is sent as auto (HTML or JSON, as the client's Accept "
                                 f"header prefers), text/html or application/json, got {value!r}"
                                 f"{_did_you_mean_type(value, BUILTIN_PAGE_TYPES)}; another type needs "
                                 "a body or body_file of its own")
            return value.strip().lower()
        if value.strip().lower() == "auto":
            raise ValueError("auto chooses between the built-in HTML and JSON pages; a body of your own "
                             "is sent as the one type you give it, e.g. application/json")
        if not _MEDIA_TYPE.fullmatch(value.strip()):
            raise ValueError(f"expected a media type like 'application/json' or 'text/plain', got {value!r}"
                             f"{_did_you_mean_type(value, _COMMON_TYPES)}")
        charset = re.search(r";\s*charset\s*=\s*\"?([^\s;\"]*)", value, re.IGNORECASE)
        if charset is not None and charset.group(1).lower() not in ("utf-8", "utf8"):
            raise ValueError(f"pages are sent as UTF-8, got charset {charset.group(1)!r}; "
                             "remove the charset or give charset=utf-8")
        return value.strip()

    @field_validator("body_file")
    @classmethod
    def _readable(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            read_text_file(value, info, "page template")
        return value

    @model_validator(mode="after")
    def _one_page(self) -> "BlockAction":
        if self.body is not None and self.body_file is not None:
            raise ValueError("give either body or body_file, not both")
        if self.close and (self.body is not None or self.body_file is not None):
            raise ValueError("close: true sends no page; remove body/body_file")
        return self


class BanIncrement(Strict):
    """Escalating bans, as fail2ban's ``bantime.increment``: a repeat ban of
    an address by the same rule, within ``remember`` after its last ban by
    that rule ended, lasts ``factor`` times the last one, up to ``max``."""

    factor: float = Field(2.0, gt=1, allow_inf_nan=False)
    max_: Duration = Field(alias="max")
    remember: Duration

    @field_validator("max_")
    @classmethod
    def _longest(cls, value: float) -> float:
        if not 1 <= value <= 365 * 86400:
            raise ValueError("a ban lasts from 1s to 1y")
        return value

    @field_validator("remember")
    @classmethod
    def _remember(cls, value: float) -> float:
        if not 1 <= value <= 365 * 86400:
            raise ValueError("bans are remembered from 1s to 1y")
        return value


class BanAction(Strict):
    duration: Duration = 3600.0
    increment: BanIncrement | None = None

    @field_validator("duration")
    @classmethod
    def _range(cls, value: float) -> float:
        if not 1 <= value <= 365 * 86400:
            raise ValueError("a ban lasts from 1s to 1y")
        return value

    @field_validator("increment")
    @classmethod
    def _max_at_least_duration(cls, value: BanIncrement | None, info: ValidationInfo) -> BanIncrement | None:
        duration = info.data.get("duration")
        if value is not None and duration is not None and value.max_ < duration:
            raise ValueError(f"max {format_duration(value.max_)} is shorter than the ban's duration "
                             f"{format_duration(duration)}; a ban never gets shorter as it repeats")
        return value


class ChallengeAction(Strict):
    ttl: Duration = 86400.0
    # Unsolved penalties of one address's key within a day, after which
    # the next one bans the address (for challenge.auto_ban.ban).
    then_ban_after: int | None = Field(None, ge=1)

    @field_validator("ttl")
    @classmethod
    def _range(cls, value: float) -> float:
        if not 1800 <= value <= 7 * 86400:
            raise ValueError("a challenge credential lasts from 30m to 7d")
        return value


class ResponseHeaderTest(Strict):
    name: str = Field(min_length=1)
    equals: str | None = None
    present: bool | None = None

    @model_validator(mode="after")
    def _one_operator(self) -> "ResponseHeaderTest":
        _exactly_one(self, ("equals", "present"))
        return self


class CountOn(Strict):
    status: list[Annotated[int, Field(ge=100, le=599)]] | None = Field(None, min_length=1)
    header: ResponseHeaderTest | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> "CountOn":
        if self.status is None and self.header is None:
            raise ValueError("count_on needs status and/or header")
        return self


class ResetOn(Strict):
    """Responses that clear the rule's counter (and penalty) for the key."""

    status: list[Annotated[int, Field(ge=100, le=599)]] = Field(min_length=1)


class Rule(Strict):
    # Built at first use, and again when a kind of limit is registered.
    model_config = ConfigDict(defer_build=True)

    id: str
    match: Condition | None = None
    key: list[Dimension] = []
    limit: Limit
    action: Action
    penalty: Duration | None = None
    block: BlockAction | None = None
    ban: BanAction | None = None
    challenge: ChallengeAction | None = None
    count_on: CountOn | None = None
    reset_on: ResetOn | None = None
    # Evaluated, counted and decided as when enforcing, but its block, ban
    # or challenge is not applied: the request is allowed, and logged.
    shadow: bool = False
    # A check that reaches Sluice later than overload.after, when its
    # client is not known to be over this rule's limit: counted on this
    # node alone, let in within the limit there (open), or refused with a
    # 503 (closed).
    overload: OverloadMode = "open"

    @field_validator("id")
    @classmethod
    def _id_charset(cls, value: str) -> str:
        if not RULE_ID_RE.match(value):
            raise ValueError("a rule id is 1-64 characters of letters, digits, '_', '.', '-'")
        return value

    @field_validator("key")
    @classmethod
    def _no_repeats(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("a dimension is listed twice")
        return value

    @model_validator(mode="after")
    def _settings_fit_the_limit(self) -> "Rule":
        self.limit.check_rule(self)
        return self

    @model_validator(mode="after")
    def _reset_on_and_count_on_apart(self) -> "Rule":
        if self.reset_on is not None and self.count_on is not None and self.count_on.status is not None:
            both = set(self.reset_on.status) & set(self.count_on.status)
            if both:
                raise ValueError(f"status {min(both)} both counts (count_on) and resets (reset_on)")
        return self

    @model_validator(mode="after")
    def _settings_match_action(self) -> "Rule":
        for section in ("block", "ban", "challenge"):
            if getattr(self, section) is not None and self.action != section:
                raise ValueError(f"'{section}:' settings need action: {section}")
        return self


class ClientIPConfig(Strict):
    trusted_proxies: list[Network] = []
    ipv6_prefix: int = Field(64, ge=1, le=128)
    ipv4_prefix: int = Field(32, ge=1, le=32)


class ClusterConfig(Strict):
    """A Redis Cluster: some of its nodes, from which Sluice learns the rest."""

    nodes: list[str] = Field(min_length=1)

    @field_validator("nodes")
    @classmethod
    def _addresses(cls, nodes: list[str]) -> list[str]:
        from sidecar.store.redis_cluster import parse_node

        for node in nodes:
            parse_node(node)
        return nodes


class SentinelConfig(Strict):
    """Redis Sentinel: the sentinels name the master, asked again after
    every lost connection (sidecar.store.sentinel)."""

    master: str  # the name the sentinels monitor
    nodes: list[HostPort] = Field(min_length=1)
    db: int = Field(0, ge=0)
    password: str | None = Field(None, min_length=1)  # the master's (and replicas')
    username: str | None = Field(None, min_length=1)
    sentinel_password: str | None = Field(None, min_length=1)  # the sentinels' own requirepass

    @field_validator("master")
    @classmethod
    def _one_word(cls, value: str) -> str:
        if not re.fullmatch(r"[^\s]+", value):
            raise ValueError(f"expected the master's name as the sentinels know it (one word), got {value!r}")
        return value

    @field_validator("nodes")
    @classmethod
    def _no_repeats(cls, value: list[tuple[str, int]]) -> list[tuple[str, int]]:
        if len(set(value)) != len(value):
            raise ValueError("a sentinel is listed twice")
        return value

    @field_validator("username")
    @classmethod
    def _with_password(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("password") is None:
            raise ValueError("a username needs a password")
        return value


class StateConfig(Strict):
    backend: Backend = "memory"
    # With backend: redis, the sentinels that name the master, or the url
    # of one server (fields are validated in this order: url's check sees
    # sentinel's); on a cluster, url gives the credentials and TLS of its nodes.
    sentinel: SentinelConfig | None = None
    url: str = "redis://127.0.0.1:6379/0"
    cluster: ClusterConfig | None = None
    max_keys: int = Field(100_000, ge=1)
    # Requests a leaky bucket may hold at once on this node: when
    # all are taken, a request that would have to wait is refused instead.
    max_delayed: int = Field(1_000, ge=0)
    fail: FailMode = "open"

    @field_validator("sentinel")
    @classmethod
    def _sentinel_needs_redis(cls, value: SentinelConfig | None, info: ValidationInfo) -> SentinelConfig | None:
        if value is not None and info.data.get("backend", "redis") != "redis":
            raise ValueError("sentinel: is for backend: redis")
        return value

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str, info: ValidationInfo) -> str:
        from sidecar.store.redis_pipeline import RedisAddress

        if info.data.get("sentinel") is not None:
            raise ValueError("give either url or sentinel, not both: the sentinels name the master "
                             "(its database and password go in sentinel.db and sentinel.password)")
        try:
            RedisAddress(url)
        except ValueError as exc:  # a bad scheme, port or database number
            raise ValueError(str(exc) if "redis://" in str(exc) else
                             f"expected a URL like redis://HOST:PORT/DB or unix:///PATH, got {url!r}") from None
        return url

    @model_validator(mode="after")
    def _cluster_on_redis(self) -> "StateConfig":
        if self.cluster is not None:
            if self.backend != "redis":
                raise ValueError("cluster: needs backend: redis")
            if self.sentinel is not None:
                raise ValueError("cluster: and sentinel: exclude each other (a Redis Cluster fails over by itself)")
            from sidecar.store.redis_pipeline import RedisAddress

            address = RedisAddress(self.url)
            if address.path is not None or address.db:
                raise ValueError("with cluster:, url gives only the nodes' credentials and TLS "
                                 "(redis://[USER:PASSWORD@]HOST or rediss://...); a cluster has "
                                 "no Unix socket and only database 0")
        return self


class VerifiedBots(Strict):
    cidrs: list[Network] = Field(min_length=1)
    user_agent: Regex | None = None


class AutoBan(Strict):
    challenges: int = Field(100, ge=1)
    per: Duration = 60.0
    ban: Duration = 300.0


class ChallengeConfig(Strict):
    secret_file: str | None = None
    auto_ban: AutoBan = AutoBan()
    # Leading zero bits of the proof of work: 2**D hashes on average. 16 is
    # about a second in a browser; every bit more doubles it.
    difficulty: int = Field(16, ge=1, le=24)

    @field_validator("secret_file")
    @classmethod
    def _readable(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            read_text_file(value, info, "secret file")
        return value


class Override(Strict):
    cidrs: list[Network] = Field(min_length=1)
    rules: list[str] = Field(min_length=1)
    multiply: float = Field(gt=0)


LogKeys = Literal["hash", "clear", "omit"]


class DecisionLogConfig(Strict):
    # How counting-key values (API keys, phone numbers, session ids: personal
    # data or secrets) appear in decision lines: a keyed hash, stable per
    # value (hash), as they are (clear), or not at all (omit). Client
    # addresses are shown either way.
    keys: LogKeys = "hash"


class OverloadConfig(Strict):
    # A check that waited longer than this before Sluice could read it is
    # answered at once by the overload policy, well before the proxy's own
    # timeout (1 s in the shipped configurations) would let it in unchecked.
    after: Duration = 0.25

    @field_validator("after")
    @classmethod
    def _range(cls, value: float) -> float:
        if not 0.01 <= value <= 60:
            raise ValueError("overload.after is from 10ms to 60s (below the proxies' timeouts for Sluice)")
        return value


class RulesFile(Strict):
    model_config = ConfigDict(defer_build=True)  # as Rule's

    # shadow: every rule as with `shadow: true`.
    mode: Literal["enforce", "shadow"] = "enforce"
    node: str | None = Field(None, min_length=1)
    decision_log: DecisionLogConfig = DecisionLogConfig()
    # draft: allowed responses also carry the IETF RateLimit-Policy and
    # RateLimit fields (draft-ietf-httpapi-ratelimit-headers).
    headers: Literal["standard", "draft"] = "standard"
    client_ip: ClientIPConfig = ClientIPConfig()
    state: StateConfig = StateConfig()
    exempt: list[Network] = []
    verified_bots: list[VerifiedBots] = []
    challenge: ChallengeConfig = ChallengeConfig()
    overrides: list[Override] = []
    overload: OverloadConfig = OverloadConfig()
    rules: list[Rule] = []


def _rebuild() -> None:
    """The schema of a rules file, for the kinds of limit registered now."""
    Rule.model_rebuild(force=True)
    RulesFile.model_rebuild(force=True)


registry.on_change(_rebuild)


def resolve_file(name: str, base_dir: Path) -> Path:
    """Files named in a rules file are relative to the rules file."""
    path = Path(name)
    return path if path.is_absolute() else base_dir / path


def read_text_file(name: str, info: ValidationInfo, what: str) -> str:
    base_dir = (info.context or {}).get("base_dir", Path.cwd())
    try:
        return resolve_file(name, base_dir).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {name!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the {what} {name!r} is not UTF-8 text") from None


def plural(count: int, noun: str) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _exactly_one(model: BaseModel, fields: tuple[str, ...]) -> None:
    given = [f for f in fields if getattr(model, f) is not None]
    if len(given) != 1:
        names = ", ".join(f.rstrip("_") for f in fields)
        raise ValueError(f"expected exactly one of {names}")


# --------------------------------------------------------------------------
# YAML with line numbers
# --------------------------------------------------------------------------


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


class _Document:
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
        return _locate(self.file, self.lines, self.path(loc, missing), message)

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


def _message(error: Mapping[str, Any]) -> str:
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


@dataclass(frozen=True, slots=True)
class LoadedRules:
    """A validated rules file, plus what is needed to resolve file references."""

    model: RulesFile
    source: str
    base_dir: Path
    lines: dict[Loc, int]

    def issue(self, loc: Loc, message: str) -> ConfigIssue:
        issue = _locate(self.source, self.lines, loc, message)
        if len(loc) > 1 and loc[0] == "rules" and isinstance(loc[1], int) and loc[1] < len(self.model.rules):
            issue = dataclasses.replace(issue, rule=self.model.rules[loc[1]].id)
        return issue


def _locate(file: str, lines: dict[Loc, int], loc: Loc, message: str) -> ConfigIssue:
    for depth in range(len(loc), -1, -1):
        if loc[:depth] in lines:
            return ConfigIssue(file, lines[loc[:depth]], format_loc(loc), message)
    return ConfigIssue(file, 1, format_loc(loc), message)


def parse_rules_text(text: str, source: str, base_dir: Path) -> LoadedRules:
    """Validate rules-file text; raise ConfigError listing every problem."""
    document = _Document(source, text)
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


def validation_issues(document: _Document, exc: ValidationError,
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


def _field_names() -> set[str]:
    """Every field name the rules file knows, at any level (of the kinds
    of limit, those registered now)."""
    names: set[str] = set()
    kinds = {kind.model for kind in registry.limit_kinds()}
    models: list[type[BaseModel]] = [Strict]
    while models:
        model = models.pop()
        models.extend(model.__subclasses__())
        if model in kinds or not issubclass(model, LimitModel):
            names.update(info.alias or name for name, info in model.model_fields.items())
    return names


def _did_you_mean(name: str) -> str:
    """A hint for a misspelt field name: the known name it most looks like."""
    # A name known elsewhere (per: in a concurrency limit) is no misspelling.
    close = difflib.get_close_matches(name, sorted(_field_names() - {name}), n=1, cutoff=0.7)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _cross_checks(document: _Document) -> list[ConfigIssue]:
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


def _limit_checks(document: _Document) -> list[ConfigIssue]:
    """What a rule's kind of limit cannot be combined with, at the field
    that combines it (a rule's own validator could only name the rule)."""
    issues = []
    rules = document.data.get("rules")
    for index, rule in enumerate(rules if isinstance(rules, list) else []):
        tag = _limit_tag(rule.get("limit")) if isinstance(rule, dict) else None
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


def _then_ban_checks(document: _Document) -> list[ConfigIssue]:
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
