"""Refusal bodies as HTML or JSON: the client's Accept header, the rule's
``block: {content_type: ...}``, and what every front door sends."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.actions import (
    CONTENT_TYPE_HTML,
    CONTENT_TYPE_JSON,
    BlockPage,
    PageTemplate,
    Refusal,
    deny_answer,
    json_body,
    page_body,
    prefers_json,
)
from sidecar.app import SluiceApp
from sidecar.challenge import SOLUTION_PATH, IssuedChallenge
from sidecar.engine import STORE_UNAVAILABLE
from sidecar.frontdoors.grpc_authz import check_response
from sidecar.frontdoors.nginx import PAGE_HEADER, DenyToken

from .conftest import FakeClock, Harness
from .test_app import call

RULES = """
rules:
  - id: auto
    match: {path: {prefix: /auto/}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: block
  - id: always-json
    match: {path: {prefix: /json/}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: block
    block: {content_type: application/json}
  - id: always-html
    match: {path: {prefix: /html/}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: block
    block: {content_type: text/html}
  - id: own-json
    match: {path: {prefix: /own/}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: block
    block: {status: 503, content_type: application/json, body: '{"busy": "${{http_host}}", "id": "${{request_id}}"}'}
  - id: verify
    match: {path: {prefix: /verify/}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: challenge
"""

BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"
JSON_FIELDS = {"error", "status", "message", "retry_after", "rule", "request_id"}


@pytest.fixture
def app() -> SluiceApp:
    return SluiceApp(Harness(RULES).engine)


# --------------------------------------------------------------------------
# Negotiation
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("accept", "json_preferred"), [
    ("", False),
    ("application/json", True),
    ("APPLICATION/JSON", True),
    ("application/json; charset=utf-8", True),
    ("text/html", False),
    ("*/*", False),  # curl, fetch, requests: a tie
    (BROWSER, False),
    ("application/json, text/plain, */*", True),  # axios: named outright, HTML only by */*
    ("application/json, text/html", False),  # both named, same weight: a tie
    ("application/json, text/html;q=0.9", True),
    ("text/html;q=0.9, application/json", True),
    ("application/json;q=0.5, */*", False),
    ("application/*", True),
    ("text/*;q=0.5, application/json", True),
    ("application/json;q=0", False),
    ("text/html;q=0, */*", True),
    ("*/*;q=0", False),
    ("application/json,,", True),  # empty list elements
    ("application/json;q=1.000", True),
    # Malformed: HTML, never an error.
    ("application/json;q=abc", False),
    ("application/json;q=1.5", False),
    ("application/json, garbage", False),
    ("*/json", False),
    ("application/json" + " " * 2000, False),  # longer than any client's
])
def test_json_is_chosen_when_the_accept_header_prefers_it_to_html(accept: str, json_preferred: bool) -> None:
    assert prefers_json(accept) is json_preferred


media_ranges = st.builds(
    "{}/{}{}".format,
    st.sampled_from(["application", "text", "*", "image", "APPLICATION", ""]),
    st.sampled_from(["json", "html", "*", "xml", "problem+json", ""]),
    st.lists(st.sampled_from([";q=0", ";q=0.5", ";q=1", ";q=0.001", ";q=2", ";q=", ";level=1", "; charset=utf-8",
                              ";q=0.5;q=1", " ;Q=0.3"]), max_size=3).map("".join))
accept_headers = st.one_of(st.text(max_size=200), st.lists(media_ranges, max_size=6).map(", ".join))


@settings(max_examples=500)
@given(accept_headers)
def test_any_accept_header_chooses_html_or_json_without_an_error(accept: str) -> None:
    assert prefers_json(accept) in (True, False)


@given(st.integers(400, 599), st.integers(0, 10**6), st.one_of(st.none(), st.text(max_size=64)),
       st.text(max_size=100), st.one_of(st.none(), st.builds(IssuedChallenge, st.text(max_size=40),
                                                             st.integers(1, 24))))
def test_the_json_body_is_always_json_with_every_field(status: int, retry_after: int, rule_id: str | None,
                                                       request_id: str, challenge: IssuedChallenge | None) -> None:
    body = json.loads(json_body(Refusal(status, retry_after, rule_id, request_id, "192.0.2.1", "h", challenge)))
    assert JSON_FIELDS <= set(body)
    assert (body["status"], body["retry_after"], body["rule"], body["request_id"]) == \
        (status, retry_after, rule_id, request_id)
    if challenge is not None:
        assert (body["error"], body["challenge"], body["difficulty"], body["solution_path"]) == \
            ("challenge_required", challenge.text, challenge.difficulty, SOLUTION_PATH)


def test_the_json_body_shows_no_client_address_or_host() -> None:
    body = json_body(Refusal(429, 3, "api", "rid", "198.51.100.7", "shop.example"))
    assert json.loads(body) == {"error": "rate_limited", "status": 429, "message": "Too Many Requests",
                                "retry_after": 3, "rule": "api", "request_id": "rid"}


def test_a_page_of_ones_own_in_json_escapes_its_values_for_json() -> None:
    from sidecar import config

    block = config.BlockAction(content_type="application/json", body='{"host": "${{http_host}}"}')
    page = BlockPage.from_config(block, base_dir=None)  # type: ignore[arg-type]
    content_type, body = page_body(page, Refusal(429, 1, "r", "rid", host='a"b\\c\n'), as_json=False)
    assert (content_type, json.loads(body)) == ("application/json", {"host": 'a"b\\c\n'})
    assert page.one_line is None  # nginx fetches it, with its type


# --------------------------------------------------------------------------
# Through the front doors
# --------------------------------------------------------------------------


def forward(app: SluiceApp, uri: str, accept: str | None = None) -> tuple[int, dict[str, str], bytes]:
    headers = {"X-Forwarded-Method": "GET", "X-Forwarded-Host": "shop.example", "X-Forwarded-Uri": uri,
               "X-Request-Id": "fa-1", **({"Accept": accept} if accept is not None else {})}
    return call(app, "/v1/check", headers, client=("198.51.100.1", 4000))


def refused(door: Any, app: SluiceApp, uri: str, accept: str | None) -> tuple[int, dict[str, str], bytes]:
    """The second answer (the first request is let in)."""
    assert door(app, uri, accept)[0] == 200
    return door(app, uri, accept)


def envoy(app: SluiceApp, uri: str, accept: str | None = None) -> tuple[int, dict[str, str], bytes]:
    headers = {"host": "shop.example", "x-sluice-client-addr": "198.51.100.2", "x-request-id": "env-1",
               **({"accept": accept} if accept is not None else {})}
    return call(app, "/v1/envoy/auth" + uri, headers)


@pytest.mark.parametrize("door", [forward, envoy])
@pytest.mark.parametrize(("path", "accept", "json_sent"), [
    ("/auto/", "application/json", True),
    ("/auto/", BROWSER, False),
    ("/auto/", None, False),
    ("/json/", BROWSER, True),
    ("/json/", None, True),
    ("/html/", "application/json", False),
])
def test_a_refusal_is_json_or_html_as_its_rule_and_the_client_say(app: SluiceApp, door: Any, path: str,
                                                                  accept: str | None, json_sent: bool) -> None:
    status, headers, body = refused(door, app, path, accept)
    assert status == 429
    if json_sent:
        assert headers["content-type"] == CONTENT_TYPE_JSON
        assert json.loads(body)["rule"] == {"/auto/": "auto", "/json/": "always-json"}[path]
        assert json.loads(body)["retry_after"] == int(headers["retry-after"])
    else:
        assert headers["content-type"] == CONTENT_TYPE_HTML and body.startswith(b"<!doctype html>")
    # Only a page that follows the Accept header says it does.
    assert ("vary" in headers) is (path == "/auto/")


def test_a_json_page_of_ones_own_keeps_its_type_whatever_the_client_accepts(app: SluiceApp) -> None:
    status, headers, body = refused(forward, app, "/own/", BROWSER)
    assert (status, headers["content-type"]) == (503, "application/json")
    assert json.loads(body) == {"busy": "shop.example", "id": "fa-1"}


def test_envoy_sends_a_5xx_json_refusal_as_403_with_the_real_status(app: SluiceApp) -> None:
    status, headers, body = refused(envoy, app, "/own/", None)
    assert (status, headers["x-sluice-status"], headers["content-type"]) == (403, "503", "application/json")


def test_a_challenge_for_a_json_client_is_json_with_what_the_page_would_solve(app: SluiceApp) -> None:
    status, headers, body = refused(forward, app, "/verify/", "application/json")
    document = json.loads(body)
    assert (status, headers["content-type"], document["error"]) == (403, CONTENT_TYPE_JSON, "challenge_required")
    assert document["challenge"] and document["difficulty"] >= 1 and document["solution_path"] == SOLUTION_PATH
    status, headers, body = forward(app, "/verify/", BROWSER)  # still over the limit
    assert headers["content-type"] == CONTENT_TYPE_HTML and b"sluice-challenge" in body


def test_the_store_unavailable_refusal_is_json_for_a_json_client() -> None:
    request = Harness(RULES).request(headers={"accept": "application/json"})
    status, headers, body = deny_answer(request, STORE_UNAVAILABLE)
    assert (status, dict(headers)["Content-Type"]) == (503, CONTENT_TYPE_JSON)
    assert json.loads(body) == {"error": "unavailable", "status": 503, "message": "Service Unavailable",
                                "retry_after": 1, "rule": None, "request_id": "req-1"}


def test_grpc_denied_response_carries_the_json_type_and_body(app: SluiceApp) -> None:
    reply = refused(forward, app, "/json/", None)
    response = check_response((reply[0], list(reply[1].items()), reply[2]))
    headers = {option.header.key: option.header.value for option in response.denied_response.headers}
    assert headers["content-type"] == CONTENT_TYPE_JSON
    assert json.loads(response.denied_response.body)["rule"] == "always-json"


def nginx(app: SluiceApp, uri: str, accept: str | None = None) -> tuple[int, dict[str, str], bytes]:
    headers = {"X-Sluice-Client-Addr": "198.51.100.3", "X-Original-URI": uri, "X-Original-Method": "GET",
               "X-Original-Host": "shop.example", "X-Request-Id": "rid-1",
               **({"Accept": accept} if accept is not None else {})}
    return call(app, "/v1/nginx/auth", headers)


def nginx_page(app: SluiceApp, token: str) -> tuple[int, dict[str, str], bytes]:
    """The second call, as @sluice_deny makes it: none of the client's headers."""
    return call(app, "/v1/nginx/deny", {"X-Sluice-Deny": token, "X-Original-Host": "shop.example",
                                        "X-Request-Id": "rid-1"})


def test_nginx_fetches_a_json_page_with_the_preference_in_the_token(app: SluiceApp) -> None:
    status, headers, _ = refused(nginx, app, "/auto/", "application/json")
    # nginx would send an inline page as HTML: a JSON one is fetched.
    assert status == 403 and PAGE_HEADER.lower() not in headers
    assert DenyToken.decode(headers["x-sluice-deny"]).prefers_json
    assert headers["vary"] == "Accept"  # nginx's cache of refusals keeps one answer per Accept
    status, headers, body = nginx_page(app, headers["x-sluice-deny"])
    assert (status, headers["content-type"]) == (429, CONTENT_TYPE_JSON)
    assert json.loads(body)["rule"] == "auto"


def test_nginx_sends_an_html_page_inline_to_a_browser(app: SluiceApp) -> None:
    status, headers, _ = refused(nginx, app, "/auto/", BROWSER)
    assert headers[PAGE_HEADER.lower()].startswith("<!doctype html>")
    assert not DenyToken.decode(headers["x-sluice-deny"]).prefers_json


def test_nginx_fetches_a_page_that_is_always_json(app: SluiceApp) -> None:
    status, headers, _ = refused(nginx, app, "/json/", BROWSER)
    assert PAGE_HEADER.lower() not in headers and "vary" not in headers
    status, headers, body = nginx_page(app, headers["x-sluice-deny"])
    assert (status, headers["content-type"], json.loads(body)["rule"]) == (429, CONTENT_TYPE_JSON, "always-json")


@settings(max_examples=200, deadline=None)
@given(accept_headers)
def test_any_accept_header_gets_an_html_or_json_refusal_from_every_door(accept: str) -> None:
    app = SluiceApp(Harness(RULES).engine)
    for door in (forward, envoy):
        status, headers, body = refused(door, app, "/auto/", accept)
        assert status == 429
        if headers["content-type"] == CONTENT_TYPE_JSON:
            assert JSON_FIELDS <= set(json.loads(body))
        else:
            assert headers["content-type"] == CONTENT_TYPE_HTML
    status, headers, _ = refused(nginx, app, "/auto/", accept)
    status, headers, body = nginx_page(app, headers["x-sluice-deny"])
    assert status == 429 and headers["content-type"] in (CONTENT_TYPE_HTML, CONTENT_TYPE_JSON)
    assert app.engine.metrics.errors.value == 0


def test_a_stored_refusal_is_sent_again_only_to_a_client_of_the_same_accept_header() -> None:
    """The answer the HTTP protocol stores for a whole address depends on
    the Accept header: a JSON client's is not a browser's."""
    import asyncio

    from .test_stored_refusals import RULESETS, Node, check

    def with_accept(request: bytes, accept: str) -> bytes:
        return request[:-2] + f"Accept: {accept}\r\n\r\n".encode("latin-1")

    async def run() -> None:
        clock = FakeClock()
        loop = asyncio.get_running_loop()
        stored, decided = Node(RULESETS["block"], clock, True, loop), Node(RULESETS["block"], clock, False, loop)
        for door in ("envoy", "nginx"):
            request = check(door, "GET", "192.0.2.7", "0123456789abcdef0123456789abcdef", "shop.example", "/", None)
            for accept in ["application/json"] * 4 + [BROWSER, "application/json", BROWSER]:
                answer = stored.ask(with_accept(request, accept))
                assert answer == decided.ask(with_accept(request, accept))
            assert len(stored.engine.address_refusals) > 0  # answers were stored, and kept apart

    asyncio.run(run())


@pytest.mark.parametrize(("block", "json_choice"), [
    ("{}", "if_preferred"), ("{content_type: application/json}", "always"), ("{content_type: text/html}", "never"),
    ("{body: '{\"a\": 1}', content_type: application/json}", "always"), ("{body: '<p>no</p>'}", "never"),
])
def test_a_late_checks_503_is_sent_as_its_rules_page_would_be(block: str, json_choice: str) -> None:
    from .test_overload import Overloaded

    h = Overloaded(f"""
rules:
  - id: login
    key: [ip]
    limit: {{requests: 5, per: 60s}}
    action: block
    block: {block}
    overload: closed
""")
    page = h.check(late=1.0).page
    assert (page.status, page.json, page.content_type) == (503, json_choice, CONTENT_TYPE_HTML)


@given(st.text(max_size=20), st.text(max_size=20))
def test_a_page_renders_whatever_text_its_rules_file_and_the_request_give(page: str, host: str) -> None:
    """Even a lone surrogate, which YAML reads from "\\ud800" and UTF-8
    cannot carry, is sent as a replacement character, never an error."""
    rendered = PageTemplate(page + "${{http_host}}").render("192.0.2.1", host + "\ud800", "req-1")

    assert rendered.decode("utf-8").endswith("?")
