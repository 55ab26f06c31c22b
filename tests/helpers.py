"""Small helpers shared by the tests: what processes and descriptors this test process has."""

from __future__ import annotations

import os

import psutil


def worker_children() -> list[psutil.Process]:
    """Child processes of this process, less multiprocessing's long-lived resource tracker."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if any("resource_tracker" in part for part in child.cmdline()):
                continue
        except psutil.Error:
            continue
        out.append(child)
    return out


def open_fds() -> int:
    """Number of file descriptors this process has open."""
    return len(os.listdir("/proc/self/fd"))
