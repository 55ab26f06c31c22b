"""How much of the machine other work took while a measurement ran.

A timing check on CPU ranks holds only while nothing else wants their cores. The load average
cannot say so (a one-minute average that lags, and counts the ranks themselves), so
:func:`busy_seconds` reads the busy CPU seconds of the CPUs this process may run on (its
affinity mask, where the platform has one), whoever used them; less the measured processes'
own, that is other work's (:class:`OtherWork`). :func:`waited_seconds` counts the other side:
how long this process's threads waited for a CPU.

What it cannot see: a CPU quota without an affinity mask (Docker's ``--cpus``) and, on macOS,
reaped children's time (psutil reports none): both count as other work. Work on CPUs outside
the mask (a hyper-thread sibling of a rank's core) is not counted, though it can slow the ranks
through shared caches.
"""

from __future__ import annotations

import time

__all__ = ["OtherWork", "busy_seconds", "waited_seconds"]


def _cpus() -> list[int] | None:
    """The CPUs this process may run on, where the platform says (Linux); None: all of them."""
    import os

    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return None


def busy_seconds() -> float:
    """CPU seconds the CPUs this process may run on have spent busy, all processes together."""
    import psutil

    cpus = _cpus()
    every = psutil.cpu_times(percpu=True)
    total = 0.0
    for i, t in enumerate(every):
        if cpus is not None and i not in cpus:
            continue
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        for guest in ("guest", "guest_nice"):  # Linux counts these inside user and nice as well
            busy -= getattr(t, guest, 0.0)
        total += busy
    return total


def waited_seconds() -> float:
    """Seconds this process's threads have spent ready to run but waiting for a CPU, all together.

    Read from Linux's ``/proc/self/task/*/schedstat`` (its second field, run-queue wait); NaN
    where the kernel does not say (macOS, Windows, a kernel without schedstats). It counts what
    the process lost to others: a rank that sleeps most of a step waits only when it wakes to a
    busy core. Waits behind its own threads and its sibling ranks count too.
    """
    import glob

    texts = []
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                texts.append(f.read())
        except OSError:  # the thread ended meanwhile
            continue
    return _waited(texts)


def _waited(texts: list[str]) -> float:
    """Run-queue wait in seconds over schedstat lines ("run_ns wait_ns slices"); NaN if unknown.

    A kernel with scheduler statistics off prints "0 0 0" (proc_pid_schedstat): the thread that
    reads the file has run, so no run time at all means the kernel does not say.
    """
    import math

    total, ran = 0.0, 0
    for text in texts:
        fields = text.split()
        if len(fields) >= 2 and fields[0].isdigit() and fields[1].isdigit():
            ran += int(fields[0])
            total += int(fields[1]) / 1e9
    return total if ran else math.nan


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

    Not counted as other work: this process, its live descendants (a :class:`mgtutor.Pool`'s
    ranks) and the children they reaped.

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
        self._start = (time.perf_counter(), busy_seconds(), _own_seconds())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._start is not None, "OtherWork: __exit__ without __enter__"
        wall, busy, own = self._start
        own_now = _own_seconds()
        busy_now = busy_seconds()
        self.wall += time.perf_counter() - wall
        self.cpu += max((busy_now - busy) - (own_now - own), 0.0)
        self._start = None

    @property
    def cores(self) -> float:
        """Other processes' CPU seconds per wall-clock second inside the blocks."""
        return self.cpu / self.wall if self.wall > 0 else 0.0
