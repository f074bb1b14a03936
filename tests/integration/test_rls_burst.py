"""A burst of simultaneous Rate Limit Service calls on one descriptor, with
the Redis backend, admits exactly the budget: through Envoy's ratelimit
filter (hundreds of client connections at once) and straight to Sluice's
gRPC port (a thousand calls in flight over many channels); no store error
and no internal error is counted. The stack fails closed, so a call the
store could not decide would be refused and counted."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from devstack.launcher import Stack
from sidecar.frontdoors.messages import OK, RATE_LIMIT_SERVICE, SHOULD_RATE_LIMIT, RateLimitRequest, RateLimitResponse
from tests.integration.burst import burst
from tests.integration.conftest import fresh_client_address, sluice_metric, start_stack
from tests.integration.redis_server import RedisServer
from tests.integration.test_rls_stack import failed_open

pytestmark = pytest.mark.integration

BUDGET = 50


@pytest.fixture(scope="module")
def rls_redis_stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("rls-burst")
    rules = directory / "rules.yaml"
    rules.write_text(f'state: {{backend: redis, url: "{redis_server.url}", fail: closed}}\nrules: []\n')
    config = directory / "ratelimit"
    config.mkdir()
    # The shipped rate_limits' descriptors: per address, and per address and key.
    (config / "sluice.yaml").write_text(f"""\
domain: sluice
descriptors:
  - key: remote_address
    rate_limit: {{unit: hour, requests_per_unit: {BUDGET}}}
    descriptors:
      - key: api_key
        rate_limit: {{unit: hour, requests_per_unit: 1000000}}
""")
    # Envoy's 1 s timeout for the call would let a slow answer through
    # unchecked, as documented; what is tested is Sluice's count.
    stack = start_stack(directory / "stack", Path(rules), {"SLUICE_CHECK_TIMEOUT": "20s"}, rls_config=config)
    yield stack
    stack.stop()


@pytest.mark.parametrize("concurrency", [200, 800])
def test_a_burst_through_the_ratelimit_filter_admits_exactly_the_budget(rls_redis_stack: Stack,
                                                                         concurrency: int) -> None:
    errors = sluice_metric(rls_redis_stack, "sluice_store_errors_total")
    unchecked = failed_open(rls_redis_stack)
    statuses = burst(rls_redis_stack.ports.envoy_rls, concurrency, "/burst", source=fresh_client_address())
    # What would explain a wrong count, asserted first: a call Envoy let
    # through on an error, a store error, an internal error.
    assert failed_open(rls_redis_stack) == unchecked, statuses
    assert sluice_metric(rls_redis_stack, "sluice_store_errors_total") == errors, statuses
    assert sluice_metric(rls_redis_stack, "sluice_internal_errors_total") == 0, statuses
    assert statuses == {200: BUDGET, 429: concurrency - BUDGET}


def test_a_thousand_calls_in_flight_admit_exactly_the_budget(rls_redis_stack: Stack) -> None:
    address = "192.0.2.77"

    async def calls() -> collections.Counter[int]:
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{rls_redis_stack.ports.sluice_grpc}") for _ in range(20)]
        try:
            methods = [channel.unary_unary(f"/{RATE_LIMIT_SERVICE}/{SHOULD_RATE_LIMIT}",
                                           request_serializer=RateLimitRequest.SerializeToString,
                                           response_deserializer=RateLimitResponse.FromString)
                       for channel in channels]
            request = RateLimitRequest(domain="sluice")
            request.descriptors.add().entries.add(key="remote_address", value=address)
            answers = await asyncio.gather(*(methods[n % len(methods)](request, timeout=30) for n in range(1000)))
        finally:
            await asyncio.gather(*(channel.close() for channel in channels))
        return collections.Counter(answer.overall_code for answer in answers)

    codes = asyncio.run(calls())
    assert codes[OK] == BUDGET and sum(codes.values()) == 1000
    assert sluice_metric(rls_redis_stack, "sluice_internal_errors_total") == 0
