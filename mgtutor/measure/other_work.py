"""How much of the machine other work took while a measurement ran.

A timing check on CPU ranks measures the ranks only while nothing else wants their cores. The
load average cannot say so: it is a one-minute average that lags (work that starts after it is
read goes unseen) and it counts the ranks themselves once they run. :class:`OtherWork` counts
instead, over exactly the blocks it wraps, the machine's busy CPU seconds (``psutil.cpu_times``)
less those of this process and its descendants (the ranks a :class:`mgtutor.Pool` started,
including children they reaped), per wall-clock second: the cores other processes held.

Where a child's CPU time cannot be read (it ended between the listing and the reading, or macOS,
where psutil reports no reaped children's time), it counts as other work: the meter errs towards
calling a machine busy, never quiet. In a container whose ``/proc/stat`` shows the host's CPUs,
the host's other tenants count as other work too.
"""

from __future__ import annotations

import time

__all__ = ["OtherWork"]


def _busy_seconds() -> float:
    """CPU seconds the machine's CPUs have spent busy, all processes together."""
    import psutil

    t = psutil.cpu_times()
    total = sum(t)
    for guest in ("guest", "guest_nice"):  # Linux counts these inside user and nice as well
        total -= getattr(t, guest, 0.0)
    return total - t.idle - getattr(t, "iowait", 0.0)


def _own_seconds() -> float:
    """CPU seconds of this process, its live descendants, and the children they reaped."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            c = p.cpu_times()
        except psutil.Error:  # ended meanwhile: its time reaches its parent's children_* later
            continue
        total += c.user + c.system + c.children_user + c.children_system
    return total


class OtherWork:
    """The cores other processes held while the ``with`` blocks ran (summed over every block).

    >>> other = OtherWork()
    >>> with other:
    ...     pass  # the measurement
    >>> other.cores >= 0.0
    True
    """

    def __init__(self) -> None:
        self.wall = 0.0  # seconds inside the blocks
        self.cpu = 0.0  # CPU seconds other processes used during them
        self._start: tuple[float, float, float] | None = None

    def __enter__(self) -> OtherWork:
        self._start = (time.perf_counter(), _busy_seconds(), _own_seconds())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._start is not None, "OtherWork: __exit__ without __enter__"
        wall, busy, own = self._start
        own_now = _own_seconds()
        busy_now = _busy_seconds()
        self.wall += time.perf_counter() - wall
        self.cpu += max((busy_now - busy) - (own_now - own), 0.0)
        self._start = None

    @property
    def cores(self) -> float:
        """Other processes' CPU seconds per wall-clock second inside the blocks."""
        return self.cpu / self.wall if self.wall > 0 else 0.0
