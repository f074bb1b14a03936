"""Counts and bans in Redis (or Valkey), shared by every node and worker.

Each operation is one Lua script, shipped as a file under ``sidecar/lua/``,
registered once and called by its digest (EVALSHA, loaded again after
NOSCRIPT): a request's ban check and all its checks are one atomic step and
one round trip. The scripts run the request-phase policy of
``sidecar.policy`` (the one reference, which the parity tests hold them to)
and the algorithms of ``sidecar.limiters`` line for line (the Lua files each
algorithm names are prepended to every script); the draft RateLimit quotas
come back with the decision. Each limiter encodes its own arguments
(``redis_args``): this module never learns which algorithm a check runs.

Every key carries a hash tag of its subject (see ``counting_key``). On a
single Redis that changes nothing; on a Redis Cluster (``ClusterRedis``)
it spreads the keys of different clients over every master, while the
keys of one client share a slot with its ban record, so that a request's
per-client checks stay one atomic script. Checks of other slots are one
call each, sent at once. Every key has an expiry: a counter's when its
window no longer weighs in and its penalty is over, a ban's when it ends;
but the tier assignments made at run time, which last until they are
removed (see sidecar.store.redis_admin).

Time is the Redis server's (``TIME``), which all nodes share; with
``server_time=False`` the scripts use the ``now`` the engine passes (tests
with a fake clock). Durations come back, never instants, and are turned
into the caller's clock, so ban records look as they do from MemoryStore.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import json
import time
import zlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from importlib import resources
from json.encoder import encode_basestring_ascii
from typing import Any

from sidecar.bounded import BoundedMap
from sidecar.counters import CounterState, KeySelection
from sidecar.keys import CountingKey, key_dimensions
from sidecar.limiters import UNDER_LIMIT, Hit, Quota, refused
from sidecar.limiters.registry import NO_LIMITER, lua_sources
from sidecar.limiters.window import WINDOW
from sidecar.networkbans import NetworkBans
from sidecar.state import BanRecord, Check, Clock, Evaluation, ResponseCount, epoch_clock
from sidecar.store import Described, StoreUnavailable
from sidecar.store.penalties import PenaltyCache
from sidecar.store.redis_admin import (
    ADMIN_VERSION,
    COUNT_INFIX,
    NETWORK_HEAD,
    NETWORK_INDEX,
    TIERS,
    TIERS_VERSION,
    VERSION_KEPT_MS,
    AdminCopy,
    glob_escape,
    key_of_name,
    network_record,
    new_version,
    scan,
)
from sidecar.store.redis_cluster import ClusterRedis
from sidecar.store.redis_pipeline import PipelinedRedis, RedisAddress
from sidecar.tiers import MAX_ASSIGNMENTS, TierAssignments

__all__ = ["RedisStore", "StoreUnavailable", "counting_key", "ban_key"]

PREFIX = "sluice:"
BAN_INDEX = PREFIX + "bans"
# A ban record is "sluice:{ADDRESS}:ban".
BAN_HEAD, BAN_TAIL = PREFIX + "{", "}:ban"

# A store that does not answer within this is unavailable for this request:
# the request fails open (or closed) instead of waiting.
DEFAULT_TIMEOUT = 0.1


def counting_key(key: CountingKey) -> str:
    """The Redis key of a counting key tuple: ``sluice:{TAG}:count:`` and
    the tuple's JSON, which is readable in redis-cli and unambiguous
    (strings are quoted and escaped).

    The hash tag is the key's subject: the client address for a key that
    counts per address, so that on a Redis Cluster every such key of one
    client shares the slot of its ban record, and one atomic script decides
    the request; a CRC of the JSON for any other key.

    Written out, because it runs for every rule of every request and
    ``json.dumps`` builds an encoder per call (15 % of a ten-rule check):
    the rule's part is encoded once, a text value with the C escaper that
    ``json.dumps`` itself uses; anything else goes through ``json.dumps``.
    """
    prefix = key[0]
    rule = _RULE_PARTS.get(prefix)
    if rule is None:
        if len(_RULE_PARTS) >= _MAX_PREFIXES:
            _RULE_PARTS.clear()  # only many reloads with ever new rules get here
        names = key_dimensions(key)
        rule = _RULE_PARTS[prefix] = ("[" + _json(prefix), names.index("ip") + 1 if "ip" in names else 0)
    head, address_at = rule
    parts = [head]
    for value in key[1:]:
        parts.append(encode_basestring_ascii(value) if type(value) is str else _json(value))
    body = ",".join(parts) + "]"
    tag = key[address_at] if address_at else f"{zlib.crc32(body.encode()):08x}"
    return f"{PREFIX}{{{tag}}}:count:{body}"


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


# Each rule's part of its keys (rule id, dimension names): its JSON, and
# where in the key the client address is (0: nowhere).
_RULE_PARTS: dict[object, tuple[str, int]] = {}
_MAX_PREFIXES = 4096


def ban_key(address: str) -> str:
    return BAN_HEAD + address + BAN_TAIL


# A shadow rule's would-be ban of an address, in the address's slot: listed
# beside the bans, read by no script that decides.
SHADOW_TAIL = "}:shadowban"


def shadow_ban_key(address: str) -> str:
    return BAN_HEAD + address + SHADOW_TAIL


def _script(name: str) -> str:
    """A script: every kind's Lua (the limiter registry's), then the ban
    helpers and the script's own file."""
    lua = resources.files("sidecar") / "lua"
    return "\n".join((*lua_sources(), *((lua / f"{part}.lua").read_text()
                                        for part in ("ban_record", "ban_history", name))))


def _lua_string(text: str) -> str:
    """A Lua string literal: printable ASCII as is, any other byte escaped."""
    return '"' + "".join(chr(byte) if 32 <= byte < 127 and byte not in b'"\\' else f"\\{byte:03d}"
                         for byte in text.encode()) + '"'


class _RuleTable:
    """What each kind of check does, numbered once and written into the
    evaluation script as the Lua table RULES: the rule id, its flags and its
    limiter's arguments. A request then sends one number per check instead
    of eleven arguments, and Redis parses one.

    A kind of check is a rule with its effective threshold (overrides scale
    it) and flags (a verified bot neither stops nor bans), so the table grows
    only with the rules file, never with traffic; a reload starts a new one.
    A check never seen makes a new version of the script, loaded at once on
    the connections already open (ahead of the commands that use it); the
    last few versions stay registered for callers still using them.
    """

    KEEP = 4  # versions registered with the client

    def __init__(self, client: PipelinedRedis | ClusterRedis, body: str) -> None:
        self._client = client
        self.body = body
        # kind -> (its number, the limiter, kept so that its id stays its own)
        self._numbers: dict[tuple[Any, ...], tuple[str, Any]] = {}
        self._entries: list[str] = []
        self._versions: collections.deque[str] = collections.deque()
        self.digest = ""  # none until the first request

    def numbers(self, checks: Sequence[Check]) -> list[str]:
        """Each check's number; kinds never seen are added, in one new version."""
        numbers = []
        added = False
        for check in checks:
            kind = (id(check.limiter), check.threshold, check.rule_id, check.spec.count, check.stops,
                    check.ban_duration, check.auto_ban is not None, check.ban_increment, check.penalty_ban)
            known = self._numbers.get(kind)
            if known is None:
                known = self._numbers[kind] = str(len(self._entries) + 1), check.limiter
                fields = [check.rule_id, _flag(check.spec.count), _flag(check.stops), _ban_spec(check),
                          _flag(check.auto_ban is not None), *check.limiter.redis_args(check.threshold)]
                if check.penalty_ban is not None:
                    fields += check.penalty_ban.lua_fields()
                self._entries.append("{" + ",".join(map(_lua_string, fields)) + "}")
                added = True
            numbers.append(known[0] if check.amount == 1 else f"{known[0]}*{check.amount}")
        if added or not self.digest:
            self.digest = self._publish()
        return numbers

    def _publish(self) -> str:
        digest = self._client.script("local RULES = {" + ",\n".join(self._entries) + "}\n" + self.body)
        self._versions.append(digest)
        if len(self._versions) > self.KEEP:
            self._client.forget(self._versions.popleft())
        return digest

    def close(self) -> None:
        for digest in self._versions:
            self._client.forget(digest)


def _flag(value: bool) -> str:
    return "1" if value else "0"


def _ban_spec(check: Check) -> str:
    """A check's ban duration in RULES: '' for none, 'D F M R' for a ban
    that escalates (ban_history.lua)."""
    if check.ban_duration is None:
        return ""
    if check.ban_increment is not None:
        return check.ban_increment.lua_spec(check.ban_duration)
    return repr(float(check.ban_duration))


# The auto-ban arguments of a request without a challenge rule: read by the
# script, never used.
_NO_AUTO_BAN = (WINDOW, "1", "1", "0", "0", "0", "")
# inspect.lua's arguments for a key no rule running now counts.
_NO_LIMITER = (NO_LIMITER, "", "", "", "", "")
# Keys of one command an admin call sends at most.
BATCH = 1000


def _hits(values: Sequence[Any]) -> list[Hit]:
    return [refused(float(values[i + 1])) if int(values[i]) else UNDER_LIMIT
            for i in range(0, len(values), 2)]


async def _all(calls: Sequence[Awaitable[Any]]) -> list[Any]:
    """The results of calls made at once (one is awaited as it is)."""
    return [await calls[0]] if len(calls) == 1 else list(await asyncio.gather(*calls))


class Mode(enum.StrEnum):
    """What one call of evaluate.lua does about bans (see the script)."""

    SINGLE = "F"  # a single Redis: the ban check, and a ban written with its index entry
    ADDRESS_SLOT = "S"  # the address's slot: the ban check, and a ban written without the index
    OTHER_SLOT = "N"  # another slot: no ban check; a ban is answered as wanted, issued by the caller


class _Part:
    """One call of the evaluation script: the checks of one hash slot (all
    of them on a single Redis), and what the script answered for them."""

    __slots__ = ("mode", "indices", "banned", "new_ban", "ban", "delay", "hits", "quotas", "step")

    def __init__(self, mode: Mode, indices: list[int]) -> None:
        self.mode = mode  # see evaluate.lua
        self.indices = indices

    def read(self, result: list[Any], quotas: bool) -> None:
        banned, new_ban, *ban, delay, evaluated = result[:9]
        end = 9 + 2 * int(evaluated)
        self.banned, self.new_ban, self.ban = bool(int(banned)), int(new_ban), ban
        self.delay = float(delay)
        self.hits = _hits(result[9:end])
        self.step = result[-1]  # the ban's, last
        self.quotas = None
        if quotas and not self.banned:
            values = result[end:-1]
            self.quotas = [Quota(int(values[i]), float(values[i + 1]), float(values[i + 2]))
                           if values[i] != "" else None for i in range(0, len(values), 3)]

class RedisStore:
    """The shared state store: each operation is one round trip (to each
    master involved, in parallel, on a Redis Cluster)."""

    answers_at_once = False

    def __init__(self, client: PipelinedRedis | ClusterRedis, node: str, server_time: bool = True,
                 wall_clock: Clock = time.time, max_keys: int = 100_000,
                 clock: Clock = epoch_clock) -> None:
        self.client = client
        self.node = node
        # Keys known over limit: answered on this node, no round trip.
        self.penalties = PenaltyCache(max_keys, clock)
        self.server_time = server_time
        self._wall_clock = wall_clock
        self._rules = _RuleTable(client, _script("evaluate"))
        self._issue_ban = client.script(_script("issue_ban"))
        self._record = client.script(_script("record"))
        self._bans = client.script(_script("bans"))
        self._ban_of = client.script(_script("ban_of"))
        self._lift_ban = client.script(_script("lift_ban"))
        self._release = client.script(_script("release"))
        self._scripts: dict[str, str] = {}
        self._writes: set[asyncio.Task[None]] = set()  # shadow bans being written
        # address -> when the shadow ban this node last wrote for it ends
        self._shadow_written = BoundedMap(max_keys, lambda expires: expires, clock)
        # address -> when the ban an evaluation of this node gave it ends: its
        # requests are asked of Redis (which refuses them with the ban), not
        # answered from the cache of keys over limit with a rule's page.
        self._banned_here = BoundedMap(max_keys, lambda expires: expires, clock)
        self._clock = clock
        self.admin = AdminCopy(self._admin_state, self._ban_record, self.penalties, clock)
        self.network_bans: NetworkBans = self.admin.network_bans  # read again in place on changes
        self.tier_assignments: TierAssignments = self.admin.tier_assignments  # likewise

    @classmethod
    def from_url(cls, url: str, node: str, timeout: float = DEFAULT_TIMEOUT,
                 cluster: Sequence[tuple[str, int]] | None = None, **kwargs: Any) -> RedisStore:
        # One pipelined connection (per cluster master) carries every
        # decision in flight (see sidecar.store.redis_pipeline): a burst is a
        # queue Redis works through, never a pool that runs out and fails
        # requests open while Redis is fine.
        client: PipelinedRedis | ClusterRedis = PipelinedRedis(url, timeout) if not cluster else \
            ClusterRedis(cluster, RedisAddress(url), timeout)
        return cls(client, node, **kwargs)

    def _now(self, now: float) -> str:
        return "" if self.server_time else repr(now)

    async def evaluate(self, now: float, address: str, checks: Sequence[Check],
                       can_delay: bool = True, quotas: bool = False) -> Evaluation:
        """``Policy.evaluate`` (sidecar.policy) in one script; with
        ``quotas``, also every counting check's (remaining, reset, window)
        after the decision, as the policy answers (None for the others). Keys known over
        limit are answered here (see sidecar.store.penalties).

        On a Redis Cluster the checks are split by hash slot, one call each,
        all at once: the checks that count per client share the address's
        slot with its ban record and are one atomic step; see docs/redis.md
        for what holds across slots."""
        banned = self._banned_here.data
        if not banned or banned.get(address, now) <= now:
            known = self.penalties.answer(now, checks)
            if known is not None:
                return known
        names = [counting_key(check.key) for check in checks]
        auto_ban = next((check.auto_ban for check in checks if check.auto_ban is not None), None)
        head = [self._now(now), address, self.node, repr(self._wall_clock())]
        if auto_ban is not None:
            head += auto_ban.limiter.redis_args(auto_ban.threshold)
            head.append(repr(float(auto_ban.duration)))
        else:
            head += _NO_AUTO_BAN
        # The request's lease id, for the concurrency slots it may take.
        lease = next((check.lease for check in checks if check.lease), "")
        head += [_flag(can_delay), _flag(quotas)]
        record = ban_key(address)
        # The address's challenge counter (auto-ban), in the record's slot.
        counter = counting_key(auto_ban.key(address)) if auto_ban else record
        parts = self._parts(address, names)
        rules = self._rules
        numbers = rules.numbers(checks)
        calls = []
        for part in parts:
            if part.mode == Mode.SINGLE:
                keys = [record, BAN_INDEX, counter]
            elif part.mode == Mode.ADDRESS_SLOT:
                keys = [record, record, counter]
            else:
                keys = [names[part.indices[0]]] * 3
            args = head + [part.mode, lease]
            for i in part.indices:
                keys.append(names[i])
                args.append(numbers[i])
            calls.append(self.client.evalsha(rules.digest, keys, args))
        results = await _all(calls)
        for part, result in zip(parts, results):
            part.read(result, quotas)
        evaluation = await self._combined(now, address, checks, parts, [record, counter], head[:11], quotas)
        if evaluation.ban is None:
            self.penalties.learn(now, checks, evaluation.hits)
        else:
            self._banned_here[address] = evaluation.ban.expires
        return evaluation

    def _parts(self, address: str, names: list[str]) -> list[_Part]:
        """The calls of one evaluation: one on a single Redis, else one per
        hash slot, the address's first (it checks the ban)."""
        if not self.client.clustered:
            return [_Part(Mode.SINGLE, list(range(len(names))))]
        groups = self._by_slot(names, ban_key(address) if address else None)
        return [_Part(Mode.ADDRESS_SLOT if address and n == 0 else Mode.OTHER_SLOT, indices)
                for n, indices in enumerate(groups)]

    def _by_slot(self, names: Sequence[str], first: str | None = None) -> list[list[int]]:
        """The positions of ``names`` grouped by hash slot (one group on a
        single Redis); with ``first``, its slot's group comes first, empty
        if no name shares it."""
        slots: dict[int, list[int]] = {}
        if first is not None:
            slots[self.client.slot(first)] = []
        for i, name in enumerate(names):
            slots.setdefault(self.client.slot(name), []).append(i)
        return list(slots.values())

    async def _combined(self, now: float, address: str, checks: Sequence[Check], parts: list[_Part],
                        own: list[str], head: list[str], quotas: bool) -> Evaluation:
        """The evaluation the parts' answers make, as one script would have
        made it: the hits in rule order up to the first refusal that ends
        evaluation, and the ban that refusal issues."""
        first = parts[0] if parts else None
        if first is not None and first.banned:
            return Evaluation(ban=self._ban_record(address, now, [*first.ban, first.step]))
        evaluation = Evaluation()
        refusing: _Part | None = None
        if len(parts) == 1:
            # One script (a single Redis, or every check in the address's
            # slot): it already stopped where evaluation stops.
            evaluation.hits = first.hits if first is not None else []
            if evaluation.hits and evaluation.hits[-1].over_limit and checks[len(evaluation.hits) - 1].stops:
                refusing = first
        else:
            # Each part's checks in rule order: the hits up to the first
            # refusal of any part (later checks of other parts counted too).
            owner: list[_Part | None] = [None] * len(checks)
            hit_at: list[Hit | None] = [None] * len(checks)
            for part in parts:
                for i, answered in zip(part.indices, part.hits):
                    owner[i], hit_at[i] = part, answered
            for i, found in enumerate(hit_at):
                assert found is not None  # a part stops only after an earlier refusal
                evaluation.hits.append(found)
                if found.over_limit and checks[i].stops:
                    refusing = owner[i]
                    break
        if refusing is None:
            evaluation.delay = max((part.delay for part in parts), default=0.0)
        elif refusing.new_ban == 1:
            evaluation.new_ban = True
            evaluation.ban = self._ban_record(address, now, [*refusing.ban, refusing.step])
        elif refusing.new_ban:
            # A check in another slot than the address's called for a ban
            # (or one more challenge towards the auto-ban): issued there now.
            duration = refusing.ban[4] if refusing.new_ban == 2 else ""
            result = await self.client.evalsha(self._issue_ban, own, head + [refusing.ban[0], duration])
            if int(result[0]):
                evaluation.new_ban = True
                evaluation.ban = self._ban_record(address, now, result[1:])
        if quotas and evaluation.ban is None:
            quota_of = {i: quota for part in parts for i, quota in zip(part.indices, part.quotas or ())}
            evaluation.quotas = [quota_of.get(i) for i in range(len(checks))]
        return evaluation

    @staticmethod
    def _ban_record(address: str, now: float, fields: Sequence[Any]) -> BanRecord:
        """A ban from the scripts' fields: rule, node, started, remaining,
        duration, then the step of an escalating ban and the reason of one
        issued by hand, when the script reads them."""
        rule_id, node, started, remaining, duration, *rest = fields
        step = int(rest[0]) if rest and rest[0] not in ("", None) else 0
        return BanRecord(address, rule_id, node, float(started), now + float(remaining), float(duration),
                         step=step, reason=rest[1] if len(rest) > 1 else "")

    async def record(self, now: float, counts: Sequence[ResponseCount]) -> list[Hit]:
        names = [counting_key(count.key) for count in counts]
        groups = self._by_slot(names)
        calls = []
        for indices in groups:
            args = [self._now(now)]
            for i in indices:
                args.append(str(counts[i].amount))
                args += counts[i].limiter.redis_args(counts[i].threshold)
            calls.append(self.client.evalsha(self._record, [names[i] for i in indices], args))
        results = await _all(calls)
        hits: list[Hit] = [UNDER_LIMIT] * len(counts)
        for indices, result in zip(groups, results):
            for i, hit in zip(indices, _hits(result)):
                hits[i] = hit
        return hits

    async def release(self, lease: str, keys: Sequence[CountingKey]) -> int:
        """Every slot of the request by its lease id: one script call (per
        hash slot of its keys, all at once, on a Redis Cluster)."""
        names = [counting_key(key) for key in keys]
        released = await _all([self.client.evalsha(self._release, [names[i] for i in indices], [lease])
                               for indices in self._by_slot(names)])
        return sum(int(count) for count in released)

    async def active_bans(self, now: float) -> list[BanRecord]:
        if not isinstance(self.client, ClusterRedis):
            values = await self.client.evalsha(self._bans, [BAN_INDEX], [self._now(now), BAN_HEAD, BAN_TAIL])
            return [self._ban_record(values[i], now, values[i + 1:i + 8]) for i in range(0, len(values), 8)]
        # A cluster keeps no index (its records are in their addresses'
        # slots): each master's are found by scanning its keys.
        names = await self.client.scan(BAN_HEAD + "*" + BAN_TAIL)
        records = await asyncio.gather(*(self.client.evalsha(self._ban_of, [name], [self._now(now)])
                                         for name in names))
        return [self._ban_record(name[len(BAN_HEAD):-len(BAN_TAIL)], now, fields)
                for name, fields in zip(names, records) if fields]

    def record_shadow_ban(self, record: BanRecord) -> None:
        """Written in the background: the request it was decided for does
        not wait, and a shared store that does not answer loses only it.
        Every request over the shadow rule's limit calls for the ban again;
        it is written once while the one this node wrote is in force."""
        written = self._shadow_written.get(record.address)
        if written is not None and record.expires - record.duration < written:  # made now, on the rules' clock
            return
        self._shadow_written[record.address] = record.expires
        task = asyncio.get_running_loop().create_task(self._write_shadow_ban(record))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_shadow_ban(self, record: BanRecord) -> None:
        name = shadow_ban_key(record.address)
        ttl = max(1, int(record.duration * 1000))  # from now: the decision was just made
        try:
            await self.client.evalsha(self._lazy_script("shadow_ban"), [name], [
                record.rule_id, record.node, repr(record.started_wall), repr(record.duration), ttl])
        except StoreUnavailable:
            # A shadow ban is a note: the next request that calls for it writes it.
            self._shadow_written.pop(record.address, None)

    async def shadow_bans(self, now: float) -> list[BanRecord]:
        """Every node's, found by scanning (with the time Redis has left them)."""
        names: list[str] = []
        async for batch in scan(self.client, BAN_HEAD + "*" + SHADOW_TAIL):
            names.extend(batch)
        replies = await _all([self._command(name, command, name, *fields) for name in names
                              for command, fields in (("HMGET", ("rule", "node", "started", "duration")),
                                                      ("PTTL", ()))])
        found = []
        for name, fields, ttl in zip(names, replies[0::2], replies[1::2]):
            if fields[0] is None or int(ttl) <= 0:
                continue
            address = name[len(BAN_HEAD):-len(SHADOW_TAIL)]
            found.append(BanRecord(address, fields[0], fields[1], float(fields[2]), now + int(ttl) / 1000,
                                   float(fields[3]), shadow=True))
        return found

    async def forget_history(self, address: str) -> int:
        """DEL of the address's ban history beside its ban record (see
        ban_history.lua), found by scanning."""
        names: list[str] = []
        for kind in ("banstep", "counted", "penalties"):
            async for batch in scan(self.client, f"{BAN_HEAD}{glob_escape(address)}}}:{kind}:*"):
                names.extend(batch)
        return await self._delete(names)

    async def lift_shadow_ban(self, address: str) -> bool:
        self._shadow_written.pop(address, None)
        name = shadow_ban_key(address)
        return bool(await self._command(name, "DEL", name))

    async def _delete(self, names: Sequence[str]) -> int:
        """DEL of the names, a batch per hash slot at a time (at its slot's
        master on a cluster), all at once; how many existed."""
        calls = [self._command(names[indices[0]], "DEL", *(names[i] for i in indices))
                 for indices in self._batches(names)]
        return sum(int(count) for count in await _all(calls)) if calls else 0

    async def reset(self, keys: Sequence[CountingKey]) -> int:
        """DEL of the keys, a batch per hash slot at a time (at its slot's
        master on a cluster); this node forgets what it knew of them being
        over limit. Other nodes are not told (a reported response's reset:
        see reset_keys for an administrator's)."""
        for key in keys:
            self.penalties.forget(key)
        return await self._delete([counting_key(key) for key in keys])

    async def lift_ban(self, address: str) -> bool:
        if isinstance(self.client, ClusterRedis):
            return bool(await self.client.execute(ban_key(address), "DEL", ban_key(address)))
        return bool(await self.client.evalsha(self._lift_ban, [ban_key(address), BAN_INDEX], [address]))

    def may_be_banned(self) -> bool:
        return True  # another node may have banned anyone: the script checks

    # -- what administrators do (see sidecar.store.redis_admin) --------------

    def _lazy_script(self, name: str) -> str:
        """The digest of a script used off the request path (the admin's, a
        shadow ban's), registered when first used (loaded ahead of that
        call): a node that is never asked loads none."""
        digest = self._scripts.get(name)
        if digest is None:
            digest = self._scripts[name] = self.client.script(_script(name))
        return digest

    async def _admin_state(self, now: float, known: str, known_tiers: str) -> list[Any]:
        """admin_state.lua: the admin version, and the network bans when it
        is not ``known`` (with the tier assignments when their version is
        not ``known_tiers``)."""
        state: list[Any] = await self.client.evalsha(
            self._lazy_script("admin_state"), [ADMIN_VERSION, NETWORK_INDEX, TIERS, TIERS_VERSION],
            [self._now(now), known, NETWORK_HEAD, known_tiers])
        return state

    async def _command(self, key: str, *command: Any) -> Any:
        """One command on the server of ``key`` (its master, on a cluster)."""
        if isinstance(self.client, ClusterRedis):
            return await self.client.execute(key, *command)
        return await self.client.execute(*command)

    async def _changed(self, now: float) -> None:
        """After an action of this node's: a new admin version for the
        others to notice, and this node's copy read at once."""
        await self._command(ADMIN_VERSION, "SET", ADMIN_VERSION, new_version(), "PX", VERSION_KEPT_MS)
        await self.admin.refresh(now)

    async def ban_of(self, now: float, address: str) -> BanRecord | None:
        fields = await self.client.evalsha(self._ban_of, [ban_key(address)], [self._now(now)])
        return self._ban_record(address, now, fields) if fields else None

    async def ban(self, now: float, address: str, duration: float, reason: str) -> BanRecord:
        record = ban_key(address)
        single = not isinstance(self.client, ClusterRedis)
        # On a single Redis the version changes in the same step; a cluster
        # keeps it in another slot.
        keys = [record, BAN_INDEX, ADMIN_VERSION] if single else [record] * 3
        fields = await self.client.evalsha(self._lazy_script("manual_ban"), keys, [
            self._now(now), address, self.node, repr(self._wall_clock()), repr(float(duration)), reason,
            _flag(single), new_version() if single else "", VERSION_KEPT_MS])
        if single:
            await self.admin.refresh(now)
        else:
            await self._changed(now)
        return self._ban_record(address, now, [*fields, 0, reason])

    async def ban_network(self, now: float, network: str, duration: float, reason: str) -> BanRecord:
        keys = [network_record(network), NETWORK_INDEX, ADMIN_VERSION]
        fields = await self.client.evalsha(self._lazy_script("manual_ban"), keys, [
            self._now(now), network, self.node, repr(self._wall_clock()), repr(float(duration)), reason,
            "1", new_version(), VERSION_KEPT_MS])
        await self.admin.refresh(now)
        return self._ban_record(network, now, [*fields, 0, reason])

    async def lift_network_ban(self, now: float, network: str) -> bool:
        lifted = await self.client.evalsha(self._lift_ban, [network_record(network), NETWORK_INDEX, ADMIN_VERSION],
                                           [network, new_version(), VERSION_KEPT_MS])
        await self.admin.refresh(now)
        return bool(lifted)

    async def active_network_bans(self, now: float) -> list[BanRecord]:
        await self.admin.refresh(now, force=True)
        return self.network_bans.in_force(now)

    # -- tiers (see sidecar.store.redis_admin) --------------------------------

    async def assign_tier(self, identity: str, tier: str) -> None:
        """One script in the admin slot; this node's copy at once, every
        other node's within the watch interval. ValueError when the store
        holds ``MAX_ASSIGNMENTS`` others already (another node may have
        added the last since the caller counted)."""
        if not tier:
            raise ValueError("expected a tier")  # '' removes an assignment in tier.lua
        if await self._write_tier(identity, tier) < 0:
            raise ValueError(f"the store holds {MAX_ASSIGNMENTS:,} tier assignments made at run time, the most "
                             "it takes: remove one first")
        self.tier_assignments.set(identity, tier)
        await self.admin.refresh(self._clock())

    async def unassign_tier(self, identity: str) -> bool:
        removed = await self._write_tier(identity, "") > 0
        self.tier_assignments.remove(identity)  # whether or not another node removed it first
        if removed:
            await self.admin.refresh(self._clock())
        return removed

    async def _write_tier(self, identity: str, tier: str) -> int:
        """tier.lua: assign ``tier`` ('' = remove the assignment)."""
        done = await self.client.evalsha(self._lazy_script("tier"), [TIERS, TIERS_VERSION, ADMIN_VERSION],
                                         [identity, tier, new_version(), VERSION_KEPT_MS, MAX_ASSIGNMENTS])
        return int(done)

    async def assigned_tiers(self) -> dict[str, str]:
        """The hash, read now (one ``HGETALL``)."""
        values = await self._command(TIERS, "HGETALL", TIERS)
        return dict(zip(values[0::2], values[1::2]))

    async def find_keys(self, now: float, selection: KeySelection, limit: int | None = None) -> list[CountingKey]:
        """Found by name: see sidecar.store.redis_admin."""
        if selection.key is not None:
            name = counting_key(selection.key)
            return [selection.key] if await self._command(name, "EXISTS", name) else []
        found: dict[str, CountingKey] = {}
        async with contextlib.aclosing(self._names(selection)) as batches:
            async for names in batches:
                for name in names:
                    key = key_of_name(name)
                    if key is not None and selection.holds(key) and counting_key(key) == name:
                        found[name] = key
                        if limit is not None and len(found) >= limit:
                            return list(found.values())
        return list(found.values())

    async def _names(self, selection: KeySelection) -> AsyncGenerator[list[str], None]:
        """Names that may be keys the selection names, in batches."""
        address = selection.address
        if address is None:
            assert selection.rule is not None
            async for names in scan(self.client, PREFIX + "*" + COUNT_INFIX + glob_escape(
                    f"[[{encode_basestring_ascii(selection.rule)},") + "*"):
                yield names
            return
        tagged = f"{PREFIX}{{{address}}}:count:"
        if isinstance(self.client, ClusterRedis):
            # The address's keys are the keys of its slot that carry its tag.
            slot = self.client.slot(tagged)
            count = await self.client.execute(tagged, "CLUSTER", "COUNTKEYSINSLOT", slot)
            names = await self.client.execute(tagged, "CLUSTER", "GETKEYSINSLOT", slot, count) if count else []
            yield [name for name in names if name.startswith(tagged)]
        else:
            async for names in scan(self.client, glob_escape(tagged) + "*"):
                yield names
        # A session rule's fallback to the address, under any tag.
        fallback = "," + _json(("ip", address)) + "]"
        async for names in scan(self.client, PREFIX + "*" + COUNT_INFIX + "*" + glob_escape(fallback) + "*"):
            yield names

    def _batches(self, names: Sequence[str]) -> list[list[int]]:
        """The positions of ``names`` by hash slot, in batches of at most
        BATCH: an admin call never makes one long command that holds the
        decisions behind it."""
        return [indices[start:start + BATCH] for indices in self._by_slot(names)
                for start in range(0, len(indices), BATCH)]

    async def describe_keys(self, now: float, keys: Sequence[Described]) -> list[CounterState | None]:
        """inspect.lua, one call per batch of a hash slot (all at once)."""
        names = [counting_key(key) for key, _, _ in keys]
        groups = self._batches(names)
        calls = []
        for indices in groups:
            args = [self._now(now)]
            for i in indices:
                _, limiter, threshold = keys[i]
                args += _NO_LIMITER if limiter is None else limiter.redis_args(threshold)
            calls.append(self.client.evalsha(self._lazy_script("inspect"), [names[i] for i in indices], args))
        described: list[CounterState | None] = [None] * len(keys)
        for indices, result in zip(groups, await _all(calls)):
            for n, i in enumerate(indices):
                stored, penalty, remaining, reset, window = result[5 * n:5 * n + 5]
                if int(stored):
                    quota = None if remaining == "" else Quota(int(float(remaining)), float(reset), float(window))
                    described[i] = CounterState(keys[i][0], float(penalty), quota)
        return described

    async def reset_keys(self, now: float, keys: Sequence[CountingKey]) -> int:
        """``reset``, and every node told to ask Redis again about the keys
        it knows over limit."""
        deleted = await self.reset(keys)
        if deleted:
            await self._changed(now)
        return deleted

    def configure(self, max_keys: int, node: str) -> None:
        """New settings from a reload. ``max_keys`` bounds the node's cache of
        keys over limit and of shadow bans written; Redis's own ``maxmemory``
        bounds the shared state,
        where every key expires."""
        self.node = node
        self.penalties.configure(max_keys)
        self._shadow_written.max_keys = max_keys
        self._banned_here.max_keys = max_keys
        # The new rules' checks are other kinds: a table of their own.
        self._rules.close()
        self._rules = _RuleTable(self.client, self._rules.body)

    def gauges(self) -> dict[str, tuple[str, Callable[[], float]]]:
        # Bans and keys are Redis's to count (INFO keyspace); the node's own
        # cache of keys over limit is this node's.
        return {"sluice_penalty_cache_keys": ("Keys known over limit on the shared store, answered "
                                              "on this node until their wait ends.",
                                              lambda: len(self.penalties)),
                "sluice_penalty_cache_answers_total": ("Requests answered from the cache of keys "
                                                       "over limit, without a round trip.",
                                                       lambda: self.penalties.answered)}

    async def open(self) -> None:
        """Connect, and from now on follow what administrators change (a
        task of this loop, until ``close``)."""
        self.admin.watch()
        await self.client.open()

    async def close(self) -> None:
        await self.admin.stop()
        await self.client.close()
