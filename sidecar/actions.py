"""What a decision looks like to the client: pages and headers (SPEC §6)."""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path

from sidecar import config

_VARIABLE = re.compile(r"\$\{\{\s*(remote_addr|http_host|request_id)\s*\}\}")

_BUILTIN_PAGE = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>${{status}} ${{reason}}</title>
<style>body{font-family:system-ui,sans-serif;max-width:36em;margin:4em auto;padding:0 1em;color:#222}
code{background:#f3f3f3;padding:.1em .3em}</style></head>
<body>
<h1>${{status}} ${{reason}}</h1>
<p>Too many requests from your address were received in a short time.
Please wait a moment before trying again.</p>
<p><small>Request ID: <code>${{request_id}}</code></small></p>
</body>
</html>
"""


class PageTemplate:
    """A page with ``${{remote_addr}}``, ``${{http_host}}``, ``${{request_id}}``.

    The template is split once at load; rendering joins literal parts with
    HTML-escaped values (``& < > " '``).
    """

    __slots__ = ("_parts",)

    def __init__(self, text: str) -> None:
        parts: list[str] = []
        position = 0
        for match in _VARIABLE.finditer(text):
            parts.append(text[position:match.start()])
            parts.append(match.group(1))
            position = match.end()
        parts.append(text[position:])
        self._parts = tuple(parts)

    def render(self, remote_addr: str, http_host: str, request_id: str) -> bytes:
        values = {"remote_addr": remote_addr, "http_host": http_host, "request_id": request_id}
        out = []
        for index, part in enumerate(self._parts):
            # Odd positions hold variable names, even ones literal text.
            out.append(html.escape(values[part], quote=True) if index % 2 else part)
        return "".join(out).encode("utf-8")


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


def over_limit_headers(limit: int, reset: int) -> list[tuple[str, str]]:
    """The headers every over-limit response carries (SPEC §6)."""
    return [("X-RateLimit", "true"), ("X-RateLimit-Limit", str(limit)),
            ("X-RateLimit-Reset", str(reset))]


def retry_after_seconds(wait: float) -> int:
    """Whole seconds until the key may send again: rounded up, at least 1."""
    return max(1, math.ceil(wait))


def deny_headers(limit: int, reset: int, retry_after: int, request_id: str) -> list[tuple[str, str]]:
    """Headers of a deny page: over-limit headers and Sluice's additions."""
    return over_limit_headers(limit, reset) + [
        ("Retry-After", str(retry_after)),
        ("Cache-Control", "no-store"),
        ("X-Request-Id", request_id),
        ("Content-Type", CONTENT_TYPE_HTML),
    ]
