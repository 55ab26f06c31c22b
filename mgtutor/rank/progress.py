"""A rank's progress, reported from inside fn: ``mgtutor.progress(step, total)``.

Sent over the rank's channel (:mod:`.channel`) to the notebook, which draws a bar per rank
(:mod:`mgtutor.launcher.progress_bars`); outside a launched rank it prints a line at every
tenth of the way.
"""

from __future__ import annotations

import sys
import time

from mgtutor.rank import channel
from mgtutor.wire.messages import Progress

__all__ = ["print_text", "progress"]

_MIN_INTERVAL_S = 0.1
_last_sent: dict[str, float] = {}


def progress(step: int, total: int, desc: str = "") -> None:
    """Report that this rank has done ``step`` of ``total`` units of work.

    Cheap enough to call every step: updates are sent at most ten times a second, and the
    first and last always go through.

    Args:
        step: units done so far (1..total).
        total: units in all.
        desc: a short label shown beside the bar ("epoch 2").

    Example:
        >>> for i in range(100):
        ...     train_step()
        ...     mgtutor.progress(i + 1, 100, desc="training")
    """
    if total <= 0:
        raise ValueError(f"progress total must be positive, got {total}")
    now = time.monotonic()
    last = _last_sent.get(desc)
    if step < total and last is not None and now - last < _MIN_INTERVAL_S:
        return
    _last_sent[desc] = now
    if channel.send(Progress(int(step), int(total), desc)):
        return
    print_text(None, step, total, desc, None)


def print_text(rank: int | None, step: int, total: int, desc: str, last: int | None) -> int:
    """Print a text line when the tenth of the way changes; return the tenth printed."""
    tenth = min(10, int(10 * step / total))
    if tenth == last:
        return tenth
    prefix = f"[rank {rank}] " if rank is not None else ""
    label = f"{desc}: " if desc else ""
    print(f"{prefix}{label}{step}/{total} ({100 * step / total:.0f}%)", file=sys.stdout)
    return tenth
