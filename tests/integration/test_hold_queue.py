"""``state.max_delayed`` bounds the requests a leaky bucket holds, with the
memory store and with a real Redis, also when decisions are in flight at
once: a hold slot is taken before the store is asked, and given back on
every path (the wait ends, the client goes away, or nothing is held)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sidecar.app import SluiceApp
from sidecar.engine import Engine
from sidecar.store.redis import RedisStore
from tests.integration.redis_server import RedisServer
from tests.unit.conftest import ruleset_from

pytestmark = pytest.mark.integration

MAX_DELAYED = 100
RULES = f"""\
state: {{backend: BACKEND, url: "URL", max_delayed: {MAX_DELAYED}}}
rules:
  - id: slow
    key: [ip]
    limit: {{rate: 1r/m, burst: 5000, delay: 0}}
    action: block
"""



def make_engine(backend: str, redis_server: RedisServer) -> Engine:
    ruleset = ruleset_from(RULES.replace("BACKEND", backend).replace("URL", redis_server.url))
    if backend == "redis":
        redis_server.client().flushdb()
        return Engine(ruleset, store=RedisStore.from_url(redis_server.url, "a"))
    return Engine(ruleset)


class CheckCall:
    """One nginx check in flight: answered, held (waiting for its slot), or neither yet."""

    def __init__(self, app: SluiceApp) -> None:
        self.status: int | None = None
        self.held = False
        self.gone = asyncio.get_running_loop().create_future()
        scope = {"type": "http", "path": "/v1/nginx/auth", "raw_path": b"/v1/nginx/auth", "method": "GET",
                 "query_string": b"", "headers": [(b"x-sluice-client-addr", b"10.70.0.1")],
                 "client": ("127.0.0.1", 5000), "scheme": "http"}
        self.task = asyncio.ensure_future(app(scope, self.receive, self.send))

    async def receive(self) -> dict[str, Any]:
        # Only a held request listens for its client going away.
        self.held = True
        return await self.gone

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]

    def leave(self) -> None:
        if not self.gone.done():
            self.gone.set_result({"type": "http.disconnect"})


async def settled(calls: list[CheckCall]) -> None:
    """Until every call is answered or held (at most 10 s)."""
    for _ in range(1000):
        if all(call.status is not None or call.held for call in calls):
            return
        await asyncio.sleep(0.01)
    pytest.fail("checks neither answered nor held within 10 s")


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_concurrent_decisions_hold_no_more_than_max_delayed(backend: str, redis_server: RedisServer) -> None:
    async def run() -> tuple[int, int, int, int, int]:
        engine = make_engine(backend, redis_server)
        app = SluiceApp(engine)
        # 91 one after the other: the first passes at once, 90 are held.
        first: list[CheckCall] = []
        for _ in range(91):
            first.append(CheckCall(app))
            await settled(first)
        # Then 60 at once: room for 10 more.
        burst = [CheckCall(app) for _ in range(60)]
        calls = first + burst
        await settled(calls)
        held = sum(call.held and call.status is None for call in calls)
        allowed = sum(call.status == 200 for call in calls)
        refused = sum(call.status == 403 for call in calls)
        taken = engine.delayed
        for call in calls:
            call.leave()
        await asyncio.gather(*(call.task for call in calls))
        return held, allowed, refused, taken, engine.delayed

    held, allowed, refused, taken, after = asyncio.run(run())
    assert (held, allowed, refused) == (MAX_DELAYED, 1, 50)
    assert taken == MAX_DELAYED
    assert after == 0  # every slot given back when the clients left
