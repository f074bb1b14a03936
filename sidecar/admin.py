"""Reload and the admin API.

A reload (``SIGHUP`` or ``POST /v1/admin/reload``) reads the rules file
again, and the Rate Limit Service configurations when Sluice serves them:
valid files replace the rules at once, keeping counters (a rule keeps its
counters under the same id and dimensions, a descriptor under the same
entries); an invalid one is refused with its errors and the old rules and
configurations keep running.

The admin API answers only with a bearer token (``--admin-token-file``,
compared in constant time), or — with no token configured — only to
loopback peers of a loopback listener. Without either it is off.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sidecar.config import ConfigError
from sidecar.engine import Engine
from sidecar.rules import Ruleset, default_ruleset, load_ruleset

if TYPE_CHECKING:
    from sidecar.frontdoors.rls import RateLimitService

log = logging.getLogger("sluice")


class Admin:
    def __init__(self, engine: Engine, config_path: str | None, token: bytes | None = None,
                 loopback_listener: bool = False, rls: RateLimitService | None = None,
                 shadow: bool = False) -> None:
        self.engine = engine
        self.config_path = config_path
        self.rls = rls
        self.shadow = shadow  # sluice serve --shadow: every rule reloaded in shadow mode
        self._token = token
        self.loopback_listener = loopback_listener

    # -- reload --------------------------------------------------------------

    def load(self) -> Ruleset:
        return load_ruleset(self.config_path, self.shadow) if self.config_path else default_ruleset(self.shadow)

    def reload(self, who: str = "signal") -> list[str]:
        """Reload the rules file; the errors, or [] when the new rules run.
        ``who`` asked (``signal``, ``token`` or ``loopback``): the audit line says."""
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
            log.info("reloaded %d Rate Limit Service limits from %s", rls_config.limits, self.rls.path)
        self.engine.metrics.reloaded(succeeded=True)
        log.info("reloaded %d rules from %s", len(ruleset.rules), ruleset.source)
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

    def rules(self) -> list[dict]:
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

    async def bans(self) -> list[dict]:
        now = self.engine.clock()
        return [{
            "address": ban.address,
            "rule": ban.rule_id,
            "node": ban.node,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ban.started_wall)),
            "duration_seconds": ban.duration,
            "remaining_seconds": round(ban.expires - now, 3),
            "shadow": ban.shadow,
            "step": ban.step,
        } for ban in await self.engine.active_bans()]

    async def lift_ban(self, address: str, who: str) -> bool:
        lifted = await self.engine.lift_ban(address)
        self.engine.log.audit("unban", who, "lifted" if lifted else "no ban", address=address)
        return lifted

    @property
    def caller(self) -> str:
        """Who an allowed admin request came from, for the audit line: the
        token's holder, or a loopback peer."""
        return "token" if self._token is not None else "loopback"


def read_token(path: str | None) -> bytes | None:
    if path is None:
        return None
    token = Path(path).read_bytes().strip()
    if len(token) < 16:
        raise ValueError(f"the admin token in {path} is shorter than 16 characters")
    return token
