"""A limiter that only the tests know: the generic cell rate algorithm
(GCRA), declared as a limiter of ``sidecar/limiters`` is, to show that a
new limiter is this module, its Lua (``cell_rate.lua``, beside it) and its
tests, and that no file of Sluice names it.

``limit: {cells: N, per: PERIOD}`` admits N requests per period, spread
evenly: each admitted request moves the key's theoretical arrival time
(TAT) one emission interval (PERIOD / N) later, from now at the earliest,
and a request is admitted while its TAT stays within one period of now. So
a key at rest may send N at once, then one per interval. A refusal changes
nothing; the algorithm has no penalty. A Rate Limit Service descriptor
names it as ``algorithm: cell_rate``.

Importing the module registers it (``test_cell_rate.py`` does it inside
``registry.scope()``, which withdraws it afterwards).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from sidecar.config import Duration, LimitModel, format_duration
from sidecar.limiters import UNDER_LIMIT, Algorithm, Hit, Quota, RuleLimit, lua_number, registry

CELL_RATE = registry.lua_kind("G", "window", Path(__file__).with_name("cell_rate.lua"))


@dataclass(slots=True)
class CellState:
    tat: float  # the theoretical arrival time: when the key is at rest again
    # The limiter the state belongs to: a reload may give the key another.
    limiter: Any = None
    used: bool = False  # marked by the memory store's table when read


class CellRate(Algorithm):
    """GCRA: ``threshold`` requests per ``period``, at once from rest and
    then one per ``period / threshold``."""

    __slots__ = ("cells", "period")
    deferred = False  # counts at once
    holds = False
    scalable = True  # overrides may scale the cells
    leases = False

    def __init__(self, cells: int, period: float) -> None:
        self.cells = cells
        self.period = period

    def new_state(self) -> CellState:
        return CellState(-math.inf, self)

    def peek(self, state: CellState, now: float) -> Hit:
        return UNDER_LIMIT  # no penalty

    def hit(self, state: CellState, now: float, threshold: float, amount: int = 1) -> Hit:
        tat = max(state.tat, now) + self.period / threshold * amount
        if tat - now > self.period:
            return Hit(True, tat - now - self.period)
        state.tat = tat
        return UNDER_LIMIT

    def quota(self, state: CellState, now: float, threshold: float) -> Quota:
        """Requests admitted at once now, the time until the key is at rest, the period."""
        tat = max(state.tat, now)
        return Quota(max(0, math.floor((now + self.period - tat) / (self.period / threshold))), tat - now, self.period)

    def expires_at(self, state: CellState) -> float:
        return state.tat

    def longest_hold(self) -> float:
        return 0.0

    def redis_args(self, threshold: float, lease: str = "") -> tuple[str, ...]:
        """CELL_RATE and cell_rate.lua's {cells, period}."""
        return (CELL_RATE, lua_number(threshold), lua_number(self.period), "", "", "")

    def peak_period(self) -> float:
        return self.period

    def sustained_rate(self) -> float:
        return self.cells / self.period

    def describe(self) -> str:
        return f"{self.cells} cells per {format_duration(self.period)}"


class CellRateLimit(LimitModel):
    tag: ClassVar[str] = "cell-rate"
    refused_settings: ClassVar[Mapping[str, str]] = {
        "penalty": "a cell rate has no penalty: a request is refused until its cell comes",
    }
    cells: int = Field(ge=1)
    per: Duration


@registry.limit(CellRateLimit, field="cells", needs="per", threshold="cells")
def _cell_rate(limit: CellRateLimit, penalty: float | None) -> RuleLimit:
    return RuleLimit(CellRate(limit.cells, limit.per), limit.cells, None)


def _some_cells(requests: int, period: float) -> None:
    if requests < 1:
        raise ValueError("a cell rate needs requests_per_unit of at least 1")


@registry.rls_algorithm("cell_rate", burst=False, check=_some_cells)
def _rls_cell_rate(requests: int, period: float, burst: int | None, penalty: float | None) -> RuleLimit:
    return RuleLimit(CellRate(requests, period), requests, None)
