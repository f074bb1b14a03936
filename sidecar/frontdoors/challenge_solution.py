"""Where a challenge page's solution arrives: a credential cookie
and back to the original page, or a refusal. The proxy maps the site's
SOLUTION_PATH here, without checking it."""

from __future__ import annotations

import html

from sidecar.actions import CONTENT_TYPE_HTML
from sidecar.asgi import Receive, Scope, Send
from sidecar.challenge import FINGERPRINT_HEADER
from sidecar.frontdoors.common import Route, Service, header_map, read_body, respond
from sidecar.request import parse_query

CHALLENGE_PATH = "/v1/challenge"
MAX_SOLUTION_BODY = 8192


def refused_solution_page(problem: str, location: str) -> bytes:
    return (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>Verification failed</title></head>\n<body><h1>Verification failed</h1>\n"
            f"<p>{html.escape(problem)}.</p>\n<p><a href=\"{html.escape(location, quote=True)}\">"
            f"Try again</a></p></body></html>\n").encode()


async def solution(service: Service, scope: Scope, receive: Receive, send: Send) -> None:
    engine = service.engine
    headers = header_map(scope)
    body = await read_body(receive, MAX_SOLUTION_BODY)
    # The first value of a repeated field counts, as in query strings.
    form = parse_query(body.decode("latin-1")) if scope["method"] == "POST" and body else {}
    # nginx and Envoy name the client as for a check; a forward-auth
    # proxy's route to here makes the proxy the peer.
    peer = scope.get("client")
    client = engine.resolve_client(headers.get("x-sluice-client-addr") or (peer[0] if peer else ""),
                                   headers.get("x-forwarded-for"))
    fingerprint = headers.get(FINGERPRINT_HEADER, "")
    ticket, problem = engine.challenges.verify(form.get("challenge", ""), form.get("nonce", ""),
                                               client.key, fingerprint)
    rule = engine.ruleset.by_id.get(ticket.rule_id) if ticket is not None else None
    # A reload may have removed the rule or changed its action since.
    settings = rule.challenge if rule is not None else None
    if ticket is None or problem or rule is None or settings is None:
        engine.metrics.challenges_refused.inc()
        await respond(send, 403, [("Cache-Control", "no-store"), ("Content-Type", CONTENT_TYPE_HTML)],
                      refused_solution_page(problem or "this page no longer asks for a check",
                                            ticket.location if ticket is not None else "/"))
        return
    engine.metrics.challenges_solved.inc()
    credential = engine.challenges.credential(rule.id, client.key, fingerprint, settings.ttl)
    proto = headers.get("x-forwarded-proto") or scope.get("scheme", "http")
    cookie = (f"{settings.cookie}={credential}; Max-Age={int(settings.ttl)}; Path=/; "
              "HttpOnly; SameSite=Lax" + ("; Secure" if proto.lower() == "https" else ""))
    await respond(send, 303, [("Location", ticket.location), ("Set-Cookie", cookie),
                              ("Cache-Control", "no-store")])


ROUTES = (Route(CHALLENGE_PATH, solution),)
