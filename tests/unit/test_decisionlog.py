"""The decision log keeps what an operator may keep: counting-key values as
keyed hashes by default, the request's method, host, path and user agent,
an ISO-8601 UTC time, and audit lines for admin actions."""

from __future__ import annotations

import json
import logging
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.admin import Admin
from sidecar.decisionlog import RepeatFold, iso_time, log_hash_key, logged_key
from sidecar.engine import ALLOW, DENY
from tests.unit.conftest import Harness

RULES = """
rules:
  - id: api
    key: [ip, "header:x-api-key", "session:sid"]
    limit: {requests: 1, per: 60s}
    action: block
"""


def lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [json.loads(record.getMessage()) for record in caplog.records if record.name == "sluice.decisions"]


def refused_line(caplog: pytest.LogCaptureFixture, keys: str | None, secret: bytes | None = None,
                 api_key: str = "secret-api-key-123", cookie: str | None = None) -> dict:
    text = RULES if keys is None else f"decision_log: {{keys: {keys}}}\n" + RULES
    h = Harness(text)
    if secret is not None:
        h.engine._secret = secret
    caplog.set_level(logging.INFO, logger="sluice.decisions")
    headers = {"x-api-key": api_key, "user-agent": "curl/8.5"}
    if cookie is not None:
        headers["cookie"] = f"sid={cookie}"
    assert h.outcomes(2, headers=headers, path="/api/items?token=hunter2") == [ALLOW, DENY]
    return lines(caplog)[-1]


def test_by_default_key_values_are_hashed_and_the_address_stays_readable(caplog) -> None:
    entry = refused_line(caplog, None, cookie="session-of-alice")
    assert "secret-api-key-123" not in json.dumps(entry) and "session-of-alice" not in json.dumps(entry)
    assert re.fullmatch(r"header:x-api-key=#[0-9a-f]{12} ip=192\.0\.2\.1 session:sid=#[0-9a-f]{12}",
                        entry["key"]), entry["key"]
    assert entry["client"] == "192.0.2.1"


def test_a_hash_is_stable_per_value_and_secret_and_differs_between_values(caplog) -> None:
    one = refused_line(caplog, "hash", secret=b"s" * 32)["key"]
    caplog.clear()
    again = refused_line(caplog, "hash", secret=b"s" * 32)["key"]
    caplog.clear()
    other_value = refused_line(caplog, "hash", secret=b"s" * 32, api_key="another")["key"]
    caplog.clear()
    other_secret = refused_line(caplog, "hash", secret=b"t" * 32)["key"]
    assert one == again and one != other_value and one != other_secret


def test_clear_shows_values_and_omit_names_only_the_dimensions(caplog) -> None:
    assert refused_line(caplog, "clear")["key"] == "header:x-api-key=secret-api-key-123 ip=192.0.2.1 " \
        "session:sid=('ip', '192.0.2.1')"
    caplog.clear()
    # The session fallback is the address: shown in every mode.
    assert refused_line(caplog, "omit")["key"] == "header:x-api-key ip=192.0.2.1 session:sid=('ip', '192.0.2.1')"


def test_a_line_has_the_request_and_an_iso_time_but_never_the_query(caplog) -> None:
    entry = refused_line(caplog, None)
    assert (entry["method"], entry["host"], entry["path"], entry["user_agent"]) == \
        ("GET", "example.com", "/api/items", "curl/8.5")
    assert "hunter2" not in json.dumps(entry)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["time"])
    assert iso_time(entry["ts"])[:19] == entry["time"][:19]


def test_a_bad_setting_is_an_error_at_its_field() -> None:
    from tests.unit.test_config import issues_of
    issues = issues_of("decision_log: {keys: maybe}\nrules: []\n")
    assert [(issue.line, issue.field) for issue in issues] == [(1, "decision_log.keys")]


@settings(max_examples=200)
@given(st.text(max_size=300), st.sampled_from(["hash", "omit"]))
def test_no_value_ever_shows_in_hash_or_omit_mode(value: str, keys: str) -> None:
    if len(value) < 4:
        value = value + "-secret-value"
    key = (("r", ("cookie:c", "header:h")), value, "x" + value)
    shown = logged_key(key, keys, log_hash_key(b"k" * 32))  # type: ignore[arg-type]
    # The dimensions' names are shown (with "=" and a hash, or alone when
    # omitted): a value that is part of them ("head", "cook") proves nothing.
    assert value not in re.sub(r"(cookie:c|header:h)=?", " ", shown) and len(shown) <= 257


def test_admin_actions_write_audit_lines(caplog, tmp_path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    h = Harness(RULES)
    admin = Admin(h.engine, str(rules), token=b"t" * 32)
    caplog.set_level(logging.INFO, logger="sluice.decisions")
    assert admin.reload(admin.caller) == []
    rules.write_text("rules: [\n")
    assert admin.reload() != []
    import asyncio
    assert asyncio.run(admin.lift_ban("192.0.2.9", admin.caller)) is False
    audit = [(e["audit"], e["who"], e["result"]) for e in lines(caplog) if "audit" in e]
    assert audit == [("reload", "token", "reloaded"), ("reload", "signal", "refused"),
                     ("unban", "token", "no ban")]


FLOOD = """
rules:
  - id: per-ip
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
"""


def test_a_flood_of_one_keys_refusals_is_one_line_a_second_counting_the_folded_ones(caplog) -> None:
    caplog.set_level(logging.INFO, logger="sluice.decisions")
    h = Harness(FLOOD)
    assert h.outcomes(1 + 50) == [ALLOW] + [DENY] * 50
    h.decide_now(ip="198.51.100.7")
    h.decide_now(ip="198.51.100.7")  # another key is not folded into the first one's
    assert [(line["client"], line.get("repeated")) for line in lines(caplog)] == \
        [("192.0.2.1", None), ("198.51.100.7", None)]
    h.clock.advance(1)
    h.decide_now()
    assert lines(caplog)[-1]["client"] == "192.0.2.1" and lines(caplog)[-1]["repeated"] == 49
    assert h.engine.metrics.over_limit_of("per-ip") == {"block": 52}


def test_the_fold_forgets_the_oldest_keys_beyond_its_capacity() -> None:
    fold = RepeatFold(capacity=2)
    assert [fold.admit(key, 0.0) for key in ("a", "b", "c")] == [0, 0, 0]
    assert fold.admit("a", 0.5) == 0  # forgotten: written again
    assert fold.admit("c", 0.5) is None
