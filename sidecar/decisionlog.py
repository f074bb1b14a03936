"""The decision log: one bare JSON line per refusal, observation and counted
response, on the ``sluice.decisions`` logger.

Lines are built only when the logger is enabled, so a disabled log costs a
level check per event and nothing else.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Callable, TextIO

from sidecar.keys import CountingKey
from sidecar.request import CheckRequest
from sidecar.rules import CompiledRule, describe_key
from sidecar.state import Check, ResponseCount

decision_log = logging.getLogger("sluice.decisions")

# A counting key's values come from the client (a header, a cookie): a
# decision line shows at most this much of them, however long they are.
LOGGED_KEY_CHARS = 256


def logged_key(key: CountingKey) -> str:
    text = describe_key(key)
    return text if len(text) <= LOGGED_KEY_CHARS else text[:LOGGED_KEY_CHARS] + "…"


def configure_decision_log(stream: TextIO = sys.stderr) -> None:
    """Decision log lines are bare JSON, one per line."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    decision_log.handlers[:] = [handler]
    decision_log.setLevel(logging.INFO)
    decision_log.propagate = False


class DecisionLog:
    """Writes the lines; ``node`` names this node (it may change on reload)."""

    def __init__(self, node: Callable[[], str], wall_clock: Callable[[], float] = time.time) -> None:
        self._node = node
        self._wall_clock = wall_clock

    def matched(self, request: CheckRequest, rule: CompiledRule, check: Check, outcome: str,
                banned: bool = False) -> None:
        """A rule over its limit: the request refused, or observed."""
        if not decision_log.isEnabledFor(logging.INFO):
            return
        entry: dict[str, object] = {
            "ts": round(self._wall_clock(), 3),
            "request_id": request.request_id,
            "rule": rule.id,
            "action": rule.action,
            "outcome": outcome,
            "key": logged_key(check.key),
            "client": request.client.key,
            "node": self._node(),
        }
        if banned:
            entry["ban_seconds"] = check.ban_duration
        self._write(entry)

    def counted(self, rule: CompiledRule, count: ResponseCount) -> None:
        """A reported response counted for a rule."""
        if decision_log.isEnabledFor(logging.INFO):
            self._write({"ts": round(self._wall_clock(), 3), "rule": rule.id, "outcome": "counted",
                         "amount": count.amount, "key": logged_key(count.key), "node": self._node()})

    @staticmethod
    def _write(entry: dict[str, object]) -> None:
        decision_log.info(json.dumps(entry, separators=(",", ":")))
