"""Envoy HTTP ext_authz: the original path after ENVOY_AUTH_PREFIX."""

from __future__ import annotations

from sidecar.actions import deny_answer
from sidecar.asgi import Scope
from sidecar.engine import DENY, Decision
from sidecar.frontdoors.common import Check, Checked, Decide, Reply, Route
from sidecar.frontdoors.forward_auth import answer_in_full
from sidecar.request import CheckRequest, check_request

# Envoy's HTTP ext_authz appends the original path to a prefix.
ENVOY_AUTH_PREFIX = "/v1/envoy/auth"
# Envoy's ext_authz takes any 5xx from the authorization service for a
# failure of the service itself and, failing open, lets the request in. A
# refusal with such a status is sent as 403 carrying the real status, which
# the shipped Envoy template's Lua filter puts back.
ENVOY_STATUS_HEADER = "X-Sluice-Status"


def describe_envoy(scope: Scope, headers: dict[str, str]) -> CheckRequest:
    """Envoy HTTP ext_authz: the original method, the original path after
    ENVOY_AUTH_PREFIX, the original Host, and the direct peer's address
    added by the filter as ``x-sluice-client-addr``."""
    raw_path = scope.get("raw_path") or scope["path"].encode()
    uri = raw_path[len(ENVOY_AUTH_PREFIX):].decode("latin-1") or "/"
    if scope.get("query_string"):
        uri += "?" + scope["query_string"].decode("latin-1")
    return check_request(
        headers,
        method=scope["method"],
        host=None,  # Host, without its port
        uri=uri,
        peer=headers.get("x-sluice-client-addr", ""),
    )


def answer_envoy(request: CheckRequest, decision: Decision) -> Reply:
    if decision.outcome != DENY:
        return answer_in_full(request, decision)
    status, headers, body = deny_answer(request, decision)
    if status >= 500:
        headers.append((ENVOY_STATUS_HEADER, str(status)))
        status = 403
    return Reply(status, headers, body)


def envoy_at_once(scope: Scope, headers: dict[str, str], decide: Decide) -> Checked:
    """Envoy's HTTP check in one pass through this module (``Check.at_once``)."""
    request = describe_envoy(scope, headers)
    decision = decide(request)
    return request, decision, answer_envoy(request, decision)


ROUTES = (Route(ENVOY_AUTH_PREFIX, Check("envoy", describe_envoy, answer_envoy, envoy_at_once), prefix=True),)
