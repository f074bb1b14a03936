"""Counting keys: which counter a request counts against.

A key is ``(prefix, *values)``: the prefix is the rule id and the sorted
names of its dimensions (``rules.compile_key``), the values are the
request's for them, in that order. A key's parts are read through the
functions here, never by position.

A key is a plain tuple, built by a tuple display for every matching rule
of every request and kept as the memory store's dict key: C-level hash and
equality, its JSON array is its Redis key name, and the collector stops
tracking a stored key of strings. A tuple subclass with properties was
measured and rejected: its type call costs 6-12 % of a ten-rule decision
(the rules of bench/bench_engine.py, in CPU time), and CPython never
untracks one, so each stored key would be walked at every full collection
(the rotation figure of the same bench went from 85 to 112 µs).
"""

from __future__ import annotations

from collections.abc import Hashable

KeyPrefix = tuple[str, tuple[str, ...]]  # (rule id, sorted dimension names)
# The values are text, or a tagged pair for the session fallback
# (rules._dimension_value).
CountingKey = tuple[KeyPrefix, *tuple[Hashable, ...]]


def key_rule_id(key: CountingKey) -> str:
    return key[0][0]


def key_dimensions(key: CountingKey) -> tuple[str, ...]:
    return key[0][1]


def key_values(key: CountingKey) -> tuple[Hashable, ...]:
    return key[1:]
