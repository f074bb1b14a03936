"""Pending response-phase counts, carried by the proxy in a signed token.

A response-phase rule (``count_on:``, score budgets) is matched at request
time but counted only when the proxy reports the response. Which
(rule, key) pairs wait for that response is not kept in Sluice: it travels
with the request as a token the proxy hands back with the response report.
So do the concurrency slots the request holds, given back by the report:
the request's lease id and the (rule, key) of each slot.
That keeps Sluice's memory flat whatever happens to the reports (a lost one
costs one count and nothing else), lets any Sluice process of a node (or of a
fleet sharing a store) take the report, and survives reloads.

The token is ``base64url(payload).base64url(HMAC-SHA256(payload)[:16])``;
the payload is JSON ``[issued_at, [[rule_id, threshold, value, ...], ...]]``,
followed by ``lease_id, [[rule_id, value, ...], ...]`` when the request
holds concurrency slots.
Tokens older than ``max_age`` are refused, so a replayed one is worthless
after a while (and can only ever count against its own keys).
"""

from __future__ import annotations

import binascii
import json
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.signing import Signer, b64decode, b64encode

# A counting key's values (``keys.key_values``): text, or a tagged pair
# for the session fallback (see rules._dimension_value).
KeyValues = tuple[Hashable, ...]
PendingEntry = tuple[str, float, KeyValues]
SlotEntry = tuple[str, KeyValues]  # a concurrency slot: its rule and key values

MAX_TOKEN_LENGTH = 4096


def _thaw(value: Any) -> Hashable:
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True, slots=True)
class Pending:
    """What a genuine token carries back with the response."""

    counts: list[PendingEntry]
    lease: str = ""  # the request's lease id, with slots
    slots: list[SlotEntry] = field(default_factory=list)


class PendingTokens:
    def __init__(self, secret: bytes, max_age: float = 600.0,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._signer = Signer(secret, b"sluice pending responses")
        self.max_age = max_age
        self._wall_clock = wall_clock

    def issue(self, entries: Sequence[PendingEntry], lease: str = "",
              slots: Sequence[SlotEntry] = ()) -> str | None:
        """A token for these entries and the slots held under ``lease``, or
        None when it would be too long to carry (very long key values):
        that response then goes uncounted, and its slots end with their lease."""
        document: list[Any] = [int(self._wall_clock()),
                               [[rule_id, threshold, *values] for rule_id, threshold, values in entries]]
        if slots:
            document += [lease, [[rule_id, *values] for rule_id, values in slots]]
        payload = json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        encoded = b64encode(payload)
        token = f"{encoded}.{self._signer.sign(encoded.encode('ascii'))}"
        return token if len(token) <= MAX_TOKEN_LENGTH else None

    def open(self, token: str) -> Pending | None:
        """What a genuine, fresh token carries; None for anything else."""
        encoded, _, signature = token.strip().partition(".")
        if not encoded or not signature or len(token) > MAX_TOKEN_LENGTH:
            return None
        try:
            if not self._signer.verifies(encoded.encode("ascii"), signature):
                return None
            issued, raw_entries, *held = json.loads(b64decode(encoded))
            lease, raw_slots = held or ("", [])
        except (ValueError, UnicodeError, binascii.Error, TypeError):
            return None
        age = self._wall_clock() - issued
        if not -60 <= age <= self.max_age:
            return None
        return Pending([(entry[0], float(entry[1]), tuple(_thaw(v) for v in entry[2:])) for entry in raw_entries],
                       lease, [(slot[0], tuple(_thaw(v) for v in slot[1:])) for slot in raw_slots])
