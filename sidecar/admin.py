"""Reload and the admin API.

A reload (``SIGHUP``, ``POST /v1/admin/reload``, or the rules file changing:
``sidecar.watch``) reads the rules file again, and the Rate Limit Service
configurations when Sluice serves them: valid files replace the rules at
once, keeping counters (a rule keeps its counters under the same id and
dimensions, a descriptor under the same entries); an invalid one is
refused with its errors and the old rules and configurations keep running.

The admin API answers only with a bearer token (``--admin-token-file``,
compared in constant time), or — with no token configured — only to
loopback peers of a loopback listener. Without either it is off.

Besides reload it undoes mistakes, through the store (so with Redis every
node sees them): a client's or a rule's counters are listed and reset
(``sidecar.counters``), and clients and networks are banned and unbanned
by hand (``sidecar.networkbans``). Every action writes one audit line to
the decision log, which never holds the token.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.clientip import ClientAddress, parse_address
from sidecar.config import ConfigError, parse_duration
from sidecar.counters import CounterState, KeySelection, dimension_values, key_from_text
from sidecar.engine import Engine
from sidecar.keys import CountingKey, key_dimensions, key_rule_id, key_values
from sidecar.limiters.base import Limiter
from sidecar.networkbans import BanTarget, ban_target, client_key
from sidecar.plurals import plural
from sidecar.rules import Ruleset, describe_key, load_ruleset, no_ruleset
from sidecar.state import AutoBan, BanRecord
from sidecar.tiers import MAX_ASSIGNMENTS, Tiers, check_identity, check_tier_name
from sidecar.watch import RulesFileWatch

if TYPE_CHECKING:
    from sidecar.frontdoors.rls import RateLimitService

log = logging.getLogger("sluice")

# A ban by hand lasts as long as a rule's may.
SHORTEST_BAN, LONGEST_BAN = 1.0, 365 * 86400.0
LONGEST_REASON = 256
MAX_BAN_REQUEST = 16 * 1024  # bytes of a ban's JSON
# Network bans are looked up for every request: a bound on how many a node
# holds (the lookup's cost is per prefix length, not per network).
MAX_NETWORK_BANS = 10_000
# Counters listed at most per call.
MAX_LISTED = 10_000


class Refused(Exception):
    """An admin call that cannot be done as asked: the HTTP status and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Admin:
    def __init__(self, engine: Engine, config_path: str | None, token: bytes | None = None,
                 loopback_listener: bool = False, rls: RateLimitService | None = None,
                 shadow: bool = False, watch_interval: float = 0.0) -> None:
        self.engine = engine
        self.config_path = config_path
        self.rls = rls
        self.shadow = shadow  # sluice serve --shadow: every rule reloaded in shadow mode
        # Reloads when the rules file changes (sluice serve --watch-interval;
        # 0: off), from the file as it is now, when its rules were loaded.
        self.file_watch = RulesFileWatch(config_path, watch_interval, lambda: self.reload("file")) \
            if config_path and watch_interval > 0 else None
        self._token = token
        self.loopback_listener = loopback_listener

    # -- reload --------------------------------------------------------------

    def load(self) -> Ruleset:
        return load_ruleset(self.config_path, self.shadow) if self.config_path else no_ruleset(self.shadow)

    def reload(self, who: str = "signal") -> list[str]:
        """Reload the rules file; the errors, or [] when the new rules run.
        ``who`` asked (``signal``, ``file`` (it changed), ``token`` or
        ``loopback``): the audit line says."""
        errors: list[str] = []
        try:
            ruleset = self.load()
        except ConfigError as exc:
            errors = [str(issue) for issue in exc.issues]
        rls_config = None
        if self.rls is not None:
            try:
                rls_config = self.rls.read()
            except ConfigError as exc:
                errors.extend(str(issue) for issue in exc.issues)
        if errors:
            log.error("reload refused, the old rules keep running:\n%s", "\n".join(errors))
            self.engine.metrics.reloaded(succeeded=False)
            self.engine.log.audit("reload", who, "refused", errors=len(errors))
            return errors
        self.engine.reload(ruleset)
        if self.rls is not None and rls_config is not None:
            self.rls.config = rls_config
            log.info("reloaded %s from %s", plural(rls_config.limits, "Rate Limit Service limit"), self.rls.path)
        self.engine.metrics.reloaded(succeeded=True)
        log.info("reloaded %s from %s", plural(len(ruleset.rules), "rule"), ruleset.source)
        for warning in ruleset.warnings:
            log.warning("%s", warning)
        self.engine.log.audit("reload", who, "reloaded", rules=len(ruleset.rules))
        return []

    # -- access --------------------------------------------------------------

    @property
    def needs_token(self) -> bool:
        """A bearer token is configured: refusals are 401, not 403."""
        return self._token is not None

    def allows(self, authorization: str | None, peer: str | None) -> bool:
        if self._token is not None:
            scheme, _, given = (authorization or "").partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(
                given.strip().encode("utf-8", "surrogateescape"), self._token)
        if not self.loopback_listener or peer is None:
            return False
        try:
            return ipaddress.ip_address(peer).is_loopback
        except ValueError:
            return peer == ""  # a Unix socket peer

    # -- what the API shows --------------------------------------------------

    def rules(self) -> list[dict[str, Any]]:
        metrics = self.engine.metrics
        return [{
            "id": rule.id,
            "action": rule.action,
            "limit": rule.threshold,
            "penalty_seconds": rule.reset,
            "response_phase": rule.response is not None,
            "hits": metrics.hits_of(rule.id),
            "over_limit": metrics.over_limit_of(rule.id),
        } for rule in self.engine.ruleset.rules]

    async def bans(self) -> list[dict[str, Any]]:
        """Every ban in force: of client addresses (earned or by hand), then
        of networks."""
        now = self.engine.clock()
        addresses = sorted(await self.engine.active_bans(), key=lambda ban: ban.address)
        return [ban_view(ban, now, network=False) for ban in addresses] + \
            [ban_view(ban, now, network=True) for ban in await self.engine.store.active_network_bans(now)]

    async def ban(self, text: str, duration: float, reason: str, who: str) -> dict[str, Any]:
        """Ban a client address (its counting key: an IPv6 address by its
        /64) or a network by hand, replacing the ban it has."""
        target = self._target(text)
        now = self.engine.clock()
        store = self.engine.store
        if target.network is None:
            ban = await store.ban(now, target.text, duration, reason)
        else:
            held = {held.address for held in await store.active_network_bans(now)}
            if len(held) >= MAX_NETWORK_BANS and target.text not in held:
                raise Refused(409, f"{len(held)} networks are banned, the most a node holds; lift some first")
            ban = await store.ban_network(now, target.text, duration, reason)
        self.engine.forget_refusals()  # a refusal answered again would now be this ban's
        self.engine.log.audit("ban", who, "banned", address=target.text, duration=duration, reason=reason)
        return ban_view(ban, now, network=target.network is not None)

    async def lift_ban(self, address: str, who: str) -> bool:
        """Lift the ban of a client address, earned or by hand, or of a
        network; False when it had none (``no_ban`` says so)."""
        target = self._target(address)
        engine = self.engine
        if target.network is None:
            lifted = await engine.lift_ban(target.text)
        else:
            # A ban listed under a network's text may be a client key of a
            # width the rules no longer count by.
            lifted = await engine.store.lift_network_ban(engine.clock(), target.text) \
                or await engine.lift_ban(target.text)
            engine.forget_refusals()
        self.engine.log.audit("unban", who, "lifted" if lifted else "no ban", address=target.text)
        return lifted

    def no_ban(self, text: str) -> str:
        """Why there was no ban of ``text`` to lift, and what bans it instead
        (a network's ban)."""
        target = self._target(text)
        now = self.engine.clock()
        ban = self._network_ban(target.text, now)
        crowdsec = [view["value"] for view in self._crowdsec_of(target.text, now) if view["type"] == "ban"]
        return f"no ban of {target.text}" + (f"; it is in the banned network {ban.address}: lift that"
                                              if ban is not None else "") + \
            (f"; CrowdSec bans {', '.join(crowdsec)}: delete that in CrowdSec (cscli decisions delete)"
             if crowdsec else "")

    def _target(self, text: str) -> BanTarget:
        try:
            return ban_target(self.engine.ruleset.resolver, text)
        except ValueError as exc:
            raise Refused(422, f"address: {exc}") from None

    # -- tiers ---------------------------------------------------------------

    def _tiers(self, assigning: bool = False) -> Tiers:
        tiers = self.engine.ruleset.tiers
        if tiers is None:
            raise Refused(409, "the rules file has no tiers: section")
        if assigning and tiers.identity is None:
            raise Refused(409, "tiers.identity is not set: assignments name identities (an API key's header, "
                               "a cookie, a claim)")
        return tiers

    async def tier_assignments(self, limit: int = MAX_LISTED) -> dict[str, Any]:
        """The tiers, and every assignment: made at run time (the store's,
        which come first), then the file's; with ``truncated`` past ``limit``."""
        tiers = self._tiers()
        run_time = await self.engine.store.assigned_tiers()
        listed = [{"identity": identity, "tier": tier, "from": "run time"}
                  for identity, tier in sorted(run_time.items())]
        listed += [{"identity": identity, "tier": tier, "from": "file"}
                   for identity, tier in sorted(tiers.assigned_in_file.items()) if identity not in run_time]
        return {"names": list(tiers.names), "default": tiers.default, "identity": tiers.identity_text or None,
                "assignments": listed[:limit], "truncated": len(listed) > limit}

    async def assign_tier(self, identity: str, tier: str, who: str) -> dict[str, Any]:
        """Assign an identity to a tier at run time, replacing its assignment."""
        tiers = self._tiers(assigning=True)
        try:
            check_identity(identity)
            check_tier_name(tier, tiers.names)
        except ValueError as exc:
            raise Refused(422, str(exc)) from None
        store = self.engine.store
        if identity not in store.tier_assignments and len(store.tier_assignments) >= MAX_ASSIGNMENTS:
            raise Refused(409, f"{len(store.tier_assignments)} identities are assigned at run time, the most a "
                               "store holds; remove some, or assign them in tiers.file")
        try:
            await store.assign_tier(identity, tier)
        except ValueError as exc:  # a store with no room left for it
            raise Refused(409, str(exc)) from None
        self.engine.log.audit("tier", who, "assigned", identity=self._identity_hash(identity), tier=tier)
        return {"identity": identity, "tier": tier}

    async def unassign_tier(self, identity: str, who: str) -> bool:
        """Remove an identity's run-time assignment; False when it had none."""
        self._tiers(assigning=True)
        removed = await self.engine.store.unassign_tier(identity)
        self.engine.log.audit("untier", who, "removed" if removed else "none",
                              identity=self._identity_hash(identity))
        return removed

    def no_assignment(self, identity: str) -> str:
        """Why there was no run-time assignment to remove, and the tier the
        identity has instead."""
        tiers = self.engine.ruleset.tiers
        if tiers is None:
            return "no run-time assignment of that identity"
        tier, source = tiers.tier_of_identity(identity)
        return f"no run-time assignment of that identity; it is in tier {tier!r} ({source})"

    def _identity_hash(self, identity: str) -> str:
        """An identity (an API key, maybe) as the audit line shows it: a
        keyed hash, never the value."""
        key = self.engine.derived_key(b"sluice audit identities")
        return hmac.new(key, identity.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()[:16]

    # -- counters -------------------------------------------------------------

    def select(self, ip: str | None, rule: str | None, key: Sequence[str]) -> KeySelection:
        """The counters a call names: every one of a client address (``ip``),
        of a rule, of a rule for one address, or one key of a rule (``key``,
        ``DIMENSION=VALUE`` for each of its dimensions)."""
        ruleset = self.engine.ruleset
        if key and rule is None:
            raise Refused(422, "key=DIMENSION=VALUE needs rule=RULE")
        if ip is None and rule is None:
            raise Refused(422, "name the counters: ip=ADDRESS, or rule=RULE (and key=DIMENSION=VALUE "
                               "for one key of it)")
        if key and ip is not None:
            raise Refused(422, "with key=, give the address as one of the key's values: key=ip=ADDRESS")
        compiled = None
        if rule is not None:
            compiled = ruleset.by_id.get(rule)
            if compiled is None:
                names = ", ".join(list(ruleset.by_id)[:20])
                raise Refused(404, f"no rule {rule[:100]!r} runs now (rules: {names or 'none'})")
        try:
            address = client_key(ruleset.resolver, ip) if ip is not None else None
            exact = key_from_text(compiled, ruleset.resolver, key) if compiled is not None and key else None
        except ValueError as exc:
            raise Refused(422, str(exc)) from None
        return KeySelection(address, rule, exact)

    async def counters(self, ip: str | None, rule: str | None, key: Sequence[str],
                       limit: int = MAX_LISTED) -> dict[str, Any]:
        """The counters ``select`` names, each as its rule's limiter
        describes it, in rule order; with ``truncated`` when there were more
        than ``limit``; for a client address, its ban too."""
        selection = self.select(ip, rule, key)
        now = self.engine.clock()
        store = self.engine.store
        keys = await store.find_keys(now, selection, limit + 1)
        limits = [(key, *self._limit_of(key)) for key in keys[:limit]]
        described = await store.describe_keys(now, limits)
        order = {rule_id: n for n, rule_id in enumerate(self.engine.ruleset.by_id)}
        found = sorted(((state, limiter) for state, (_, limiter, _) in zip(described, limits) if state is not None),
                       key=lambda pair: (order.get(key_rule_id(pair[0].key), len(order)), describe_key(pair[0].key)))
        listing: dict[str, Any] = {"counters": [counter_view(state, limiter) for state, limiter in found],
                                   "truncated": len(keys) > limit}
        if selection.address is not None:
            listing["ban"] = await self._ban_of(now, selection.address)
            if self.engine.ruleset.crowdsec is not None:
                listing["crowdsec"] = self._crowdsec_of(selection.address, now)
        return listing

    async def reset(self, ip: str | None, rule: str | None, key: Sequence[str], who: str) -> dict[str, Any]:
        """Forget the counters ``select`` names: their counts and penalties end."""
        selection = self.select(ip, rule, key)
        now = self.engine.clock()
        store = self.engine.store
        reset = await store.reset_keys(now, await store.find_keys(now, selection))
        if selection.address is not None and selection.rule is None:
            # Everything of an address: what its next bans would react to too.
            reset += await store.forget_history(selection.address)
        self.engine.forget_refusals()
        details: dict[str, object] = {name: value for name, value in
                                      (("ip", selection.address), ("rule", selection.rule)) if value is not None}
        if selection.key is not None:
            # As the decision log shows counting keys: values hashed unless
            # decision_log.keys says otherwise.
            details["key"] = self.engine.log.key_text(selection.key)
        self.engine.log.audit("reset", who, "reset", counters=reset, **details)
        result: dict[str, Any] = {"reset": reset}
        if selection.address is not None:
            result["ban"] = await self._ban_of(now, selection.address)
        return result

    def _limit_of(self, key: CountingKey) -> tuple[Limiter | None, float]:
        """The limiter and threshold the rules running now count the key
        by; (None, 0) when none does (a rule removed, or keyed otherwise)."""
        ruleset = self.engine.ruleset
        rule = ruleset.by_id.get(key_rule_id(key))
        if rule is not None and rule.key_prefix == (rule.id, key_dimensions(key)):
            address = next((parse_address(str(value).partition("/")[0]) for name, value
                            in zip(key_dimensions(key), key_values(key)) if name == "ip"), None)
            return rule.limiter, rule.threshold_for(ClientAddress(address, "") if address is not None else None)
        auto_ban = ruleset.auto_ban
        if key_rule_id(key) == key_rule_id(AutoBan.key("")):
            return auto_ban.limiter, float(auto_ban.threshold)
        return None, 0.0

    async def _ban_of(self, now: float, address: str) -> dict[str, Any] | None:
        """The ban that refuses a client address now: its own, or its network's."""
        ban = await self.engine.store.ban_of(now, address)
        if ban is not None:
            return ban_view(ban, now, network=False)
        ban = self._network_ban(address, now)
        return ban_view(ban, now, network=True) if ban is not None else None

    def _network_ban(self, text: str, now: float) -> BanRecord | None:
        """The network ban in force that holds a client key or a network's
        text (by its first address), if any."""
        address = parse_address(text.partition("/")[0])
        return self.engine.store.network_bans.find(address, now) if address is not None else None

    def _crowdsec_of(self, text: str, now: float) -> list[dict[str, Any]]:
        """The CrowdSec decisions in force on a client key or a network
        (those that hold it, and those it holds)."""
        crowdsec = self.engine.ruleset.crowdsec
        if crowdsec is None:
            return []
        try:
            network = ipaddress.ip_network(text.strip(), strict=False)
        except ValueError:
            return []
        return [{"value": decision.value, "type": decision.kind, "scenario": decision.scenario,
                 "origin": decision.origin, "remaining_seconds": round(decision.expires - now, 3)}
                for decision in crowdsec.table.matching(network, now)]

    @property
    def caller(self) -> str:
        """Who an allowed admin request came from, for the audit line: the
        token's holder, or a loopback peer."""
        return "token" if self._token is not None else "loopback"


def ban_view(ban: BanRecord, now: float, network: bool) -> dict[str, Any]:
    return {
        "address": ban.address,
        "scope": "network" if network else "address",
        "rule": "manual" if ban.manual else ban.rule_id,
        "reason": ban.reason if ban.manual else None,
        "node": ban.node,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ban.started_wall)),
        "duration_seconds": ban.duration,
        "remaining_seconds": round(ban.expires - now, 3),
        "shadow": ban.shadow,
        "step": ban.step,
    }


def counter_view(state: CounterState, limiter: Limiter | None) -> dict[str, Any]:
    remaining, reset, window = state.quota if state.quota is not None else (None, None, None)
    return {
        "rule": key_rule_id(state.key),
        "key": describe_key(state.key),
        "dimensions": dimension_values(state.key),
        "limit": limiter.describe() if limiter is not None else None,
        "remaining": remaining,
        "reset_seconds": None if reset is None else round(reset, 3),
        "window_seconds": window,
        "penalty_seconds": round(state.penalty, 3),
    }


def parse_ban(body: bytes) -> tuple[str, float, str]:
    """The address, duration and reason of ``POST /v1/admin/bans``'s JSON;
    ValueError says what is wrong with it."""
    fields = _json_fields(body, 'a JSON object like {"address": "203.0.113.7", "duration": "1h", "reason": "..."}',
                          {"address", "duration", "reason"}, "a ban has an address, a duration and a reason")
    address, duration, reason = fields.get("address"), fields.get("duration"), fields.get("reason", "")
    if not isinstance(address, str):
        raise ValueError("address: expected an IP address or a network (CIDR), as a string")
    if duration is None:
        raise ValueError("duration: required, like \"1h\" or 3600 (seconds)")
    try:
        seconds = parse_duration(duration)
    except ValueError as exc:
        raise ValueError(f"duration: {exc}") from None
    if not SHORTEST_BAN <= seconds <= LONGEST_BAN:
        raise ValueError("duration: a ban lasts from 1s to 1y")
    if not isinstance(reason, str) or len(reason) > LONGEST_REASON or not reason.isprintable():
        raise ValueError(f"reason: expected text of at most {LONGEST_REASON} printable characters")
    return address, seconds, reason


def parse_assignment(body: bytes, needs_tier: bool = True) -> tuple[str, str]:
    """The identity and tier of ``POST /v1/admin/tiers``'s JSON (the
    identity alone for ``DELETE``); ValueError says what is wrong with it."""
    example = ('a JSON object like {"identity": "KEY", "tier": "pro"}' if needs_tier
               else 'a JSON object like {"identity": "KEY"}')
    fields = _json_fields(body, example, {"identity", "tier"} if needs_tier else {"identity"}, f"expected {example}")
    identity, tier = fields.get("identity"), fields.get("tier", "")
    if not isinstance(identity, str) or not identity:
        raise ValueError("identity: expected the value of tiers.identity (an API key, a subject), as a string")
    if needs_tier and (not isinstance(tier, str) or not tier):
        raise ValueError("tier: expected one of tiers.names, as a string")
    return identity, tier


def _json_fields(body: bytes, example: str, known: set[str], unknown_says: str) -> dict[str, Any]:
    """An admin call's JSON object, of at most ``MAX_BAN_REQUEST`` bytes
    and the ``known`` fields only; ValueError says what is wrong with it."""
    if len(body) > MAX_BAN_REQUEST:
        raise ValueError(f"expected {example}, of at most {MAX_BAN_REQUEST} bytes")
    try:
        fields = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise ValueError(f"expected {example}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"expected {example}")
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown field {unknown[0][:100]!r}: {unknown_says}")
    return fields


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


def read_token(path: str | None) -> bytes | None:
    if path is None:
        return None
    token = Path(path).read_bytes().strip()
    if len(token) < 16:
        raise ValueError(f"the admin token in {path} is shorter than 16 characters")
    return token
