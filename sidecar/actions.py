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
# The challenge page has two variables more; block pages do not know them.
_CHALLENGE_VARIABLE = re.compile(
    r"\$\{\{\s*(remote_addr|http_host|request_id|challenge|difficulty|solution_path)\s*\}\}")

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

# The human-verification page (SPEC §6). The challenge and its difficulty are
# data attributes of one element, so a script (or a test) reads them without
# parsing JavaScript. The browser searches nonces with crypto.subtle in
# batches; outside a secure context (plain HTTP other than localhost)
# crypto.subtle does not exist, and a small SHA-256 in JavaScript stands in.
# The solution goes back as an ordinary form post, so the browser follows
# Sluice's 303 to the original page with the credential cookie set.
_CHALLENGE_PAGE = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><meta name="robots" content="noindex">
<title>Checking your browser</title>
<style>body{font-family:system-ui,sans-serif;max-width:36em;margin:4em auto;padding:0 1em;color:#222}
code{background:#f3f3f3;padding:.1em .3em}</style></head>
<body>
<main id="sluice-challenge" data-challenge="${{challenge}}" data-difficulty="${{difficulty}}">
<h1>Checking your browser</h1>
<p id="sluice-status">Many requests came from your address in a short time. Your browser is
doing a short calculation to show that a person is behind it; this page continues by
itself in a moment.</p>
<noscript><p>This check needs JavaScript. Please enable it and reload the page.</p></noscript>
<form id="sluice-form" method="post" action="${{solution_path}}">
<input type="hidden" name="challenge" value="${{challenge}}">
<input type="hidden" name="nonce" value="">
</form>
<p><small>Request ID: <code>${{request_id}}</code></small></p>
</main>
<script>
(function () {
  "use strict";
  var box = document.getElementById("sluice-challenge");
  var form = document.getElementById("sluice-form");
  var challenge = box.getAttribute("data-challenge");
  var difficulty = parseInt(box.getAttribute("data-difficulty"), 10);
  var encoder = new TextEncoder();
  var subtle = window.crypto && window.crypto.subtle;
  var K = [], H0 = [];
  (function () {
    var n = 2, found = 0;
    function frac(x) { return ((x - Math.floor(x)) * 4294967296) | 0; }
    while (found < 64) {
      var prime = true;
      for (var d = 2; d * d <= n; d++) { if (n % d === 0) { prime = false; break; } }
      if (prime) { if (found < 8) { H0.push(frac(Math.sqrt(n))); } K.push(frac(Math.cbrt(n))); found++; }
      n++;
    }
  })();
  function sha256(data) {
    var H = H0.slice(), w = new Array(64), i;
    var padded = new Uint8Array(((data.length + 9 + 63) >> 6) << 6);
    padded.set(data);
    padded[data.length] = 0x80;
    var bits = data.length * 8;
    for (i = 1; i <= 4; i++) { padded[padded.length - i] = (bits >>> (8 * (i - 1))) & 255; }
    for (var offset = 0; offset < padded.length; offset += 64) {
      for (i = 0; i < 16; i++) {
        var j = offset + 4 * i;
        w[i] = padded[j] << 24 | padded[j + 1] << 16 | padded[j + 2] << 8 | padded[j + 3];
      }
      for (i = 16; i < 64; i++) {
        var x = w[i - 15], y = w[i - 2];
        var s0 = (x >>> 7 | x << 25) ^ (x >>> 18 | x << 14) ^ (x >>> 3);
        var s1 = (y >>> 17 | y << 15) ^ (y >>> 19 | y << 13) ^ (y >>> 10);
        w[i] = (w[i - 16] + s0 + w[i - 7] + s1) | 0;
      }
      var h = H.slice();
      for (i = 0; i < 64; i++) {
        var a = h[0], e = h[4];
        var t1 = (h[7] + ((e >>> 6 | e << 26) ^ (e >>> 11 | e << 21) ^ (e >>> 25 | e << 7))
                  + ((e & h[5]) ^ (~e & h[6])) + K[i] + w[i]) | 0;
        var t2 = (((a >>> 2 | a << 30) ^ (a >>> 13 | a << 19) ^ (a >>> 22 | a << 10))
                  + ((a & h[1]) ^ (a & h[2]) ^ (h[1] & h[2]))) | 0;
        h = [(t1 + t2) | 0, a, h[1], h[2], (h[3] + t1) | 0, h[4], h[5], h[6]];
      }
      for (i = 0; i < 8; i++) { H[i] = (H[i] + h[i]) | 0; }
    }
    var out = new Uint8Array(32);
    for (i = 0; i < 32; i++) { out[i] = (H[i >> 2] >>> (24 - 8 * (i & 3))) & 255; }
    return out;
  }
  function digest(text) {
    var bytes = encoder.encode(text);
    if (subtle) {
      return subtle.digest("SHA-256", bytes).then(function (b) { return new Uint8Array(b); });
    }
    return Promise.resolve(sha256(bytes));
  }
  function zeroBits(bytes) {
    var bits = 0;
    for (var i = 0; i < bytes.length; i++) {
      if (bytes[i] === 0) { bits += 8; continue; }
      return bits + Math.clz32(bytes[i]) - 24;
    }
    return bits;
  }
  function search(start) {
    var batch = [];
    for (var n = start; n < start + 256; n++) { batch.push(digest(challenge + n)); }
    return Promise.all(batch).then(function (digests) {
      for (var k = 0; k < digests.length; k++) {
        if (zeroBits(digests[k]) >= difficulty) { return start + k; }
      }
      return search(start + 256);
    });
  }
  window.sluiceSolve = search;
  search(0).then(function (nonce) {
    form.elements.nonce.value = String(nonce);
    form.submit();
  }, function () {
    document.getElementById("sluice-status").textContent =
      "Your browser could not complete the check. Please reload the page.";
  });
})();
</script>
</body>
</html>
"""

# Status 403, as in the seeds: a challenge is not a "too many requests" refusal.
CHALLENGE_PAGE = BlockPage(403, PageTemplate(_CHALLENGE_PAGE, _CHALLENGE_VARIABLE), False)


def over_limit_headers(limit: int, reset: int) -> list[tuple[str, str]]:
    """The headers every over-limit response carries (SPEC §6)."""
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
