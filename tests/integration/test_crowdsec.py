"""CrowdSec, both ways, against a real CrowdSec Local API (tests/crowdsec.py:
Debian's crowdsec package, started on loopback with a configuration of
its own) and the stack's real nginx and Envoy.

The decisions are made with ``cscli`` as an administrator would; Sluice
polls the stream every second, so each test waits (with a deadline) for
the next poll to be seen. One LAPI and one stack serve the module; the
test that stops the LAPI starts it again.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from urllib.parse import urlencode

import pytest

from devstack.launcher import Stack
from sidecar.challenge import solve
from tests.crowdsec import LocalApi
from tests.integration.clients import CONNECTION_CLOSED, Client, closed
from tests.integration.conftest import (
    fresh_client_address,
    front_door_port,
    sluice_metric,
    stack_on,
    unique_path,
    wait_until,
)

pytestmark = pytest.mark.integration

PASSWORD = "sluice-test-machine-password"
# The stream is polled every second: a change is seen within two.
SEEN_WITHIN = 10.0
RULES = """
challenge: {{difficulty: 4}}
crowdsec:
  url: "{url}"
  key_file: bouncer.key
  poll: 1s
  timeout: 1s
  push_bans: {{machine_id: sluice-test, password_file: machine.password}}
rules:
  - id: cs-login
    match: {{path: {{prefix: /cs-login/}}}}
    key: [ip]
    limit: {{requests: 1, per: 1h}}
    action: ban
    ban: {{duration: 10m}}
"""
HTML = {"Accept": "text/html"}
DOORS = ["nginx", "envoy"]
# Networks of their own for the range decisions: no other test sends from them.
_networks = itertools.count(1)


@pytest.fixture(scope="module")
def lapi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalApi]:
    api = LocalApi(tmp_path_factory.mktemp("crowdsec"))
    try:
        api.add_machine("sluice-test", PASSWORD)
        yield api
    finally:
        api.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, lapi: LocalApi) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("crowdsec-stack")
    (directory / "bouncer.key").write_text(lapi.bouncer_key("sluice-test") + "\n")
    (directory / "machine.password").write_text(PASSWORD + "\n")
    with stack_on(directory, RULES.format(url=lapi.url)) as started:
        wait_until(lambda: polls(started) >= 1, "Sluice read the decision stream", SEEN_WITHIN)
        yield started


def polls(stack: Stack, result: str = "succeeded") -> float:
    return sluice_metric(stack, "sluice_crowdsec_polls_total", f'result="{result}"')


@pytest.mark.parametrize("front_door", DOORS)
def test_an_address_banned_in_crowdsec_is_closed_and_a_range_ban_covers_its_addresses(
        stack: Stack, lapi: LocalApi, front_door: str) -> None:
    port = front_door_port(stack, front_door)
    banned, bystander = Client(port, fresh_client_address()), Client(port, fresh_client_address())
    network = f"127.8.{next(_networks)}.0/30"
    inside, outside = Client(port, network.replace(".0/30", ".2")), Client(port, network.replace(".0/30", ".5"))
    assert banned.request("/").status == 200 and inside.request("/").status == 200

    lapi.add_decision(banned.source)
    lapi.add_decision(network, duration="30m")

    wait_until(lambda: closed(banned, front_door), "the ban applied", SEEN_WITHIN)
    wait_until(lambda: closed(inside, front_door), "the range ban applied", SEEN_WITHIN)
    assert bystander.request("/").status == 200 and outside.request("/").status == 200
    assert sluice_metric(stack, "sluice_crowdsec_requests_total", 'decision="ban"') >= 2
    assert sluice_metric(stack, "sluice_crowdsec_decisions", 'type="ban"') >= 2


@pytest.mark.parametrize("front_door", DOORS)
def test_a_captcha_decision_gets_the_challenge_and_solving_it_lets_the_client_in(
        stack: Stack, lapi: LocalApi, front_door: str) -> None:
    client = Client(front_door_port(stack, front_door), fresh_client_address())
    path = unique_path("/captcha/")
    lapi.add_decision(client.source, "captcha")

    wait_until(lambda: client.request(path, headers=HTML).status == 403, "the captcha applied", SEEN_WITHIN)
    page = client.request(path, headers=HTML)
    text = page.body.decode()
    challenge = re.search(r'data-challenge="([^"]+)"', text)
    difficulty = re.search(r'data-difficulty="(\d+)"', text)
    assert challenge and difficulty, text[:300]
    answer = client.request("/.sluice/challenge", method="POST",
                            headers={"Content-Type": "application/x-www-form-urlencoded"},
                            body=urlencode({"challenge": challenge.group(1),
                                            "nonce": solve(challenge.group(1), int(difficulty.group(1)))}).encode())

    assert answer.status == 303, answer.body[:300]
    assert answer.headers["Location"] == path
    cookie = answer.headers["Set-Cookie"].split(";")[0]
    assert cookie.startswith("sluice_pass_crowdsec=")
    assert client.request(path, headers={**HTML, "Cookie": cookie}).status == 200
    assert client.request(path, headers=HTML).status == 403  # without the credential, challenged again


@pytest.mark.parametrize("front_door", DOORS)
def test_a_decision_deleted_in_crowdsec_lets_the_client_in_after_the_next_poll(
        stack: Stack, lapi: LocalApi, front_door: str) -> None:
    client = Client(front_door_port(stack, front_door), fresh_client_address())
    lapi.add_decision(client.source)
    wait_until(lambda: closed(client, front_door), "the ban applied", SEEN_WITHIN)

    lapi.delete_decisions(client.source)

    wait_until(lambda: not closed(client, front_door), "the deletion applied", SEEN_WITHIN)
    assert client.request("/").status == 200


def test_sluices_own_ban_is_sent_as_an_alert_that_crowdsec_holds(stack: Stack, lapi: LocalApi) -> None:
    client = Client(stack.ports.nginx, fresh_client_address())
    path = unique_path("/cs-login/")
    assert client.request(path).status == 200
    with pytest.raises(CONNECTION_CLOSED):
        client.request(path)  # over the limit: banned by the rule

    def held() -> list[dict[str, object]]:
        return [decision for alert in lapi.decisions() for decision in alert.get("decisions") or []
                if decision.get("value") == client.source]

    wait_until(lambda: bool(held()), "the ban in CrowdSec's decisions", SEEN_WITHIN)
    decision = held()[0]
    assert decision["type"] == "ban" and decision["scope"] == "Ip" and decision["origin"] == "sluice"
    assert re.fullmatch(r"sluice/[^/]+/cs-login", str(decision["scenario"]))
    alerts = [alert for alert in lapi.alerts() if alert.get("source", {}).get("value") == client.source]
    assert alerts and "rule cs-login banned" in alerts[0]["message"], json.dumps(alerts)[:500]
    assert sluice_metric(stack, "sluice_crowdsec_alerts_total", 'result="sent"') >= 1
    # Read back in the stream, the node's own ban is not applied twice.
    wait_until(lambda: sluice_metric(stack, "sluice_crowdsec_decisions_ignored_total", 'reason="own"') >= 1,
               "the node's own ban read back and ignored", SEEN_WITHIN)


def test_while_the_lapi_is_down_the_last_decisions_stay_and_checks_are_answered(
        stack: Stack, lapi: LocalApi) -> None:
    port = front_door_port(stack, "nginx")
    banned = Client(port, fresh_client_address())
    lapi.add_decision(banned.source)
    wait_until(lambda: closed(banned, "nginx"), "the ban applied", SEEN_WITHIN)
    failed = polls(stack, "failed")

    lapi.stop()
    try:
        wait_until(lambda: polls(stack, "failed") >= failed + 2, "two polls failed", SEEN_WITHIN)
        assert closed(banned, "nginx") and closed(Client(front_door_port(stack, "envoy"), banned.source), "envoy")
        for front_door in DOORS:
            assert Client(front_door_port(stack, front_door), fresh_client_address()).request("/").status == 200
    finally:
        lapi.start()
    succeeded = polls(stack)
    wait_until(lambda: polls(stack) >= succeeded + 1, "a poll succeeded again", SEEN_WITHIN)
    assert closed(banned, "nginx")  # the whole list, read again, still has it
