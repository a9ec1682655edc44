"""A helper the tests share: the length of the common prefix of two token sequences."""

from __future__ import annotations

from itertools import takewhile


def common_prefix(a, b) -> int:
    """How many leading items ``a`` and ``b`` share."""
    return sum(1 for _ in takewhile(lambda xy: xy[0] == xy[1], zip(a, b)))
