"""Tiers: who a client is names its tier, and a rule's threshold comes
from the tier (the ``tiers:`` section, and a rule's own ``tiers:``).

A request's identity is one value of it (``tiers.identity``: an API key's
header, a cookie, or a claim of its verified token). The identity's tier
is, in this order:

- an assignment made at run time (``sluice admin tier set``, ``POST
  /v1/admin/tiers``), kept by the state store, so that with Redis every
  node has it (``TierAssignments`` is this node's copy, read with every
  request);
- an assignment from the file ``tiers.file`` names (read at load and at
  every reload);
- the tier a claim of the request's verified token names (``tiers.claim``,
  ``plan: pro``), when it is one of ``tiers.names``;
- ``tiers.default``.

A rule with ``tiers: {free: 100, pro: 2000}`` counts as its ``limit`` says
and takes its threshold from the request's tier; a tier it does not list
keeps the limit's own. A client whose tier changes keeps its count and a
penalty it earned: the new threshold applies from its next request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from sidecar.config.document import ConfigIssue, Document

if TYPE_CHECKING:
    from sidecar.request import CheckRequest

# Identities longer than this are no identity: a request with one is in
# the default tier, and an assignment of one is refused.
MAX_IDENTITY_CHARS = 256
# Assignments made at run time a store holds: each is read into every
# node's memory.
MAX_ASSIGNMENTS = 100_000


def check_identity(identity: str) -> str:
    """``identity`` as an assignment names it; ValueError says what is wrong."""
    if not isinstance(identity, str) or not identity:
        raise ValueError("expected an identity: the value of tiers.identity (an API key, a subject)")
    if len(identity) > MAX_IDENTITY_CHARS:
        raise ValueError(f"an identity is at most {MAX_IDENTITY_CHARS} characters")
    if not identity.isprintable():
        raise ValueError("an identity is printable text")
    return identity


def check_tier_name(name: str, names: tuple[str, ...]) -> str:
    """``name`` when it is one of ``names``; ValueError says which there are."""
    if name not in names:
        raise ValueError(f"no tier {str(name)[:40]!r}; the tiers are {', '.join(names)} (tiers.names)")
    return name


class TierAssignments:
    """A node's copy of the assignments made at run time: identity to tier.
    The store changes it when an administrator assigns or removes a tier,
    and a shared store replaces it when another node did."""

    def __init__(self) -> None:
        self._tiers: dict[str, str] = {}

    def get(self, identity: str) -> str | None:
        return self._tiers.get(identity)

    def set(self, identity: str, tier: str) -> None:
        self._tiers[identity] = tier

    def remove(self, identity: str) -> bool:
        return self._tiers.pop(identity, None) is not None

    def replace(self, tiers: Mapping[str, str]) -> None:
        self._tiers = dict(tiers)

    def items(self) -> Iterator[tuple[str, str]]:
        return iter(sorted(self._tiers.items()))

    def __len__(self) -> int:
        return len(self._tiers)

    def __contains__(self, identity: object) -> bool:
        return identity in self._tiers


class Tiers:
    """The ``tiers:`` section compiled: which tier a request is in."""

    def __init__(self, names: tuple[str, ...], default: str, identity: Callable[[CheckRequest], str | None] | None,
                 identity_text: str, claim: Callable[[CheckRequest], str | None] | None,
                 assigned_in_file: Mapping[str, str]) -> None:
        self.names = names
        self.default = default
        self.identity = identity
        self.identity_text = identity_text  # tiers.identity as written (header:x-api-key)
        self.claim = claim
        self.assigned_in_file = dict(assigned_in_file)
        # The store's copy, bound by the engine that runs the rules.
        self.assigned = TierAssignments()

    def tier_of(self, request: CheckRequest) -> str:
        """The tier of the request's identity (the module's order)."""
        if self.identity is not None:
            identity = self.identity(request)
            if identity:
                tier = self.assigned.get(identity)
                if tier is not None:
                    return tier
                tier = self.assigned_in_file.get(identity)
                if tier is not None:
                    return tier
        if self.claim is not None:
            named = self.claim(request)
            if named is not None and named in self.names:
                return named
        return self.default

    def tier_of_identity(self, identity: str) -> tuple[str, str]:
        """The tier an identity has, and where it comes from: ``run time``,
        ``file`` or ``default`` (a token's claim is the request's, not the
        identity's)."""
        tier = self.assigned.get(identity)
        if tier is not None:
            return tier, "run time"
        tier = self.assigned_in_file.get(identity)
        if tier is not None:
            return tier, "file"
        return self.default, "default"


def read_assignments(file: str, text: str, names: tuple[str, ...]) -> tuple[dict[str, str], list[ConfigIssue]]:
    """A tiers file: each tier's identities (``pro: [key-1, key-2]``), as
    identity to tier, and every problem at its line."""
    document = Document(file, text)
    issues = list(document.issues)
    assigned: dict[str, str] = {}
    data = document.data
    if not isinstance(data, dict):
        issues.append(document.issue((), "expected each tier's identities: `TIER: [IDENTITY, ...]`"))
        return {}, issues
    for tier, identities in data.items():
        try:
            check_tier_name(tier, names)
        except ValueError as exc:
            issues.append(document.issue((tier,), str(exc)))
            continue
        if not isinstance(identities, list):
            issues.append(document.issue((tier,), "expected a list of identities"))
            continue
        for index, identity in enumerate(identities):
            if not isinstance(identity, str):
                issues.append(document.issue((tier, index), f"expected an identity as text, got {identity!r:.40}"))
                continue
            try:
                check_identity(identity)
            except ValueError as exc:
                issues.append(document.issue((tier, index), str(exc)))
                continue
            if identity in assigned:
                issues.append(document.issue((tier, index), f"already in tier {assigned[identity]!r}"))
                continue
            assigned[identity] = tier
    return assigned, issues
