"""The Rate Limit Service: envoyproxy/ratelimit's configuration files, the
matching of descriptors, and ShouldRateLimit's answers over the memory
store on a fake clock (the same through Envoy: tests/integration/test_rls_envoy.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.config import ConfigError
from sidecar.engine import Engine
from sidecar.frontdoors.messages import OK, OVER_LIMIT, UNIT_NUMBERS, RateLimitRequest, RateLimitResponse
from sidecar.frontdoors.rls import InvalidRequest, RateLimitService, stat_level
from sidecar.rls import RlsConfig, compile_domain, load_rls, parse_rls_text
from sidecar.store import StoreUnavailable
from sidecar.store.memory import MemoryStore

from .conftest import FakeClock, ruleset_from

NO_RULES = ruleset_from("rules: []\n")


def config_of(*texts: str) -> RlsConfig:
    domains = {}
    for text in texts:
        model = parse_rls_text(text, "test.yaml")
        domains[model.domain] = compile_domain(model)
    return RlsConfig(domains)


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_rls_text(text, "rl.yaml")
    return [str(issue) for issue in caught.value.issues]


# -- the files ----------------------------------------------------------------


def test_every_error_is_reported_with_file_line_and_field() -> None:
    errors = errors_of("""\
domain: rl
descriptors:
  - key: a
    rate_limit: {unit: fortnight, requests_per_unit: 1}
  - key: a
    ratelimit: {unit: second, requests_per_unit: 1}
  - key: b
    rate_limit: {unlimited: true, unit: second}
  - key: c
    rate_limit: {unit: second}
  - key: ""
  - key: d
    value: x
    share_threshold: true
""")
    assert errors == [
        "rl.yaml:4: descriptors[0].rate_limit.unit: unknown unit 'fortnight' (one of second, minute, hour, day, "
        "month, year, week)",
        "rl.yaml:5: descriptors[1].key: duplicate descriptor 'a' at this level",
        "rl.yaml:6: descriptors[1].ratelimit: unknown field (did you mean 'rate_limit'?)",
        "rl.yaml:8: descriptors[2].rate_limit: an unlimited rate limit has no unit and no requests_per_unit",
        "rl.yaml:10: descriptors[3].rate_limit: give unit and requests_per_unit, or unlimited: true",
        "rl.yaml:11: descriptors[4].key: a descriptor's key cannot be empty",
        "rl.yaml:12: descriptors[5]: share_threshold shares one counter among the values a wildcard value "
        "matches: give this descriptor a value with '*'",
    ]


def test_sluice_extensions_are_checked_where_they_make_sense() -> None:
    errors = errors_of("""\
domain: rl
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 5}
    sluice: {algorithm: sliding, burst: 3}
  - key: path
    rate_limit: {unit: second, requests_per_unit: 5}
    sluice: {ban: 10m}
  - key: remote_address
    descriptors:
      - key: path
        rate_limit: {unit: second, requests_per_unit: 5}
        sluice: {ban: 10m, algorithm: token_bucket, window: 0s}
  - key: free
    rate_limit: {unlimited: true}
    sluice: {algorithm: sliding}
  - key: named
    rate_limit: {unit: second, requests_per_unit: 5, name: me, replaces: [{name: me}]}
""")
    assert errors == [
        "rl.yaml:5: descriptors[0].sluice: burst is a bucket's (algorithm: token_bucket or leaky_bucket)",
        "rl.yaml:8: descriptors[1].sluice.ban: a ban bans a client address: put this descriptor under (or at) "
        "a remote_address entry",
        "rl.yaml:13: descriptors[2].descriptors[0].sluice.window: a duration must be positive, got '0s'",
        "rl.yaml:14: descriptors[3]: sluice: shapes a rate_limit: give this descriptor one that is not unlimited",
        "rl.yaml:18: descriptors[4].rate_limit: a limit cannot replace itself (name 'me' is in its replaces)",
    ]


def test_a_directory_loads_every_yaml_file_and_refuses_a_domain_twice(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("domain: one\ndescriptors: [{key: k, rate_limit: {unit: day, "
                                     "requests_per_unit: 1}}]\n")
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "b.yml").write_text("domain: two\n")
    (tmp_path / ".hidden.yaml").write_text("domain: one\n")  # a dot file: skipped
    (tmp_path / "notes.txt").write_text("not configuration")
    config = load_rls(tmp_path)
    assert sorted(config.domains) == ["one", "two"] and config.limits == 1
    (tmp_path / "c.yaml").write_text("domain: two\n")
    with pytest.raises(ConfigError) as caught:
        load_rls(tmp_path)
    assert [str(issue) for issue in caught.value.issues] == [
        f"{tmp_path / 'nested' / 'b.yml'}:1: domain: domain 'two' is already configured in {tmp_path / 'c.yaml'}"]


def test_values_yaml_reads_as_numbers_or_booleans_are_text() -> None:
    config = config_of("domain: d\ndescriptors:\n  - {key: code, value: 500, rate_limit: {unit: second, "
                       "requests_per_unit: 1}}\n  - {key: on, value: yes, rate_limit: {unit: second, "
                       "requests_per_unit: 2}}\n")
    match = config.match("d", [("code", "500")])
    assert match is not None and match.limit.requests_per_unit == 1
    match = config.match("d", [("true", "true")])
    assert match is not None and match.limit.requests_per_unit == 2


# -- matching -----------------------------------------------------------------

MESSAGING = """\
domain: messaging
descriptors:
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit: {unit: day, requests_per_unit: 5}
  - key: to_number
    rate_limit: {unit: day, requests_per_unit: 100}
  - key: path
    value: /api/*/action
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: path
    value: /api/*
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: remote_address
    value: 50.0.0.5
    rate_limit: {unit: second, requests_per_unit: 0}
"""


@pytest.mark.parametrize(("entries", "limit"), [
    ([("message_type", "marketing"), ("to_number", "2061111111")], 5),
    ([("to_number", "2061111111")], 100),
    ([("message_type", "marketing")], None),  # ends above its limit
    ([("to_number", "1"), ("extra", "x")], None),  # deeper than the tree
    ([("message_type", "other"), ("to_number", "1")], None),
    ([("path", "/api/123/action")], 20),  # the first pattern that matches
    ([("path", "/api/123/other")], 30),
    ([("path", "/web")], None),
    ([("remote_address", "50.0.0.1")], 10),
    ([("remote_address", "50.0.0.5")], 0),  # the exact value beats the key
    ([], None),
])
def test_the_most_specific_entry_matches_first(entries: list[tuple[str, str]], limit: int | None) -> None:
    match = config_of(MESSAGING).match("messaging", entries)
    assert (match.limit.requests_per_unit if match is not None else None) == limit


def test_statistics_names_follow_detailed_metric_value_to_metric_and_the_configuration() -> None:
    config = config_of("""\
domain: example8
descriptors:
  - key: key1
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: key1
    value: value1
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: route
    value_to_metric: true
    descriptors:
      - key: http_method
        value_to_metric: true
        descriptors:
          - key: subject_id
            rate_limit: {unit: minute, requests_per_unit: 60}
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 10}
""")
    levels = [config.match("example8", entries).levels for entries in (  # type: ignore[union-attr]
        [("key1", "unspecified_value")], [("key1", "value1")],
        [("route", "api"), ("http_method", "GET"), ("subject_id", "123")], [("files", "files/a.pdf")])]
    assert levels == [("key1_unspecified_value",), ("key1_value1",),
                      ("route_api", "http_method_GET", "subject_id"), ("files_files/*",)]
    shared = [config.match("example8", [("files", name)]).values for name in ("files/a", "files/b")]  # type: ignore[union-attr]
    assert shared == [("files/*",), ("files/*",)]
    assert stat_level("remote_address_50.0.0.5:80|x") == "remote_address_50_0_0_5_80_x"


# -- ShouldRateLimit ------------------------------------------------------------


class Service:
    """The Rate Limit Service over the memory store, on a fake clock at the start of a day."""

    def __init__(self, *texts: str, rules: Any = NO_RULES, shadow: bool = False) -> None:
        self.clock = FakeClock(86400.0 * 20_000)
        self.engine = Engine(rules, store=MemoryStore(10_000, "node", self.clock), clock=self.clock)
        self.service = RateLimitService(self.engine, None, shadow=shadow)
        self.service.config = config_of(*texts)

    def ask(self, domain: str, *descriptors: list[tuple[str, str]], hits: int = 0,
            addends: dict[int, int] | None = None, override: tuple[int, str] | None = None) -> Any:
        request = RateLimitRequest(domain=domain, hits_addend=hits)
        for index, entries in enumerate(descriptors):
            descriptor = request.descriptors.add()
            for key, value in entries:
                descriptor.entries.add(key=key, value=value)
            if addends and index in addends:
                descriptor.hits_addend.value = addends[index]
            if override is not None:
                descriptor.limit.requests_per_unit, descriptor.limit.unit = override[0], UNIT_NUMBERS[override[1]]
        answer = asyncio.run(self.service.answer(RateLimitRequest.FromString(request.SerializeToString())))
        return RateLimitResponse.FromString(answer.SerializeToString())

    def codes(self, domain: str, *descriptors: list[tuple[str, str]], **options: Any) -> tuple[int, list[int]]:
        answer = self.ask(domain, *descriptors, **options)
        return answer.overall_code, [status.code for status in answer.statuses]


def test_a_fixed_window_passes_its_limit_per_window_and_says_what_remains_and_when_it_resets() -> None:
    service = Service(MESSAGING)
    number = [("message_type", "marketing"), ("to_number", "2061111111")]
    answers = [service.ask("messaging", number) for _ in range(6)]
    assert [(a.overall_code, a.statuses[0].limit_remaining) for a in answers] == \
        [(OK, 4), (OK, 3), (OK, 2), (OK, 1), (OK, 0), (OVER_LIMIT, 0)]
    status = answers[0].statuses[0]
    assert (status.current_limit.requests_per_unit, status.current_limit.unit) == (5, UNIT_NUMBERS["DAY"])
    service.clock.advance(3600)
    assert answers[0].statuses[0].duration_until_reset.seconds == 86400
    assert service.ask("messaging", number).statuses[0].duration_until_reset.seconds == 82800
    # Another number counts on its own; the next day starts anew.
    assert service.codes("messaging", [("message_type", "marketing"), ("to_number", "2")]) == (OK, [OK])
    service.clock.advance(82800)
    assert service.codes("messaging", number) == (OK, [OK])


def test_each_descriptor_counts_on_its_own_and_one_over_refuses_the_request() -> None:
    service = Service(MESSAGING)
    both = ([("message_type", "marketing"), ("to_number", "3")], [("to_number", "3")])
    for _ in range(5):
        service.ask("messaging", *both)
    assert service.codes("messaging", *both) == (OVER_LIMIT, [OVER_LIMIT, OK])
    # The refused request still counted its other descriptor: 6 of 100.
    assert service.ask("messaging", both[1]).statuses[0].limit_remaining == 93


def test_unknown_domains_and_unmatched_descriptors_are_ok_and_unlimited_reports_the_most() -> None:
    service = Service("domain: internal\ndescriptors:\n  - {key: ldap, rate_limit: {unlimited: true}}\n")
    answer = service.ask("internal", [("ldap", "x")], [("azure", "y")])
    assert answer.overall_code == OK
    assert [(s.code, s.limit_remaining, s.HasField("current_limit")) for s in answer.statuses] == \
        [(OK, 2**32 - 1, False), (OK, 0, False)]
    assert service.codes("nowhere", [("ldap", "x")]) == (OK, [OK])


def test_hits_addend_counts_at_once_per_request_or_per_descriptor_and_zero_only_looks() -> None:
    service = Service(MESSAGING)
    numbers = [("to_number", "7")]
    assert service.ask("messaging", numbers, hits=60).statuses[0].limit_remaining == 40
    assert service.codes("messaging", numbers, hits=41) == (OVER_LIMIT, [OVER_LIMIT])  # does not fit: not counted
    assert service.ask("messaging", numbers, addends={0: 0}).statuses[0].limit_remaining == 40
    assert service.ask("messaging", numbers, hits=60, addends={0: 40}).statuses[0].limit_remaining == 0
    assert service.codes("messaging", numbers, addends={0: 0}) == (OK, [OK])


def test_a_request_limit_override_replaces_the_configured_one() -> None:
    service = Service(MESSAGING)
    answers = [service.ask("messaging", [("to_number", "8")], override=(2, "MINUTE")) for _ in range(3)]
    assert [a.overall_code for a in answers] == [OK, OK, OVER_LIMIT]
    limit = answers[0].statuses[0].current_limit
    assert (limit.requests_per_unit, limit.unit) == (2, UNIT_NUMBERS["MINUTE"])


REPLACES = """\
domain: example7
descriptors:
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        value: bkthomps
        rate_limit: {name: specific_limit, requests_per_unit: 5, unit: second}
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          replaces: [{name: specific_limit}]
          requests_per_unit: 10
          unit: second
"""


def test_a_limit_that_replaces_another_drops_it_from_the_request() -> None:
    service = Service(REPLACES)
    first, second = [("key_1", "value_1"), ("user", "bkthomps")], [("key_2", "value_2"), ("user", "bkthomps")]
    answer = service.ask("example7", first, second)
    assert [s.current_limit.requests_per_unit for s in answer.statuses] == [0, 10]
    assert answer.statuses[1].limit_remaining == 9
    # The replaced limit counted nothing.
    assert service.ask("example7", first).statuses[0].limit_remaining == 4


SHADOW = """\
domain: example6
descriptors:
  - key: service
    descriptors:
      - key: user
        value: user-a
        rate_limit: {requests_per_unit: 2, unit: second}
        shadow_mode: true
      - key: user
        value: user-b
        rate_limit: {requests_per_unit: 2, unit: second}
"""


def metric(engine: Engine, name: str, labels: dict[str, str]) -> float:
    value = engine.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_shadow_mode_answers_ok_but_counts_and_logs_over_limit(caplog: pytest.LogCaptureFixture) -> None:
    service = Service(SHADOW)
    a, b = [("service", "s"), ("user", "user-a")], [("service", "s"), ("user", "user-b")]
    with caplog.at_level(logging.INFO, logger="sluice.decisions"):
        assert [service.codes("example6", a) for _ in range(4)] == [(OK, [OK])] * 4
        assert [service.codes("example6", b)[0] for _ in range(3)] == [OK, OK, OVER_LIMIT]
    labels = {"domain": "example6", "key1": "service", "key2": "user_user-a"}
    assert metric(service.engine, "ratelimit_service_rate_limit_shadow_mode", labels) == 2
    assert metric(service.engine, "ratelimit_service_rate_limit_over_limit", labels) == 2
    assert metric(service.engine, "ratelimit_service_rate_limit_total_hits", labels) == 4
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "sluice.decisions"]
    assert [(line["rule"], line["action"], line["outcome"]) for line in lines] == \
        [("example6.service.user_user-a", "shadow", "observe")] * 2 + [("example6.service.user_user-b", "block",
                                                                        "deny")]


def test_global_shadow_mode_answers_ok_overall_and_keeps_the_statuses() -> None:
    service = Service(SHADOW, shadow=True)
    b = [("service", "s"), ("user", "user-b")]
    assert [service.codes("example6", b) for _ in range(3)][-1] == (OK, [OVER_LIMIT])


def test_statistics_split_hits_at_the_near_limit_mark_and_the_limit() -> None:
    service = Service("domain: d\ndescriptors:\n  - {key: k, rate_limit: {unit: minute, requests_per_unit: 10}}\n")
    for hits in (7, 2, 3):  # 7 within; 9 within, one past the mark of 8; 3 do not fit
        service.ask("d", [("k", "v")], hits=hits)
    labels = {"domain": "d", "key1": "k", "key2": ""}
    values = [metric(service.engine, f"ratelimit_service_rate_limit_{stat}", labels)
              for stat in ("total_hits", "within_limit", "near_limit", "over_limit")]
    assert values == [12, 9, 2, 2]


def test_quota_mode_descriptors_refuse_only_when_all_of_them_are_over() -> None:
    service = Service("domain: q\ndescriptors:\n"
                      "  - {key: a, quota_mode: true, rate_limit: {unit: minute, requests_per_unit: 1}}\n"
                      "  - {key: b, quota_mode: true, rate_limit: {unit: minute, requests_per_unit: 2}}\n")
    both = ([("a", "1")], [("b", "1")])
    assert [service.codes("q", *both) for _ in range(3)] == [
        (OK, [OK, OK]), (OK, [OVER_LIMIT, OK]), (OVER_LIMIT, [OVER_LIMIT, OVER_LIMIT])]


def test_a_batch_beyond_a_leaky_buckets_burst_is_over_limit_even_for_a_new_key() -> None:
    """hits_addend asks for several requests at once: a leaky bucket of
    burst 2 admits three at once on a key never seen (its first place and
    the burst), and refuses four, on a new key too, with a wait."""
    service = Service("""\
domain: batches
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 2}
    sluice: {algorithm: leaky_bucket, burst: 2}
""")
    refused = service.ask("batches", [("user", "new")], hits=4)
    assert (refused.overall_code, refused.statuses[0].code) == (OVER_LIMIT, OVER_LIMIT)
    assert refused.statuses[0].duration_until_reset.seconds == 1  # (4000 - 2000) thousandths at 2000 a second
    assert service.codes("batches", [("user", "another")], hits=3) == (OK, [OK])
    assert service.codes("batches", [("user", "another")]) == (OVER_LIMIT, [OVER_LIMIT])


def test_sliding_and_token_bucket_descriptors_count_as_their_algorithm() -> None:
    service = Service("""\
domain: shapes
descriptors:
  - key: sliding
    rate_limit: {unit: minute, requests_per_unit: 4}
    sluice: {algorithm: sliding}
  - key: fixed
    rate_limit: {unit: minute, requests_per_unit: 4}
  - key: bucket
    rate_limit: {unit: second, requests_per_unit: 1}
    sluice: {algorithm: token_bucket, burst: 3}
""")
    service.clock.advance(50)
    for _ in range(4):
        service.ask("shapes", [("sliding", "x")], [("fixed", "x")])
    service.clock.advance(15)  # 5 s into the next minute
    assert service.codes("shapes", [("sliding", "x")], [("fixed", "x")]) == (OVER_LIMIT, [OVER_LIMIT, OK])
    assert [service.codes("shapes", [("bucket", "x")])[0] for _ in range(4)] == [OK, OK, OK, OVER_LIMIT]
    service.clock.advance(1)
    assert service.codes("shapes", [("bucket", "x")])[0] == OK


def test_a_ban_bans_the_remote_address_for_every_descriptor_and_for_the_rules() -> None:
    rules = ruleset_from("rules:\n  - id: any\n    key: [ip]\n    limit: {requests: 1000, per: 1m}\n"
                         "    action: block\n")
    service = Service("""\
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 2}
    sluice: {ban: 10m}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 100}
""", rules=rules)
    address = [("remote_address", "2001:db8:1:2::7")]
    assert [service.codes("edge", address)[0] for _ in range(3)] == [OK, OK, OVER_LIMIT]
    # Another address of the same /64, with a descriptor that has no ban:
    # refused, every descriptor.
    assert service.codes("edge", [("remote_address", "2001:db8:1:2::9")], [("path", "/")]) == \
        (OVER_LIMIT, [OVER_LIMIT, OVER_LIMIT])
    bans = asyncio.run(service.engine.active_bans())
    assert [(ban.address, ban.rule_id, ban.duration) for ban in bans] == [("2001:db8:1:2::/64", "edge.remote_address",
                                                                            600.0)]


def test_a_shared_store_that_does_not_answer_fails_as_the_rules_say() -> None:
    class Down(MemoryStore):
        async def evaluate(self, *args: Any, **kwargs: Any) -> Any:
            raise StoreUnavailable("down")

    for fail, code in (("open", OK), ("closed", OVER_LIMIT)):
        service = Service(MESSAGING, rules=ruleset_from(f"state: {{fail: {fail}}}\nrules: []\n"))
        service.engine.store = Down(10, "node", service.clock)
        assert service.codes("messaging", [("to_number", "1")]) == (code, [code])
        assert metric(service.engine, "ratelimit_service_should_rate_limit_error", {"err_type": "redis_error"}) == 1


def test_a_request_without_domain_or_descriptors_is_invalid() -> None:
    service = Service(MESSAGING)
    for request in (RateLimitRequest(domain=""), RateLimitRequest(domain="messaging")):
        with pytest.raises(InvalidRequest):
            asyncio.run(service.service.answer(request))


_text = st.text(st.characters(codec="utf-8"), max_size=300)


@settings(max_examples=200, deadline=None)
@given(domain=st.sampled_from(["messaging", "example7", "nowhere", "x"]),
       descriptors=st.lists(st.lists(st.tuples(st.sampled_from(["to_number", "message_type", "path", "key_1",
                                                                "user", "remote_address", ""]) | _text,
                                               st.sampled_from(["marketing", "50.0.0.5", "::1", "/api/1/action",
                                                                "bkthomps", ""]) | _text),
                                     max_size=4), min_size=1, max_size=5),
       hits=st.integers(0, 2**32 - 1), addend=st.none() | st.integers(0, 2**64 - 1))
def test_any_request_gets_one_status_per_descriptor_and_no_internal_error(
        domain: str, descriptors: list[list[tuple[str, str]]], hits: int, addend: int | None) -> None:
    service = FUZZED
    answer = service.ask(domain, *descriptors, hits=hits, addends=None if addend is None else {0: addend})
    assert answer.overall_code in (OK, OVER_LIMIT)
    assert len(answer.statuses) == len(descriptors)
    assert service.engine.metrics.errors.value == 0


FUZZED = Service(MESSAGING, REPLACES)


def test_rls_and_health_answer_on_the_grpc_port_and_a_failure_inside_sluice_fails_open() -> None:
    import grpc

    from sidecar.app import SluiceApp
    from sidecar.frontdoors.grpc_server import GrpcListener
    from sidecar.frontdoors.messages import (
        HEALTH_SERVICE,
        RATE_LIMIT_SERVICE,
        SERVING,
        SHOULD_RATE_LIMIT,
        HealthCheckRequest,
        HealthCheckResponse,
    )

    service = Service(MESSAGING)
    app = SluiceApp(service.engine)

    async def calls() -> tuple[list[int], list[Any], int, Any]:
        listener = GrpcListener(app, "127.0.0.1", 0, rls=service.service)
        await listener.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{listener.port}") as channel:
                ask = channel.unary_unary(f"/{RATE_LIMIT_SERVICE}/{SHOULD_RATE_LIMIT}",
                                          request_serializer=RateLimitRequest.SerializeToString,
                                          response_deserializer=RateLimitResponse.FromString)
                health = channel.unary_unary(f"/{HEALTH_SERVICE}/Check",
                                             request_serializer=HealthCheckRequest.SerializeToString,
                                             response_deserializer=HealthCheckResponse.FromString)
                request = RateLimitRequest(domain="messaging")
                request.descriptors.add().entries.add(key="remote_address", value="192.0.2.9")
                # Ten at once on one key of 10 per second: one refused.
                answers = await asyncio.gather(*(ask(request, timeout=5) for _ in range(11)))
                statuses = [(await health(HealthCheckRequest(service=name), timeout=5)).status
                            for name in ("", "ratelimit")]
                try:
                    await health(HealthCheckRequest(service="nope"), timeout=5)
                    unknown: Any = "answered"
                except grpc.aio.AioRpcError as error:
                    unknown = error.code()
                service.service.config = None  # type: ignore[assignment]  # a failure inside Sluice
                failed = await ask(request, timeout=5)
        finally:
            await listener.stop()
        return sorted(answer.overall_code for answer in answers), statuses, failed.overall_code, unknown

    codes, statuses, failed, unknown = asyncio.run(calls())
    assert codes == [OK] * 10 + [OVER_LIMIT]
    assert statuses == [SERVING, SERVING] and unknown == grpc.StatusCode.NOT_FOUND
    assert failed == OK and service.engine.metrics.errors.value == 1


class _Aborted(Exception):
    pass


class _Context:
    """What a method handler is given: abort raises, as grpc.aio's does."""

    code: Any = None

    async def abort(self, code: Any, details: str) -> None:
        self.code = code
        raise _Aborted(details)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200) | st.builds(lambda r: r.SerializeToString(), st.builds(
    RateLimitRequest, domain=st.sampled_from(["messaging", "", "x"]), hits_addend=st.integers(0, 2**32 - 1))))
def test_any_bytes_on_the_grpc_methods_get_an_answer_or_invalid_argument(data: bytes) -> None:
    import grpc

    from sidecar.app import SluiceApp
    from sidecar.frontdoors.grpc_authz import check_handler
    from sidecar.frontdoors.grpc_server import Health
    from sidecar.frontdoors.rls import rls_handler

    class Method:
        invocation_metadata = ()

        def __init__(self, method: str) -> None:
            self.method = method

    app = SluiceApp(FUZZED.engine)
    handlers = [
        (rls_handler(FUZZED.service, app.internal_error),
         "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"),
        (check_handler(app), "/envoy.service.auth.v3.Authorization/Check"),
        (Health().handler(), "/grpc.health.v1.Health/Check"),
    ]
    for generic, path in handlers:
        method = generic.service(Method(path))
        context = _Context()
        try:
            answer = asyncio.run(method.unary_unary(method.request_deserializer(data), context))
            method.response_serializer(answer)
        except _Aborted:
            assert context.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert FUZZED.engine.metrics.errors.value == 0
