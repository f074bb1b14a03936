"""nginx ``auth_request``: the check, and the deny page nginx may fetch after it.

nginx's auth_request understands only 2xx, 401 and 403. Sluice answers 403
for "deny with a page" and 401 for "close the connection".

A refusal costs nginx one call: the 403 carries the page itself
(``X-Sluice-Page``, with its status in ``X-Sluice-Page-Status``), which
nginx sends with ``return`` (sluice-server.conf's ``@sluice_deny``). A page
that cannot travel as one header field (a challenge's, which runs a script,
or one over MAX_INLINE_PAGE) is fetched in a second call from
NGINX_DENY_PATH, which answers with the real status; so is any page whose
status the shipped ``@sluice_deny`` does not list, and any page that is not
HTML (``@sluice_deny`` sends what it holds as HTML; the second call's answer
keeps its Content-Type). That call carries none of the client's headers, so
the check's answer says in the token whether the client's Accept header
prefers JSON, and, when the page depends on it, ``Vary: Accept`` for
nginx's cache of refusals.
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple

from sidecar.actions import (
    BlockPage,
    Refusal,
    allow_headers,
    deny_headers,
    page_body,
)
from sidecar.actions import prefers_json as prefers_accepted_json
from sidecar.asgi import Receive, Scope, Send
from sidecar.challenge import MAX_CHALLENGE_LENGTH, IssuedChallenge
from sidecar.clientip import parse_address
from sidecar.config import RULE_ID_RE
from sidecar.engine import ALLOW, ALLOWED, CLOSE, Decision
from sidecar.frontdoors.common import (
    Check,
    Checked,
    Decide,
    Reply,
    Route,
    Service,
    header_map,
    new_reply,
    respond,
)
from sidecar.ratelog import RateLimitedLog
from sidecar.request import CheckRequest, check_request, request_id_of
from sidecar.rules import CompiledRule

log = logging.getLogger("sluice")

NGINX_AUTH_PATH = "/v1/nginx/auth"
NGINX_DENY_PATH = "/v1/nginx/deny"
NGINX_DENY_STATUS = 403
NGINX_CLOSE_STATUS = 401
PAGE_HEADER = "X-Sluice-Page"
PAGE_STATUS_HEADER = "X-Sluice-Page-Status"
# Until when nginx may answer the client's checks from its cache: the
# last Unix second, as "@N" (nginx's own header for it).
PROXY_EXPIRES_HEADER = "X-Accel-Expires"
# The largest page sent in the check's answer: with the other fields, well
# within the 16 KiB proxy_buffer_size of the shipped check location (a
# larger answer head would be nginx's 502, and the request let in).
MAX_INLINE_PAGE = 8 * 1024


def inline_page(page: BlockPage, request: CheckRequest, client_text: str | None = None) -> str | None:
    """The page for ``request`` as one header field's value, or None when
    nginx must fetch it instead (see the module). ``client_text``: the
    client's address as text, when the caller has read it already."""
    if client_text is None:
        client_text = request.client.text
    _, body = page.refusal(0, 0, True, False, client_text, request.host, request.request_id)
    return _header_page(body)


def _header_page(body: bytes | None) -> str | None:
    """A one-line page as a header field's value; None when too large."""
    return body.decode("latin-1") if body is not None and len(body) <= MAX_INLINE_PAGE else None


class DenyFields(NamedTuple):
    status: int
    limit: int
    reset: int
    retry_after: int
    rule_id: str  # "-": no rule
    client: str  # "": none
    challenge: IssuedChallenge | None
    prefers_json: bool  # the client's Accept header prefers JSON to HTML


class DenyToken:
    """What nginx carries from the auth answer to the page request.

    Plain text ``status limit reset retry-after rule-id client``, then
    ``json`` when the client's Accept header prefers JSON, then for a
    challenge page ``difficulty challenge``: rule ids, addresses and
    challenges contain no spaces (rule ids are checked at load).
    """

    @staticmethod
    def encode(decision: Decision, client_text: str, prefers_json: bool = False) -> str:
        rule = decision.rule
        assert decision.page is not None
        # No rule: refused because the shared store is unavailable (fail:
        # closed); the page request then gets the built-in page.
        token = (f"{decision.page.status} {decision.limit} {decision.reset} {decision.retry_after} "
                 f"{rule.id if rule is not None else '-'} {client_text or '-'}")
        if prefers_json:
            token += " json"
        if decision.challenge is not None:
            token += f" {decision.challenge.difficulty} {decision.challenge.text}"
        return token

    @staticmethod
    def decode(token: str) -> DenyFields:
        """The token's fields; ValueError for anything ``encode`` does not
        write (a token is checked field by field, never trusted)."""
        if len(token) > MAX_DENY_TOKEN:
            raise ValueError("token too long")
        fields = token.split(" ")
        prefers_json = len(fields) in (7, 9)
        if prefers_json and fields.pop(6) != "json":
            raise ValueError("not the json mark")
        if len(fields) not in (6, 8):
            raise ValueError(f"{len(fields)} fields")
        status, limit, reset, retry_after, rule_id, client = fields[:6]
        status_code = _token_number(status, 3)
        if not 400 <= status_code <= 599:
            raise ValueError(f"status {status_code} out of range")
        if rule_id != "-" and not RULE_ID_RE.fullmatch(rule_id):
            raise ValueError("not a rule id")
        address = parse_address(client) if client != "-" else None
        if client != "-" and address is None:
            raise ValueError("not a client address")
        challenge = None
        if len(fields) == 8:
            if not (0 < len(fields[7]) <= MAX_CHALLENGE_LENGTH and _CHALLENGE_TEXT.fullmatch(fields[7])):
                raise ValueError("not a challenge")
            challenge = IssuedChallenge(fields[7], _token_number(fields[6], 3))
        return DenyFields(status_code, _token_number(limit), _token_number(reset), _token_number(retry_after),
                          rule_id, "" if address is None else str(address), challenge, prefers_json)


# Longer than any token encode writes (a challenge is at most
# MAX_CHALLENGE_LENGTH); numbers are plain decimal digits, never signs,
# spaces, underscores or exponents, and at most 20 digits (64 bits).
MAX_DENY_TOKEN = MAX_CHALLENGE_LENGTH + 256
_CHALLENGE_TEXT = re.compile(r"[A-Za-z0-9_.-]+")


def _token_number(text: str, digits: int = 20) -> int:
    if not (0 < len(text) <= digits and text.isascii() and text.isdigit()):
        raise ValueError(f"not a number of at most {digits} digits")
    return int(text)


# A client that reaches the deny endpoint can send bad tokens as fast as it likes.
_bad_token_log = RateLimitedLog(log, 60.0)


def describe_nginx(scope: Scope, headers: dict[str, str]) -> CheckRequest:
    """nginx sends the original request line and client address as headers."""
    return check_request(
        headers,
        method=headers.get("x-original-method", "GET"),
        host=headers.get("x-original-host") or None,  # None: Host, without its port
        uri=headers.get("x-original-uri", "/"),
        peer=headers.get("x-sluice-client-addr", ""),
    )


def answer_nginx(request: CheckRequest, decision: Decision) -> Reply:
    if decision.outcome == ALLOW:
        # ALLOWED, nearly every answer, carries no field (allow_headers, an interpreted call).
        return new_reply((200, [] if decision is ALLOWED else allow_headers(decision), b""))
    # A refusal that holds for every request of the client: nginx may
    # answer it from its cache until then (sluice-server.conf).
    cached = [(PROXY_EXPIRES_HEADER, f"@{request.proxy_expires}")] if request.proxy_expires else []
    if decision.outcome == CLOSE:
        return Reply(NGINX_CLOSE_STATUS, cached, b"")
    # The token lets nginx fetch the page when it cannot send it itself;
    # the over-limit fields and Retry-After are added by @sluice_deny.
    page = decision.page
    assert page is not None
    # Read once each: the client's text (sidecar.clientip) and whether it
    # prefers JSON (sidecar.actions.prefers_json).
    client_text = request.client.text
    prefers_json = prefers_accepted_json(request.headers.get("accept", ""))
    over_limit, body = page.refusal(decision.limit, decision.reset, decision.challenge is None, prefers_json,
                                    client_text, request.host, request.request_id)
    headers = [("X-Sluice-Deny", DenyToken.encode(decision, client_text, prefers_json)), *over_limit,
               ("Retry-After", str(decision.retry_after)), *cached]
    if page.json == "if_preferred":
        headers.append(("Vary", "Accept"))  # for nginx's cache of refusals
    inline = _header_page(body)
    if inline is not None:
        headers += [(PAGE_STATUS_HEADER, str(page.status)), (PAGE_HEADER, inline)]
    return Reply(NGINX_DENY_STATUS, headers, b"")


def nginx_at_once(scope: Scope, headers: dict[str, str], decide: Decide) -> Checked:
    """nginx's check in one pass through this module (``Check.at_once``)."""
    request = describe_nginx(scope, headers)
    decision = decide(request)
    return request, decision, answer_nginx(request, decision)


def _deny_page(rule: CompiledRule | None, status: int, challenge: IssuedChallenge | None
               ) -> tuple[BlockPage, IssuedChallenge | None]:
    """The page (and challenge) for a deny token whose rule may have been
    reloaded since nginx was told: the rule's own page while it still gives
    one for that status, else the built-in page for the status. A challenge
    is shown only while its rule still challenges (a solution would be
    refused otherwise), and a challenge rule's token without one (the rule
    blocked when nginx asked) gets the built-in page."""
    if rule is None or rule.page is None or rule.page.close:
        return BlockPage.builtin(status), None
    if rule.challenge is not None:
        return (rule.page, challenge) if challenge is not None else (BlockPage.builtin(status), None)
    return rule.page.for_status(status), None


async def deny_page(service: Service, scope: Scope, receive: Receive, send: Send) -> None:
    """The page for a deny nginx was told about (see NGINX_DENY_STATUS).

    Every token gets a page: a malformed one the built-in 429, a stale
    one (its rule reloaded away or changed) the built-in page for the
    status nginx was told."""
    headers = header_map(scope)
    request_id = request_id_of(headers)
    token = headers.get("x-sluice-deny", "")
    try:
        fields = DenyToken.decode(token)
    except ValueError as exc:
        _bad_token_log.warning("deny page asked for with an invalid token %r (%s; reported once "
                               "per minute)", token[:200], exc)
        fields = DenyFields(429, 1, 1, 1, "-", "", None, False)
    status, limit, reset, retry_after = fields.status, fields.limit, fields.reset, fields.retry_after
    try:
        page, challenge = _deny_page(service.engine.ruleset.by_id.get(fields.rule_id), status, fields.challenge)
        refusal = Refusal(status, retry_after, None if fields.rule_id == "-" else fields.rule_id, request_id,
                          fields.client, headers.get("x-original-host", ""), challenge)
        content_type, body = page_body(page, refusal, page.sends_json(fields.prefers_json))
    except Exception:  # a bug: still a refusal, never a 500 for nginx to show
        service.internal_error()
        status, limit, reset, retry_after = 429, 1, 1, 1
        page = BlockPage.builtin(status)
        content_type, body = page_body(page, Refusal(status, retry_after, None, request_id), False)
    await respond(send, status, deny_headers(limit, reset, retry_after, request_id, content_type), body)


ROUTES = (
    Route(NGINX_AUTH_PATH, Check("nginx", describe_nginx, answer_nginx, nginx_at_once)),
    Route(NGINX_DENY_PATH, deny_page),
)
