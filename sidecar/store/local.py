"""A store in this process: the policy (``sidecar.policy``) over a table of
primitives, answered at once.

``LocalStore`` is the deciding role (``sidecar.store.Deciding``) of any
in-process table: a new in-process backend implements the eight members of
``StateTable`` and gets the whole request phase from here. The memory store
(``sidecar.store.memory``) is one, with the roles of bans, inspection and
lifecycle beside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from sidecar.keys import CountingKey
from sidecar.limiters import Hit
from sidecar.limiters.base import Limiter
from sidecar.networkbans import NetworkBans
from sidecar.policy import Policy, StateTable, TableInC
from sidecar.state import Check, Evaluation, ResponseCount

if TYPE_CHECKING:
    from sidecar.store.node import NodeStore

# A store's evaluate as a plain function: (now, address, checks, can_delay, quotas).
PlainEvaluation = Callable[[float, str, Sequence[Check], bool, bool], Evaluation]


class LocalStore:
    """The policy over ``table``; every operation answers at once: its
    coroutines never wait (see ``sidecar.at_once.run_at_once`` for callers
    with no event loop)."""

    answers_at_once = True

    def __init__(self, table: StateTable, node: str, wall_clock: Callable[[], float] = time.time) -> None:
        self.policy = Policy(table, node, wall_clock)
        self.network_bans = NetworkBans()

    async def evaluate(self, now: float, address: str, checks: Sequence[Check],
                       can_delay: bool = True, quotas: bool = False) -> Evaluation:
        return self.policy.evaluate(now, address, checks, can_delay, quotas)

    async def record(self, now: float, counts: Sequence[ResponseCount]) -> list[Hit]:
        count = self.policy.count
        return [count(c.key, c.limiter, now, c.threshold, c.amount) for c in counts]

    def count_now(self, key: Hashable, limiter: Limiter, now: float, threshold: float, amount: int) -> Hit:
        """Count one at once, whatever the limiter (a bucket is charged
        when it has room), without an event loop."""
        return self.policy.count(key, limiter, now, threshold, amount)

    async def release(self, lease: str, keys: Sequence[CountingKey]) -> int:
        return self.policy.release(lease, keys)

    async def reset(self, keys: Sequence[CountingKey]) -> int:
        return self.policy.reset(keys)

    def may_be_banned(self) -> bool:
        return True  # the table is asked with every request


def plain_policy(store: object) -> Policy | None:
    """The policy of a ``LocalStore`` whose ``evaluate`` is the class's own
    (the memory store's): what ``plain_evaluation`` calls; else None."""
    if isinstance(store, LocalStore) and getattr(type(store), "evaluate", None) is LocalStore.evaluate:
        return store.policy
    return None


def plain_evaluation(store: object) -> PlainEvaluation | None:
    """``store.evaluate`` as a plain function, when it is ``LocalStore``'s
    own (its policy's ``evaluate``), without a coroutine (the engine's
    ``decide_now``). None for any other store, and for one whose class
    overrides ``evaluate`` (to record what it decided, or to fail): that
    one is asked through its coroutine. The node-wide store's transaction
    is asked of its table (``plain_table``)."""
    policy = plain_policy(store)
    return policy.evaluate if policy is not None else None


def _plain_node_store(store: object) -> NodeStore | None:
    """``store`` when it is the node-wide store and its ``evaluate`` the
    class's own; else None."""
    from sidecar.store.node import NodeStore  # asked once a store: no import at every check

    if isinstance(store, NodeStore) and getattr(type(store), "evaluate", None) is NodeStore.evaluate:
        return store
    return None


def plain_table(store: object) -> tuple[TableInC, Policy, NetworkBans] | None:
    """The node-wide store's table, its policy and its network bans, when
    its ``evaluate`` is the class's own: the engine asks the table for the
    transaction (``TableInC.decide``) and to catch up with the other
    workers (``TableInC.catch_up``, after which the network bans are
    current) in C. None for any other store."""
    node = _plain_node_store(store)
    return (node.table, node.policy, node.network_bans) if node is not None else None
