"""The limiters' states in lines of the cache (sidecar/_slab.pyx): with
the compiled core, each state takes one aligned block of 64 bytes, released
blocks are taken again before new memory, and a type the blocks cannot
hold is refused. The pure-Python core keeps Python's allocator."""

import gc
import importlib
import tracemalloc

import pytest

from sidecar import core
from sidecar.limiters.concurrent import LeaseState
from sidecar.limiters.leaky import LeakyState
from sidecar.limiters.token import TokenState
from sidecar.limiters.window import WindowState

pytestmark = pytest.mark.skipif(core.PURE, reason="the compiled core's allocator: the compiled core only")

LINE = 64


def states(count: int) -> list[object]:
    """``count`` states of each kind, as the limiters make them."""
    made: list[object] = []
    for number in range(count):
        made += [WindowState(number, 0, 1, 0.0), TokenState(1.5, None, 0.0), LeakyState(1000, number, 0.0),
                 LeaseState({})]
    return made


def test_every_kind_of_state_starts_on_a_line_of_its_own() -> None:
    made = states(500)
    assert all(id(state) % LINE == 0 for state in made)
    assert len({id(state) for state in made}) == len(made)
    # What a state holds is untouched by where it lives.
    assert made[4 * 7] == WindowState(7, 0, 1, 0.0) and made[4 * 7 + 2] == LeakyState(1000, 7, 0.0)
    assert made[3].held == {} and made[1].last is None


def test_released_states_are_made_again_in_their_blocks_and_memory_stays_flat() -> None:
    made = states(2_000)
    blocks = {id(state) for state in made}
    del made
    again = states(2_000)
    assert {id(state) for state in again} == blocks  # the same blocks, no new ones
    del again
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20):
            batch = states(2_000)
            del batch
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 8 * 1024  # at most a chunk, though 160,000 states came and went


def test_a_type_the_blocks_cannot_hold_is_refused() -> None:
    place_in_lines = importlib.import_module("sidecar._slab").place_in_lines

    class Collected:  # tracked by the garbage collector
        pass

    class Plain:  # not tracked, but not one of Sluice's types
        __slots__ = ()

    from sidecar.bounded import BoundedMap  # Sluice's, tracked by the collector
    from sidecar.clientip import ClientAddress  # Sluice's, untracked, over 64 bytes

    for kind in (BoundedMap, ClientAddress, Collected, Plain, dict, bytes, float, "WindowState"):
        with pytest.raises(TypeError, match="not an untracked type"):
            place_in_lines(kind)
