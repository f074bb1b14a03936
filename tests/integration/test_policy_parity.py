"""The Redis store's Lua (evaluate.lua and the scripts beside it) held to the
request-phase policy of ``sidecar.policy``, the one reference: random traces
of requests and responses through a real redis-server and through the policy
over the smallest table, on the same clock, answer the same to the
nanosecond."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, example, given, settings

from sidecar.store.local import LocalStore
from sidecar.store.redis import RedisStore
from tests.integration.redis_server import RedisServer
from tests.unit.dict_table import DictTable
from tests.unit.policy_traces import Request, Response, Step, replay, traces

pytestmark = pytest.mark.integration


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(trace=traces)
# A key this node knows over limit, then a ban of the address by another rule
# of this node: the next request of the address is the ban's, not the key's.
@example(trace=[(0.0, Request("192.0.2.1", rules, False, False, repeat))
                for rules, repeat in ((("ban",), 1), (("ban",), 1), (("fixed",), 3), (("ban",), 1), (("fixed",), 1))])
# A batch beyond a bucket's burst on a key never seen, refused with the
# rule's penalty: the penalty holds for the key's next request, then ends.
@example(trace=[(advance, Request("192.0.2.1", ("batch",), False, False, 1)) for advance in (0.0, 0.05, 4.0)])
@example(trace=[(0.0, Request("192.0.2.1", ("batch",), False, False, 1)),
                (0.05, Request("192.0.2.1", ("ban",), False, False, 1)),
                (0.0, Request("192.0.2.1", ("ban", "batch"), False, False, 1))])
# A slot whose lease ended while its key was not full, given back by a
# later report: still held (both drop ended leases only when the key is full).
@example(trace=[(0.0, Request("192.0.2.1", ("ban",), False, False, 1)),
                (0.0, Request("192.0.2.1", ("slots",), False, False, 1)),
                (11.0, Request("192.0.2.1", ("slots",), False, False, 1)),
                (0.0, Request("192.0.2.1", ("ban",), False, False, 1)),
                (0.0, Response("192.0.2.1", 0, 3))])
def test_the_lua_decides_every_trace_as_the_policy_does(redis_server: RedisServer, trace: list[Step]) -> None:
    redis_server.client().flushdb()

    async def through_redis() -> list:
        # The decisions are compared, not the deadline: a machine that stalls
        # past the default 0.1 s must not fail a connection here.
        store = RedisStore.from_url(redis_server.url, "node", timeout=5.0, server_time=False)
        try:
            return await replay(store, trace)
        finally:
            await store.close()

    assert asyncio.run(through_redis()) == asyncio.run(replay(LocalStore(DictTable(), "node"), trace))
