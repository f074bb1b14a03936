"""JA3 and JA4 as keys and conditions: the proxy's x-sluice-ja3 and
x-sluice-ja4 fields (the shipped Envoy filters fill them from the
listener's tls_inspector; the shipped nginx empties them)."""

from __future__ import annotations

from sidecar.engine import Engine
from tests.unit.conftest import FakeClock, refused_by, ruleset_from

RULES = """
rules:
  - id: modern-tls
    match: {ja4: {prefix: t13}}
    key: [ja4]
    limit: {requests: 2, per: 1h}
    action: block
  - id: per-ja3
    key: [ja3]
    limit: {requests: 3, per: 1h}
    action: block
"""
CHROME_LIKE, OLD_STACK = "t13d1516h2_8daaf6152771_b186095e22b6", "t12i020600_6d4732649639_e7e480e5a997"


def test_a_fingerprint_is_counted_whatever_address_it_comes_from() -> None:
    engine = Engine(ruleset_from(RULES), clock=FakeClock())
    rotating = [refused_by(engine, f"203.0.113.{n}", {"x-sluice-ja4": CHROME_LIKE, "x-sluice-ja3": f"ja3-{n}"})
                for n in range(1, 4)]
    assert rotating == ["allow", "allow", "modern-tls"]
    # Another TLS stack: no modern-tls match, its own JA3 count.
    assert [refused_by(engine, "203.0.113.9", {"x-sluice-ja4": OLD_STACK, "x-sluice-ja3": "old"})
            for _ in range(4)] == ["allow"] * 3 + ["per-ja3"]


def test_without_a_fingerprint_the_value_is_empty_and_the_condition_fails() -> None:
    engine = Engine(ruleset_from(RULES), clock=FakeClock())
    assert [refused_by(engine, f"198.51.100.{n}", {}) for n in range(1, 5)] == ["allow"] * 3 + ["per-ja3"]


def test_the_matcher_names_the_fields_and_tests() -> None:
    source = ruleset_from(RULES).match_source.text
    assert "headers.get('x-sluice-ja4', '').startswith(c1)" in source
    assert "modern-tls (line 4): ja4 prefix 't13'" in source


def test_replay_counts_a_logged_fingerprint_whatever_address_it_came_from(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A JSON access log whose http_x_sluice_ja4 field holds the
    listener's JA4 (Envoy: "%TLS_JA4_FINGERPRINT%"): replay counts the
    fingerprint across the rotating addresses."""
    import json

    from sidecar.replay.simulate import replay_logs

    start = 1_709_287_200.0
    lines = [json.dumps({"remote_addr": f"198.51.100.{n}", "msec": f"{start + n:.3f}", "request": "GET / HTTP/1.1",
                         "status": "200", "http_x_sluice_ja4": CHROME_LIKE if n % 2 else OLD_STACK})
             for n in range(1, 9)]
    (tmp_path / "access.log").write_text("\n".join(lines) + "\n")

    report = replay_logs(ruleset_from(RULES), [str(tmp_path / "access.log")])

    modern = next(rule for rule in report["rules"] if rule["id"] == "modern-tls")
    # Four requests of one TLS stack from four addresses: two let in, two refused.
    assert (modern["matched"], modern["allowed"], modern["blocked"]) == (4, 2, 2)
