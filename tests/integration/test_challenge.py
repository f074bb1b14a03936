"""`action: challenge` through nginx and Envoy: the page, the
solution posted back through the front door, the credential cookie.

Rules: the `challenge` rule of rules/limits.yaml (2 requests per hour per
address, difficulty 4). The test client does what the page's JavaScript
does: it reads the challenge from the page's data attributes, finds the
nonce, posts it to /.sluice/challenge and follows the 303 with the cookie.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import urlencode

import pytest

from devstack.launcher import Stack
from sidecar.challenge import solve, solves
from tests.integration.clients import Client, Reply
from tests.integration.conftest import sluice_metric, unique_path

pytestmark = pytest.mark.integration

HTML = {"Accept": "text/html"}


def trip(client: Client, path: str) -> Reply:
    """Two requests pass; the third is in the penalty and gets the page."""
    for _ in range(2):
        assert client.request(path, headers=HTML).status == 200
    page = client.request(path, headers=HTML)
    assert page.status == 403, page.body[:200]
    return page


def challenge_of(page: Reply) -> tuple[str, int]:
    text = page.body.decode()
    challenge = re.search(r'data-challenge="([^"]+)"', text)
    difficulty = re.search(r'data-difficulty="(\d+)"', text)
    assert challenge and difficulty, text[:300]
    return challenge.group(1), int(difficulty.group(1))


def post_solution(client: Client, challenge: str, nonce: str) -> Reply:
    return client.request("/.sluice/challenge", method="POST",
                          headers={"Content-Type": "application/x-www-form-urlencoded"},
                          body=urlencode({"challenge": challenge, "nonce": nonce}).encode())


def pass_challenge(client: Client, path: str) -> str:
    """Trip the rule, solve the page's challenge; the credential cookie ("name=value")."""
    challenge, difficulty = challenge_of(trip(client, path))
    answer = post_solution(client, challenge, solve(challenge, difficulty))
    assert answer.status == 303, answer.body[:300]
    assert answer.headers["Location"] == path
    cookie = answer.headers["Set-Cookie"]
    assert cookie.startswith("sluice_pass_challenge=")
    assert {"HttpOnly", "SameSite=Lax", "Path=/", "Max-Age=1800"} <= set(cookie.split("; ")[1:])
    return cookie.split(";")[0]


def test_challenge_page_carries_the_over_limit_headers_and_a_signed_challenge(
        new_client: Callable[..., Client]) -> None:
    client = new_client()
    page = trip(client, unique_path("/challenge/"))
    headers = page.headers
    assert (headers["X-RateLimit"], headers["X-RateLimit-Limit"], headers["X-RateLimit-Reset"]) == \
        ("true", "2", "3600")
    assert int(headers["Retry-After"]) > 3500
    assert headers["Cache-Control"] == "no-store"
    assert headers["X-Request-Id"]
    assert headers["Content-Type"].startswith("text/html")
    challenge, difficulty = challenge_of(page)
    assert difficulty == 4 and "." in challenge
    assert b'action="/.sluice/challenge"' in page.body and b"crypto.subtle" in page.body


def test_solving_the_challenge_sets_a_credential_that_passes_the_rule(
        new_client: Callable[..., Client], limits_stack: Stack) -> None:
    passed_before = sluice_metric(limits_stack, "sluice_challenges_solved_total")
    client = new_client()
    path = unique_path("/challenge/") + "?item=1"
    cookie = pass_challenge(client, path)
    for _ in range(5):
        reply = client.request(path, headers={**HTML, "Cookie": f"theme=dark; {cookie}"})
        assert reply.status == 200 and reply.echo()["path"] == path.partition("?")[0]
        assert "X-RateLimit" not in reply.headers
    assert sluice_metric(limits_stack, "sluice_challenges_solved_total") >= passed_before + 1


def test_a_forged_credential_does_not_pass(new_client: Callable[..., Client]) -> None:
    client = new_client()
    path = unique_path("/challenge/")
    cookie = pass_challenge(client, path)
    name, _, value = cookie.partition("=")
    expires, _, signature = value.partition(".")
    for forged in (f"{name}={int(expires) + 86400}.{signature}", f"{name}={expires}.{'A' * len(signature)}"):
        assert client.request(path, headers={**HTML, "Cookie": forged}).status == 403


def test_a_credential_from_another_address_does_not_pass(new_client: Callable[..., Client]) -> None:
    path = unique_path("/challenge/")
    cookie = pass_challenge(new_client(), path)
    other = new_client()
    trip(other, path)
    reply = other.request(path, headers={**HTML, "Cookie": cookie})
    assert reply.status == 403 and b"data-challenge" in reply.body


def test_a_solution_from_another_address_or_with_a_wrong_nonce_is_refused(
        new_client: Callable[..., Client]) -> None:
    client = new_client()
    challenge, difficulty = challenge_of(trip(client, unique_path("/challenge/")))
    stolen = post_solution(new_client(), challenge, solve(challenge, difficulty))
    assert stolen.status == 403 and "Set-Cookie" not in stolen.headers
    wrong = next(str(n) for n in range(1000) if not solves(challenge, str(n), difficulty))
    refused = post_solution(client, challenge, wrong)
    assert refused.status == 403 and "Set-Cookie" not in refused.headers
    assert b"Verification failed" in refused.body
