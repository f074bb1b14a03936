"""What a decision looks like to the client: pages and headers.

A refusal's page is its rule's template (the built-in HTML page, or a body
of the rules file's, sent as the type it declares), or the built-in JSON
body, for clients that prefer JSON to HTML or for rules that always send it
(``block: {content_type: ...}``).
"""

from __future__ import annotations

import functools
import html
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from sidecar import config
from sidecar.challenge import SOLUTION_PATH, IssuedChallenge

if TYPE_CHECKING:
    from sidecar.engine import Decision
    from sidecar.limiters import Quota
    from sidecar.request import CheckRequest

_VARIABLE = re.compile(r"\$\{\{\s*(remote_addr|http_host|request_id)\s*\}\}")
# The challenge page has two variables more; block pages do not know them.
_CHALLENGE_VARIABLE = re.compile(
    r"\$\{\{\s*(remote_addr|http_host|request_id|challenge|difficulty|solution_path)\s*\}\}")

# The built-in block page: ${{status}} and ${{reason}} are filled in once
# per status, the other variables per request.
_BUILTIN_PAGE = (resources.files("sidecar") / "pages" / "blocked.html").read_text(encoding="utf-8")


def escape_html(value: str) -> str:
    return html.escape(value, quote=True)


def escape_json(value: str) -> str:
    """A value inside a JSON string: the template writes the quotes."""
    return json.dumps(value)[1:-1]


class PageTemplate:
    """A page with ``${{remote_addr}}``, ``${{http_host}}``, ``${{request_id}}``.

    The template is split once at load; rendering joins literal parts with
    escaped values: HTML-escaped (``& < > " '``), or escaped for a JSON
    string in a JSON page.
    """

    __slots__ = ("_parts", "_escape")

    def __init__(self, text: str, variables: re.Pattern[str] = _VARIABLE,
                 escape: Callable[[str], str] = escape_html) -> None:
        self._escape = escape
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
            out.append(self._escape(values.get(part, "")) if index % 2 else part)
        # A lone surrogate (YAML's "\ud800" in a page) cannot be UTF-8:
        # it is sent as "?", never an error at the moment of a refusal.
        return "".join(out).encode("utf-8", "replace")

    def one_line(self) -> PageTemplate | None:
        """The same page on one line, to travel in a header field (line
        breaks become spaces, which HTML renders alike); None when its line
        breaks matter (scripts, preformatted text) or it holds control
        characters."""
        literal = "".join(self._parts[::2])
        if _NOT_ONE_LINE.search(literal):
            return None
        one_line = PageTemplate("", escape=self._escape)
        one_line._parts = tuple(_LINE_BREAK.sub(" ", part) if index % 2 == 0 else part
                                for index, part in enumerate(self._parts))
        return one_line


# What a page cannot hold to be sent on one line: elements whose line breaks
# are not plain white space, and control characters but tab and line breaks.
_NOT_ONE_LINE = re.compile(r"<(?:script|pre|textarea|listing|xmp|plaintext)\b|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]",
                           re.IGNORECASE)
_LINE_BREAK = re.compile(r"\r\n|[\r\n]")


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Request refused"


def _builtin_template(status: int) -> PageTemplate:
    text = _BUILTIN_PAGE.replace("${{status}}", str(status)).replace("${{reason}}", html.escape(_reason(status)))
    return PageTemplate(text)


CONTENT_TYPE_HTML = "text/html; charset=utf-8"
CONTENT_TYPE_JSON = "application/json"

# When a page is sent as the built-in JSON body instead of its template:
# never, always, or when the client's Accept header prefers JSON to HTML.
JsonChoice = Literal["never", "always", "if_preferred"]
# The built-in page's content_type in the rules file, as a JsonChoice.
_BUILTIN_JSON: dict[str, JsonChoice] = {"auto": "if_preferred", "text/html": "never", "application/json": "always"}


@dataclass(frozen=True, slots=True)
class BlockPage:
    """A block action's answer: a status and page, or closing the connection."""

    status: int
    template: PageTemplate
    close: bool
    content_type: str = CONTENT_TYPE_HTML  # the template's
    json: JsonChoice = "if_preferred"
    # The page on one line, for nginx's one-call refusals, which nginx sends
    # as HTML (None: fetched, with its own type).
    one_line: PageTemplate | None = field(init=False, compare=False)

    def __post_init__(self) -> None:
        html_page = self.content_type == CONTENT_TYPE_HTML and self.json != "always"
        object.__setattr__(self, "one_line", self.template.one_line() if html_page else None)

    @classmethod
    def from_config(cls, block: config.BlockAction, base_dir: Path) -> BlockPage:
        if block.body is not None:
            own = block.body
        elif block.body_file is not None:
            own = config.resolve_file(block.body_file, base_dir).read_text(encoding="utf-8")
        else:
            return cls.builtin(block.status, _BUILTIN_JSON[block.content_type or "auto"], block.close)
        content_type = media_type(block.content_type or "text/html")
        escape = escape_json if is_json(content_type) else escape_html
        return cls(block.status, PageTemplate(own, escape=escape), block.close, content_type, "never")

    @classmethod
    def builtin(cls, status: int, json: JsonChoice = "if_preferred", close: bool = False) -> BlockPage:
        return _builtin_page(status, json, close)

    def for_status(self, status: int) -> BlockPage:
        """The page of this page's refusals with another status (a late
        check's 503, a stale nginx token): the built-in page, sent as JSON
        as this one is (always, when this one is a JSON page of its own)."""
        if status == self.status and not self.close:
            return self
        return _builtin_page(status, "always" if is_json(self.content_type) else self.json, False)

    def sends_json(self, client_prefers_json: bool) -> bool:
        """Whether this page goes as the built-in JSON body to a client
        that does (or does not) prefer JSON."""
        return self.json == "always" or (self.json == "if_preferred" and client_prefers_json)

    def refusal(self, limit: int, reset: int, inline: bool, client_prefers_json: bool, client_text: str,
                host: str, request_id: str) -> tuple[list[tuple[str, str]], bytes | None]:
        """What a proxy that sends the page itself needs of a refusal, in one
        call (nginx's answer): the over-limit fields, and the page on one
        line, or None when the proxy is to fetch it (``inline`` False, a JSON
        page, a page of another type, or a host or request id that cannot
        go in a header field)."""
        fields = over_limit_headers(limit, reset)
        template = self.one_line
        if template is None or not inline or self.sends_json(client_prefers_json) \
                or not (host.isprintable() and request_id.isprintable()):
            return fields, None
        return fields, template.render(client_text, host, request_id)


@functools.cache
def _builtin_page(status: int, json: JsonChoice, close: bool) -> BlockPage:
    """Built once per status and kind: pages are immutable."""
    return BlockPage(status, _builtin_template(status), close, CONTENT_TYPE_HTML, json)


def media_type(declared: str) -> str:
    """A page's Content-Type: UTF-8 said for text, as pages are sent."""
    base = declared.split(";", 1)[0].strip().lower()
    if re.sub(r"\s", "", declared.lower()) in ("text/html", "text/html;charset=utf-8"):
        return CONTENT_TYPE_HTML
    if base.startswith("text/") and "charset=" not in declared.lower():
        return f"{declared.strip()}; charset=utf-8"
    return declared.strip()


def is_json(content_type: str) -> bool:
    """application/json, or a +json type (application/problem+json)."""
    base = content_type.split(";", 1)[0].strip().lower()
    return base == CONTENT_TYPE_JSON or base.endswith("+json")


# An Accept header longer than any a client sends is not read (HTML).
MAX_ACCEPT = 1024
_MEDIA_RANGE = re.compile(r"\s*([A-Za-z0-9!#$%&'*+.^_`|~-]+)/([A-Za-z0-9!#$%&'*+.^_`|~-]+)\s*((?:;[^;]*)*)")
_QVALUE = re.compile(r"\s*[qQ]\s*=\s*(0(?:\.\d{0,3})?|1(?:\.0{0,3})?)\s*")


@functools.lru_cache(maxsize=256)
def prefers_json(accept: str) -> bool:
    """Whether an Accept header (RFC 9110, section 12.5.1) prefers
    application/json to text/html. Each type's weight is the q of the most
    specific range that matches it (type/subtype, type/*, */*), 0 for none.
    At equal weights, a type the header names outright wins over one it
    matches by a wildcard (``application/json, */*``, as HTTP libraries
    send, is JSON; a browser names text/html); a full tie, no header and a
    malformed one are HTML."""
    if not accept or len(accept) > MAX_ACCEPT:
        return False
    json_weight = (-1, 0.0)  # (specificity, q) of the best range so far
    html_weight = (-1, 0.0)
    for element in accept.split(","):
        if not element.strip():
            continue  # an empty list element (RFC 9110, section 5.6.1)
        range_ = _media_range(element)
        if range_ is None:
            return False
        kind, subtype, q = range_
        json_weight = max(json_weight, _matches(kind, subtype, q, "application", "json"))
        html_weight = max(html_weight, _matches(kind, subtype, q, "text", "html"))
    return json_weight[1] > 0 and json_weight[::-1] > html_weight[::-1]


def _media_range(element: str) -> tuple[str, str, float] | None:
    """type, subtype and q of one media range; None when malformed.
    Parameters other than q are not compared: text/html;level=1 is text/html."""
    match = _MEDIA_RANGE.fullmatch(element)
    if match is None:
        return None
    kind, subtype = match.group(1).lower(), match.group(2).lower()
    if kind == "*" and subtype != "*":
        return None
    q = 1.0
    for parameter in match.group(3).split(";")[1:]:
        name = parameter.split("=", 1)[0].strip().lower()
        if name == "q":
            weight = _QVALUE.fullmatch(parameter)
            if weight is None:
                return None
            q = float(weight.group(1))
    return kind, subtype, q


def _matches(kind: str, subtype: str, q: float, wanted_kind: str, wanted_subtype: str) -> tuple[int, float]:
    """(specificity, q) of a media range for a type; (-1, 0) when it does not match."""
    if kind == wanted_kind and subtype == wanted_subtype:
        return 2, q
    if kind == wanted_kind and subtype == "*":
        return 1, q
    if kind == "*":
        return 0, q
    return -1, 0.0


@dataclass(frozen=True, slots=True)
class Refusal:
    """What a refusal's page may show, whichever page it is."""

    status: int
    retry_after: int
    rule_id: str | None  # None: no rule refused (the shared store is unavailable)
    request_id: str
    remote_addr: str = ""
    host: str = ""
    challenge: IssuedChallenge | None = None


def page_body(page: BlockPage, refusal: Refusal, as_json: bool) -> tuple[str, bytes]:
    """A refusal's Content-Type and body: the built-in JSON body, the
    challenge page, or the page's template."""
    if as_json:
        return CONTENT_TYPE_JSON, json_body(refusal)
    challenge = refusal.challenge
    if challenge is not None:
        return CONTENT_TYPE_HTML, CHALLENGE_PAGE.template.render(
            refusal.remote_addr, refusal.host, refusal.request_id, challenge=challenge.text,
            difficulty=str(challenge.difficulty), solution_path=SOLUTION_PATH)
    return page.content_type, page.template.render(refusal.remote_addr, refusal.host, refusal.request_id)


def json_body(refusal: Refusal) -> bytes:
    """The built-in JSON body: what the built-in HTML page says (status,
    reason, request id), and what a program acts on: a stable error code,
    the wait, the rule (a name from the rules file) and, for a challenge,
    what the challenge page's script solves. Never the client's address,
    host or keys."""
    status = refusal.status
    challenge = refusal.challenge
    error = "challenge_required" if challenge is not None else "unavailable" if status == 503 else "rate_limited"
    body: dict[str, object] = {"error": error, "status": status, "message": _reason(status),
                               "retry_after": refusal.retry_after, "rule": refusal.rule_id,
                               "request_id": refusal.request_id}
    if challenge is not None:
        body.update(challenge=challenge.text, difficulty=challenge.difficulty, solution_path=SOLUTION_PATH)
    return json.dumps(body).encode("utf-8") + b"\n"

# The human-verification page. The challenge and its difficulty are
# data attributes of one element, so a script (or a test) reads them without
# parsing JavaScript. The browser searches nonces with crypto.subtle in
# batches; outside a secure context (plain HTTP other than localhost)
# crypto.subtle does not exist, and a small SHA-256 in JavaScript stands in.
# The solution goes back as an ordinary form post, so the browser follows
# Sluice's 303 to the original page with the credential cookie set.
_CHALLENGE_PAGE = (resources.files("sidecar") / "pages" / "challenge.html").read_text(encoding="utf-8")

# Status 403, as in the seeds: a challenge is not a "too many requests" refusal.
CHALLENGE_PAGE = BlockPage(403, PageTemplate(_CHALLENGE_PAGE, _CHALLENGE_VARIABLE), False, CONTENT_TYPE_HTML,
                           "if_preferred")


def over_limit_headers(limit: int, reset: int) -> list[tuple[str, str]]:
    """The headers every over-limit response carries."""
    return [("X-RateLimit", "true"), ("X-RateLimit-Limit", str(limit)),
            ("X-RateLimit-Reset", str(reset))]


def allow_headers(decision: Decision) -> list[tuple[str, str]]:
    """The fields of an allow: over-limit headers in observe mode, and the
    pending-counts token the proxy hands back with the response report,
    and the draft RateLimit fields."""
    rule = decision.rule
    headers = [] if rule is None else over_limit_headers(decision.limit, decision.reset)
    if rule is not None and rule.shadow:
        headers.append(("X-RateLimit-Shadow", "true"))
    if decision.pending is not None:
        headers.append(("X-Sluice-Pending", decision.pending))
    if decision.quota is not None:
        headers.append(("RateLimit-Policy", decision.quota[0]))
        headers.append(("RateLimit", decision.quota[1]))
    return headers


# What an HTTP server refuses to send in a header value (uvicorn answers 500).
_UNSENDABLE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def deny_answer(request: CheckRequest, decision: Decision) -> tuple[int, list[tuple[str, str]], bytes]:
    """A deny's status, header fields and page (HTML or JSON), for a proxy
    that sends Sluice's answer as it is (Envoy, forward auth): one call."""
    page = decision.page
    assert page is not None
    refusal = Refusal(page.status, decision.retry_after, decision.rule.id if decision.rule is not None else None,
                      request.request_id, request.client.text, request.host, decision.challenge)
    content_type, body = page_body(page, refusal, page.sends_json(prefers_json(request.headers.get("accept", ""))))
    headers = deny_headers(decision.limit, decision.reset, decision.retry_after, request.request_id,
                           content_type, page.json == "if_preferred")
    return page.status, headers, body


def deny_headers(limit: int, reset: int, retry_after: int, request_id: str,
                 content_type: str = CONTENT_TYPE_HTML, negotiated: bool = False) -> list[tuple[str, str]]:
    """Headers of a deny page: over-limit headers and Sluice's additions.
    The request id is the proxy's: control characters in it are dropped.
    A page chosen by the request's Accept header says so (Vary)."""
    headers = over_limit_headers(limit, reset) + [
        ("Retry-After", str(retry_after)),
        ("Cache-Control", "no-store"),
        ("X-Request-Id", _UNSENDABLE.sub("", request_id)),
        ("Content-Type", content_type),
    ]
    if negotiated:
        headers.append(("Vary", "Accept"))
    return headers


def draft_fields(quotas: list[tuple[str, float, Quota]]) -> tuple[str, str]:
    """The draft ``RateLimit-Policy`` and ``RateLimit`` field values from
    (rule id, threshold, (requests left, seconds to reset, window)) of each
    enforcing rule of an allowed request."""
    policies = [f'"{rule_id}";q={math.ceil(threshold)};w={max(1, math.ceil(window))}'
                for rule_id, threshold, (_, _, window) in quotas]
    remaining = [f'"{rule_id}";r={left};t={math.ceil(reset)}' for rule_id, _, (left, reset, _) in quotas]
    return ", ".join(policies), ", ".join(remaining)
