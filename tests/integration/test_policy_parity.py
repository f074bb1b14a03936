"""The Redis store's Lua (evaluate.lua and the scripts beside it) held to the
request-phase policy of ``sidecar.policy``, the one reference: random traces
of requests and responses through a real redis-server and through the policy
over the smallest table, on the same clock, answer the same to the
nanosecond."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings

from sidecar.store.local import LocalStore
from sidecar.store.redis import RedisStore
from tests.integration.redis_server import RedisServer
from tests.unit.dict_table import DictTable
from tests.unit.policy_traces import Step, replay, traces

pytestmark = pytest.mark.integration


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(trace=traces)
def test_the_lua_decides_every_trace_as_the_policy_does(redis_server: RedisServer, trace: list[Step]) -> None:
    redis_server.client().flushdb()

    async def through_redis() -> list:
        store = RedisStore.from_url(redis_server.url, "node", server_time=False)
        try:
            return await replay(store, trace)
        finally:
            await store.close()

    assert asyncio.run(through_redis()) == asyncio.run(replay(LocalStore(DictTable(), "node"), trace))
