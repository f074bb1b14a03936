"""The request-phase policy (sidecar.policy) over its tables: the smallest
in-process backend is its eight members, and the memory store's table
decides as a plain dict does while nothing is evicted."""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any

import pytest
from hypothesis import given, settings

from sidecar.at_once import run_at_once
from sidecar.bounded import state_expiry
from sidecar.keystate import limiter_of
from sidecar.limiters import UNDER_LIMIT, Hit, RuleLimit, refused
from sidecar.limiters.token import TokenBucket
from sidecar.limiters.window import WindowCounter
from sidecar.policy import StateTable, TableInC, carried_over
from sidecar.state import Check
from sidecar.store import Deciding
from sidecar.store.local import LocalStore
from sidecar.store.memory import MemoryStore, MemoryTable
from tests.unit.dict_table import DictTable
from tests.unit.policy_traces import SPECS, Step, replay, traces


def public(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls) if not name.startswith("_")}


def test_a_new_in_process_backend_is_the_tables_primitives_and_no_policy() -> None:
    assert public(DictTable) == public(StateTable)
    assert len(public(DictTable)) <= 8
    store: Deciding = LocalStore(DictTable(), "node")  # the deciding role, whole
    assert store.answers_at_once


def test_the_memory_table_has_the_primitives() -> None:
    table: StateTable = MemoryTable(10, lambda: 0.0)
    assert all(callable(getattr(table, name)) for name in public(StateTable))


@settings(max_examples=300, deadline=None)
@given(trace=traces)
def test_the_memory_store_decides_as_the_smallest_table_while_nothing_is_evicted(trace: list[Step]) -> None:
    memory = MemoryStore(10_000, "node", clock=lambda: 0.0)
    smallest = LocalStore(DictTable(), "node")
    assert run_at_once(replay(memory, trace)) == run_at_once(replay(smallest, trace))


class TableCalledInC(DictTable, TableInC):
    """The smallest table, as a table the compiled policy calls in C (its
    reads, writes, hints and bans: the node's table's way)."""


@settings(max_examples=200, deadline=None)
@given(trace=traces)
def test_a_table_called_in_c_decides_as_one_called_through_its_methods(trace: list[Step]) -> None:
    called_in_c = LocalStore(TableCalledInC(), "node")
    assert run_at_once(replay(called_in_c, trace)) == run_at_once(replay(LocalStore(DictTable(), "node"), trace))


@pytest.mark.parametrize(("name", "args"), [("state", ("k",)), ("keep", ("k", None)), ("expect", ([],)),
                                            ("ban", ("192.0.2.1",))])
def test_a_table_called_in_c_overrides_every_primitive_it_gives(name: str, args: tuple[Any, ...]) -> None:
    with pytest.raises(NotImplementedError):
        getattr(TableInC(), name)(*args)


def test_a_ban_note_and_a_penalty_note_of_one_address_are_kept_apart() -> None:
    """The notes bans react to are named by kind: an address's escalation
    step and its counted penalty of the same rule never overwrite each other."""
    table = MemoryTable(10, lambda: 0.0)
    table.keep_note(("ban step", "192.0.2.1", "r"), (1, 60.0), 100.0)
    table.keep_note(("counted penalty", "192.0.2.1", "r"), True, 50.0)
    assert table.note(("ban step", "192.0.2.1", "r"), 10.0) == (1, 60.0)
    assert table.note(("counted penalty", "192.0.2.1", "r"), 10.0) is True
    assert table.note(("counted penalty", "192.0.2.1", "r"), 50.0) is None  # kept until, not at
    assert table.forget_notes("192.0.2.1") == 2
    assert table.note(("ban step", "192.0.2.1", "r"), 10.0) is None


# --------------------------------------------------------------------------
# The limiters' base: what the policy calls, compiled or not
# --------------------------------------------------------------------------


class EveryOther(WindowCounter):
    """A limiter written in Python over a compiled one: refuses every
    other request of a key, whatever its count."""

    def __init__(self) -> None:
        super().__init__(1_000, 60.0, 60.0)
        self.calls = 0

    def hit(self, state: Any, now: float, threshold: float, amount: int = 1) -> Hit:
        self.calls += 1
        super().hit(state, now, threshold, amount)
        return refused(1.0) if self.calls % 2 == 0 else UNDER_LIMIT


def test_the_policy_calls_a_limiters_own_method_where_it_overrides_the_base() -> None:
    limiter = EveryOther()
    store = MemoryStore(100, "node", clock=lambda: 0.0)
    check = Check.of("r", (("r", ("ip",)), "192.0.2.1"), limiter, 1_000, True)
    refusals = [run_at_once(store.evaluate(10.0, "", [check])).hits[0].over_limit for _ in range(4)]
    assert refusals == [False, True, False, True]
    assert limiter.calls == 4
    state = store.table.states.data[check.key]
    assert state.current == 4  # the base's arithmetic ran under the override too
    assert state_expiry(state) == limiter.expires_at(state) == 120.0  # asked of the state's limiter


@pytest.mark.parametrize("name", ["block", "tokens", "paced", "slots"])
def test_a_states_limiter_is_read_as_its_attribute_whatever_its_kind(name: str) -> None:
    """``limiter_of`` (read in C by the compiled policy and state map) is
    the state's ``limiter``: for each kind of state, after a reload gave
    the state another limiter, and for any other object."""
    limiter = SPECS[name].limiter
    state = limiter.new_state()
    assert limiter_of(state) is state.limiter is limiter
    other = type(limiter).__new__(type(limiter))
    assert carried_over(state, other) is state
    assert limiter_of(state) is other is not limiter
    anything = types.SimpleNamespace(limiter=limiter)
    assert limiter_of(anything) is limiter


class ChargedAtOnce(TokenBucket):
    """A bucket of one's own that counts at once, as a window does: its
    class says so by its class attribute."""

    deferred = False


@pytest.mark.parametrize(("limiter", "deferred"), [
    (WindowCounter(5, 60.0, 60.0), False), (TokenBucket(5, 1.0, 1, None), True), (EveryOther(), False),
    (ChargedAtOnce(5, 1.0, 1, None), False)])
def test_a_spec_carries_its_limiters_deferred_and_the_policy_charges_by_it(limiter: Any, deferred: bool) -> None:
    key = (("r", ("ip",)), "192.0.2.1")
    check = Check.of("r", key, limiter, 5, True)
    assert check.spec.deferred is deferred
    assert dataclasses.replace(check.spec, threshold=3).deferred is deferred
    # A later check refuses the request: a deferred limiter is not charged for it.
    refusing = Check.of("no", (("no", ("ip",)), "192.0.2.1"), WindowCounter(1, 60.0, 60.0), 1, True)
    store = MemoryStore(100, "node", clock=lambda: 0.0)
    run_at_once(store.evaluate(10.0, "", [refusing]))  # its one request
    evaluation = run_at_once(store.evaluate(10.0, "", [check, refusing]))
    assert [hit.over_limit for hit in evaluation.hits] == [False, True]
    assert (key in store.table.states.data) is not deferred


class NotALimiter:
    """Every method of the protocol, but not a limiter's base."""

    deferred = holds = scalable = leases = False

    def new_state(self) -> object:
        return object()


def test_a_limit_of_something_that_is_not_a_limiter_is_refused_when_made() -> None:
    with pytest.raises(TypeError, match="^NotALimiter is not a limiter: a limiter subclasses sidecar.limiters"):
        RuleLimit(NotALimiter(), 10, None)
    assert RuleLimit(EveryOther(), 10, None).limiter.calls == 0


class ExpectingTable(DictTable):
    """The smallest table, noting the hints it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.expected: list[list[Any]] = []

    def expect(self, checks: Any) -> None:
        self.expected.append([check.key for check in checks])


def test_the_policy_tells_the_table_which_keys_it_reads_next_when_there_are_several() -> None:
    limiter = WindowCounter(5, 60.0, 60.0)
    table = ExpectingTable()
    store = LocalStore(table, "node")
    policy = store.policy
    one = [Check.of("a", ("a", "192.0.2.1"), limiter, 5.0, True)]
    two = [*one, Check.of("b", ("b", "192.0.2.1"), limiter, 5.0, True)]
    policy.evaluate(0.0, "192.0.2.1", one)
    policy.evaluate(0.0, "192.0.2.1", two)
    assert table.expected == [[("a", "192.0.2.1"), ("b", "192.0.2.1")]]
