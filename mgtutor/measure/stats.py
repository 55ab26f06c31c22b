"""Repeated measurements, read honestly: a median with its spread, and a difference only when the
repeats do not overlap.

A timing on a shared machine varies from one repeat to the next, often by tens of percent, so
:func:`compare` calls a difference only when *every* repeat of one configuration lies beyond
*every* repeat of the other.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Literal

__all__ = ["compare", "spread"]


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """``(median, min, max)`` of the repeats of one configuration; ValueError if there are none."""
    if len(values) == 0:
        raise ValueError("spread needs at least one measurement; repeat the configuration")
    return statistics.median(values), min(values), max(values)


def compare(a: Sequence[float], b: Sequence[float]) -> Literal["lower", "higher"] | None:
    """Whether the repeats ``a`` lie below or above the repeats ``b``, beyond their spread.

    Returns:
        ``"lower"`` if every repeat of ``a`` is below every repeat of ``b``, ``"higher"`` if
        every one is above, and ``None`` when the ranges overlap: the measurements cannot tell
        the two apart. ValueError if either is empty.
    """
    if len(a) == 0 or len(b) == 0:
        raise ValueError("compare needs at least one measurement on each side")
    if max(a) < min(b):
        return "lower"
    if min(a) > max(b):
        return "higher"
    return None
