"""The values of a rules file: durations, rates, networks, patterns,
counting dimensions, and the files it names.

Each parser reads what the file wrote and raises ValueError saying what to
write instead; each has a pydantic type beside it (``Duration``, ``Network``,
...) that the models use. ``sidecar.schema`` tells editors what each parser
accepts, so a new parser is described there too.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any

from pydantic import PlainValidator, ValidationInfo

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

_DIMENSIONS = ("ip", "host", "method", "path", "uri", "asn", "country", "ja3", "ja4")
_NAMED_DIMENSIONS = ("header", "cookie", "query", "session", "jwt")
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
        "or header:NAME, cookie:NAME, query:NAME, session:COOKIE, jwt:CLAIM"
    )


Dimension = Annotated[str, PlainValidator(parse_dimension)]


def parse_asn(value: Any) -> str:
    """An autonomous system as a database gives it: its number as text
    (``64500``, ``"64500"`` and ``"AS64500"`` alike)."""
    text = str(value).strip() if not isinstance(value, bool) and isinstance(value, (int, str)) else ""
    digits = text[2:] if text[:2].upper() == "AS" else text
    if not digits.isascii() or not digits.isdigit() or int(digits) >= 1 << 32:
        raise ValueError(f"an autonomous system is a number like 64500 or AS64500, got {_shown(value)}")
    return str(int(digits))


def parse_country(value: Any) -> str:
    """A country's two-letter ISO code, in upper case."""
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z]{2}", value.strip()):
        raise ValueError(f"a country is its two-letter ISO code, like DE, got {_shown(value)}")
    return value.strip().upper()


Asn = Annotated[str, PlainValidator(parse_asn)]

@dataclass(frozen=True, slots=True)
class TierThreshold:
    """A tier's threshold on a rule: a count, and the period it was written
    with (``2000/1m``), which must be the rule's own."""

    count: int
    per: float | None = None


def parse_tier_threshold(value: Any) -> TierThreshold:
    """``2000`` (requests, or score, in the rule's own period), or
    ``2000/1m`` (the period said again, and checked against the rule's)."""
    if isinstance(value, int) and not isinstance(value, bool):
        count, per = value, None
    elif isinstance(value, str) and re.fullmatch(r"\s*[0-9]{1,12}\s*/\s*\S+\s*", value):
        number, _, period = value.partition("/")
        count, per = int(number), parse_duration(_PERIOD_WORDS.get(period.strip(), period.strip()))
    else:
        raise ValueError(f"a tier's threshold is a number (2000), or a number per the rule's period "
                         f"(2000/1m), got {_shown(value)}")
    if count < 0 or count >= 1 << 40:
        raise ValueError(f"a tier's threshold is from 0 to {(1 << 40) - 1}, got {_shown(value)}")
    return TierThreshold(count, per)


# The periods a rate may name by their word (100/min).
_PERIOD_WORDS = {"s": "1s", "sec": "1s", "second": "1s", "m": "1m", "min": "1m", "minute": "1m",
                 "h": "1h", "hour": "1h", "d": "1d", "day": "1d"}
TIER_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,32}$"


def parse_tier_name(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(TIER_NAME_PATTERN, value):
        raise ValueError(f"a tier's name is 1-32 letters, digits, '_', '.', '-', got {_shown(value)}")
    return value


TierName = Annotated[str, PlainValidator(parse_tier_name)]
Threshold = Annotated[TierThreshold, PlainValidator(parse_tier_threshold)]

Country = Annotated[str, PlainValidator(parse_country)]


def resolve_file(name: str, base_dir: Path) -> Path:
    """Files named in a rules file are relative to the rules file."""
    path = Path(name)
    return path if path.is_absolute() else base_dir / path


def read_text_file(name: str, info: ValidationInfo, what: str) -> str:
    """The text of a file a field names (``what`` it is, for the error),
    relative to the rules file being validated."""
    base_dir = (info.context or {}).get("base_dir", Path.cwd())
    try:
        return resolve_file(name, base_dir).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {name!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the {what} {name!r} is not UTF-8 text") from None
