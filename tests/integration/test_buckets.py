"""Token and leaky buckets as clients of nginx and Envoy see them.

Rules: rules/buckets.yaml, in a stack shared with test_leaky_vs_nginx.py,
and rules/held_disconnect.yaml (one place in the wait queue) in a stack of
its own. Every test sends from addresses of its own and runs once through
each front door.

Latencies are real clocks, so they are compared with the slots the bucket
gives with some slack; waiting for a refill is a bounded poll, never a sleep
taken for proof.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from devstack.launcher import Stack
from tests.integration.clients import LOOPBACK, Client, TimedReply, send_at_once
from tests.integration.conftest import (
    RULES,
    fresh_client_address,
    front_door_port,
    sluice_metric,
    start_stack,
    unique_path,
    wait_until,
)

pytestmark = pytest.mark.integration

# How far a client-observed latency may be from its slot: the trips through
# the front door to Sluice and to the application, and thread scheduling.
SLACK_SECONDS = 0.06
# A bucket frees a token or a place within a second in these tests; this
# long only on a machine that is badly overloaded.
DEADLINE_SECONDS = 3.0
# A leaky bucket's first held request waits this long (rate 5r/s); one
# answered at once comes before it, by at least the margin.
FIRST_SLOT_SECONDS = 0.2
AT_ONCE_MARGIN_SECONDS = 0.02
# Between two tries of a request that was refused. Refused requests take
# nothing from a bucket, so trying again changes nothing.
RETRY_INTERVAL_SECONDS = 0.02


def client_of(stack: Stack, front_door: str) -> Client:
    return Client(front_door_port(stack, front_door), fresh_client_address())


def burst(client: Client, prefix: str, count: int) -> list[TimedReply]:
    """`count` requests of one client at once, each on a connection of its own."""
    return send_at_once([(client, unique_path(prefix)) for _ in range(count)], at=time.monotonic() + 0.05)


def assert_near_slots(latencies: list[float], slots: list[float]) -> None:
    assert len(latencies) == len(slots)
    assert all(abs(latency - slot) <= SLACK_SECONDS for latency, slot in zip(latencies, slots)), \
        f"latencies {[round(latency, 3) for latency in latencies]}, slots {slots}"


def first_admission(client: Client, path: str) -> float:
    """Sends `path` until it is admitted; the monotonic time of that answer."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        reply = client.request(path)
        if reply.status == 200:
            return time.monotonic()
        assert reply.status == 429
        time.sleep(RETRY_INTERVAL_SECONDS)
    pytest.fail(f"{path} still refused after {DEADLINE_SECONDS} s")


def test_token_bucket_admits_three_at_once_refuses_the_fourth_and_refills_after_half_a_second(
    buckets_stack: Stack, front_door: str
) -> None:
    # The seeds' example: capacity 3, refill 2/s, key [ip, path].
    client = client_of(buckets_stack, front_door)
    path = unique_path("/tokens/")

    assert [client.request(path).status for _ in range(3)] == [200, 200, 200]
    refused = client.request(path)
    refused_at = time.monotonic()

    assert refused.status == 429
    assert refused.headers["X-RateLimit-Limit"] == "3"
    assert int(refused.headers["Retry-After"]) >= 1
    # The key includes the path: the same address has a full bucket elsewhere.
    assert client.request(unique_path("/tokens/")).status == 200
    # A token is back half a second after the third request, which came a
    # few milliseconds before the refusal.
    assert first_admission(client, path) - refused_at >= 0.4


def test_draft_ratelimit_fields_show_the_remaining_budget_on_allowed_responses(
    buckets_stack: Stack, front_door: str
) -> None:
    client = client_of(buckets_stack, front_door)
    path = unique_path("/tokens/")
    first, second = client.request(path), client.request(path)
    assert first.headers["RateLimit-Policy"] == '"tokens";q=3;w=2'
    # Capacity 3: two tokens left after the first request, then one (a few
    # milliseconds of refill do not add a whole token).
    assert first.headers["RateLimit"] == '"tokens";r=2;t=1'
    assert second.headers["RateLimit"] == '"tokens";r=1;t=1'
    assert "X-RateLimit" not in first.headers


def test_leaky_bucket_holds_requests_within_the_burst_until_their_slot_and_refuses_the_rest(
    buckets_stack: Stack, front_door: str
) -> None:
    # rate 5r/s, burst 7, delay 1: excess 0 and 1 pass at once, excess 2..7
    # are held 0.2 s apart (the last 1.2 s, longer than the front doors'
    # old 1 s timeouts), excess 8 and 9 are refused.
    replies = burst(client_of(buckets_stack, front_door), "/leaky/hold/", 10)

    passed = sorted(reply.seconds for reply in replies if reply.status == 200)
    refused = [reply for reply in replies if reply.status != 200]
    assert len(passed) == 8
    # The held six answer on their slots, which the bucket counts from the
    # burst's first request.
    assert_near_slots(passed[2:], [FIRST_SLOT_SECONDS * slot for slot in range(1, 7)])
    # The other four are answered at once: before the first slot. (Not near
    # zero: a stall of the machine at the burst's start delays them, while
    # the slots stay where the bucket put them.)
    assert [reply.status for reply in refused] == [429, 429]
    answered_at_once = passed[:2] + [reply.seconds for reply in refused]
    assert max(answered_at_once) < FIRST_SLOT_SECONDS - AT_ONCE_MARGIN_SECONDS, \
        f"answered at once after {[round(latency, 3) for latency in answered_at_once]}"
    for reply in refused:
        assert reply.reply.headers["X-RateLimit-Limit"] == "8"
        assert int(reply.reply.headers["Retry-After"]) >= 1


def test_nodelay_admits_the_whole_burst_at_once_and_keeps_its_debt(buckets_stack: Stack, front_door: str) -> None:
    # rate 2r/s, burst 3, nodelay: four pass at once, the rest are refused,
    # and the bucket drains one request per half second.
    client = client_of(buckets_stack, front_door)

    replies = burst(client, "/leaky/nodelay/", 6)

    statuses = sorted(reply.status for reply in replies)
    assert statuses == [200, 200, 200, 200, 429, 429]
    assert_near_slots([reply.seconds for reply in replies], [0.0] * 6)
    assert {reply.reply.headers["X-RateLimit-Limit"] for reply in replies if reply.status == 429} == {"4"}
    # nodelay does not drop the debt: the burst still fills the bucket.
    assert client.request(unique_path("/leaky/nodelay/")).status == 429


# -- a client that goes away while held ------------------------------------


@pytest.fixture(scope="module")
def held_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """rules/held_disconnect.yaml: state.max_delayed 1."""
    stack = start_stack(tmp_path_factory.mktemp("held-stack"), RULES / "held_disconnect.yaml")
    yield stack
    stack.stop()


def delayed_total(stack: Stack) -> float:
    return sluice_metric(stack, "sluice_delayed_total")


def second_request(stack: Stack, front_door: str) -> TimedReply:
    """A new key's second request to /short/: it has to wait 0.2 s, if there
    is a free place in the wait queue."""
    client = client_of(stack, front_door)
    assert client.request(unique_path("/short/")).status == 200
    started = time.monotonic()
    reply = client.request(unique_path("/short/"))
    return TimedReply(reply, time.monotonic() - started)


def test_a_client_that_disconnects_while_held_frees_its_place_in_the_wait_queue(
    held_stack: Stack, front_door: str
) -> None:
    port = front_door_port(held_stack, front_door)
    holder = Client(port, fresh_client_address())
    held_path = unique_path("/long/")
    delayed_before = delayed_total(held_stack)
    assert holder.request(unique_path("/long/")).status == 200

    with socket.create_connection((LOOPBACK, port), timeout=DEADLINE_SECONDS,
                                  source_address=(holder.source, 0)) as held:
        # The key's second request: held 10 s, in the queue's only place.
        held.sendall(f"GET {held_path} HTTP/1.1\r\nHost: {LOOPBACK}:{port}\r\n\r\n".encode())
        wait_until(lambda: delayed_total(held_stack) == delayed_before + 1, "the request held",
                   DEADLINE_SECONDS)
        refused = second_request(held_stack, front_door)
        assert refused.status == 429

    # The holder is gone, 10 s before its slot: its place is free again.
    deadline = time.monotonic() + DEADLINE_SECONDS
    while (waited := second_request(held_stack, front_door)).status != 200 and time.monotonic() < deadline:
        assert waited.status == 429
        time.sleep(RETRY_INTERVAL_SECONDS)
    assert waited.status == 200
    assert waited.seconds >= 0.2 - SLACK_SECONDS
    assert delayed_total(held_stack) == delayed_before + 2
    # The abandoned request never reached the application: this is its first.
    assert Client(held_stack.ports.upstream).request(held_path).echo()["hits"] == 1
