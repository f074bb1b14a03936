"""The rules file's schema: strict pydantic models, one per section.

Validation happens once, at load (``sidecar.config.loader``); the compiled
rules (``sidecar.rules``) are built from the validated model. Each kind of
``limit:`` is a model declared with its limiter (``sidecar.limiters``):
``Rule`` and ``RulesFile`` are built at first use from the kinds the
registry holds, and again when a kind is registered.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    GetCoreSchemaHandler,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import CoreSchema

from sidecar import core
from sidecar.config.values import (
    RULE_ID_RE,
    Asn,
    Country,
    Dimension,
    Duration,
    HostPort,
    Network,
    Regex,
    Threshold,
    TierName,
    format_duration,
    read_text_file,
)
from sidecar.limiters import registry


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, dict) else value


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
    def _one_operator(self) -> StringTest:
        _exactly_one(self, ("equals", "in_", "prefix", "regex"))
        return self


class _ValueTest(Strict):
    """One test on a value found by name; exactly one operator."""

    equals: str | None = None
    in_: list[str] | None = Field(None, alias="in")
    prefix: str | None = None
    regex: Regex | None = None
    present: bool | None = None

    @model_validator(mode="after")
    def _one_operator(self) -> _ValueTest:
        _exactly_one(self, ("equals", "in_", "prefix", "regex", "present"))
        return self


class NamedTest(_ValueTest):
    """A test on a header, cookie or query parameter found by name."""

    name: str = Field(min_length=1)


class IPTest(Strict):
    in_: list[Network] = Field(alias="in", min_length=1)


class AsnTest(Strict):
    in_: list[Asn] = Field(alias="in", min_length=1)


class CountryTest(Strict):
    in_: list[Country] = Field(alias="in", min_length=1)


class JwtTest(_ValueTest):
    """A test on a claim of the request's valid token (``jwt:`` section);
    without one, it does not hold."""

    claim: str = Field(min_length=1)


NamedTests = Annotated[list[NamedTest], BeforeValidator(_as_list)]


class Condition(Strict):
    """A ``match:`` mapping: several leaves mean all of them."""

    all: list[Condition] | None = Field(None, min_length=1)
    any: list[Condition] | None = Field(None, min_length=1)
    not_: Condition | None = Field(None, alias="not")
    path: StringTest | None = None
    host: StringTest | None = None
    method: Annotated[list[str], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)] | None = None
    header: NamedTests | None = None
    cookie: NamedTests | None = None
    query: NamedTests | None = None
    ip: IPTest | None = None
    asn: AsnTest | None = None
    country: CountryTest | None = None
    ja3: StringTest | None = None
    ja4: StringTest | None = None
    jwt: Annotated[list[JwtTest], BeforeValidator(_as_list)] | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> Condition:
        if not any(getattr(self, name) is not None for name in type(self).model_fields):
            raise ValueError("a condition needs at least one of all, any, not, path, host, "
                             "method, header, cookie, query, ip, asn, country, ja3, ja4, jwt")
        return self

    def uses(self, name: str) -> bool:
        """Whether the condition tests ``name`` (jwt, asn, country), at any depth."""
        parts = [*(self.all or ()), *(self.any or ()), *([self.not_] if self.not_ is not None else [])]
        return getattr(self, name) is not None or any(part.uses(name) for part in parts)


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

    # A compiled limiter module's methods are functions too, not fields (sidecar.core).
    model_config = ConfigDict(ignored_types=core.function_types())
    tag: ClassVar[str]
    # Rule settings this kind of limit does not take, each with the reason,
    # reported at the setting: fields of the rule, and actions by name.
    refused_settings: ClassVar[Mapping[str, str]] = {}
    refused_actions: ClassVar[Mapping[str, str]] = {}

    def check_rule(self, rule: Rule) -> None:
        """Raise ValueError for what the rule's other settings cannot do
        with this limit."""

    def without_holds(self) -> LimitModel:
        """The limit of a shadow rule, which admits and refuses as this one
        but never holds a request (holding it would apply the rule)."""
        return self


def limit_tag(value: Any) -> str | None:
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
        # Union[...] of a tuple: the kinds are only known at run time, so
        # there is no `A | B` to write (ruff's UP007 fix drops the Union).
        union = Annotated[
            Union[choices],  # type: ignore[valid-type]  # noqa: UP007
            Discriminator(limit_tag, custom_error_type="limit_kind",
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
    def _one_page(self) -> BlockAction:
        if self.body is not None and self.body_file is not None:
            raise ValueError("give either body or body_file, not both")
        if self.close and (self.body is not None or self.body_file is not None):
            raise ValueError("close: true sends no page; remove body/body_file")
        return self


class BanIncrementConfig(Strict):
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
    increment: BanIncrementConfig | None = None

    @field_validator("duration")
    @classmethod
    def _range(cls, value: float) -> float:
        if not 1 <= value <= 365 * 86400:
            raise ValueError("a ban lasts from 1s to 1y")
        return value

    @field_validator("increment")
    @classmethod
    def _max_at_least_duration(cls, value: BanIncrementConfig | None,
                               info: ValidationInfo) -> BanIncrementConfig | None:
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
    def _one_operator(self) -> ResponseHeaderTest:
        _exactly_one(self, ("equals", "present"))
        return self


class CountOn(Strict):
    status: list[Annotated[int, Field(ge=100, le=599)]] | None = Field(None, min_length=1)
    header: ResponseHeaderTest | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> CountOn:
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
    # Thresholds by the request's tier (the tiers: section); a tier not
    # listed keeps the limit's own.
    tiers: dict[TierName, Threshold] | None = Field(None, min_length=1)
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
    def _settings_fit_the_limit(self) -> Rule:
        self.limit.check_rule(self)
        return self

    @model_validator(mode="after")
    def _reset_on_and_count_on_apart(self) -> Rule:
        if self.reset_on is not None and self.count_on is not None and self.count_on.status is not None:
            both = set(self.reset_on.status) & set(self.count_on.status)
            if both:
                raise ValueError(f"status {min(both)} both counts (count_on) and resets (reset_on)")
        return self

    @model_validator(mode="after")
    def _settings_match_action(self) -> Rule:
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
    def _cluster_on_redis(self) -> StateConfig:
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


class AutoBanConfig(Strict):
    challenges: int = Field(100, ge=1)
    per: Duration = 60.0
    ban: Duration = 300.0


class ChallengeConfig(Strict):
    secret_file: str | None = None
    auto_ban: AutoBanConfig = AutoBanConfig()
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


class JwtToken(Strict):
    """Where a request's token is: a header (``Authorization`` takes a
    ``Bearer`` token), a cookie, or the payload header of a proxy that
    verified the token (base64url JSON, as Envoy's jwt_authn
    ``forward_payload_header`` writes it)."""

    header: str | None = Field(None, min_length=1)
    cookie: str | None = Field(None, min_length=1)
    payload_header: str | None = Field(None, min_length=1)

    @field_validator("header", "payload_header")
    @classmethod
    def _lower(cls, value: str | None) -> str | None:
        return value.strip().lower() if value is not None else None

    @model_validator(mode="after")
    def _one_place(self) -> JwtToken:
        _exactly_one(self, ("header", "cookie", "payload_header"))
        return self


class JwtKeys(Strict):
    """The keys tokens are verified with: a JWKS file, read at load (and
    at each reload), or a JWKS URL, fetched in the background every
    ``refresh``, the last good set kept when a fetch fails."""

    file: str | None = Field(None, min_length=1)
    url: str | None = Field(None, min_length=1)
    refresh: Duration = 600.0
    timeout: Duration = 5.0

    @field_validator("file")
    @classmethod
    def _usable(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            from sidecar.identity import parse_jwks

            try:
                parse_jwks(read_text_file(value, info, "JWKS file"))
            except ValueError as exc:
                message = str(exc)
                raise ValueError(message if message.startswith("cannot read") else
                                 f"the JWKS file {value!r} is unusable: {message}") from None
        return value

    @field_validator("url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s]+", value):
            raise ValueError("a JWKS URL is http:// or https://, with a host")
        return value

    @field_validator("refresh")
    @classmethod
    def _refresh(cls, value: float) -> float:
        if value < 1:
            raise ValueError("keys are fetched again every 1s at most")
        return value

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, value: float) -> float:
        if not 0 < value <= 60:
            raise ValueError("a fetch's timeout is above 0 and at most 60s")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> JwtKeys:
        _exactly_one(self, ("file", "url"))
        return self


JwtAlgorithm = Literal["HS256", "HS384", "HS512", "RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
                       "ES256", "ES384", "ES512", "EdDSA"]


class JwtConfig(Strict):
    """The ``jwt:`` section: where tokens are, and how they are trusted."""

    token: JwtToken = Field(default_factory=lambda: JwtToken(header="authorization"))
    keys: JwtKeys | None = None
    # Read without verifying: only for a token the proxy verified already
    # (and sets itself, overwriting what the client sent).
    verified_by_proxy: bool = False
    algorithms: list[JwtAlgorithm] = Field(["RS256", "ES256", "EdDSA", "PS256"], min_length=1)
    issuer: str | None = None
    audience: str | None = None
    leeway: Duration = 0.0

    @model_validator(mode="after")
    def _trusted_somehow(self) -> JwtConfig:
        if self.verified_by_proxy == (self.keys is not None):
            raise ValueError("give keys (a JWKS file or url) to verify tokens, or verified_by_proxy: true "
                             "when the proxy verified them already; exactly one")
        if self.token.payload_header is not None and not self.verified_by_proxy:
            raise ValueError("a payload header carries no signature: it needs verified_by_proxy: true")
        return self


class GeoipConfig(Strict):
    """Local MaxMind-format databases (GeoLite2, DB-IP, IPinfo's), paths
    relative to the rules file: ``asn`` for the ``asn`` dimension and
    condition, ``country`` for ``country`` (a Country or City database)."""

    asn: str | None = Field(None, min_length=1)
    country: str | None = Field(None, min_length=1)


class TiersConfig(Strict):
    """The ``tiers:`` section: the tiers there are, and how a request's is
    found (``sidecar.tiers``)."""

    names: list[TierName] = Field(min_length=1)
    default: TierName
    # The request's identity, looked up in the assignments: an API key's
    # header, a cookie, or a claim of its verified token.
    identity: Dimension | None = None
    # A claim of the request's verified token that names its tier.
    claim: str | None = Field(None, min_length=1)
    # Assignments: `TIER: [IDENTITY, ...]`, relative to the rules file.
    file: str | None = Field(None, min_length=1)

    @field_validator("names")
    @classmethod
    def _no_repeats(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("a tier is listed twice")
        return value

    @field_validator("identity")
    @classmethod
    def _an_identity(cls, value: str | None) -> str | None:
        if value is not None and value.partition(":")[0] not in ("header", "cookie", "jwt"):
            raise ValueError(f"an identity is header:NAME, cookie:NAME or jwt:CLAIM, got {value!r}")
        return value

    @model_validator(mode="after")
    def _default_named(self) -> TiersConfig:
        if self.identity is None and self.claim is None:
            raise ValueError("say how a request's tier is found: identity (looked up in the assignments), "
                             "claim (a token's claim naming it), or both")
        if self.file is not None and self.identity is None:
            raise ValueError("a file assigns identities to tiers: it needs identity")
        return self


# An environment variable's name, as POSIX shells accept it.
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"


class CrowdSecPush(Strict):
    """Sluice's own bans sent to the Local API as alerts, by a machine
    (``cscli machines add``): its id, and its password from a file or an
    environment variable, never inline."""

    machine_id: str = Field(min_length=1)
    password_file: str | None = Field(None, min_length=1)
    password_env: str | None = Field(None, pattern=ENV_NAME_PATTERN)
    # Bans waiting to be sent; past it a ban is dropped (and counted).
    queue: int = Field(1000, ge=1, le=100_000)

    @field_validator("password_file")
    @classmethod
    def _password_readable(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not read_text_file(value, info, "password file").strip():
            raise ValueError(f"the password file {value!r} is empty")
        return value

    @model_validator(mode="after")
    def _one_password(self) -> CrowdSecPush:
        _exactly_one(self, ("password_file", "password_env"))
        return self


class CrowdSecConfig(Strict):
    """The ``crowdsec:`` section: a CrowdSec Local API whose decisions
    Sluice applies as a bouncer, and optionally sends its own bans to."""

    url: str
    # The bouncer's key (``cscli bouncers add``): a file, or an environment variable.
    key_file: str | None = Field(None, min_length=1)
    key_env: str | None = Field(None, pattern=ENV_NAME_PATTERN)
    poll: Duration = 10.0
    timeout: Duration = 2.0
    # What a captcha decision does: Sluice's challenge, a ban, or nothing.
    captcha: Literal["challenge", "ban", "ignore"] = "challenge"
    # How long a solved challenge lets the client past a captcha decision.
    captcha_ttl: Duration = 3600.0
    # The decisions held at most (a community blocklist is tens of thousands).
    max_decisions: int = Field(200_000, ge=1, le=10_000_000)
    push_bans: CrowdSecPush | None = None

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s?#]+(/[^\s?#]*)?$", value):
            raise ValueError("the Local API's URL is http:// or https://, a host and an optional path, "
                             "like http://127.0.0.1:8080")
        return value.rstrip("/")

    @field_validator("key_file")
    @classmethod
    def _key_readable(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not read_text_file(value, info, "bouncer key file").strip():
            raise ValueError(f"the bouncer key file {value!r} is empty")
        return value

    @field_validator("poll")
    @classmethod
    def _poll(cls, value: float) -> float:
        if not 1 <= value <= 3600:
            raise ValueError("decisions are polled every 1s to 1h")
        return value

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, value: float) -> float:
        if not 0 < value <= 60:
            raise ValueError("a request's timeout is above 0 and at most 60s")
        return value

    @field_validator("captcha_ttl")
    @classmethod
    def _captcha_ttl(cls, value: float) -> float:
        if not 60 <= value <= 7 * 86400:
            raise ValueError("a solved challenge lasts from 1m to 7d")
        return value

    @model_validator(mode="after")
    def _one_key(self) -> CrowdSecConfig:
        _exactly_one(self, ("key_file", "key_env"))
        return self


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
    jwt: JwtConfig | None = None
    geoip: GeoipConfig | None = None
    tiers: TiersConfig | None = None
    crowdsec: CrowdSecConfig | None = None
    rules: list[Rule] = []


def _rebuild() -> None:
    """The schema of a rules file, for the kinds of limit registered now."""
    Rule.model_rebuild(force=True)
    RulesFile.model_rebuild(force=True)


registry.on_change(_rebuild)


def _exactly_one(model: BaseModel, fields: tuple[str, ...]) -> None:
    given = [f for f in fields if getattr(model, f) is not None]
    if len(given) != 1:
        names = ", ".join(f.rstrip("_") for f in fields)
        raise ValueError(f"expected exactly one of {names}")


def field_names() -> set[str]:
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

