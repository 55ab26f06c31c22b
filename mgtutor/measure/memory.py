"""Per-rank peak memory: what the CUDA caching allocator held, or what the process occupied.

Two different things are measured, and the plots label which:

* On a GPU rank: ``torch.cuda.max_memory_allocated`` (bytes held by live tensors at their peak)
  and ``torch.cuda.max_memory_reserved`` (bytes the caching allocator took from the driver at
  its peak; always at least the allocated figure). Both count this process's tensors on this
  rank's device only: not the CUDA context (a few hundred MiB per process, visible in
  ``nvidia-smi``), not NCCL's own buffers (allocated outside the caching allocator), and not
  other processes on the same GPU.
* On every rank: the process's resident set size (RSS) when fn started and its peak RSS while
  fn ran. RSS counts the whole worker process: the Python interpreter and torch's libraries
  (several hundred MiB once torch is imported) plus fn's CPU tensors. It does not count
  DataLoader worker processes, which are separate processes. On Linux the peak is the kernel's
  high-water mark (``VmHWM``), reset just before fn starts, so it covers fn alone; where it
  cannot be reset (macOS, some sandboxes) it is the peak over the process's whole life, and
  :attr:`MemoryStats.peak_rss_since_start` says so.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass

__all__ = [
    "MemoryStats",
    "current_rss",
    "measure",
    "peak_rss",
    "reset_cuda_peaks",
    "reset_peak_rss",
]


@dataclass(frozen=True)
class MemoryStats:
    """One rank's memory figures in bytes (see the module docstring for what each counts).

    Attributes:
        device: the rank's device ("cpu", "cuda:0", ...).
        rss_at_start: resident memory of the worker process when fn started.
        peak_rss: the worker process's peak resident memory while fn ran.
        peak_allocated: on a GPU rank, peak bytes held by tensors on its device; else None.
        peak_reserved: on a GPU rank, peak bytes reserved by the caching allocator; else None.
        peak_rss_since_start: True where the RSS peak could not be reset before fn, so it
            covers the process's whole life (its start-up included).
    """

    device: str
    rss_at_start: int
    peak_rss: int
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    peak_rss_since_start: bool = False

    @property
    def is_cuda(self) -> bool:
        """True when the GPU allocator figures were measured."""
        return self.peak_allocated is not None

    def headline(self) -> int:
        """The figure a table shows first: peak reserved on a GPU, peak RSS on the CPU."""
        return self.peak_reserved if self.peak_reserved is not None else self.peak_rss


def current_rss() -> int:
    """Resident memory of this process now, in bytes."""
    statm = _read_proc("/proc/self/statm")  # a few microseconds; psutil's way takes 70 to 140
    if statm is not None:
        return int(statm.split()[1]) * _PAGE_SIZE
    import psutil

    return int(psutil.Process().memory_info().rss)


_PAGE_SIZE = resource.getpagesize()


def _read_proc(path: str) -> bytes | None:
    """The contents of a small ``/proc/self`` file, or None where there is none."""
    fd = _proc_fd(path, os.O_RDONLY)
    if fd is None:
        return None
    try:
        return os.pread(fd, 65536, 0)  # the kernel writes it anew at each read from 0
    except OSError:
        return None


_proc_fds: dict[str, tuple[int, int]] = {}


def _proc_fd(path: str, flags: int) -> int | None:
    """A ``/proc/self`` file of this process, opened once: a pool reads them at every call.

    Reopened in a forked child, whose inherited descriptor still names its parent's file.
    Opening one took 10 to 150 us on a loaded machine; reading or writing it again, 1 to 10.
    """
    pid = os.getpid()
    known = _proc_fds.get(path)
    if known is not None and known[0] == pid:
        return known[1]
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    _proc_fds[path] = (pid, fd)
    return fd


def reset_peak_rss() -> bool:
    """Restart this process's RSS high-water mark from its current RSS (Linux only).

    Returns:
        True if the mark was reset; False where the kernel offers no way to do it.
    """
    fd = _proc_fd("/proc/self/clear_refs", os.O_WRONLY)
    if fd is None:
        return False
    try:
        os.write(fd, b"5")  # "5" resets the peak RSS, see the kernel's proc(5) manual page
        return True
    except OSError:
        return False


def reset_cuda_peaks() -> None:
    """Restart the CUDA allocator's peak counters, if this process has already used CUDA."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def peak_rss() -> int:
    """Peak resident memory of this process since start (or since :func:`reset_peak_rss`)."""
    status = _read_proc("/proc/self/status")
    if status is not None and b"\nVmHWM:" in status:
        start = status.index(b"\nVmHWM:") + len(b"\nVmHWM:")
        return int(status[start : status.index(b"\n", start)].split()[0]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def measure(device: str, rss_at_start: int, peak_was_reset: bool) -> MemoryStats:
    """Collect this rank's figures at the end of its work.

    Args:
        device: the rank's device as a string.
        rss_at_start: :func:`current_rss` taken when the work started.
        peak_was_reset: what :func:`reset_peak_rss` returned when the work started.

    Returns:
        The rank's :class:`MemoryStats`.
    """
    allocated = reserved = None
    torch = sys.modules.get("torch")
    if torch is not None and device.startswith("cuda") and torch.cuda.is_initialized():
        allocated = int(torch.cuda.max_memory_allocated(device))
        reserved = int(torch.cuda.max_memory_reserved(device))
    return MemoryStats(
        device=device,
        rss_at_start=rss_at_start,
        peak_rss=peak_rss(),
        peak_allocated=allocated,
        peak_reserved=reserved,
        peak_rss_since_start=not peak_was_reset,
    )
