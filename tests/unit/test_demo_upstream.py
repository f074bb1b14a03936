"""The demo upstream's ``?sleep=S`` and ``?stream=S``: seconds from 0 to 10,
anything else 400."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devstack import demo_upstream
from devstack.demo_upstream import DemoUpstream, parse_sleep

from .test_app import call


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds the upstream waited, without waiting."""
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(demo_upstream.asyncio, "sleep", sleep)
    return waits


@pytest.mark.parametrize("written, seconds", [("0", 0.0), ("2", 2.0), ("0.25", 0.25), ("10", 10.0),
                                              ("1.5", 1.5)])
def test_the_upstream_answers_after_the_seconds_asked(written: str, seconds: float, slept: list[float]) -> None:
    status, _, body = call(DemoUpstream(), f"/export?sleep={written}", {})
    assert status == 200 and json.loads(body)["path"] == "/export"
    assert slept == [seconds]


@pytest.mark.parametrize("name", ["sleep", "stream"])
@pytest.mark.parametrize("written", ["", "-1", "10.5", "11", "nan", "inf", "1e1", "0x1", " 1", "1,5", "٣",
                                     "1." + "0" * 7])
def test_a_bad_wait_is_answered_400_at_once(name: str, written: str, slept: list[float]) -> None:
    status, headers, body = call(DemoUpstream(), f"/x?{name}={written}", {})
    assert status == 400 and name in json.loads(body)["error"]
    assert headers["content-type"] == "application/json" and slept == []


def test_a_streamed_answer_sends_its_echo_at_once_and_ends_its_body_later(slept: list[float]) -> None:
    sent: list[tuple[dict, list[float]]] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append((message, list(slept)))

    scope = {"type": "http", "path": "/x", "method": "GET", "query_string": b"stream=2.5", "headers": []}
    asyncio.run(DemoUpstream()(scope, receive, send))
    (start, _), (first, before), (last, after) = sent
    assert start["status"] == 200 and b"content-length" not in dict(start["headers"])
    assert json.loads(first["body"])["path"] == "/x" and first["more_body"] and before == []
    assert last["body"] == b"" and not last.get("more_body") and after == [2.5]


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=12), st.floats(allow_nan=True).map(repr),
                 st.decimals(allow_nan=False, allow_infinity=False, places=3).map(str)))
def test_any_sleep_value_is_seconds_from_0_to_10_or_refused(text: str) -> None:
    seconds = parse_sleep(text)
    if seconds is not None:
        assert math.isfinite(seconds) and 0 <= seconds <= 10
        assert seconds == float(text)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000))
def test_every_whole_millisecond_up_to_ten_seconds_is_accepted(ms: int) -> None:
    assert parse_sleep(f"{ms // 1000}.{ms % 1000:03d}") == ms / 1000
