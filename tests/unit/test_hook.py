"""Bad response reports (D5): refused cheaply, counted as refused, logged at
most once per interval, never a traceback or an internal error."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from sidecar import hook
from sidecar.hook import HookDatagrams, datagram_report, report_from_headers
from sidecar.ratelog import RateLimitedLog

from .conftest import FakeClock, Harness

RULES = """
rules:
  - id: login
    match: {path: {equals: /api/login}}
    key: [ip]
    limit: {requests: 5, per: 60s}
    count_on: {status: [401]}
    action: block
  - id: heavy
    match: {path: {equals: /api/login}}
    key: [ip]
    limit: {score: 400, per: 60s, header: x-score}
    action: block
"""

PREFIX = b"<190>Nov 30 04:53:59 sluice: "

BAD_DATAGRAMS = [
    b'{"token":"x","status":Infinity}',
    b'{"token":"x","status":-Infinity}',
    b'{"token":"x","status":NaN}',
    b'{"token":"x","status":1e400}',
    b'{"token":' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"token":"x","status":401,"headers":' + b'{"a":' * 5000 + b'"b"' + b"}" * 5001,
    b'{"token":"x","status":1' + b"0" * 4000 + b"}",
    b'{"token":"x","status":401.0}',
    b'{"token":"x","status":true}',
    b'{"token":"x","status":"4_01"}',
    b'{"token":"x","status":"\xd9\xa4\xd9\xa0\xd9\xa1"}',  # Arabic-Indic digits
    b'{"token":"x","status":401,"headers":{"x-score":{"nested":"1"}}}',
    b'{"token":"x","status":401,"headers":{"x-score":7}}',
    b'{"token":"x","status":401,"headers":["x-score"]}',
    b'{"token":"\xff","status":401}',
    b'{"token":"x","status":401,"pad":"' + b"a" * 20_000 + b'"}',
]


@pytest.fixture
def quiet_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The refusal log on a clock of the test's own."""
    clock = FakeClock()
    monkeypatch.setattr(hook, "refused_log", RateLimitedLog(logging.getLogger("sluice"), 60.0, clock),
                        raising=False)
    return clock


def sluice_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("sluice")]


@pytest.mark.parametrize("payload", BAD_DATAGRAMS, ids=lambda p: p[:40].decode("latin-1"))
def test_a_bad_datagram_is_refused_not_an_internal_error(payload, caplog, quiet_clock):
    h = Harness(RULES)
    with caplog.at_level(logging.DEBUG, logger="sluice"):
        HookDatagrams(h.engine).datagram_received(PREFIX + payload, ("127.0.0.1", 5140))
    metrics = h.engine.metrics
    assert (metrics.reports_refused.value, metrics.errors.value, metrics.reports.value) == (1, 0, 0)
    records = sluice_records(caplog)
    assert [r.levelno for r in records] == [logging.WARNING]
    assert not records[0].exc_info and "Traceback" not in caplog.text


def test_bad_datagrams_are_logged_once_per_minute_with_a_count(caplog, quiet_clock):
    h = Harness(RULES)
    receiver = HookDatagrams(h.engine)
    with caplog.at_level(logging.DEBUG, logger="sluice"):
        for _ in range(100):
            receiver.datagram_received(PREFIX + BAD_DATAGRAMS[0], ("127.0.0.1", 5140))
        assert len(sluice_records(caplog)) == 1
        quiet_clock.advance(60)
        receiver.datagram_received(PREFIX + BAD_DATAGRAMS[4], ("127.0.0.1", 5140))
    records = sluice_records(caplog)
    assert len(records) == 2 and "(99 more since the last report)" in records[1].getMessage()
    assert h.engine.metrics.reports_refused.value == 101
    assert h.engine.metrics.errors.value == 0


def test_deep_nesting_is_refused_before_the_parser_sees_it(monkeypatch, quiet_clock):
    h = Harness(RULES)
    parsed = []
    loads = json.loads
    monkeypatch.setattr(hook.json, "loads", lambda *a, **k: parsed.append(a) or loads(*a, **k))
    assert datagram_report(h.engine, PREFIX + BAD_DATAGRAMS[4]) is None
    assert datagram_report(h.engine, PREFIX + b'{"token":"x","status":401,"pad":"' + b"a" * 20_000 + b'"}') is None
    assert parsed == []
    # An ordinary report is parsed.
    assert datagram_report(h.engine, PREFIX + b'{"token":"x","status":"401","headers":{"X-Score":"5",'
                                                b'"x-empty":""}}') == ("x", 401, {"x-score": "5"})
    assert len(parsed) == 1


def test_good_reports_still_count_with_integer_or_text_status(quiet_clock):
    h = Harness(RULES)
    receiver = HookDatagrams(h.engine)
    for status in ('401', '"401"', '" 401"'):
        token = h.decide_now(path="/api/login").pending
        receiver.datagram_received(PREFIX + f'{{"token":"{token}","status":{status},'
                                            f'"headers":{{"x-score":"100"}}}}'.encode(), ("127.0.0.1", 1))
    assert h.engine.metrics.reports.value == 3
    assert h.engine.metrics.hits_of("login") == 3 and h.engine.metrics.hits_of("heavy") == 3


@pytest.mark.parametrize("status", ["+401", "4_01", "401.0", "1e3", "\u0664\u0660\u0661", "9" * 5000, "", "600",
                                    "099", "Infinity"])
def test_http_hook_refuses_a_status_that_is_not_three_digits(status, caplog, quiet_clock):
    h = Harness(RULES)
    token = h.decide_now(path="/api/login").pending
    with caplog.at_level(logging.DEBUG, logger="sluice"):
        counted = asyncio.run(report_from_headers(h.engine, {"x-sluice-pending": token, "x-sluice-status": status}))
    assert counted == 0
    assert (h.engine.metrics.reports_refused.value, h.engine.metrics.reports.value) == (1, 0)
    assert all(not r.exc_info and r.levelno < logging.ERROR for r in sluice_records(caplog))


def test_http_hook_refuses_too_many_response_headers(quiet_clock):
    h = Harness(RULES)
    token = h.decide_now(path="/api/login").pending
    headers = {"x-sluice-pending": token, "x-sluice-status": "401",
               **{f"x-sluice-response-h{i}": "v" for i in range(hook.MAX_REPORT_HEADERS + 1)}}
    assert asyncio.run(report_from_headers(h.engine, headers)) == 0
    assert h.engine.metrics.reports_refused.value == 1


def test_a_failure_inside_sluice_is_still_an_internal_error_logged_with_its_traceback(caplog, monkeypatch):
    """Bad input is refused quietly; a bug is not hidden by that."""
    h = Harness(RULES)
    monkeypatch.setattr(hook, "failed_log", RateLimitedLog(logging.getLogger("sluice"), 10.0, FakeClock()),
                        raising=False)

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(h.engine, "record_response", broken)
    token = h.decide_now(path="/api/login").pending
    with caplog.at_level(logging.DEBUG, logger="sluice"):
        for _ in range(3):
            HookDatagrams(h.engine).datagram_received(PREFIX + json.dumps({"token": token, "status": 401})
                                                      .encode(), ("127.0.0.1", 1))
    assert h.engine.metrics.errors.value == 3
    [record] = sluice_records(caplog)  # once per interval
    assert record.levelno == logging.ERROR and record.exc_info
