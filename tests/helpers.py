"""Small helpers shared by the tests: what processes and descriptors this test process has."""

from __future__ import annotations

import os

import psutil


def worker_children() -> list[psutil.Process]:
    """Child processes of this process, less multiprocessing's long-lived helpers.

    The resource tracker and the forkserver (which mgtutor.launch starts once and reuses) live
    as long as this process; every rank a launch started must be gone.
    """
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(child.cmdline())
            if "resource_tracker" in command:
                continue
            # The server itself is our child; the ranks it forks carry its command line too.
            if "forkserver import main" in command and child.ppid() == os.getpid():
                continue
        except psutil.Error:
            continue
        out.append(child)
    return out


def open_fds() -> int:
    """Number of file descriptors this process has open."""
    return len(os.listdir("/proc/self/fd"))
