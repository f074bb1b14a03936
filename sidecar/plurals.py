"""Counts in words, for everything Sluice prints: ``1 rule``, ``2 rules``,
``1,528 requests``."""


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``count`` and the noun in the number it takes: ``nouns`` for a plural
    that is not the noun and an s (``1 entry``, ``2 entries``)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"
