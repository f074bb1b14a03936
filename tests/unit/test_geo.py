"""Country and ASN as keys and conditions (sidecar.geo, the geoip: section),
over databases the tests write with mmdb-writer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import geo
from sidecar.config import ConfigError
from sidecar.engine import Engine
from sidecar.geo import GeoDatabase, asn_of, country_of
from sidecar.replay.simulate import replay_logs
from sidecar.request import CheckRequest
from tests.geodb import write_asn_database, write_country_database
from tests.unit.conftest import FakeClock, refused_by, ruleset_from

RULES = """
geoip: {asn: asn.mmdb, country: country.mmdb}
rules:
  - id: not-from-nl
    match: {country: {in: [nl]}}
    key: [ip]
    limit: {requests: 1, per: 1h}
    action: block
  - id: per-network
    key: [asn]
    limit: {requests: 3, per: 1h}
    action: block
"""


@pytest.fixture
def databases(tmp_path: Path) -> Path:
    write_asn_database(tmp_path / "asn.mmdb")
    write_country_database(tmp_path / "country.mmdb")
    return tmp_path


def request_from(engine: Engine, address: str) -> CheckRequest:
    return CheckRequest("GET", "h", "/", {}, engine.resolve_client(address, None), "r")


def test_an_address_gives_its_systems_number_and_its_country(databases: Path) -> None:
    engine = Engine(ruleset_from(RULES, databases), clock=FakeClock())
    asn, country = engine.ruleset.geo["asn"], engine.ruleset.geo["country"]

    for address, expected in (("203.0.113.9", ("64500", "NL")), ("2001:db8::7", ("64502", "US")),
                              ("192.0.2.1", ("", "")), ("not an address", ("", ""))):
        request = request_from(engine, address)
        assert (asn.value_of(request), country.value_of(request)) == expected


def test_rotating_addresses_of_one_network_share_its_count(databases: Path) -> None:
    engine = Engine(ruleset_from(RULES, databases), clock=FakeClock())

    # Each address once: an ip rule would let every one in.
    assert [refused_by(engine, f"198.51.100.{n}") for n in range(1, 5)] == ["allow"] * 3 + ["per-network"]
    assert refused_by(engine, "203.0.113.1") == "allow"  # another network
    assert refused_by(engine, "203.0.113.1") == "not-from-nl"  # a country rule, per address


def test_an_unknown_address_counts_under_the_empty_value(databases: Path) -> None:
    engine = Engine(ruleset_from(RULES, databases), clock=FakeClock())
    assert [refused_by(engine, f"192.0.2.{n}") for n in range(1, 5)] == ["allow"] * 3 + ["per-network"]


def test_a_missing_database_is_a_warning_and_an_empty_value_until_it_appears(tmp_path: Path) -> None:
    clock = FakeClock()
    ruleset = ruleset_from("geoip: {asn: asn.mmdb}\nrules:\n  - id: r\n    key: [asn]\n"
                           "    limit: {requests: 1, per: 1h}\n    action: block\n", tmp_path)
    database = ruleset.geo["asn"]
    database.clock = clock

    assert ruleset.warnings == [f"test.yaml: geoip.asn: no database at {tmp_path / 'asn.mmdb'}; "
                                "the asn dimension is empty until it can be read"]
    engine = Engine(ruleset, clock=FakeClock())
    assert database.value_of(request_from(engine, "203.0.113.1")) == ""
    write_asn_database(tmp_path / "asn.mmdb")
    assert database.value_of(request_from(engine, "203.0.113.1")) == ""  # looked at once a second
    clock.advance(geo.CHECK_EVERY)
    assert database.value_of(request_from(engine, "203.0.113.1")) == "64500"


def test_a_changed_file_is_read_again_and_a_broken_one_keeps_the_last_good(databases: Path) -> None:
    clock = FakeClock()
    database = GeoDatabase(str(databases / "asn.mmdb"), asn_of, clock)
    engine = Engine(ruleset_from("rules: []"), clock=FakeClock())
    request = request_from(engine, "203.0.113.1")
    assert database.value_of(request) == "64500"

    write_asn_database(databases / "asn.mmdb", {"203.0.113.0/24": (65000, "New Owner", "NL")})
    os.utime(databases / "asn.mmdb", ns=(1, 1))  # a stamp of its own, whatever the file system's resolution
    clock.advance(geo.CHECK_EVERY)
    assert database.value_of(request) == "65000"

    (databases / "asn.mmdb").write_bytes(b"not a database")
    clock.advance(geo.CHECK_EVERY)
    assert database.value_of(request) == "65000"


def test_what_is_remembered_is_bounded(databases: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(geo, "CACHE_SIZE", 100)
    database = GeoDatabase(str(databases / "asn.mmdb"), asn_of, FakeClock())
    engine = Engine(ruleset_from("rules: []"), clock=FakeClock())
    for n in range(1000):
        for _ in range(2):  # stored from an address's second lookup
            database.value_of(request_from(engine, f"10.0.{n >> 8}.{n & 255}"))
        assert len(database._cache) <= 100
    assert database._cache  # it stored some


def test_a_rotation_of_addresses_is_not_stored_and_a_returning_client_is(databases: Path) -> None:
    database = GeoDatabase(str(databases / "asn.mmdb"), asn_of, FakeClock())
    engine = Engine(ruleset_from("rules: []"), clock=FakeClock())
    texts = [f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}" for n in range(2000)]
    for text in texts:
        database.value_of(request_from(engine, text))
    # One bit in 65,536 per address: at most a few collide and are stored.
    assert len(database._cache) < 100
    returning = request_from(engine, "203.0.113.1")
    assert database.value_of(returning) == "64500"
    assert database.value_of(returning) == "64500"
    assert database._cache["203.0.113.1"] == "64500"


@settings(max_examples=200, deadline=None)
@given(record=st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5)),
                           lambda inner: st.dictionaries(st.sampled_from(["country", "registered_country",
                                                                          "iso_code", "autonomous_system_number"]),
                                                         inner, max_size=3), max_leaves=8))
def test_any_record_gives_text(record: object) -> None:
    if isinstance(record, dict):
        assert isinstance(asn_of(record), str) and isinstance(country_of(record), str)


@pytest.mark.parametrize(("text", "says"), [
    ("rules:\n  - id: r\n    key: [asn]\n    limit: {requests: 1, per: 1s}\n    action: block\n",
     "test.yaml:3: rules[0](r).key[0]: asn needs geoip.asn, the ASN database"),
    ("geoip: {asn: a.mmdb}\nrules:\n  - id: r\n    match: {country: {in: [DE]}}\n    limit: {requests: 1, per: 1s}\n"
     "    action: block\n", "test.yaml:4: rules[0](r).match: a country condition needs geoip.country"),
    ("rules:\n  - id: r\n    match: {asn: {in: [ASX]}}\n    limit: {requests: 1, per: 1s}\n    action: block\n",
     "an autonomous system is a number like 64500 or AS64500"),
    ("rules:\n  - id: r\n    match: {country: {in: [Germany]}}\n    limit: {requests: 1, per: 1s}\n"
     "    action: block\n", "a country is its two-letter ISO code"),
])
def test_sluice_check_says_what_is_wrong_with_file_and_line(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ConfigError) as raised:
        ruleset_from(text, tmp_path)
    assert says in str(raised.value)


def test_conditions_take_numbers_or_as_names_and_codes_in_any_case(databases: Path) -> None:
    engine = Engine(ruleset_from("geoip: {asn: asn.mmdb}\nrules:\n  - id: r\n    match: {asn: {in: [AS64500, 1]}}\n"
                                 "    key: [ip]\n    limit: {requests: 1, per: 1h}\n    action: block\n", databases),
                    clock=FakeClock())
    assert [refused_by(engine, "203.0.113.5") for _ in range(2)] == ["allow", "r"]
    assert [refused_by(engine, "198.51.100.5") for _ in range(2)] == ["allow", "allow"]


def test_replay_shows_an_asn_rule_catching_an_attacker_that_rotates_addresses(databases: Path) -> None:
    """The question replay's sweep answers: would a rule per network have
    caught a scraper rotating through its hosting provider's addresses,
    where the rule per address let every request in?"""
    start = 1_709_287_200.0
    lines = [json.dumps({"remote_addr": f"203.0.113.{n % 250 + 1}", "msec": f"{start + n * 0.1:.3f}",
                         "request": f"GET /items?page={n} HTTP/1.1", "status": "200"}) for n in range(300)]
    lines += [json.dumps({"remote_addr": f"198.51.100.{n + 1}", "msec": f"{start + n:.3f}",
                          "request": "GET / HTTP/1.1", "status": "200"}) for n in range(20)]
    (databases / "access.log").write_text("\n".join(sorted(lines, key=lambda line: json.loads(line)["msec"])) + "\n")
    rules = ("geoip: {asn: asn.mmdb}\nrules:\n"
             "  - id: per-address\n    key: [ip]\n    limit: {requests: 60, per: 1m}\n    action: log\n"
             "  - id: per-network\n    key: [asn]\n    limit: {requests: 100, per: 1m}\n    action: block\n")

    report = replay_logs(ruleset_from(rules, databases), [str(databases / "access.log")])

    by_id = {rule["id"]: rule for rule in report["rules"]}
    assert by_id["per-address"]["observed"] == 0  # no address went past 60 a minute
    assert by_id["per-network"]["blocked"] == 200  # the scraper's network, past its first 100
