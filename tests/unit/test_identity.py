"""JWT claims as keys and conditions (sidecar.identity, the jwt: section).

Tokens of every algorithm are verified against a JWKS file, or a JWKS URL
served on loopback that rotates its keys; every way a token can be wrong
has its outcome, its count and the client's address as its key; time is
the engine's clock; a token is verified once, and what is remembered is
bounded whatever clients send."""

from __future__ import annotations

import base64
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import jwt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import identity
from sidecar.config import ConfigError
from sidecar.engine import Engine
from sidecar.identity import OUTCOMES, JwtReader, TokenRead, parse_jwks
from sidecar.request import CheckRequest
from tests.jwks import ALGORITHMS, Issuer, JwksServer
from tests.unit.conftest import FakeClock, refused_by, ruleset_from

NOW = 1_800_000_000.0
ISSUER = Issuer()


def reader(algorithms: tuple[str, ...] = ALGORITHMS, **settings: object) -> tuple[JwtReader, FakeClock]:
    """A reader of the issuer's keys on a fake wall clock at NOW."""
    clock = FakeClock(NOW)
    found = JwtReader(keys=parse_jwks(json.dumps(ISSUER.jwks()), algorithms), algorithms=algorithms,
                      **settings)  # type: ignore[arg-type]
    found.start(clock, Counter(), Counter())
    return found, clock


def bearer(text: str | None) -> str | None:
    """The Authorization field a client sends with ``text``."""
    return None if text is None else f"Bearer {text}"


def token(claims: dict[str, object] | None = None, algorithm: str = "RS256", **options: object) -> str:
    return ISSUER.token({"sub": "alice", "exp": NOW + 600, **(claims or {})}, algorithm, **options)  # type: ignore[arg-type]


# -- the keys ----------------------------------------------------------------------


def test_a_jwks_gives_each_key_with_its_algorithm() -> None:
    keys = parse_jwks(json.dumps(ISSUER.jwks()))

    assert sorted(key.algorithm_name for key in keys.keys) == sorted(ALGORITHMS)
    assert [key.key_id for key in keys.candidates("es256-0", "ES256")] == ["es256-0"]
    assert keys.candidates("es256-0", "RS256") == []  # a key is used with its own algorithm only


@pytest.mark.parametrize(("text", "says"), [
    ("{", "not JSON"), ("[]", "not a JWKS"), ('{"keys": {}}', "not a JWKS"),
    ('{"keys": []}', "no usable signing key"), ('{"keys": [{"kty": "nope"}]}', "no usable signing key"),
    ('{"keys": [1]}', "is not an object"),
])
def test_an_unusable_jwks_says_why(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_jwks(text)


def test_keys_of_algorithms_the_file_does_not_allow_are_left_out() -> None:
    keys = parse_jwks(json.dumps(ISSUER.jwks()), ("ES256",))
    assert [key.algorithm_name for key in keys.keys] == ["ES256"]


# -- verification --------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_token_of_each_algorithm_is_verified(algorithm: str) -> None:
    found, _ = reader()

    read = found.read(bearer(token({"plan": "free"}, algorithm)))

    assert read.outcome == "valid"
    assert read.claims["sub"] == "alice" and read.claims["plan"] == "free"


@pytest.mark.parametrize(("make", "outcome"), [
    (lambda: None, "missing"),
    (lambda: "", "missing"),
    (lambda: "   ", "missing"),
    (lambda: "not.a.token", "malformed"),
    (lambda: "x" * identity.MAX_TOKEN_LENGTH, "too_long"),
    (lambda: token(kid="nobody"), "unknown_key"),
    (lambda: token(generation=1), "unknown_key"),  # another key under a known kid's name? no: its own kid
    (lambda: token(kid="rs256-0", generation=1), "bad_signature"),  # a known kid, another key's signature
    (lambda: token(kid="es256-0"), "unknown_key"),  # the kid of a key of another algorithm
    (lambda: jwt.encode({"sub": "x"}, None, algorithm="none"), "algorithm"),
    (lambda: token({"exp": NOW - 1}), "expired"),
    (lambda: token({"nbf": NOW + 60}), "not_yet_valid"),
    (lambda: token({"exp": "tomorrow"}), "malformed"),
])
def test_every_wrong_token_has_its_outcome_and_no_claims(make, outcome: str) -> None:  # type: ignore[no-untyped-def]
    found, _ = reader()

    read = found.read(bearer(make()))

    assert read == TokenRead(outcome)
    assert found.outcomes == Counter({outcome: 1})


def test_an_algorithm_the_file_does_not_allow_is_refused_before_any_key() -> None:
    found, _ = reader(("RS256",))
    assert found.read(bearer(token(algorithm="HS256"))).outcome == "algorithm"


def test_issuer_and_audience_are_checked_when_the_file_names_them() -> None:
    found, _ = reader(issuer="https://idp.test", audience="api")

    assert found.read(bearer(token({"iss": "https://idp.test", "aud": "api"}))).outcome == "valid"
    assert found.read(bearer(token({"iss": "https://other.test", "aud": "api"}))).outcome == "bad_claims"
    assert found.read(bearer(token({"iss": "https://idp.test", "aud": "web"}))).outcome == "bad_claims"
    assert found.read(bearer(token())).outcome == "bad_claims"  # neither claim


def test_time_is_the_engines_clock_with_the_files_leeway() -> None:
    found, clock = reader(leeway=30.0)
    expiring = bearer(token({"exp": NOW + 10}))

    assert found.read(expiring).outcome == "valid"
    clock.advance(39)
    assert found.read(expiring).outcome == "valid"  # within the leeway
    clock.advance(1)
    assert found.read(expiring).outcome == "expired"  # the cached token, found expired on its next use


def test_a_token_is_verified_once_while_it_is_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    found, _ = reader()
    decoded: list[str] = []
    real_decode = jwt.decode
    monkeypatch.setattr(jwt, "decode", lambda text, *a, **k: decoded.append(text) or real_decode(text, *a, **k))
    alice, bob = token(), token({"sub": "bob"})

    for _ in range(5):
        assert found.read(bearer(alice)).outcome == found.read(bearer(bob)).outcome == "valid"

    assert decoded == [alice, bob]
    found.use_keys(parse_jwks(json.dumps(ISSUER.jwks())))  # new keys: verified again
    found.read(bearer(alice))
    assert decoded == [alice, bob, alice]


def test_what_is_remembered_is_bounded_whatever_clients_send() -> None:
    found, _ = reader()
    for number in range(identity.CACHE_SIZE * 2 + 10):
        found.read(f"Bearer junk.{number}.token")
        assert len(found._cache) <= identity.CACHE_SIZE
    assert found.outcomes == Counter({"malformed": identity.CACHE_SIZE * 2 + 10})


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.text(max_size=300), st.builds(
    lambda parts: ".".join(parts), st.lists(st.text("ABCDEFabcdef0123456789-_=", max_size=60), max_size=4)),
    st.builds(lambda head, body: ".".join([base64.urlsafe_b64encode(head).decode(),
                                          base64.urlsafe_b64encode(body).decode(), "sig"]),
              st.binary(max_size=80), st.binary(max_size=80))))
def test_no_token_text_makes_the_reader_fail(text: str) -> None:
    found, _ = reader()
    proxied = JwtReader(header=None, payload_header="x-jwt-payload", verified_by_proxy=True)

    assert found.read(text).outcome in OUTCOMES
    assert found.read(bearer(text)).outcome in OUTCOMES
    assert proxied.read(text).outcome in OUTCOMES


# -- tokens the proxy verified -------------------------------------------------------


def payload_header(claims: dict[str, object]) -> str:
    """A payload as Envoy's jwt_authn forward_payload_header writes it."""
    return base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()


def test_a_proxys_payload_header_is_read_without_a_signature() -> None:
    found = JwtReader(header=None, payload_header="x-jwt-payload", verified_by_proxy=True)
    found.start(FakeClock(NOW), Counter(), Counter())

    assert found.read(payload_header({"sub": "alice", "exp": NOW + 5})).claims["sub"] == "alice"
    assert found.read(payload_header({"sub": "alice", "exp": NOW - 5})).outcome == "expired"
    assert found.read("%%%").outcome == "malformed"
    assert found.read(payload_header(["not", "claims"])).outcome == "malformed"  # type: ignore[arg-type]


def test_a_bearer_token_the_proxy_verified_is_read_unverified() -> None:
    found = JwtReader(verified_by_proxy=True)
    found.start(FakeClock(NOW), Counter(), Counter())
    unknown_signer = Issuer().token({"sub": "carol", "exp": NOW + 5})

    assert found.read(bearer(unknown_signer)).claims["sub"] == "carol"


# -- where the token is -------------------------------------------------------------


@pytest.mark.parametrize(("settings", "field", "expected"), [
    ({}, "Bearer abc.def.ghi", "abc.def.ghi"),
    ({}, "bearer   abc.def.ghi ", "abc.def.ghi"),
    ({}, "Basic dXNlcjpwYXNz", None),  # not a bearer token
    ({}, "abc.def.ghi", None),
    ({"header": "x-token"}, " abc.def.ghi ", "abc.def.ghi"),
    ({"header": "x-token"}, "Bearer abc.def.ghi", "abc.def.ghi"),
    ({"cookie": "jwt"}, "abc.def.ghi", "abc.def.ghi"),
    ({"payload_header": "x-jwt-payload"}, "eyJzdWIiOiJ4In0", "eyJzdWIiOiJ4In0"),
])
def test_the_token_is_taken_from_its_field(settings: dict[str, object], field: str, expected: str | None) -> None:
    found = JwtReader(verified_by_proxy=True, **settings)  # type: ignore[arg-type]
    assert found.token_in(field) == expected


@pytest.mark.parametrize(("settings", "headers"), [
    ({}, {"authorization": "Bearer {token}"}),
    ({"header": "x-token"}, {"x-token": "{token}"}),
    ({"cookie": "jwt"}, {"cookie": "a=1; jwt={token}"}),
])
def test_a_rule_reads_the_claim_from_where_the_file_says(settings: dict[str, object],
                                                         headers: dict[str, str]) -> None:
    found = JwtReader(verified_by_proxy=True, **settings)  # type: ignore[arg-type]
    found.start(FakeClock(NOW), Counter(), Counter())
    text = token({"sub": "carol", "n": 7})
    request = CheckRequest("GET", "h", "/", {name: value.format(token=text) for name, value in headers.items()},
                           None, "r")  # type: ignore[arg-type]

    claims = found.claim(request, "sub"), found.claim(request, "n"), found.claim(request, "none")
    assert claims == ("carol", "7", None)
    assert found.outcomes == Counter({"valid": 1})  # read once for the request


# -- a JWKS URL ---------------------------------------------------------------------


@pytest.fixture
def jwks_server() -> Iterator[JwksServer]:
    server = JwksServer(ISSUER.jwks(("RS256",)))
    yield server
    server.close()


def test_keys_from_a_url_are_fetched_again_and_the_last_good_set_kept(jwks_server: JwksServer) -> None:
    found = JwtReader(url=jwks_server.url, refresh=3600.0, algorithms=("RS256",))
    fetches: Counter[str] = Counter()
    found.start(time.time, Counter(), fetches)
    assert found.read(bearer(token())).outcome in ("no_keys", "valid")  # before or after the first fetch
    deadline = time.monotonic() + 10
    while found.key_count == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    found.close()

    assert found.read(bearer(token())).outcome == "valid"
    rotated = token(generation=1)
    assert found.read(bearer(rotated)).outcome == "unknown_key"
    jwks_server.rotate(ISSUER.jwks(("RS256",), generation=1))
    assert found.fetch()
    assert found.read(bearer(rotated)).outcome == "valid"
    assert found.read(bearer(token())).outcome == "unknown_key"  # the retired key
    jwks_server.answering = False
    assert not found.fetch()
    assert found.read(bearer(rotated)).outcome == "valid"  # the last good keys
    jwks_server.rotate({"keys": []})
    jwks_server.answering = True
    assert not found.fetch()  # a set without usable keys is a failed fetch too
    assert found.read(bearer(rotated)).outcome == "valid"
    assert fetches == Counter({"succeeded": 2, "failed": 2})


def test_a_url_never_fetched_gives_no_keys() -> None:
    found = JwtReader(url="http://127.0.0.1:9/jwks.json")
    assert found.read(bearer(token())).outcome == "no_keys"


# -- rules ----------------------------------------------------------------------------


RULES = """
jwt:
  keys: {file: jwks.json}
  algorithms: [RS256, ES256]
rules:
  - id: free-plan
    match: {jwt: {claim: plan, in: [free]}}
    key: ["jwt:sub"]
    limit: {requests: 2, per: 1m}
    action: block
  - id: everyone
    key: ["jwt:sub"]
    limit: {requests: 4, per: 1m}
    action: block
"""


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    (tmp_path / "jwks.json").write_text(json.dumps(ISSUER.jwks()))
    return Engine(ruleset_from(RULES, tmp_path), clock=FakeClock(), wall_clock=lambda: NOW)


def decide(engine: Engine, token_text: str | None, address: str = "192.0.2.1") -> str:
    return refused_by(engine, address, {"authorization": f"Bearer {token_text}"} if token_text else {})


def test_each_subject_is_counted_apart_and_a_condition_reads_a_claim(engine: Engine) -> None:
    alice, bob = token({"plan": "free"}), token({"sub": "bob", "plan": "pro"}, "ES256")

    assert [decide(engine, alice) for _ in range(3)] == ["allow", "allow", "free-plan"]
    assert [decide(engine, bob) for _ in range(5)] == ["allow"] * 4 + ["everyone"]  # bob is not on the free plan
    assert Counter(engine.metrics.jwt_tokens) == Counter({"valid": 8})


def test_a_request_without_a_valid_token_is_counted_under_its_address(engine: Engine) -> None:
    wrong = [None, "junk", token({"exp": NOW - 1}), token(kid="nobody")]

    assert [decide(engine, text) for text in wrong] == ["allow"] * 4  # four checks of one address
    assert decide(engine, "junk") == "everyone"
    assert decide(engine, "junk", "192.0.2.2") == "allow"  # another address
    assert decide(engine, token()) == "allow"  # alice's own count
    assert Counter(engine.metrics.jwt_tokens) == Counter({"malformed": 3, "missing": 1, "expired": 1, "unknown_key": 1,
                                                 "valid": 1})


def test_a_claim_equal_to_an_address_is_another_key(engine: Engine) -> None:
    spoof = token({"sub": "192.0.2.1"})
    for _ in range(4):
        decide(engine, spoof)
    assert decide(engine, None) == "allow"  # the address's own count is untouched


@pytest.mark.parametrize(("text", "says"), [
    ('rules:\n  - id: r\n    key: ["jwt:sub"]\n    limit: {requests: 1, per: 1s}\n    action: block\n',
     "test.yaml:3: rules[0](r).key[0]: jwt:sub needs a jwt: section"),
    ('rules:\n  - id: r\n    match: {jwt: {claim: plan, equals: free}}\n    limit: {requests: 1, per: 1s}\n'
     '    action: block\n', "test.yaml:3: rules[0](r).match: a jwt condition needs a jwt: section"),
    ("jwt: {keys: {file: missing.json}}\nrules: []\n", "test.yaml:1: jwt.keys.file: cannot read the JWKS file"),
    ("jwt: {keys: {file: bad.json}}\nrules: []\n",
     "test.yaml:1: jwt.keys.file: the JWKS file 'bad.json' is unusable: not JSON"),
    ("jwt: {keys: {file: hs.json}, algorithms: [RS256]}\nrules: []\n",
     "test.yaml:1: jwt.keys.file: the JWKS file is unusable: no usable signing key"),
    ("jwt: {verified_by_proxy: true, keys: {url: 'https://idp.test/jwks'}}\n", "exactly one"),
    ("jwt: {token: {payload_header: x-jwt}, keys: {url: 'https://idp.test/jwks'}}\n",
     "a payload header carries no signature"),
    ("jwt: {verified_by_proxy: true, algorithms: [HS999]}\n", "jwt.algorithms"),
    ("jwt: {keys: {url: 'ftp://idp.test/jwks'}}\n", "a JWKS URL is http:// or https://"),
    ("jwt: {verified_by_proxy: true, token: {header: a, cookie: b}}\n", "expected exactly one of header, cookie"),
])
def test_sluice_check_says_what_is_wrong_with_file_and_line(tmp_path: Path, text: str, says: str) -> None:
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "hs.json").write_text(json.dumps(ISSUER.jwks(("HS256",))))
    with pytest.raises(ConfigError) as raised:
        ruleset_from(text, tmp_path)
    assert says in str(raised.value)


def test_an_administrator_names_a_claims_key_as_the_engine_counts_it(engine: Engine) -> None:
    from sidecar.counters import dimension_values, key_from_text

    rule = engine.ruleset.by_id["everyone"]
    request = CheckRequest("GET", "h", "/", {"authorization": f"Bearer {token()}"},
                           engine.resolve_client("192.0.2.1", None), "r")
    matched: list[object] = []
    checks: list[object] = []
    engine.ruleset.match_request(request, matched, checks, "", lambda *_: False)  # type: ignore[arg-type]
    counted = [check.key for check in checks if check.spec.rule_id == "everyone"]  # type: ignore[attr-defined]

    named = key_from_text(rule, engine.ruleset.resolver, ["jwt:sub=alice"])

    assert counted == [named]
    assert dimension_values(named) == {"jwt:sub": {"jwt": "alice"}}


def test_replay_counts_each_subject_of_a_logged_token_on_the_logs_clock(tmp_path: Path) -> None:
    """A JSON access log that keeps $http_authorization: the rules count
    each user apart, and a token is expired by the time of its log line,
    not today's."""
    from sidecar.replay.simulate import replay_logs

    (tmp_path / "jwks.json").write_text(json.dumps(ISSUER.jwks()))
    start = 1_709_287_200.0  # 2024-03-01
    alice = token({"exp": start + 30})  # valid for the first 30 s of the log
    lines = [json.dumps({"remote_addr": f"198.51.100.{n}", "msec": f"{start + n:.3f}", "request": "GET / HTTP/1.1",
                         "status": "200", "http_authorization": f"Bearer {alice}"}) for n in range(1, 6)]
    lines.append(json.dumps({"remote_addr": "198.51.100.9", "msec": f"{start + 40:.3f}",
                             "request": "GET / HTTP/1.1", "status": "200", "http_authorization": f"Bearer {alice}"}))
    (tmp_path / "access.log").write_text("\n".join(lines) + "\n")

    report = replay_logs(ruleset_from(RULES, tmp_path), [str(tmp_path / "access.log")])

    everyone = next(rule for rule in report["rules"] if rule["id"] == "everyone")
    # Five requests of alice from five addresses: four allowed, the fifth
    # blocked; the last, past her token's expiry, counts under its address.
    assert (everyone["matched"], everyone["allowed"], everyone["blocked"]) == (6, 5, 1)


def test_a_reload_keeps_the_fetched_keys_and_stops_the_old_fetches(jwks_server: JwksServer) -> None:
    rules = f'jwt: {{keys: {{url: "{jwks_server.url}", refresh: 1h}}, algorithms: [RS256]}}\n' + RULES.split("\n", 4)[4]
    engine = Engine(ruleset_from(rules), clock=FakeClock(), wall_clock=lambda: NOW)
    old = engine.ruleset.jwt
    assert old is not None
    deadline = time.monotonic() + 10
    while old.key_count == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    jwks_server.answering = False  # the new reader's first fetch fails: the old keys serve

    engine.reload(ruleset_from(rules))

    assert engine.ruleset.jwt is not old and engine.ruleset.jwt is not None
    assert old._stop.is_set()
    assert engine.ruleset.jwt.key_count == 1
    assert decide(engine, token()) == "allow" and engine.metrics.jwt_tokens["valid"] == 1
    engine.close()
    assert engine.ruleset.jwt._stop.is_set()
