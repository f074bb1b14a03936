"""Counts and bans in Redis (or Valkey), shared by every node and worker (SPEC §9).

Each operation is one Lua script, shipped as a file under ``sidecar/lua/``,
registered once and called by its digest (EVALSHA, loaded again after
NOSCRIPT): a request's ban check and all its checks are one atomic step and
one round trip. The scripts run the algorithms of ``sidecar.limiters`` line
for line (the Lua files each algorithm names are prepended to every script),
with the memory store's deferred charging of buckets; the draft RateLimit
quotas come back with the decision. Each limiter encodes its own arguments
(``redis_args``): this module never learns which algorithm a check runs.

Every key carries the hash tag ``{sluice}``, so the multi-key scripts are
valid on Redis Cluster; the price is that all of Sluice's keys live in one
slot, on one shard. Every key has an expiry: a counter's when its window no
longer weighs in and its penalty is over, a ban's when it ends.

Time is the Redis server's (``TIME``), which all nodes share; with
``server_time=False`` the scripts use the ``now`` the engine passes (tests
with a fake clock). Durations come back, never instants, and are turned
into the caller's clock, so ban records look as they do from MemoryStore.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii
import time
from importlib import resources
from typing import Any, Callable, Sequence

from sidecar.keys import CountingKey
from sidecar.limiters import ALLOWED, Hit, lua_libraries
from sidecar.store import StoreUnavailable
from sidecar.store.penalties import PenaltyCache
from sidecar.store.redis_pipeline import PipelinedRedis
from sidecar.state import BanRecord, Check, Clock, Evaluation, ResponseCount

__all__ = ["RedisStore", "StoreUnavailable", "counting_key", "ban_key"]

PREFIX = "{sluice}:"
COUNT_PREFIX = PREFIX + "count:"
BAN_PREFIX = PREFIX + "ban:"
BAN_INDEX = PREFIX + "bans"

# A store that does not answer within this is unavailable for this request
# (SPEC §9): the request fails open (or closed) instead of waiting.
DEFAULT_TIMEOUT = 0.1


def counting_key(key: CountingKey) -> str:
    """The Redis key of a counting key tuple: its JSON, which is readable in
    redis-cli and unambiguous (strings are quoted and escaped).

    Written out, because it runs for every rule of every request and
    ``json.dumps`` builds an encoder per call (15 % of a ten-rule check):
    the rule's part is encoded once, a text value with the C escaper that
    ``json.dumps`` itself uses; anything else goes through ``json.dumps``.
    """
    prefix = key[0]
    head = _PREFIX_JSON.get(prefix)
    if head is None:
        if len(_PREFIX_JSON) >= _MAX_PREFIXES:
            _PREFIX_JSON.clear()  # only many reloads with ever new rules get here
        head = _PREFIX_JSON[prefix] = COUNT_PREFIX + "[" + _json(prefix)
    parts = [head]
    for value in key[1:]:
        parts.append(encode_basestring_ascii(value) if type(value) is str else _json(value))
    return ",".join(parts) + "]"


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


# The JSON of each rule's part of its keys (rule id, dimension names).
_PREFIX_JSON: dict[object, str] = {}
_MAX_PREFIXES = 4096


def ban_key(address: str) -> str:
    return BAN_PREFIX + address


def _script(name: str) -> str:
    lua = resources.files("sidecar") / "lua"
    return "\n".join((lua / f"{part}.lua").read_text() for part in (*lua_libraries(), name))


def _flag(value: bool) -> str:
    return "1" if value else "0"


# The auto-ban arguments of a request without a challenge rule: read by the
# script, never used.
_NO_AUTO_BAN = ("W", "1", "1", "0", "0", "0", "")


def _hits(values: Sequence[Any]) -> list[Hit]:
    return [Hit(True, float(values[i + 1])) if int(values[i]) else ALLOWED
            for i in range(0, len(values), 2)]


class RedisStore:
    """The shared state store: each operation is one round trip."""

    answers_at_once = False

    def __init__(self, client: PipelinedRedis, node: str, server_time: bool = True,
                 wall_clock: Clock = time.time, max_keys: int = 100_000,
                 clock: Clock = time.monotonic) -> None:
        self.client = client
        self.node = node
        # Keys known over limit: answered on this node, no round trip.
        self.penalties = PenaltyCache(max_keys, clock)
        self.server_time = server_time
        self._wall_clock = wall_clock
        self._evaluate = client.script(_script("evaluate"))
        self._record = client.script(_script("record"))
        self._bans = client.script(_script("bans"))
        self._lift_ban = client.script(_script("lift_ban"))
        self._release = client.script(_script("release"))

    @classmethod
    def from_url(cls, url: str, node: str, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> "RedisStore":
        # One pipelined connection carries every decision in flight (see
        # sidecar.store.redis_pipeline): a burst is a queue Redis works through, never a
        # pool that runs out and fails requests open while Redis is fine.
        return cls(PipelinedRedis(url, timeout), node, **kwargs)

    def _now(self, now: float) -> str:
        return "" if self.server_time else repr(now)

    async def evaluate(self, now: float, address: str, checks: Sequence[Check],
                       can_delay: bool = True, quotas: bool = False) -> Evaluation:
        """MemoryStore.evaluate in one script; with ``quotas``, also every
        counting check's (remaining, reset, window) after the decision, as
        the memory store answers (None for the others). Keys known over
        limit are answered here (see sidecar.store.penalties)."""
        known = self.penalties.answer(now, checks)
        if known is not None:
            return known
        auto_ban = next((check.auto_ban for check in checks if check.auto_ban is not None), None)
        keys = [ban_key(address), BAN_INDEX, counting_key(auto_ban.key(address)) if auto_ban else BAN_INDEX]
        args = [self._now(now), address, self.node, repr(self._wall_clock())]
        if auto_ban is not None:
            args += auto_ban.limiter.redis_args(auto_ban.threshold)
            args.append(repr(float(auto_ban.duration)))
        else:
            args += _NO_AUTO_BAN
        args += [_flag(can_delay), _flag(quotas)]
        for check in checks:
            keys.append(counting_key(check.key))
            args += [check.rule_id, _flag(check.count), _flag(check.stops),
                     "" if check.ban_duration is None else repr(float(check.ban_duration)),
                     _flag(check.auto_ban is not None)]
            args += check.limiter.redis_args(check.threshold, check.lease)
        result = await self.client.evalsha(self._evaluate, keys, args)
        banned, new_ban, rule_id, node, started, remaining, duration, delay, evaluated = result[:9]
        end = 9 + 2 * int(evaluated)
        evaluation = Evaluation(new_ban=bool(int(new_ban)), hits=_hits(result[9:end]), delay=float(delay))
        if quotas and not int(banned):
            values = result[end:]
            evaluation.quotas = [(int(values[i]), float(values[i + 1]), float(values[i + 2]))
                                 if values[i] != "" else None for i in range(0, len(values), 3)]
        if int(banned) or evaluation.new_ban:
            evaluation.ban = BanRecord(address, rule_id, node, float(started), now + float(remaining),
                                       float(duration))
        else:
            self.penalties.learn(now, checks, evaluation.hits)
        return evaluation

    async def record(self, now: float, counts: Sequence[ResponseCount]) -> list[Hit]:
        args = [self._now(now)]
        for count in counts:
            args.append(str(count.amount))
            args += count.limiter.redis_args(count.threshold)
        result = await self.client.evalsha(self._record, [counting_key(count.key) for count in counts], args)
        return _hits(result)

    async def release(self, lease: str, keys: Sequence[CountingKey]) -> int:
        """Every slot of the request in one script call, by its lease id."""
        return int(await self.client.evalsha(self._release, [counting_key(key) for key in keys], [lease]))

    async def active_bans(self, now: float) -> list[BanRecord]:
        # The script reads the records by name under the ban prefix: they
        # share the index's hash slot, so this holds on a cluster too.
        values = await self.client.evalsha(self._bans, [BAN_INDEX, BAN_PREFIX], [self._now(now)])
        return [BanRecord(values[i], values[i + 1], values[i + 2], float(values[i + 3]),
                          now + float(values[i + 4]), float(values[i + 5]))
                for i in range(0, len(values), 6)]

    async def lift_ban(self, address: str) -> bool:
        return bool(await self.client.evalsha(self._lift_ban, [ban_key(address), BAN_INDEX], [address]))

    def may_be_banned(self) -> bool:
        return True  # another node may have banned anyone: the script checks

    def configure(self, max_keys: int, node: str) -> None:
        """New settings from a reload. ``max_keys`` bounds the node's cache of
        keys over limit; Redis's own ``maxmemory`` bounds the shared state,
        where every key expires."""
        self.node = node
        self.penalties.configure(max_keys)

    def gauges(self) -> dict[str, tuple[str, Callable[[], float]]]:
        # Bans and keys are Redis's to count (INFO keyspace); the node's own
        # cache of keys over limit is this node's.
        return {"sluice_penalty_cache_keys": ("Keys known over limit on the shared store, answered "
                                              "on this node until their wait ends.",
                                              lambda: len(self.penalties)),
                "sluice_penalty_cache_answers": ("Requests answered from the cache of keys over "
                                                 "limit, without a round trip (a running count).",
                                                 lambda: self.penalties.answered)}

    async def close(self) -> None:
        await self.client.close()
