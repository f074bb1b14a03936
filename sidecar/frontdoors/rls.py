"""Envoy's Rate Limit Service: ``envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit``.

Served on the gRPC port of ``sluice serve --grpc-port``, beside ext_authz,
with the configurations of ``--rls-config`` (``sidecar.rls``). Each of a
request's descriptors is matched against its domain's tree; the limits it
falls under become checks of the state store the rules file uses, all
asked in one step, so RLS descriptors count in the same memory or Redis
as the rules. Every descriptor is counted on its own, as envoyproxy/
ratelimit counts them: one over its limit does not keep the others from
counting. The answer carries one status per descriptor (its limit, what
remains and when it resets, for Envoy's ``x-ratelimit-*`` headers) and
``overall_code``.

The statistics envoyproxy/ratelimit keeps per descriptor are exposed under
the Prometheus names its own Prometheus mapping gives them
(``ratelimit_service_rate_limit_total_hits{domain, key1, key2}`` and so
on), so its dashboards keep working (``RlsStats``).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client.core import Metric, UnknownMetricFamily
from prometheus_client.registry import Collector

from sidecar.clientip import ClientIPResolver
from sidecar.config import ConfigError
from sidecar.engine import ALLOW, Engine, Tally
from sidecar.frontdoors.messages import (
    OK,
    OVER_LIMIT,
    RATE_LIMIT_SERVICE,
    SHOULD_RATE_LIMIT,
    RateLimitRequest,
    RateLimitResponse,
    reader,
)
from sidecar.keys import CountingKey
from sidecar.metrics import add_one
from sidecar.ratelog import RateLimitedLog
from sidecar.rls import Limit, Match, RlsConfig, load_rls
from sidecar.state import Check

log = logging.getLogger("sluice")

# What an unlimited descriptor reports as remaining, as envoyproxy/ratelimit does.
UNLIMITED_REMAINING = 2**32 - 1
# A request's descriptors and entries past these are answered OK uncounted
# (Envoy's route configuration makes them, never the client; these bound
# what a broken configuration can cost).
MAX_DESCRIPTORS = 64
MAX_ENTRIES = 32
# A value longer than this counts by its digest: keys stay small however
# long the header or path a descriptor carries.
MAX_KEY_VALUE = 256
# Label sets of the per-descriptor statistics: past this many, a
# descriptor is counted under its configured name (detailed_metric and
# value_to_metric put request values in the names).
MAX_STAT_KEYS = 10_000
STATS = ("total_hits", "over_limit", "near_limit", "within_limit", "shadow_mode")
_IPV4 = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")


def stat_level(level: str) -> str:
    """One level of a statistic's name as envoyproxy/ratelimit writes it:
    ``:`` and ``|`` become ``_``, and so do an IPv4 address's dots."""
    level = level.replace(":", "_").replace("|", "_")
    return _IPV4.sub(lambda found: found.group(0).replace(".", "_"), level)


class RlsStats(Collector):
    """envoyproxy/ratelimit's per-descriptor statistics, in hits (a
    request's ``hits_addend``), under the names of its Prometheus mapping:
    the domain and the first two levels of the descriptor as labels."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str], list[int]] = {}
        # The counters of a descriptor's (domain, levels), without making
        # its labels again: the same few for every request.
        self._series: dict[tuple[str, tuple[str, ...]], list[int]] = {}
        self.config_loads = {"success": 0, "error": 0}
        self.errors: collections.Counter[str] = collections.Counter()  # redis_error, service_error

    def series(self, domain: str, levels: tuple[str, ...], fallback: tuple[str, ...]) -> list[int]:
        """The counters of one descriptor (total, over, near, within, shadow)."""
        counts = self._series.get((domain, levels))
        if counts is None:
            counts = self._series_of(domain, levels, fallback)
            if len(self._series) < MAX_STAT_KEYS:
                self._series[domain, levels] = counts
        return counts

    def _series_of(self, domain: str, levels: tuple[str, ...], fallback: tuple[str, ...]) -> list[int]:
        labels = self._labels(domain, levels)
        counts = self.counts.get(labels)
        if counts is None:
            if len(self.counts) >= MAX_STAT_KEYS:
                labels = self._labels(domain, fallback)
                counts = self.counts.get(labels)
            if counts is None:
                counts = self.counts[labels] = [0, 0, 0, 0, 0]
        return counts

    @staticmethod
    def _labels(domain: str, levels: Sequence[str]) -> tuple[str, str, str]:
        return (stat_level(domain), stat_level(levels[0]) if levels else "",
                stat_level(levels[1]) if len(levels) > 1 else "")

    def count(self, counts: list[int], hits: int, before: int, limit: int, over: bool, shadow: bool,
              near_ratio: float) -> None:
        """A descriptor's hits: within or over its limit, and the part past
        the near-limit mark (``near_ratio`` of the limit) and the limit."""
        counts[0] += hits
        near = math.floor(limit * near_ratio)
        after = before + hits
        if over:
            counts[1] += after - max(before, limit) if before < limit else hits
            if before < limit and after > near:
                counts[2] += limit - max(before, near)
            if shadow:
                counts[4] += hits
            return
        counts[3] += hits
        if after > near:
            counts[2] += after - max(before, near)

    def collect(self) -> Iterator[Metric]:
        for index, stat in enumerate(STATS):
            family = UnknownMetricFamily(
                f"ratelimit_service_rate_limit_{stat}",
                f"envoyproxy/ratelimit's {stat} of each descriptor, in hits (Rate Limit Service).",
                labels=["domain", "key1", "key2"])
            for labels, counts in self.counts.items():
                family.add_metric(list(labels), counts[index])
            yield family
        # Counters under envoyproxy/ratelimit's exact names, which have no _total.
        for result, count in self.config_loads.items():
            yield UnknownMetricFamily(f"ratelimit_service_config_load_{result}",
                                      f"Rate Limit Service configuration loads that ended in {result}.",
                                      value=count)
        errors = UnknownMetricFamily("ratelimit_service_should_rate_limit_error",
                                     "ShouldRateLimit calls that failed: redis_error (the shared store "
                                     "did not answer), service_error (an invalid request).",
                                     labels=["err_type"])
        for kind, count in self.errors.items():
            errors.add_metric([kind], count)
        yield errors


class InvalidRequest(Exception):
    """A request the protocol does not allow (no domain, no descriptor)."""


@dataclass(slots=True)
class _Descriptor:
    """One of a request's descriptors, once matched."""

    limit: Limit | None
    levels: tuple[str, ...] = ()
    hits: int = 1
    check: int = -1  # its index among the request's checks; -1: nothing counted


@dataclass(slots=True)
class Described:
    """One ``RateLimitRequest`` as the engine is asked about it: each
    descriptor's limit, the checks of those that count (and which of them
    only observe, shadow_mode), and the client key a ban would be issued
    to ("" for none); ``invalid`` says why the protocol refuses it."""

    domain: str
    descriptors: list[_Descriptor]
    checks: list[Check]
    shadow: list[bool]
    client: str = ""
    invalid: str = ""


class RateLimitService:
    """``ShouldRateLimit`` as a front door: a request described as checks
    (``describe``), decided by the engine with the rules' own pipeline
    (``Engine.decide_checks``: the store, fail open or closed, bans,
    metrics and the decision log), and the engine's tally as the answer
    (``respond``); with the configurations it reads (reloaded with the
    rules file) and envoyproxy/ratelimit's statistics."""

    def __init__(self, engine: Engine, path: str | None, shadow: bool = False,
                 near_limit_ratio: float = 0.8) -> None:
        self.engine = engine
        self.path = path
        self.shadow = shadow  # every domain in shadow mode: overall_code is always OK
        self.near_limit_ratio = near_limit_ratio
        self.stats = RlsStats()
        engine.metrics.registry.register(self.stats)
        self._decisions = engine.metrics.decisions
        self.config = RlsConfig({}) if path is None else self._load()
        self._invalid_log = RateLimitedLog(log, 60)

    def _load(self) -> RlsConfig:
        assert self.path is not None
        try:
            config = load_rls(self.path, self.near_limit_ratio)
        except ConfigError:
            self.stats.config_loads["error"] += 1
            raise
        self.stats.config_loads["success"] += 1
        return config

    def read(self) -> RlsConfig | None:
        """The configurations as they are now (ConfigError when invalid),
        for a reload to put in place; None when none are served."""
        return None if self.path is None else self._load()

    async def answer(self, request: Any) -> Any:
        """The response to one ``RateLimitRequest``."""
        described = self.describe(request, self.engine.ruleset.resolver)
        tally = await self.engine.decide_checks(described.checks, described.client, described.shadow,
                                                described.domain)
        return self.respond(described, tally)

    def describe(self, request: Any, resolver: ClientIPResolver) -> Described:
        """The request's descriptors matched against its domain's tree, and
        the checks of those that count; a client address (``remote_address``)
        counts as the rules count it, by ``resolver``."""
        domain = request.domain
        if not domain or not request.descriptors:
            # Still asked of the engine, without a check: counted as a request.
            return Described(domain, [], [], [], invalid="rate limit domain must not be empty" if not domain else
                             "rate limit descriptor list must not be empty")
        descriptors, checks, shadow, client = self._checks(self.config, domain, request.descriptors,
                                                           request.hits_addend or 1, resolver)
        return Described(domain, descriptors, checks, shadow, client)

    def _checks(self, config: RlsConfig, domain: str, messages: Sequence[Any], request_hits: int,
                resolver: ClientIPResolver) -> tuple[list[_Descriptor], list[Check], list[bool], str]:
        """Each descriptor's limit (replaced ones dropped) and the checks of
        those that count, with the address a ban would be issued to."""
        matched: list[tuple[Match | None, Limit | None, int]] = []
        replaced: set[str] = set()
        for message in messages[:MAX_DESCRIPTORS]:
            entries = [(entry.key, entry.value) for entry in message.entries]
            hits = message.hits_addend.value if message.HasField("hits_addend") else request_hits
            match = config.match(domain, entries) if len(entries) <= MAX_ENTRIES else None
            limit = match.limit if match is not None else None
            if message.HasField("limit") and domain in config.domains and len(entries) <= MAX_ENTRIES:
                limit = self._override(domain, entries, message.limit)
                match = Match(limit, limit.levels, tuple(value for _, value in entries)) \
                    if limit is not None else match
            if limit is not None:
                replaced.update(limit.replaces)
            matched.append((match, limit, hits))
        descriptors: list[_Descriptor] = []
        checks: list[Check] = []
        shadow: list[bool] = []
        address = ""
        for message, (match, limit, hits) in zip(messages, matched):
            if match is None or limit is None or (limit.name and limit.name in replaced):
                descriptors.append(_Descriptor(None))
                continue
            descriptor = _Descriptor(limit, match.levels, hits)
            descriptors.append(descriptor)
            if limit.limiter is None:
                continue  # unlimited: nothing to count
            keys = tuple(entry.key for entry in message.entries)
            values = tuple(self._key_value(resolver, key, value) for key, value in zip(keys, match.values))
            key: CountingKey = (("rls:" + domain, keys), *values)
            ban = None if limit.shadow else limit.ban
            if ban is not None and not address:
                # The address as the rules count it: the ban is the same one
                # the HTTP front doors refuse.
                address = next((value for name, value in zip(keys, values)
                                if name == "remote_address" and value != ""), "")
            descriptor.check = len(checks)
            checks.append(Check.of(limit.rule_id, key, limit.limiter, limit.threshold, ban is not None, ban,
                                   amount=hits))
            shadow.append(limit.shadow)
        return descriptors + [_Descriptor(None)] * (len(messages) - len(descriptors)), checks, shadow, address

    def _override(self, domain: str, entries: list[tuple[str, str]], override: Any) -> Limit | None:
        """The request's own limit, a fixed window of its unit; None (the
        configured one applies) for an unknown unit or past the number of
        overrides a process keeps."""
        limiter = self.config.override(override.requests_per_unit, override.unit)
        if limiter is None:
            self._invalid_log.warning("a descriptor's limit override (%d per unit %d) was ignored: an "
                                      "unknown unit, or too many distinct overrides (reported once per "
                                      "minute)", override.requests_per_unit, override.unit)
            return None
        levels = tuple(key if not value else f"{key}_{value}" for key, value in entries)
        return Limit(f"{domain}.override", levels, limiter, float(override.requests_per_unit),
                     override.requests_per_unit, override.unit)

    @staticmethod
    def _key_value(resolver: ClientIPResolver, key: str, value: str) -> str:
        """A value as it counts: a client address as the rules count it (an
        IPv6 address by its /64), a long value by its digest."""
        if key == "remote_address":
            # The peer's key, as the front doors resolve it (fast paths and
            # all); no address: the empty value, never banned.
            return resolver.resolve(value, None).key
        if len(value) > MAX_KEY_VALUE:
            return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
        return value

    def respond(self, described: Described, tally: Tally) -> Any:
        """The engine's tally as the response: a status per descriptor,
        ``overall_code``, and the statistics; InvalidRequest for a request
        the protocol does not allow."""
        if described.invalid:
            self.stats.errors["service_error"] += 1
            raise InvalidRequest(described.invalid)
        if tally.failed is not None:
            self.stats.errors["redis_error"] += 1
            return self.uniform(len(described.descriptors), OK if tally.failed is ALLOW else OVER_LIMIT)
        domain = described.domain
        response = RateLimitResponse()
        over_all = tally.banned
        quota_codes = []  # quota_mode descriptors: the request is over only when all of them are
        for descriptor in described.descriptors:
            status = response.statuses.add()
            status.code = OK
            limit = descriptor.limit
            if limit is None:
                continue
            if limit.limiter is None:
                status.limit_remaining = UNLIMITED_REMAINING
                continue
            over = self._status(status, domain, descriptor, limit, tally)
            enforced = over and not limit.shadow  # shadow mode is Sluice's observe action (log)
            if enforced:
                status.code = OVER_LIMIT
            if limit.quota_mode:
                quota_codes.append(enforced)
            elif enforced:
                over_all = True
        if quota_codes and all(quota_codes):
            over_all = True
        response.overall_code = OVER_LIMIT if over_all and not self.shadow else OK
        add_one(self._decisions, ("rls", "deny" if response.overall_code == OVER_LIMIT else "allow"))
        return response

    def _status(self, status: Any, domain: str, descriptor: _Descriptor, limit: Limit, tally: Tally) -> bool:
        """Fill a counted descriptor's status (its limit, what remains, when
        it resets) and its statistics; whether it is over its limit."""
        current = status.current_limit
        current.requests_per_unit, current.unit, current.name = limit.requests_per_unit, limit.unit, limit.name
        index = descriptor.check
        hits, quotas = tally.evaluation.hits, tally.evaluation.quotas or []
        # Not evaluated: the address is banned, or a ban ended the evaluation first.
        evaluated = 0 <= index < len(hits)
        over = tally.over[index]
        quota = quotas[index] if evaluated and index < len(quotas) else None
        left, reset = (int(quota[0]), quota[1]) if quota is not None else (0, 0.0)
        if over:
            status.limit_remaining = 0
            reset = hits[index].retry_after if evaluated else reset
        else:
            status.limit_remaining = min(left, UNLIMITED_REMAINING)
        status.duration_until_reset.seconds = max(1, math.ceil(reset))
        threshold = int(limit.threshold)
        before = max(0, threshold - left - (0 if over else descriptor.hits))
        counts = self.stats.series(domain, descriptor.levels, limit.levels)
        self.stats.count(counts, descriptor.hits, before, threshold, over, limit.shadow, self.near_limit_ratio)
        return over

    def uniform(self, descriptors: int, code: int) -> Any:
        """An answer of ``code`` for the request and each of its descriptors, counted."""
        response = RateLimitResponse(overall_code=code)
        for _ in range(descriptors):
            response.statuses.add().code = code
        add_one(self._decisions, ("rls", "allow" if code == OK else "deny"))
        return response


def rls_handler(service: RateLimitService, internal_error: Callable[[], None]) -> Any:
    """``RateLimitService/ShouldRateLimit`` for a gRPC server: the
    service's answer; an invalid request gets INVALID_ARGUMENT, and a
    failure inside Sluice an OK (fail open, counted)."""

    async def should_rate_limit(message: Any, context: Any) -> Any:
        if message is None:
            service.stats.errors["service_error"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a RateLimitRequest")
        try:
            return await service.answer(message)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception:
            internal_error()
            return service.uniform(len(message.descriptors), OK)

    method = grpc.unary_unary_rpc_method_handler(should_rate_limit,
                                                 request_deserializer=reader(RateLimitRequest),
                                                 response_serializer=RateLimitResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(RATE_LIMIT_SERVICE, {SHOULD_RATE_LIMIT: method})
