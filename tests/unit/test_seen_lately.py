"""The admission filter of the address resolver's caches (SeenLately):
a value is "seen" from its second sighting, its bits are cleared after a
fixed number of first sightings, and its memory is fixed."""

from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.bounded import SEEN_BITS, SEEN_CLEARED_AFTER, SeenLately


@given(st.lists(st.text(max_size=20) | st.integers(), max_size=200))
def test_a_value_is_seen_again_from_its_second_sighting(values: list) -> None:
    seen = SeenLately()
    first = seen.again("a value of its own")
    assert first is False  # a new filter has seen nothing
    for value in values:
        seen.again(value)
        # Fewer first sightings than clear the bits: every value is still there.
        assert seen.again(value) is True


def test_its_bits_are_cleared_after_a_fixed_number_of_first_sightings() -> None:
    # Small integers hash to themselves: each of these sets a bit of its own.
    seen = SeenLately()
    assert not seen.again(0)
    for value in range(1, SEEN_CLEARED_AFTER):
        assert not seen.again(value)
    assert seen.again(0)  # SEEN_CLEARED_AFTER first sightings: still set
    assert seen.again(SEEN_CLEARED_AFTER - 1)
    assert seen.generation == 0
    assert not seen.again(SEEN_CLEARED_AFTER)  # one more first sighting clears the others
    assert seen.generation == 1  # counted, for a cache that forgets with the bits
    assert not seen.again(0)
    assert seen.again(SEEN_CLEARED_AFTER)
    assert seen.generation == 1


def test_under_a_rotation_few_new_values_pass_for_seen_and_memory_is_fixed() -> None:
    """At most one bit in eight is ever set, so a rotation of new values
    passes for seen (by another value's bit) about one time in sixteen
    and never more than one in eight; the filter's memory is its bits."""
    generator = random.Random(7)
    values = [generator.getrandbits(60) for _ in range(200_000)]  # ints hash to themselves
    seen = SeenLately()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        passed = sum(seen.again(value) for value in values)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < passed < len(values) / 8
    assert grown < SEEN_BITS // 8 + 4096  # one set of bits made anew at most, beside the old one freed


def test_a_cache_behind_it_stores_a_value_from_its_second_sighting_and_stays_bounded() -> None:
    seen = SeenLately()
    cache: dict[str, int] = {}
    seen.remember(cache, "first", 1, 3)
    assert cache == {}
    seen.remember(cache, "first", 1, 3)
    assert cache == {"first": 1}
    for n in range(20):
        for _ in range(2):
            seen.remember(cache, f"value {n}", n, 3)
        assert 0 < len(cache) <= 3
    unused: dict[str, int] = {}
    for _ in range(2):
        seen.remember(unused, "any", 1, 0)  # a cache of size 0 stores nothing
    assert unused == {}


def test_a_cache_behind_it_is_emptied_with_its_bits() -> None:
    """Under a rotation the values a filter takes for seen (their bit set
    by another) would fill a cache behind it: each cache is emptied at its
    first store after the bits were cleared, so that it holds what one
    generation of the filter stored."""
    seen = SeenLately(64)  # cleared after 8 first sightings
    fields: dict[int, str] = {}
    walks: dict[int, str] = {}
    for value in (1, 2):
        for _ in range(2):
            seen.remember(fields, value, "field", 100)
            seen.remember(walks, value + 100, "walk", 100)
    assert sorted(fields) == [1, 2] and sorted(walks) == [101, 102]
    generation = seen.generation
    number = 1000
    while seen.generation == generation:  # first sightings until the bits are cleared
        number += 1
        seen.again_at(number)
    assert sorted(fields) == [1, 2]  # not emptied before a store
    for _ in range(2):
        seen.remember(fields, 3, "field", 100)
    assert fields == {3: "field"}
    assert sorted(walks) == [101, 102]
    for _ in range(2):
        seen.remember(walks, 103, "walk", 100)
    assert walks == {103: "walk"}
    for _ in range(2):
        seen.remember(fields, 4, "field", 100)  # the same generation: kept
    assert sorted(fields) == [3, 4]


@given(st.sampled_from([8, 64, 1 << 10, 1 << 17]), st.lists(st.integers(0, 2**24), max_size=50))
def test_a_filter_of_other_bits_is_asked_by_number_and_cleared_after_an_eighth_of_them(bits: int,
                                                                                     numbers: list[int]) -> None:
    """The node's table asks a filter of 2^17 bits with a digest's bytes:
    the number picks the bit, the bits are cleared after ``bits / 8``
    first sightings, as the default filter's after SEEN_CLEARED_AFTER."""
    seen = SeenLately(bits)
    distinct = list(dict.fromkeys(number & (bits - 1) for number in numbers))[:bits // 8]
    assert [seen.again_at(number) for number in distinct] == [False] * len(distinct)
    assert all(seen.again_at(number + bits) for number in distinct)  # the same bit: seen
    fresh = SeenLately(bits)
    for number in range(bits // 8):
        fresh.again_at(number)
    assert fresh.again_at(0)
    assert not fresh.again_at(bits // 8)  # one first sighting more clears the others
    assert not fresh.again_at(0)


@pytest.mark.parametrize("bits", [0, 4, 12, 100])
def test_a_filter_s_bits_are_a_power_of_two(bits: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        SeenLately(bits)
