"""Reload and the admin API."""

from pathlib import Path

import pytest

from sidecar.admin import Admin, read_token
from sidecar.app import SluiceApp
from sidecar.engine import ALLOW, CLOSE, DENY
from sidecar.rules import load_ruleset

from .conftest import Harness
from .test_app import call

RULES = """
rules:
  - id: api
    match: {path: {prefix: /api/}}
    key: [ip]
    limit: {requests: 2, per: 1h}
    action: block
  - id: scrapers
    match: {path: {prefix: /scrape/}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: ban
    ban: {duration: 10m}
"""

TOKEN = b"a-long-enough-admin-token"


@pytest.fixture
def rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    return path


@pytest.fixture
def harness(rules_file: Path) -> Harness:
    h = Harness(RULES)
    h.engine.ruleset = load_ruleset(str(rules_file))
    return h


def admin_app(h: Harness, rules_file: Path, token=TOKEN, loopback_listener=False):
    admin = Admin(h.engine, str(rules_file), token, loopback_listener)
    return admin, SluiceApp(h.engine, admin=admin)


def bearer(token=TOKEN):
    return {"Authorization": f"Bearer {token.decode()}"}


def test_reload_replaces_rules_and_keeps_counters(harness, rules_file):
    admin, _ = admin_app(harness, rules_file)
    assert harness.decide_now(path="/api/x").outcome == ALLOW
    rules_file.write_text(RULES.replace("requests: 2", "requests: 3"))
    assert admin.reload() == []
    # The same rule id and dimensions: the request counted before still counts.
    assert [harness.decide_now(path="/api/x").outcome for _ in range(3)] == [ALLOW, ALLOW, DENY]
    assert harness.engine.ruleset.rules[0].threshold == 3


def test_an_invalid_file_is_refused_and_the_old_rules_keep_running(harness, rules_file):
    admin, _ = admin_app(harness, rules_file)
    rules_file.write_text(RULES.replace("per: 1h", "per: soon", 1))
    errors = admin.reload()
    assert len(errors) == 1 and "rules[0](api).limit.per" in errors[0]
    assert [harness.decide_now(path="/api/x").outcome for _ in range(3)] == [ALLOW, ALLOW, DENY]


@pytest.mark.parametrize("text", ["", "# rules moved elsewhere\n", "node: a\n"])
def test_an_emptied_or_truncated_file_is_refused_and_the_rules_keep_running(harness, rules_file, text):
    admin, _ = admin_app(harness, rules_file)
    rules_file.write_text(text)
    errors = admin.reload()
    assert len(errors) == 1 and ": rules: " in errors[0]
    assert len(harness.engine.ruleset.rules) == 2
    assert [harness.decide_now(path="/api/x").outcome for _ in range(3)] == [ALLOW, ALLOW, DENY]


def test_a_deliberate_empty_rules_list_reloads_with_a_warning(harness, rules_file, caplog):
    admin, _ = admin_app(harness, rules_file)
    rules_file.write_text("rules: []\n")
    assert admin.reload() == []
    assert harness.engine.ruleset.rules == ()
    assert any("no rules" in record.getMessage() and record.levelname == "WARNING" for record in caplog.records)


def test_admin_api_needs_the_bearer_token(harness, rules_file):
    """RFC 6750: a missing or wrong token is a 401 that names the scheme."""
    _, app = admin_app(harness, rules_file)
    missing = call(app, "/v1/admin/rules", {})
    assert missing[0] == 401 and missing[1]["www-authenticate"] == 'Bearer realm="sluice"'
    wrong = call(app, "/v1/admin/rules", bearer(b"a-wrong-admin-token-of-length"))
    assert wrong[0] == 401
    assert wrong[1]["www-authenticate"] == 'Bearer realm="sluice", error="invalid_token"'
    assert call(app, "/v1/admin/rules", {"Authorization": TOKEN.decode()})[0] == 401
    assert call(app, "/v1/admin/rules", bearer())[0] == 200


def test_without_a_token_only_loopback_peers_of_a_loopback_listener(harness, rules_file):
    _, app = admin_app(harness, rules_file, token=None, loopback_listener=True)
    assert call(app, "/v1/admin/rules", {}, client=("127.0.0.1", 4000))[0] == 200
    assert call(app, "/v1/admin/rules", {}, client=("::1", 4000))[0] == 200
    assert call(app, "/v1/admin/rules", {}, client=("192.0.2.8", 4000))[0] == 403
    _, public = admin_app(harness, rules_file, token=None, loopback_listener=False)
    assert call(public, "/v1/admin/rules", {}, client=("127.0.0.1", 4000))[0] == 403


def test_rules_are_listed_with_their_statistics(harness, rules_file):
    _, app = admin_app(harness, rules_file)
    for _ in range(3):
        harness.decide_now(path="/api/x")
    status, _, body = call(app, "/v1/admin/rules", bearer())
    import json
    listing = {rule["id"]: rule for rule in json.loads(body)}
    assert listing["api"]["hits"] == 2
    assert listing["api"]["over_limit"] == {"block": 1}
    assert listing["scrapers"]["action"] == "ban"


def test_bans_are_listed_and_can_be_lifted(harness, rules_file):
    import json
    _, app = admin_app(harness, rules_file)
    assert [harness.decide_now(ip="203.0.113.9", path="/scrape/a").outcome for _ in range(2)] == [ALLOW, CLOSE]
    status, _, body = call(app, "/v1/admin/bans", bearer())
    [ban] = json.loads(body)
    assert (ban["address"], ban["rule"], ban["duration_seconds"]) == ("203.0.113.9", "scrapers", 600)
    assert 0 < ban["remaining_seconds"] <= 600
    assert harness.decide_now(ip="203.0.113.9", path="/elsewhere").outcome == CLOSE
    assert call(app, "/v1/admin/bans?address=203.0.113.9", bearer(), method="DELETE")[0] == 204
    assert harness.decide_now(ip="203.0.113.9", path="/elsewhere").outcome == ALLOW
    assert call(app, "/v1/admin/bans?address=203.0.113.9", bearer(), method="DELETE")[0] == 404


def test_reload_over_http_reports_errors(harness, rules_file):
    import json
    _, app = admin_app(harness, rules_file)
    rules_file.write_text("rules: [{id: x}]\n")
    status, _, body = call(app, "/v1/admin/reload", bearer(), method="POST")
    assert status == 422 and json.loads(body)["reloaded"] is False
    rules_file.write_text(RULES)
    status, _, body = call(app, "/v1/admin/reload", bearer(), method="POST")
    assert (status, json.loads(body)) == (200, {"reloaded": True, "rules": 2})


def test_short_tokens_are_refused(tmp_path):
    (tmp_path / "t").write_text("short\n")
    with pytest.raises(ValueError):
        read_token(str(tmp_path / "t"))
    (tmp_path / "t").write_text(TOKEN.decode() + "\n")
    assert read_token(str(tmp_path / "t")) == TOKEN
