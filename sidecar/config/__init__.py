"""The rules file: YAML with line tracking, a strict schema, readable errors.

Loading happens once (at start and on reload). Every problem in the file is
reported at once as ``FILE:LINE: field.path: message``; the
per-request path never sees any of this, only the compiled objects built from
the validated model (see ``sidecar.rules``).

- ``values``: the parsers of durations, rates, networks, patterns and
  counting dimensions, and the files a rules file names;
- ``models``: the schema, pydantic models built on those values;
- ``document``: YAML with the line of every field, and the problems found
  in it (``ConfigIssue``, ``ConfigError``), shared with ``sidecar.rls``;
- ``loader``: a rules file read, validated and cross-checked.

Everything is imported from here.
"""

from sidecar.config.document import (
    ConfigError,
    ConfigIssue,
    Document,
    Loc,
    format_loc,
    locate,
    validation_issues,
    yaml_read,
)
from sidecar.config.loader import LoadedRules, load_rules_file, parse_rules_text
from sidecar.config.models import (
    BUILTIN_PAGE_TYPES,
    Action,
    AsnTest,
    AutoBanConfig,
    Backend,
    BanAction,
    BanIncrementConfig,
    BlockAction,
    ChallengeAction,
    ChallengeConfig,
    ClientIPConfig,
    ClusterConfig,
    Condition,
    CountOn,
    CountryTest,
    CrowdSecConfig,
    CrowdSecPush,
    DecisionLogConfig,
    FailMode,
    GeoipConfig,
    IPTest,
    JwtConfig,
    JwtKeys,
    JwtTest,
    JwtToken,
    Limit,
    LimitModel,
    LogKeys,
    NamedTest,
    NamedTests,
    OverloadConfig,
    OverloadMode,
    Override,
    ResetOn,
    ResponseHeaderTest,
    Rule,
    RulesFile,
    SentinelConfig,
    StateConfig,
    Strict,
    StringTest,
    TiersConfig,
    VerifiedBots,
    field_names,
    limit_tag,
)
from sidecar.config.values import (
    RULE_ID_RE,
    SENTINEL_PORT,
    Asn,
    Country,
    Dimension,
    Duration,
    HostPort,
    Network,
    Rate,
    Regex,
    Threshold,
    TierName,
    TierThreshold,
    format_duration,
    parse_asn,
    parse_country,
    parse_dimension,
    parse_duration,
    parse_host_port,
    parse_network,
    parse_rate,
    parse_refill,
    parse_regex,
    parse_tier_name,
    parse_tier_threshold,
    read_text_file,
    resolve_file,
)

__all__ = [
    # values
    "RULE_ID_RE", "SENTINEL_PORT", "Asn", "Country", "Dimension", "Duration", "HostPort", "Network", "Rate", "Regex",
    "Threshold", "TierName", "TierThreshold", "format_duration", "parse_asn", "parse_country", "parse_dimension",
    "parse_duration", "parse_host_port", "parse_network", "parse_rate", "parse_refill",
    "parse_regex", "parse_tier_name", "parse_tier_threshold", "read_text_file", "resolve_file",
    # models
    "BUILTIN_PAGE_TYPES", "Action", "AutoBanConfig", "Backend", "BanAction", "BanIncrementConfig", "BlockAction",
    "ChallengeAction", "ChallengeConfig", "ClientIPConfig", "ClusterConfig", "Condition", "CountOn",
    "CrowdSecConfig", "CrowdSecPush",
    "DecisionLogConfig", "FailMode", "AsnTest", "CountryTest", "GeoipConfig", "IPTest", "JwtConfig", "JwtKeys",
    "JwtTest", "JwtToken", "Limit", "LimitModel", "LogKeys", "NamedTest", "NamedTests",
    "OverloadConfig", "OverloadMode", "Override", "ResetOn", "ResponseHeaderTest", "Rule", "RulesFile",
    "SentinelConfig", "StateConfig", "Strict", "StringTest", "TiersConfig", "VerifiedBots", "field_names", "limit_tag",
    # document
    "ConfigError", "ConfigIssue", "Document", "Loc", "format_loc", "locate", "validation_issues", "yaml_read",
    # loader
    "LoadedRules", "load_rules_file", "parse_rules_text",
]
