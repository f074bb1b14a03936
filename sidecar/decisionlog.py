"""The decision log: one bare JSON line per refusal, observation, counted
response and admin action, on the ``sluice.decisions`` logger.

A rule's refusals (and observations) of one key are written at most once a
second (``RepeatFold``): a flood of one client's refused requests is a line a
second, whose ``"repeated"`` says how many lines were folded into it since
the previous one. Each of them is still counted in the metrics.

Counting-key values are personal data or secrets (API keys, phone numbers,
session ids). By default a line shows each as a keyed hash: the first 12
hex digits of an HMAC-SHA256 under a key derived from the node's secret
(``challenge.secret_file``, else one random per start), stable per value,
so one key can still be followed through the log, and across nodes and
restarts when they share the secret file. ``decision_log.keys`` chooses
``hash``, ``clear`` or ``omit``; client addresses are shown in every case.

Lines are built only when the logger is enabled, so a disabled log costs a
level check per event and nothing else.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Hashable
from typing import TextIO

from sidecar.config import LogKeys
from sidecar.keys import CountingKey, key_dimensions, key_values
from sidecar.request import CheckRequest
from sidecar.rules import CompiledRule, describe_key
from sidecar.signing import derive_key
from sidecar.state import BanRecord, Check, ResponseCount

decision_log = logging.getLogger("sluice.decisions")

# A counting key's values, a path and a user agent come from the client: a
# decision line shows at most this much of each, however long they are.
LOGGED_KEY_CHARS = 256


# A rule's lines for one key and outcome are at most this often; at most
# this many (rule, key) pairs are remembered for it, the oldest forgotten.
REPEAT_SECONDS = 1.0
REPEATS_TRACKED = 10_000


class RepeatFold:
    """Which repeated lines to write: the first of a (rule, key, outcome) in
    REPEAT_SECONDS, with the count of those folded since its last line."""

    def __init__(self, capacity: int = REPEATS_TRACKED) -> None:
        self.capacity = capacity
        self._last: collections.OrderedDict[Hashable, tuple[float, int]] = collections.OrderedDict()

    def admit(self, key: Hashable, now: float) -> int | None:
        """None to fold this line away; else write it, saying how many
        were folded before it."""
        last = self._last
        entry = last.get(key)
        if entry is not None and 0 <= now - entry[0] < REPEAT_SECONDS:
            last[key] = (entry[0], entry[1] + 1)
            return None
        last[key] = (now, 0)
        last.move_to_end(key)
        if len(last) > self.capacity:
            last.popitem(last=False)
        return entry[1] if entry is not None else 0

    def deadline(self, key: Hashable) -> float:
        """Until when this key's lines are folded (-inf: not folding)."""
        entry = self._last.get(key)
        return entry[0] + REPEAT_SECONDS if entry is not None else -math.inf

    def fold(self, key: Hashable) -> None:
        """One line more folded, written by no one (an answer sent again)."""
        entry = self._last.get(key)
        if entry is not None:
            self._last[key] = (entry[0], entry[1] + 1)


# Dimensions whose values are client addresses, shown as they are: a rule's
# ``ip``, and a Rate Limit Service descriptor's ``remote_address``.
ADDRESS_DIMENSIONS = ("ip", "remote_address")


def _bounded(text: str) -> str:
    return text if len(text) <= LOGGED_KEY_CHARS else text[:LOGGED_KEY_CHARS] + "…"


def log_hash_key(secret: bytes) -> bytes:
    """The key of the log's hashes: derived, so that it signs nothing else."""
    return derive_key(secret, b"sluice decision log")


def logged_key(key: CountingKey, keys: LogKeys = "clear", hash_key: bytes = b"") -> str:
    """The key as a decision line shows it: every dimension by name, client
    addresses as they are, other values as ``keys`` says."""
    if keys == "clear":
        return _bounded(describe_key(key))
    parts = []
    for name, value in zip(key_dimensions(key), key_values(key)):
        if name in ADDRESS_DIMENSIONS or (isinstance(value, tuple) and value[0] == "ip"):
            parts.append(f"{name}={value!r}" if isinstance(value, tuple) else f"{name}={value}")
        elif keys == "omit":
            parts.append(name)
        else:
            parts.append(f"{name}=#{_hashed(value, hash_key)}")
    return _bounded(" ".join(parts))


def _hashed(value: Hashable, hash_key: bytes) -> str:
    text = value[1] if isinstance(value, tuple) else value  # a session cookie's value
    data = str(text).encode("utf-8", "surrogatepass")  # a log replayed may carry a lone surrogate
    return hmac.new(hash_key, data, hashlib.sha256).hexdigest()[:12]


def iso_time(wall: float) -> str:
    """ISO 8601, UTC, to the millisecond."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall)) + f".{int(wall * 1000) % 1000:03d}Z"


def configure_decision_log(stream: TextIO = sys.stderr) -> None:
    """Decision log lines are bare JSON, one per line."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    decision_log.handlers[:] = [handler]
    decision_log.setLevel(logging.INFO)
    decision_log.propagate = False


class DecisionLog:
    """Writes the lines; ``node`` names this node and ``keys`` how values
    show (both may change on reload); ``secret`` is the node's secret."""

    def __init__(self, node: Callable[[], str], wall_clock: Callable[[], float] = time.time,
                 keys: Callable[[], LogKeys] = lambda: "hash", secret: Callable[[], bytes] = lambda: b"",
                 clock: Callable[[], float] | None = None) -> None:
        self._node = node
        self._wall_clock = wall_clock
        # What repeats are folded by: the engine's clock.
        self._clock = clock or wall_clock
        self._keys = keys
        self._secret = secret
        self._hash_key: tuple[bytes, bytes] = (b"", log_hash_key(b""))  # (secret, its log key)
        self._repeats = RepeatFold()

    def key_text(self, key: CountingKey) -> str:
        secret = self._secret()
        if self._hash_key[0] != secret:
            self._hash_key = (secret, log_hash_key(secret))
        return logged_key(key, self._keys(), self._hash_key[1])

    def _head(self) -> dict[str, object]:
        wall = self._wall_clock()
        return {"time": iso_time(wall), "ts": round(wall, 3)}

    def matched(self, request: CheckRequest, rule: CompiledRule, check: Check, outcome: str,
                banned: bool = False, shadow: bool = False, ban: BanRecord | None = None) -> None:
        """A rule over its limit: the request refused, or observed; a shadow
        rule's line has its would-be action and ``"shadow":true``."""
        if not decision_log.isEnabledFor(logging.INFO):
            return
        # A ban is written whenever it is issued; repeats of anything else fold.
        folded = 0 if banned else self._repeats.admit((rule.id, check.key, outcome, shadow), self._clock())
        if folded is None:
            return
        entry = self._head()
        entry.update({
            "request_id": request.request_id,
            "rule": rule.id,
            "action": rule.action,
            "outcome": outcome,
            "key": self.key_text(check.key),
            "client": request.client.key,
            "method": request.method,
            "host": _bounded(request.host),
            # The path without its query, whose values may be secrets.
            "path": _bounded(request.path),
            "user_agent": _bounded(request.headers.get("user-agent", "")),
            "node": self._node(),
        })
        if banned:
            # The ban as issued: an auto-ban's or an escalated one's length.
            entry["ban_seconds"] = ban.duration if ban is not None else check.ban_duration
            if ban is not None and ban.step:
                entry["ban_step"] = ban.step
        if shadow:
            entry["shadow"] = True
            if rule.ban_duration is not None:
                entry["ban_seconds"] = rule.ban_duration
        if folded:
            entry["repeated"] = folded
        self._write(entry)

    def fold_deadline(self, key: Hashable) -> float:
        """Until when a rule's line for ``key`` (rule id, counting key,
        outcome, shadow) would be folded: inf while the log is off."""
        if not decision_log.isEnabledFor(logging.INFO):
            return math.inf
        return self._repeats.deadline(key)

    def folded(self, key: Hashable) -> None:
        if decision_log.isEnabledFor(logging.INFO):
            self._repeats.fold(key)

    def rls(self, domain: str, rule_id: str, key: CountingKey, shadow: bool, banned: bool) -> None:
        """A Rate Limit Service descriptor over its limit: refused, banned,
        or only observed (shadow_mode)."""
        if not decision_log.isEnabledFor(logging.INFO):
            return
        entry = self._head()
        entry.update({"front_door": "rls", "domain": domain, "rule": rule_id,
                      "action": "shadow" if shadow else "ban" if banned else "block",
                      "outcome": "observe" if shadow else "deny", "key": self.key_text(key), "node": self._node()})
        self._write(entry)

    def counted(self, rule: CompiledRule, count: ResponseCount) -> None:
        """A reported response counted for a rule."""
        if decision_log.isEnabledFor(logging.INFO):
            entry = self._head()
            entry.update({"rule": rule.id, "outcome": "counted", "amount": count.amount,
                          "key": self.key_text(count.key), "node": self._node()})
            self._write(entry)

    def audit(self, action: str, who: str, result: str, **details: object) -> None:
        """An admin action: what, by whom (``token``, ``loopback`` or
        ``signal``), and how it ended."""
        if decision_log.isEnabledFor(logging.INFO):
            entry = self._head()
            entry.update({"audit": action, "who": who, "result": result, **details, "node": self._node()})
            self._write(entry)

    @staticmethod
    def _write(entry: dict[str, object]) -> None:
        decision_log.info(json.dumps(entry, separators=(",", ":")))
