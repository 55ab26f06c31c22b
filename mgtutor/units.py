"""Quantities written for people: byte counts as KiB, MiB and GiB.

It imports nothing of mgtutor, so that any module, however low, can write a figure with it.
"""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: int | None) -> str:
    """Write a byte count for people: ``1536 -> '1.5 KiB'``.

    The largest unit up to GiB that keeps it at least 1; "-" for None (nothing measured).
    """
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
