"""Repeated measurements, read honestly: a median with its spread, and a difference only when the
repeats do not overlap.

A timing on a shared machine varies from one repeat to the next, often by tens of percent. The
notebooks therefore run every configuration several times and compare configurations with
:func:`compare`, which calls a difference only when *every* repeat of one lies beyond *every*
repeat of the other::

    median, low, high = spread(times_a)
    compare(times_a, times_b)   # "lower", "higher", or None: the ranges overlap
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Literal

__all__ = ["compare", "spread"]


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """The median, minimum and maximum of repeated measurements.

    Args:
        values: the repeats of one configuration (at least one).

    Returns:
        ``(median, min, max)``.

    Raises:
        ValueError: if ``values`` is empty.

    Example:
        >>> spread([3.0, 1.0, 2.0])
        (2.0, 1.0, 3.0)
    """
    if len(values) == 0:
        raise ValueError("spread needs at least one measurement; repeat the configuration")
    return statistics.median(values), min(values), max(values)


def compare(a: Sequence[float], b: Sequence[float]) -> Literal["lower", "higher"] | None:
    """Whether ``a`` is below or above ``b`` by more than the spread of their repeats.

    Args:
        a: the repeats of one configuration.
        b: the repeats of the other.

    Returns:
        ``"lower"`` if every repeat of ``a`` is below every repeat of ``b``, ``"higher"`` if
        every one is above, and ``None`` when the ranges overlap: the measurements cannot tell
        the two apart.

    Raises:
        ValueError: if either is empty.

    Example:
        >>> compare([1, 2], [3, 4]), compare([1, 3], [2, 4])
        ('lower', None)
    """
    if len(a) == 0 or len(b) == 0:
        raise ValueError("compare needs at least one measurement on each side")
    if max(a) < min(b):
        return "lower"
    if min(a) > max(b):
        return "higher"
    return None
