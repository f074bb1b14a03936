"""The check endpoints at the ASGI level: what the proxy receives."""

import asyncio

import pytest

from sidecar.app import SluiceApp
from sidecar.challenge import IssuedChallenge
from sidecar.frontdoors.nginx import DenyToken

from .conftest import Harness

RULES = """
rules:
  - id: api
    match: {path: {prefix: /api/}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: block
    block: {status: 503, body: "<p>slow down ${{remote_addr}} on ${{http_host}} (${{request_id}})</p>"}
  - id: quiet
    match: {path: {prefix: /quiet}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: block
    block: {close: true}
  - id: watch
    match: {path: {prefix: /watch}}
    key: [ip]
    limit: {requests: 1, per: 30s}
    action: log
"""


def call(app: SluiceApp, path: str, headers: dict[str, str], client=("127.0.0.1", 5000), **scope_items):
    """One HTTP request through the ASGI app: (status, headers, body)."""
    path, _, query = path.partition("?")
    scope = {"type": "http", "path": path, "raw_path": path.encode(), "method": "GET",
             "client": client, "query_string": query.encode(), "http_version": "1.1", "scheme": "http",
             "root_path": "", "server": ("127.0.0.1", 8181),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()], **scope_items}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start, body = sent[0], sent[1]
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body["body"]


def nginx(app, uri, addr="198.51.100.7", **extra):
    headers = {"X-Sluice-Client-Addr": addr, "X-Original-URI": uri, "X-Original-Method": "GET",
               "X-Original-Host": "shop.example", "X-Request-Id": "rid-1", **extra}
    return call(app, "/v1/nginx/auth", headers)


@pytest.fixture
def app():
    return SluiceApp(Harness(RULES).engine)


def test_nginx_allow_is_200_without_headers(app):
    assert nginx(app, "/api/x") == (200, {"content-length": "0"}, b"")


def test_nginx_deny_is_403_with_a_token_and_the_page_comes_from_the_deny_endpoint(app):
    nginx(app, "/api/x")
    status, headers, _ = nginx(app, "/api/x")
    assert status == 403
    status, headers, body = call(app, "/v1/nginx/deny", {
        "X-Sluice-Deny": headers["x-sluice-deny"], "X-Original-Host": "shop.example",
        "X-Request-Id": "rid-1"})
    assert status == 503
    assert headers["x-ratelimit"] == "true"
    assert headers["x-ratelimit-limit"] == "1"
    assert headers["x-ratelimit-reset"] == "10"
    assert headers["retry-after"] == "10"
    assert headers["cache-control"] == "no-store"
    assert headers["x-request-id"] == "rid-1"
    assert headers["content-type"].startswith("text/html")
    assert body == b"<p>slow down 198.51.100.7 on shop.example (rid-1)</p>"


def test_nginx_close_is_401(app):
    nginx(app, "/quiet")
    assert nginx(app, "/quiet")[0] == 401


def test_nginx_observe_headers_on_allowed_response(app):
    nginx(app, "/watch")
    status, headers, _ = nginx(app, "/watch")
    assert status == 200
    assert (headers["x-ratelimit"], headers["x-ratelimit-limit"], headers["x-ratelimit-reset"]) == \
        ("true", "1", "30")


def test_page_values_are_html_escaped(app):
    status, headers, body = call(app, "/v1/nginx/deny", {
        "X-Sluice-Deny": "503 1 10 3 api 198.51.100.7", "X-Original-Host": "<script>'&\"",
        "X-Request-Id": "rid"})
    assert b"&lt;script&gt;&#x27;&amp;&quot;" in body


def test_invalid_deny_token_still_answers_a_refusal(app):
    status, headers, body = call(app, "/v1/nginx/deny", {"X-Sluice-Deny": "garbage"})
    assert status == 429 and headers["retry-after"] == "1"


def test_deny_token_round_trips_and_rejects_bad_status():
    with pytest.raises(ValueError):
        DenyToken.decode("200 1 1 1 rule -")
    assert DenyToken.decode("429 5 10 3 rule -") == (429, 5, 10, 3, "rule", "", None, False)
    assert DenyToken.decode("403 5 10 3 rule 192.0.2.1 4 abc.def") == \
        (403, 5, 10, 3, "rule", "192.0.2.1", IssuedChallenge("abc.def", 4), False)
    with pytest.raises(ValueError):
        DenyToken.decode("403 5 10 3 rule 192.0.2.1 4")


def test_deny_token_carries_whether_the_client_prefers_json():
    assert DenyToken.decode("429 5 10 3 rule - json").prefers_json
    assert DenyToken.decode("403 5 10 3 rule 192.0.2.1 json 4 abc.def") == \
        (403, 5, 10, 3, "rule", "192.0.2.1", IssuedChallenge("abc.def", 4), True)
    for bad in ("429 5 10 3 rule - jsn", "429 5 10 3 rule - 4 abc json", "429 5 10 3 rule - json json"):
        with pytest.raises(ValueError):
            DenyToken.decode(bad)


def test_internal_failure_fails_open(app):
    def broken(request):
        raise RuntimeError("boom")

    app.engine.decide_now = broken  # the memory store's decision
    assert nginx(app, "/api/x")[0] == 200
    assert app.engine.metrics.errors.value == 1


def test_missing_client_address_gets_a_defined_answer(app):
    status, _, _ = call(app, "/v1/nginx/auth", {"X-Original-URI": "/api/x"})
    assert status == 200
    assert call(app, "/v1/nginx/auth", {"X-Original-URI": "/api/x"})[0] == 403


def forward(app, uri, peer="198.51.100.7", **extra):
    headers = {"X-Forwarded-Method": "GET", "X-Forwarded-Host": "shop.example:443",
               "X-Forwarded-Uri": uri, "X-Forwarded-Proto": "https", **extra}
    return call(app, "/v1/check", headers, client=(peer, 4000))


def test_forward_auth_answers_the_deny_response_itself(app):
    assert forward(app, "/api/x")[0] == 200
    status, headers, body = forward(app, "/api/x", **{"X-Request-Id": "fa-1"})
    assert status == 503
    assert headers["retry-after"] == "10" and headers["x-request-id"] == "fa-1"
    assert body == b"<p>slow down 198.51.100.7 on shop.example (fa-1)</p>"


def test_forward_auth_close_is_an_empty_403_asking_to_close(app):
    forward(app, "/quiet")
    status, headers, body = forward(app, "/quiet")
    assert (status, headers["connection"], body) == (403, "close", b"")


def test_forward_auth_ignores_forwarded_for_from_an_untrusted_peer(app):
    assert forward(app, "/api/x", **{"X-Forwarded-For": "203.0.113.1"})[0] == 200
    assert forward(app, "/api/x", **{"X-Forwarded-For": "203.0.113.2"})[0] == 503


def test_health_and_metrics_are_served_by_the_api(app):
    status, _, body = call(app, "/healthz", {})
    assert (status, body) == (200, b"ok\n")
    nginx(app, "/api/x")
    status, _, body = call(app, "/metrics", {})
    assert b'sluice_rule_hits_total{rule="api"} 1.0' in body


def envoy(app, path, query=b"", addr="198.51.100.7", method="POST", **extra):
    headers = {"host": "shop.example:10000", "x-sluice-client-addr": addr,
               "x-request-id": "env-1", **extra}
    return call(app, "/v1/envoy/auth" + path, headers, query_string=query, method=method)


def test_envoy_check_takes_method_path_and_host_from_the_original_request(app):
    captured = []
    decide = app.engine.decide_now  # the memory store's decision
    app.engine.decide_now = lambda request: captured.append(request) or decide(request)
    envoy(app, "/api/%6Cogin", query=b"a=1")
    [request] = captured
    assert (request.method, request.uri, request.path, request.host, request.client.key) == \
        ("POST", "/api/%6Cogin?a=1", "/api/login", "shop.example", "198.51.100.7")


def test_envoy_deny_is_the_full_response_and_close_is_an_empty_403(app):
    assert envoy(app, "/api/x")[0] == 200
    status, headers, body = envoy(app, "/api/x")
    # ext_authz would take a 5xx for Sluice failing: 403 carrying the status.
    assert (status, headers["x-sluice-status"]) == (403, "503")
    assert headers["retry-after"] == "10"
    assert body == b"<p>slow down 198.51.100.7 on shop.example (env-1)</p>"
    envoy(app, "/quiet")
    status, headers, body = envoy(app, "/quiet")
    assert (status, headers["connection"], body) == (403, "close", b"")


def test_envoy_prefix_must_end_at_a_path_boundary(app):
    status, _, _ = call(app, "/v1/envoy/authx", {})
    assert status == 404
