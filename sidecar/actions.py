"""What a decision looks like to the client: pages and headers."""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass, field
from http import HTTPStatus
from importlib import resources
from pathlib import Path

from sidecar import config

_VARIABLE = re.compile(r"\$\{\{\s*(remote_addr|http_host|request_id)\s*\}\}")
# The challenge page has two variables more; block pages do not know them.
_CHALLENGE_VARIABLE = re.compile(
    r"\$\{\{\s*(remote_addr|http_host|request_id|challenge|difficulty|solution_path)\s*\}\}")

# The built-in block page: ${{status}} and ${{reason}} are filled in once
# per status, the other variables per request.
_BUILTIN_PAGE = (resources.files("sidecar") / "pages" / "blocked.html").read_text(encoding="utf-8")


class PageTemplate:
    """A page with ``${{remote_addr}}``, ``${{http_host}}``, ``${{request_id}}``.

    The template is split once at load; rendering joins literal parts with
    HTML-escaped values (``& < > " '``).
    """

    __slots__ = ("_parts",)

    def __init__(self, text: str, variables: re.Pattern[str] = _VARIABLE) -> None:
        parts: list[str] = []
        position = 0
        for match in variables.finditer(text):
            parts.append(text[position:match.start()])
            parts.append(match.group(1))
            position = match.end()
        parts.append(text[position:])
        self._parts = tuple(parts)

    def render(self, remote_addr: str, http_host: str, request_id: str, **more: str) -> bytes:
        values = {"remote_addr": remote_addr, "http_host": http_host, "request_id": request_id, **more}
        out = []
        for index, part in enumerate(self._parts):
            # Odd positions hold variable names, even ones literal text.
            # A variable without a value (a challenge page asked for
            # without its challenge) renders empty, never a KeyError.
            out.append(html.escape(values.get(part, ""), quote=True) if index % 2 else part)
        return "".join(out).encode("utf-8")

    def one_line(self) -> "PageTemplate | None":
        """The same page on one line, to travel in a header field (line
        breaks become spaces, which HTML renders alike); None when its line
        breaks matter (scripts, preformatted text) or it holds control
        characters."""
        literal = "".join(self._parts[::2])
        if _NOT_ONE_LINE.search(literal):
            return None
        one_line = PageTemplate("")
        one_line._parts = tuple(_LINE_BREAK.sub(" ", part) if index % 2 == 0 else part
                                for index, part in enumerate(self._parts))
        return one_line


# What a page cannot hold to be sent on one line: elements whose line breaks
# are not plain white space, and control characters but tab and line breaks.
_NOT_ONE_LINE = re.compile(r"<(?:script|pre|textarea|listing|xmp|plaintext)\b|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]",
                           re.IGNORECASE)
_LINE_BREAK = re.compile(r"\r\n|[\r\n]")


def _builtin_template(status: int) -> PageTemplate:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Request refused"
    text = _BUILTIN_PAGE.replace("${{status}}", str(status)).replace("${{reason}}", html.escape(reason))
    return PageTemplate(text)


@dataclass(frozen=True, slots=True)
class BlockPage:
    """A block action's answer: a status and page, or closing the connection."""

    status: int
    template: PageTemplate
    close: bool
    # The page on one line, for nginx's one-call refusals (None: fetched).
    one_line: PageTemplate | None = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "one_line", self.template.one_line())

    @classmethod
    def from_config(cls, block: config.BlockAction, base_dir: Path) -> "BlockPage":
        if block.body is not None:
            template = PageTemplate(block.body)
        elif block.body_file is not None:
            template = PageTemplate(config.resolve_file(block.body_file, base_dir)
                                    .read_text(encoding="utf-8"))
        else:
            template = _builtin_template(block.status)
        return cls(block.status, template, block.close)

    @classmethod
    def builtin(cls, status: int) -> "BlockPage":
        return cls(status, _builtin_template(status), False)



CONTENT_TYPE_HTML = "text/html; charset=utf-8"

# The human-verification page. The challenge and its difficulty are
# data attributes of one element, so a script (or a test) reads them without
# parsing JavaScript. The browser searches nonces with crypto.subtle in
# batches; outside a secure context (plain HTTP other than localhost)
# crypto.subtle does not exist, and a small SHA-256 in JavaScript stands in.
# The solution goes back as an ordinary form post, so the browser follows
# Sluice's 303 to the original page with the credential cookie set.
_CHALLENGE_PAGE = (resources.files("sidecar") / "pages" / "challenge.html").read_text(encoding="utf-8")

# Status 403, as in the seeds: a challenge is not a "too many requests" refusal.
CHALLENGE_PAGE = BlockPage(403, PageTemplate(_CHALLENGE_PAGE, _CHALLENGE_VARIABLE), False)


def over_limit_headers(limit: int, reset: int) -> list[tuple[str, str]]:
    """The headers every over-limit response carries."""
    return [("X-RateLimit", "true"), ("X-RateLimit-Limit", str(limit)),
            ("X-RateLimit-Reset", str(reset))]


def retry_after_seconds(wait: float) -> int:
    """Whole seconds until the key may send again: rounded up, at least 1."""
    return max(1, math.ceil(wait))


# What an HTTP server refuses to send in a header value (uvicorn answers 500).
_UNSENDABLE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def deny_headers(limit: int, reset: int, retry_after: int, request_id: str) -> list[tuple[str, str]]:
    """Headers of a deny page: over-limit headers and Sluice's additions.
    The request id is the proxy's: control characters in it are dropped."""
    return over_limit_headers(limit, reset) + [
        ("Retry-After", str(retry_after)),
        ("Cache-Control", "no-store"),
        ("X-Request-Id", _UNSENDABLE.sub("", request_id)),
        ("Content-Type", CONTENT_TYPE_HTML),
    ]


def draft_fields(quotas: list[tuple[str, float, tuple[int, float, float]]]) -> tuple[str, str]:
    """The draft ``RateLimit-Policy`` and ``RateLimit`` field values from
    (rule id, threshold, (requests left, seconds to reset, window)) of each
    enforcing rule of an allowed request."""
    policies = [f'"{rule_id}";q={math.ceil(threshold)};w={max(1, math.ceil(window))}'
                for rule_id, threshold, (_, _, window) in quotas]
    remaining = [f'"{rule_id}";r={left};t={math.ceil(reset)}' for rule_id, _, (left, reset, _) in quotas]
    return ", ".join(policies), ", ".join(remaining)
