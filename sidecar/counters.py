"""Counters as the admin API shows and resets them.

An administrator names counting keys in one of three ways (``KeySelection``):
every key of one client address, every key of one rule, or one key of one
rule by its dimensions' values (``DIMENSION=VALUE`` texts, made into the
key exactly as the rule makes it from a request). The store finds the keys
and describes each one (``CounterState``) with the limiter of the rule
that counts it, as the draft RateLimit fields describe it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sidecar.clientip import ClientIPResolver
from sidecar.config import parse_dimension
from sidecar.keys import CountingKey, key_dimensions, key_rule_id, key_values
from sidecar.networkbans import client_key
from sidecar.request import normalise_path

if TYPE_CHECKING:
    from sidecar.limiters import Quota
    from sidecar.rules import CompiledRule


@dataclass(frozen=True, slots=True)
class KeySelection:
    """Which counting keys: those counted for the client ``address`` (its
    counting key: a rule's ``ip`` dimension, or a ``session:`` rule's
    fallback to the address), those of ``rule``, both at once, or exactly
    ``key``."""

    address: str | None = None
    rule: str | None = None
    key: CountingKey | None = None

    def holds(self, key: CountingKey) -> bool:
        if self.key is not None:
            return key == self.key
        if self.rule is not None and key_rule_id(key) != self.rule:
            return False
        return self.address is None or counts_address(key, self.address)


def counts_address(key: CountingKey, address: str) -> bool:
    """Whether the key is counted for this client address: its ``ip``
    value, or the address a ``session:`` dimension fell back to."""
    fallback = ("ip", address)
    for name, value in zip(key_dimensions(key), key_values(key)):
        if value == fallback or (name == "ip" and value == address):
            return True
    return False


@dataclass(frozen=True, slots=True)
class CounterState:
    """One stored key as its limiter describes it: seconds of penalty left
    (0: none), and (remaining, reset seconds, window seconds) as the draft
    RateLimit fields give them, None when no rule running now counts the
    key (its rule was removed, or counts by other dimensions now)."""

    key: CountingKey
    penalty: float
    quota: Quota | None


def key_from_text(rule: CompiledRule, resolver: ClientIPResolver, given: Sequence[str]) -> CountingKey:
    """The key ``rule`` counts a request under whose dimensions have the
    values ``given`` (``DIMENSION=VALUE`` each, one per dimension of the
    rule, in any order). ValueError says what is missing or wrong."""
    _, names = rule.key_prefix
    values: dict[str, Hashable] = {}
    for text in given:
        name, sep, value = text.partition("=")
        if not sep:
            raise ValueError(f"expected DIMENSION=VALUE, got {text[:100]!r}")
        try:
            name = parse_dimension(name.strip())
        except ValueError as exc:
            raise ValueError(f"{text[:100]!r}: {exc}") from None
        if name not in names:
            raise ValueError(f"rule {rule.id} counts by {_listed(names)}, not by {name}")
        if name in values:
            raise ValueError(f"{name} is given twice")
        values[name] = _dimension_value(name, value, resolver)
    missing = [name for name in names if name not in values]
    if missing:
        raise ValueError(f"rule {rule.id} counts by {_listed(names)}: give "
                         + " and ".join(f"{name}=VALUE" for name in missing))
    return (rule.key_prefix, *(values[name] for name in names))


def _dimension_value(name: str, text: str, resolver: ClientIPResolver) -> Hashable:
    """A dimension's value as a request gives it (``rules._dimension_value``):
    the client's counting key, the normalised path, a session cookie's
    value tagged as such; other values as they are."""
    if name == "ip":
        return client_key(resolver, text)
    if name == "path":
        return normalise_path(text)
    if name.startswith("session:"):
        # The fallback to the address is the address's key: select it by ip.
        return ("cookie", text)
    if name.startswith("jwt:"):
        return ("jwt", text)  # as a claim is counted; its fallback too is the address's key
    return text


def _listed(names: Sequence[str]) -> str:
    return ", ".join(names)


def dimension_values(key: CountingKey) -> dict[str, object]:
    """The key's values by dimension, for JSON: a session value as
    ``{"cookie": VALUE}`` or ``{"ip": ADDRESS}``, a claim's as
    ``{"jwt": VALUE}`` or ``{"ip": ADDRESS}``."""
    return {name: {value[0]: value[1]} if isinstance(value, tuple) else value
            for name, value in zip(key_dimensions(key), key_values(key))}
