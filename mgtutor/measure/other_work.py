"""How much of the machine other work took while a measurement ran.

A timing check on CPU ranks measures the ranks only while nothing else wants their cores. The
load average cannot say so: it is a one-minute average that lags (work that starts after it is
read goes unseen) and it counts the ranks themselves once they run. :func:`busy_seconds` reads
instead the busy CPU seconds of the CPUs this process may run on (its affinity mask, where the
platform has one; all CPUs elsewhere), whoever used them; less the CPU seconds the measured
processes used over the same window, that is the CPU other work took there.

:class:`OtherWork` does so around blocks of code in this process, counting as its own this
process, its live descendants (the ranks a :class:`mgtutor.Pool` started) and the children they
reaped. A rank can do the same around one step of its own (:mod:`~mgtutor.experiments.step_check`
does, with :func:`time.process_time` as the rank's own).

:func:`waited_seconds` counts the other side: how long this process's threads were ready to run
but waited for a CPU (Linux). For ranks that sleep most of a step (the step check's emulated GPU
ranks) that is what crowding takes from them; other work on the cores they leave idle takes
nothing.

What it cannot see: a CPU quota without an affinity mask (Docker's ``--cpus``; the CPUs are all
shown, and work on the others counts as other work), and, on macOS, reaped children's time
(psutil reports none there; it then counts as other work). Both err towards calling a machine
busy. And one that errs the other way: work on CPUs outside the mask (a hyper-thread sibling of
a rank's core under taskset, another cpuset) is not counted, though it can slow the ranks
through the caches and memory they share.
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
    """Seconds this process's threads have spent ready to run but waiting for a CPU, all
    threads together (Linux's ``/proc/self/task/*/schedstat``, its second field: run-queue wait,
    in ns); NaN where the kernel does not say (macOS, Windows, a kernel without schedstats).

    Unlike other work's CPU, which counts the cores others used, this counts what the process
    lost to them: a thread of a rank that sleeps most of a step waits only when it wakes to a
    busy core. It also counts waits behind the process's own threads and its sibling ranks."""
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

    The step check's calibration figure (:func:`~mgtutor.experiments.step_check.calibrate_beside`);
    its steps' windows are counted by the ranks themselves instead
    (:func:`~mgtutor.experiments.step_windows.window_crowding`), unclipped, one figure per window.

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
