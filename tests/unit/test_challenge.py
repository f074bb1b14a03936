"""`action: challenge`: proof of work, credentials, the engine's part."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from urllib.parse import urlencode

import pytest

from sidecar.actions import CHALLENGE_PAGE
from sidecar.app import SluiceApp
from sidecar.challenge import (
    CHALLENGE_MAX_AGE,
    Challenges,
    cookie_name,
    leading_zero_bits,
    safe_return_uri,
    solve,
    solves,
)
from sidecar.engine import ALLOW, CLOSE, DENY, Engine
from sidecar.frontdoors.common import render_page
from tests.unit.conftest import FakeClock, Harness, ruleset_from

SECRET = b"test secret"


@pytest.fixture
def wall() -> FakeClock:
    return FakeClock(1_700_000_000.0)


@pytest.fixture
def challenges(wall: FakeClock) -> Challenges:
    return Challenges(SECRET, wall_clock=wall)


# --------------------------------------------------------------------------
# Proof of work
# --------------------------------------------------------------------------


def test_leading_zero_bits_counts_across_bytes() -> None:
    assert leading_zero_bits(b"\x80") == 0
    assert leading_zero_bits(b"\x01") == 7
    assert leading_zero_bits(b"\x00\x10") == 11
    assert leading_zero_bits(b"\x00\x00") == 16


def test_a_solved_challenge_verifies(challenges: Challenges) -> None:
    issued = challenges.issue("pages", "192.0.2.1", "", "/a?b=1", 8)
    nonce = solve(issued.text, 8)
    ticket, problem = challenges.verify(issued.text, nonce, "192.0.2.1", "")
    assert problem == "" and ticket is not None
    assert (ticket.rule_id, ticket.location, ticket.difficulty) == ("pages", "/a?b=1", 8)


def test_a_wrong_nonce_is_refused(challenges: Challenges) -> None:
    issued = challenges.issue("pages", "192.0.2.1", "", "/", 12)
    wrong = next(str(n) for n in range(10_000) if not solves(issued.text, str(n), 12))
    assert challenges.verify(issued.text, wrong, "192.0.2.1", "")[1] == \
        "the nonce does not solve the challenge"
    for junk in ("", "-1", "1e5", "12345678901234567890123"):
        assert challenges.verify(issued.text, junk, "192.0.2.1", "")[1]


def test_a_stale_challenge_is_refused(challenges: Challenges, wall: FakeClock) -> None:
    issued = challenges.issue("pages", "192.0.2.1", "", "/", 4)
    nonce = solve(issued.text, 4)
    wall.advance(CHALLENGE_MAX_AGE + 1)
    assert challenges.verify(issued.text, nonce, "192.0.2.1", "")[1] == "the challenge has expired"


def test_a_forged_or_altered_challenge_is_refused(challenges: Challenges) -> None:
    issued = challenges.issue("pages", "192.0.2.1", "", "/", 4)
    encoded, signature = issued.text.split(".")
    forged = Challenges(b"another secret").issue("pages", "192.0.2.1", "", "/", 1).text
    # The same payload with difficulty 1 instead of 4, under the old signature.
    # The signature altered in its last two characters, to ones it never has there.
    altered = signature[:-2] + ("AA" if signature[-2:] != "AA" else "BB")
    for text in (forged, encoded + "." + altered, encoded + ".", "garbage", ""):
        ticket, problem = challenges.verify(text, solve(text, 1) if text else "1", "192.0.2.1", "")
        assert ticket is None and problem == "not a challenge issued to this client"


def test_a_challenge_is_bound_to_the_client_and_fingerprint(challenges: Challenges) -> None:
    issued = challenges.issue("pages", "192.0.2.1", "ja4-a", "/", 4)
    nonce = solve(issued.text, 4)
    assert challenges.verify(issued.text, nonce, "192.0.2.2", "ja4-a")[0] is None
    assert challenges.verify(issued.text, nonce, "192.0.2.1", "ja4-b")[0] is None
    assert challenges.verify(issued.text, nonce, "192.0.2.1", "ja4-a")[1] == ""


@pytest.mark.parametrize(("uri", "location"), [
    ("/shop?item=1", "/shop?item=1"),
    ("//evil.example/x", "/evil.example/x"),
    ("/\\evil.example", "/evil.example"),
    ("/caf\u00e9", "/caf%C3%A9"),
    ("/p?" + "q" * 2000, "/p"),
    ("/" + "p" * 2000, "/"),
])
def test_the_way_back_stays_on_the_site(uri: str, location: str) -> None:
    assert safe_return_uri(uri) == location


# --------------------------------------------------------------------------
# Credentials
# --------------------------------------------------------------------------


def test_a_credential_passes_its_rule_client_and_fingerprint_until_it_expires(
        challenges: Challenges, wall: FakeClock) -> None:
    credential = challenges.credential("pages", "192.0.2.1", "ja4-a", 3600)
    assert challenges.accepts(credential, "pages", "192.0.2.1", "ja4-a")
    assert not challenges.accepts(credential, "other", "192.0.2.1", "ja4-a")
    assert not challenges.accepts(credential, "pages", "192.0.2.2", "ja4-a")
    assert not challenges.accepts(credential, "pages", "192.0.2.1", "ja4-b")
    wall.advance(3599)
    assert challenges.accepts(credential, "pages", "192.0.2.1", "ja4-a")
    wall.advance(1)
    assert not challenges.accepts(credential, "pages", "192.0.2.1", "ja4-a")


def test_a_forged_or_extended_credential_is_refused(challenges: Challenges, wall: FakeClock) -> None:
    credential = challenges.credential("pages", "192.0.2.1", "", 3600)
    expires, signature = credential.split(".")
    other = Challenges(b"another secret", wall_clock=wall).credential("pages", "192.0.2.1", "", 3600)
    for forged in (other, f"{int(expires) + 86400}.{signature}", expires, f"{expires}.",
                   "x.y", f"{expires}.{signature}\u00e9", ""):
        assert not challenges.accepts(forged, "pages", "192.0.2.1", "")


def test_a_credential_is_not_a_challenge_signature(challenges: Challenges) -> None:
    # Separate keys: the credential key signs nothing the challenge key accepts.
    credential = challenges.credential("pages", "192.0.2.1", "", 3600)
    assert challenges.open(credential, "192.0.2.1", "") is None


# --------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------

RULES = """\
challenge:
  difficulty: 4
  auto_ban: {challenges: 3, per: 60s, ban: 5m}
verified_bots:
  - cidrs: [198.51.100.0/24]
rules:
  - id: pages
    key: [ip]
    limit: {requests: 2, per: 10s}
    action: challenge
    challenge: {ttl: 1h}
  - id: after
    match: {path: {prefix: /after}}
    key: [ip]
    limit: {requests: 1, per: 10s}
    action: block
"""


def solved_cookie(harness: Harness, ip: str = "192.0.2.1", fingerprint: str = "") -> str:
    decision = harness.decide_now(ip=ip, path="/page")
    assert decision.outcome == DENY and decision.challenge is not None
    challenges = harness.engine.challenges
    ticket, problem = challenges.verify(decision.challenge.text, solve(decision.challenge.text, 4), ip, fingerprint)
    assert problem == "" and ticket is not None
    return f"{cookie_name('pages')}={challenges.credential('pages', ip, fingerprint, 3600)}"


def test_a_key_in_penalty_gets_a_challenge_page_with_the_over_limit_headers() -> None:
    harness = Harness(RULES)
    assert harness.outcomes(2, path="/page") == [ALLOW, ALLOW]
    decision = harness.decide_now(path="/page?x=1")
    assert decision.outcome == DENY and decision.page is CHALLENGE_PAGE and decision.page.status == 403
    assert (decision.limit, decision.reset, decision.retry_after) == (2, 10, 10)
    assert decision.challenge is not None and decision.challenge.difficulty == 4
    ticket = harness.engine.challenges.open(decision.challenge.text, "192.0.2.1", "")
    assert ticket is not None and ticket.location == "/page?x=1"
    assert harness.engine.metrics.challenges_issued.value == 1
    body = render_page(decision.page, "192.0.2.1", "example.com", "req-1", decision.challenge).decode()
    assert f'data-challenge="{decision.challenge.text}"' in body and 'data-difficulty="4"' in body
    assert 'action="/.sluice/challenge"' in body and "crypto.subtle" in body


def test_a_valid_credential_passes_the_rule_and_ends_evaluation() -> None:
    harness = Harness(RULES)
    harness.outcomes(2, path="/page")
    cookie = solved_cookie(harness)
    # "after" allows one request per 10 s: it would block the second if it
    # were evaluated; nothing is counted for "pages" either.
    decisions = [harness.decide_now(path="/after", headers={"cookie": f"a=b; {cookie}"}) for _ in range(5)]
    assert [d.outcome for d in decisions] == [ALLOW] * 5 and all(not d.over_limit for d in decisions)
    assert harness.engine.metrics.credentials.value == 5
    assert harness.engine.metrics.hits_of("after") == 0
    assert harness.engine.metrics.hits_of("pages") == 2


def test_a_credential_passes_no_rule_before_its_own_and_is_counted_only_when_it_lets_the_request_in() -> None:
    rules = RULES.replace("rules:\n", "rules:\n  - id: first\n    key: [ip]\n    limit: {requests: 4, per: 10s}\n"
                          "    action: block\n", 1)
    harness = Harness(rules)
    harness.outcomes(2, path="/page")
    cookie = solved_cookie(harness)  # "first" has counted three requests
    decisions = [harness.decide_now(path="/after", headers={"cookie": cookie}) for _ in range(3)]
    assert [d.outcome for d in decisions] == [ALLOW, DENY, DENY]
    assert {d.rule.id for d in decisions[1:] if d.rule is not None} == {"first"}
    assert harness.engine.metrics.credentials.value == 1


def test_a_credential_does_not_pass_from_another_address_nor_when_forged() -> None:
    harness = Harness(RULES)
    harness.outcomes(2, path="/page")
    cookie = solved_cookie(harness)
    harness.outcomes(2, ip="192.0.2.2", path="/page")
    assert harness.decide_now(ip="192.0.2.2", headers={"cookie": cookie}).outcome == DENY
    forged = cookie[:-3] + ("AAA" if not cookie.endswith("AAA") else "BBB")
    assert harness.decide_now(headers={"cookie": forged}).outcome == DENY


def test_a_credential_expires() -> None:
    harness = Harness(RULES)
    harness.engine = Engine(ruleset_from(RULES), clock=harness.clock, wall_clock=harness.clock)
    harness.outcomes(2, path="/page")
    cookie = solved_cookie(harness)
    assert harness.decide_now(headers={"cookie": cookie}).outcome == ALLOW
    harness.clock.advance(3600)
    assert harness.outcomes(3, headers={"cookie": cookie}) == [ALLOW, ALLOW, DENY]


def test_too_many_challenges_ban_the_address() -> None:
    harness = Harness(RULES)
    assert harness.outcomes(2 + 3, path="/page") == [ALLOW, ALLOW, DENY, DENY, DENY]
    decision = harness.decide_now(path="/page")
    assert decision.outcome == CLOSE and decision.rule is not None and decision.rule.id == "pages"
    (ban,) = harness.engine.store.bans_in_force(harness.clock())
    assert (ban.address, ban.rule_id, ban.duration) == ("192.0.2.1", "pages", 300)
    assert harness.decide_now(path="/elsewhere").outcome == CLOSE
    assert harness.engine.metrics.challenges_issued.value == 3
    harness.clock.advance(300)
    assert harness.engine.store.bans_in_force(harness.clock()) == []
    assert harness.decide_now(path="/page").outcome == ALLOW


def test_challenges_older_than_the_auto_ban_period_do_not_count() -> None:
    harness = Harness(RULES)
    assert harness.outcomes(4, path="/page") == [ALLOW, ALLOW, DENY, DENY]
    harness.clock.advance(120)
    assert harness.outcomes(5, path="/page") == [ALLOW, ALLOW, DENY, DENY, DENY]
    assert harness.engine.store.bans_in_force(harness.clock()) == []
    assert harness.decide_now(path="/page").outcome == CLOSE


def test_a_verified_bot_is_challenged_but_never_banned() -> None:
    harness = Harness(RULES)
    outcomes = harness.outcomes(20, ip="198.51.100.7", path="/page")
    assert outcomes == [ALLOW, ALLOW] + [DENY] * 18
    assert harness.engine.store.bans_in_force(harness.clock()) == []


# --------------------------------------------------------------------------
# The solution endpoint
# --------------------------------------------------------------------------


def post_solution(app: SluiceApp, form: dict[str, str], client_addr: str = "192.0.2.1",
                  proto: str = "http") -> tuple[int, dict[str, str], bytes]:
    body = urlencode(form).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/challenge", "raw_path": b"/v1/challenge",
             "query_string": b"", "scheme": "http", "client": ("127.0.0.1", 5000),
             "headers": [(b"x-sluice-client-addr", client_addr.encode()),
                         (b"x-forwarded-proto", proto.encode()),
                         (b"content-type", b"application/x-www-form-urlencoded")]}
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], headers, sent[1]["body"]


def test_the_solution_endpoint_sets_the_credential_and_goes_back() -> None:
    harness = Harness(RULES)
    app = SluiceApp(harness.engine)
    harness.outcomes(2, path="/page")
    challenge = harness.decide_now(path="/page?q=1").challenge
    assert challenge is not None
    form = {"challenge": challenge.text, "nonce": solve(challenge.text, 4)}
    status, headers, _ = post_solution(app, form, proto="https")
    assert status == 303 and headers["location"] == "/page?q=1"
    name, _, rest = headers["set-cookie"].partition("=")
    value, *attributes = rest.split("; ")
    assert name == "sluice_pass_pages"
    assert set(attributes) == {"Max-Age=3600", "Path=/", "HttpOnly", "SameSite=Lax", "Secure"}
    assert harness.decide_now(path="/page", headers={"cookie": f"{name}={value}"}).outcome == ALLOW
    assert harness.engine.metrics.challenges_solved.value == 1
    assert "Secure" not in post_solution(app, form)[1]["set-cookie"]


@pytest.mark.parametrize("change", ["nonce", "address", "forged"])
def test_the_solution_endpoint_refuses_what_does_not_verify(change: str) -> None:
    harness = Harness(RULES)
    app = SluiceApp(harness.engine)
    harness.outcomes(2, path="/page")
    challenge = harness.decide_now(path="/page").challenge
    assert challenge is not None
    text, address = challenge.text, "192.0.2.1"
    nonce = solve(text, 4)
    if change == "nonce":
        nonce = next(str(n) for n in range(1000) if not solves(text, str(n), 4))
    elif change == "address":
        address = "192.0.2.9"
    else:
        text = Challenges(b"guess").issue("pages", address, "", "/", 1).text
        nonce = solve(text, 1)
    status, headers, body = post_solution(app, {"challenge": text, "nonce": nonce}, address)
    assert status == 403 and "set-cookie" not in headers
    assert b"Verification failed" in body
    assert harness.engine.metrics.challenges_refused.value == 1


# --------------------------------------------------------------------------
# The page's JavaScript, run by Node when it is installed
# --------------------------------------------------------------------------

NODE_STUB = """
const posted = {};
const elements = {
  "sluice-challenge": {getAttribute: (name) => ({"data-challenge": CHALLENGE, "data-difficulty": DIFFICULTY})[name]},
  "sluice-form": {elements: {nonce: {}}, submit() { posted.nonce = this.elements.nonce.value;
                  console.log(JSON.stringify(posted)); }},
  "sluice-status": {},
};
globalThis.document = {getElementById: (id) => elements[id]};
globalThis.window = {crypto: SUBTLE ? globalThis.crypto : undefined};
"""


@pytest.mark.parametrize("subtle", [True, False], ids=["crypto.subtle", "javascript-sha256"])
def test_the_page_script_finds_a_nonce_the_server_accepts(challenges: Challenges, subtle: bool) -> None:
    node = shutil.which("node")
    assert node is not None, "node is not installed (make test installs Debian's nodejs)"
    issued = challenges.issue("pages", "192.0.2.1", "", "/", 10)
    page = render_page(CHALLENGE_PAGE, "192.0.2.1", "h", "r", issued).decode()
    script = re.search(r"<script>(.*)</script>", page, re.S).group(1)  # type: ignore[union-attr]
    stub = NODE_STUB.replace("CHALLENGE", repr(issued.text)).replace("DIFFICULTY", '"10"') \
        .replace("SUBTLE", "true" if subtle else "false")
    result = subprocess.run([node, "-e", stub + script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    nonce = re.search(r'"nonce":"(\d+)"', result.stdout).group(1)  # type: ignore[union-attr]
    assert challenges.verify(issued.text, nonce, "192.0.2.1", "") == (challenges.open(issued.text, "192.0.2.1", ""), "")
