"""Forward-auth (Traefik, Caddy): ``/v1/check``, answered in full."""

from __future__ import annotations

from sidecar.actions import allow_headers, deny_answer
from sidecar.asgi import Scope
from sidecar.engine import ALLOW, ALLOWED, CLOSE, Decision
from sidecar.frontdoors.common import Check, Checked, Decide, Reply, Route, new_reply
from sidecar.request import CheckRequest, check_request

FORWARD_AUTH_PATH = "/v1/check"


def describe_forward_auth(scope: Scope, headers: dict[str, str]) -> CheckRequest:
    """Traefik/Caddy conventions; the client is the connecting peer."""
    peer = scope.get("client")
    return check_request(
        headers,
        method=headers.get("x-forwarded-method", "GET"),
        host=None,  # X-Forwarded-Host (else Host), without its port
        uri=headers.get("x-forwarded-uri", "/"),
        peer=peer[0] if peer else "",
        host_field="x-forwarded-host",
    )


def answer_in_full(request: CheckRequest, decision: Decision) -> Reply:
    """For proxies that pass a refusal to the client as it is (forward-auth,
    Envoy ext_authz): status, headers and page in this one answer."""
    if decision.outcome == ALLOW:
        # ALLOWED, nearly every answer, carries no field (allow_headers, an interpreted call).
        return new_reply((200, [] if decision is ALLOWED else allow_headers(decision), b""))
    if decision.outcome == CLOSE:
        # Neither a forward-auth subrequest nor ext_authz can close the
        # client's connection: an empty 403 asking for a close.
        return Reply(403, [("Connection", "close"), ("Cache-Control", "no-store")], b"")
    return Reply(*deny_answer(request, decision))


def forward_auth_at_once(scope: Scope, headers: dict[str, str], decide: Decide) -> Checked:
    """A forward-auth check in one pass through this module (``Check.at_once``)."""
    request = describe_forward_auth(scope, headers)
    decision = decide(request)
    return request, decision, answer_in_full(request, decision)


ROUTES = (Route(FORWARD_AUTH_PATH,
                Check("forward_auth", describe_forward_auth, answer_in_full, forward_auth_at_once)),)
