"""The challenge page in a real browser: headless Chromium through nginx and Envoy.

test_challenge.py imitates the page with a Python client; here the page's
own JavaScript does the work in Chromium, driven over the DevTools
protocol (tests/integration/browser.py): it finds the nonce, posts it to
/.sluice/challenge through the front door, and the browser follows the 303
with the credential cookie to the demo upstream.

Rules: rules/challenge_browser.yaml, two challenge rules (`browser-first`
on /first/, `browser-second` on /second/) that allow one request per
address and path. Chromium always connects from 127.0.0.1, so each test
visits fresh paths with a browser profile of its own.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devstack.launcher import FRONT_DOORS, Stack
from tests.integration.browser import Chromium
from tests.integration.conftest import RULES, front_door_port, start_stack

pytestmark = pytest.mark.integration

FIRST_COOKIE = "sluice_pass_browser-first"
SECOND_COOKIE = "sluice_pass_browser-second"
NOSCRIPT_TEXT = "This check needs JavaScript. Please enable it and reload the page."
CREDENTIAL_TTL_SECONDS = 30 * 60


@pytest.fixture(scope="module")
def browser_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack of this module's own: the counters of 127.0.0.1 are the browsers' alone."""
    stack = start_stack(tmp_path_factory.mktemp("challenge-browser-stack"), RULES / "challenge_browser.yaml")
    yield stack
    stack.stop()


@pytest.fixture(params=FRONT_DOORS)
def site(request: pytest.FixtureRequest, browser_stack: Stack) -> str:
    """The protected site's base URL, through nginx or Envoy with HTTP ext_authz."""
    return f"http://127.0.0.1:{front_door_port(browser_stack, request.param)}"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Chromium]:
    """Chromium with JavaScript, on a fresh profile: no cookies yet."""
    with Chromium(tmp_path / "profile") as chromium:
        yield chromium


def fresh_url(site: str, prefix: str) -> str:
    """A path under `prefix` that no browser has visited: its counter is at zero."""
    return f"{site}{prefix}{uuid.uuid4().hex}"


def echo_shown(browser: Chromium, url: str) -> dict[str, Any] | None:
    """The demo upstream's JSON echo, if the tab shows one for `url`."""
    shown = browser.evaluate(
        "[location.href, document.contentType, document.readyState,"
        " document.querySelector('pre') && document.querySelector('pre').textContent]")
    if shown[:3] != [url, "application/json", "complete"] or not shown[3]:
        return None
    echo: dict[str, Any] = json.loads(shown[3])
    return echo


def wait_for_echo(browser: Chromium, url: str, hits: int) -> dict[str, Any]:
    """Wait until the tab shows the upstream's echo of its `hits`-th request for
    `url`'s path (the echo counts them), and return it."""
    def arrived() -> bool:
        echo = echo_shown(browser, url)
        return echo is not None and echo["hits"] == hits

    browser.wait_for(arrived, f"the upstream's answer to request {hits} for {url}")
    echo = echo_shown(browser, url)
    assert echo is not None
    return echo


def visit_over_the_limit(browser: Chromium, url: str) -> dict[str, Any]:
    """Visit `url` twice: the first visit reaches the upstream, the second
    is over the limit and challenged; the echo the browser lands on then."""
    browser.navigate(url)
    wait_for_echo(browser, url, hits=1)
    browser.navigate(url)
    return wait_for_echo(browser, url, hits=2)


def statuses(browser: Chromium, url: str) -> list[int]:
    return [response["status"] for response in browser.responses(url)]


def cookies_sent_with(browser: Chromium, response: dict[str, Any]) -> set[str]:
    """The names of the cookies the browser sent with the request of `response`."""
    request_id = next(event["params"]["requestId"] for event in browser.events
                      if event["method"] == "Network.responseReceived" and event["params"]["response"] is response)
    return {entry["cookie"]["name"] for event in browser.events
            if event["method"] == "Network.requestWillBeSentExtraInfo"
            and event["params"]["requestId"] == request_id
            for entry in event["params"]["associatedCookies"] if not entry["blockedReasons"]}


def pass_first_rule(browser: Chromium, site: str) -> tuple[str, dict[str, Any]]:
    """Go over the first rule's limit and let the page solve the challenge;
    the URL and the upstream's echo the browser lands on."""
    url = fresh_url(site, "/first/")
    return url, visit_over_the_limit(browser, url)


def test_the_page_solves_the_challenge_and_the_browser_lands_on_the_upstream(
        browser: Chromium, site: str) -> None:
    url, echo = pass_first_rule(browser, site)
    # Shown the page (403), posted a solution, and followed the 303 back.
    assert statuses(browser, url) == [200, 403, 200]
    posts = browser.requests(f"{site}/.sluice/challenge")
    assert [post["method"] for post in posts] == ["POST"]
    assert posts[0]["postData"].startswith("challenge=") and "&nonce=" in posts[0]["postData"]

    cookie = browser.cookies()[FIRST_COOKIE]
    assert (cookie["domain"], cookie["path"], cookie["httpOnly"], cookie["sameSite"], cookie["secure"]) == \
        ("127.0.0.1", "/", True, "Lax", False)
    assert abs(cookie["expires"] - (time.time() + CREDENTIAL_TTL_SECONDS)) < 60

    assert (echo["method"], echo["path"]) == ("GET", url.removeprefix(site))
    assert f"{FIRST_COOKIE}={cookie['value']}" in echo["headers"]["cookie"]

    # The credential passes the rule on any of its paths from now on.
    other = fresh_url(site, "/first/")
    for hits in (1, 2, 3):
        browser.navigate(other)
        wait_for_echo(browser, other, hits)
    assert statuses(browser, other) == [200, 200, 200]


def test_a_second_rule_challenges_a_browser_with_the_first_rules_credential(
        browser: Chromium, site: str) -> None:
    pass_first_rule(browser, site)
    assert set(browser.cookies()) == {FIRST_COOKIE}

    url = fresh_url(site, "/second/")
    visit_over_the_limit(browser, url)
    assert statuses(browser, url) == [200, 403, 200]
    _, challenged, after_solving = browser.responses(url)
    assert challenged["mimeType"] == "text/html"
    assert FIRST_COOKIE in cookies_sent_with(browser, challenged)
    assert len(browser.requests(f"{site}/.sluice/challenge")) == 2
    assert set(browser.cookies()) == {FIRST_COOKIE, SECOND_COOKIE}
    assert {FIRST_COOKIE, SECOND_COOKIE} <= cookies_sent_with(browser, after_solving)


def test_a_browser_without_javascript_is_told_what_to_do(tmp_path: Path, site: str) -> None:
    with Chromium(tmp_path / "profile", javascript=False) as browser:
        url = fresh_url(site, "/first/")
        browser.navigate(url)
        wait_for_echo(browser, url, hits=1)
        browser.navigate(url)
        browser.wait_for(lambda: browser.evaluate(
            "document.readyState === 'complete' && !!document.getElementById('sluice-challenge')"),
            "the challenge page")
        assert statuses(browser, url) == [200, 403]
        # innerText is the text as rendered: a <noscript> shows only where scripts are off.
        text = browser.evaluate("document.body.innerText")
        assert "Checking your browser" in text and NOSCRIPT_TEXT in text
        assert browser.evaluate("document.querySelector('#sluice-challenge').dataset.challenge")
        assert browser.requests(f"{site}/.sluice/challenge") == []
        assert browser.cookies() == {}
