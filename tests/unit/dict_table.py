"""The smallest in-process backend: the eight members of
``sidecar.policy.StateTable`` over plain dicts (its hint ignored), and no policy. Wrapped in
``LocalStore`` it decides as the memory store does (the store contract's
deciding tests run on it); it never bounds nor expires anything, which a
real backend would."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from sidecar.policy import Note
from sidecar.state import BanRecord, Check


class DictTable:
    def __init__(self) -> None:
        self.states: dict[Hashable, Any] = {}
        self.bans: dict[str, BanRecord] = {}
        self.notes: dict[Note, tuple[Any, float]] = {}

    def state(self, key: Hashable) -> Any:
        return self.states.get(key)

    def keep(self, key: Hashable, state: Any) -> None:
        self.states[key] = state

    def expect(self, checks: Sequence[Check]) -> None:
        pass  # a hint; nothing to ask for ahead in a dict

    def forget(self, key: Hashable) -> bool:
        return self.states.pop(key, None) is not None

    def ban(self, address: str) -> BanRecord | None:
        return self.bans.get(address)

    def keep_ban(self, record: BanRecord) -> None:
        self.bans[record.address] = record

    def note(self, name: Note, now: float) -> Any:
        note = self.notes.get(name)
        return note[0] if note is not None and now < note[1] else None

    def keep_note(self, name: Note, value: Any, until: float) -> None:
        self.notes[name] = (value, until)
